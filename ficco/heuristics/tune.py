"""The ``tune`` selector: time every candidate on the live group once per problem key.

It measures through the runtime's :class:`~ficco.heuristics.measured.Live` (the machinery the
``auto`` selector shares, :mod:`ficco.heuristics.measured`): two warm-up rounds, then five
interleaved timed rounds of every candidate; a candidate's time is the slowest rank's median,
agreed, so the argmin is the same everywhere; ties go to the alphabetically first name.

Candidates: ``FICCO_TUNE_CANDIDATES`` (agreed by every rank like any setting) if set, else
every schedule offered on this backend, ``ficco.schedules.offered(target, transport)``: the
eleven, plus ``gated-1d``/``gated-2d`` where Triton and the GPU run the gated GEMM. Never the
gated ones on CPU by default: there the kernel runs in Triton's interpreter (correctness
only), so timing it would only cost a first call minutes. A forced list may name them on CPU
(tests do); a forced name that cannot run here (no Triton, transport ccl) raises ConfigError
before anything is measured. A candidate list other than ``names()`` is part of the cache key.

Winners are cached in memory and in ``<FICCO_CACHE_DIR>/tune/`` (default
``~/.cache/ficco``), keyed by op, M, n, K, dtype, W, backend target, topology, transport and
ficco version; later calls cost a dictionary lookup. A file entry counts only once every rank
holds the identical entry. Where the group cannot measure (no live group: ``explain``; a rank
inside a CUDA graph capture) :func:`tune_choice` raises :class:`NotMeasured` and the caller
decides by the model, saying so.

Example::

    >>> from ficco.plan.problem import Problem
    >>> from ficco.heuristics.measured import Scripted
    >>> p = Problem(4, 8, (8,), "float32", 2)
    >>> live = Scripted(lambda name, via: 1.0 if name == "ring" else 2.0)
    >>> tune_choice(p, transport="dma", target="cpu", topology="switch", live=live,
    ...             persist=False)[0]
    'ring'
"""
from __future__ import annotations

from pathlib import Path

from .. import config, schedules
from ..errors import ConfigError, InvalidArgumentError
from ..plan.problem import Problem
from . import measured
from .measured import Live, ficco_version

CACHE_FILE = "tune"
CACHE = measured.Cache(CACHE_FILE)
#: two warm-up rounds, five timed ones, every candidate, no budget
ROUNDS = measured.Rounds(warmup=2, most=5)


class NotMeasured(Exception):
    """The group cannot measure now (the message says why); decide another way."""


def cache_key(problem: Problem, transport: str, target: str, topology: str,
              candidates: list[str] | None = None) -> str:
    """The tune cache key, as a readable string.

    >>> cache_key(Problem(4, 8, (8,), "float32", 2), "dma", "cpu", "switch").split("|")[:4]
    ['all_gather_matmul/dma', 'M=8', 'n=8', 'K=8']
    """
    ns = ",".join(map(str, problem.ns))
    key = [f"{problem.op}/{transport}", f"M={problem.big_m}", f"n={ns}", f"K={problem.k}",
           problem.dtype, f"W={problem.world}", target, topology, f"ficco={ficco_version()}"]
    if candidates is not None and list(candidates) != schedules.names(op=problem.op):
        key.append("candidates=" + ",".join(candidates))
    return "|".join(key)


def candidates(problem: Problem, transport: str, target: str) -> list[str]:
    """The schedules ``tune`` measures (see the module docstring), checked before any.

    >>> candidates(Problem(4, 8, (8,), "float32", 2), "dma", "cpu") == schedules.names()
    True
    """
    forced = config.tune_candidates()
    if not forced:
        return schedules.offered(target, transport, problem.op, problem)
    for name in forced:
        try:
            schedules.get(name, op=problem.op)
        except InvalidArgumentError as exc:
            raise ConfigError(f"FICCO_TUNE_CANDIDATES: {exc}") from None
        why = schedules.why_not_here(name, target, transport, problem.op) \
            or schedules.epilogue_reason(name, problem)
        if why is not None:
            raise ConfigError(f"FICCO_TUNE_CANDIDATES names {name}, which cannot run on "
                              f"{target} over {transport}: {why}")
    return list(forced)


def cache_path() -> Path:
    return CACHE.path()


def tune_choice(problem: Problem, *, transport: str, target: str, topology: str,
                live: Live | None, persist: bool = True
                ) -> tuple[str, dict[str, float], str]:
    """(schedule, measured seconds per candidate, reason); measures only at first sight
    (:func:`ficco.heuristics.measured.first_sight`), else raises :class:`NotMeasured`."""
    names = candidates(problem, transport, target)
    key = cache_key(problem, transport, target, topology, names)
    entry, why_not = measured.first_sight(CACHE, key, live,
                                          lambda e: e.get("schedule") in names, persist)
    if entry is not None:
        scores = {k: float(v) for k, v in entry["scores"].items()}
        return entry["schedule"], scores, f"tuned earlier (cache {key})"
    if live is None or why_not is not None:
        raise NotMeasured(why_not)
    timing = measured.time_candidates(live, [(name, transport) for name in names], ROUNDS)
    scores = {name: timing.seconds[(name, transport)] for name in names}
    best = min(scores, key=lambda name: (scores[name], name))
    CACHE.keep(key, {"schedule": best, "scores": scores}, live.agreed, persist)
    speedup = scores.get("serial", scores[best]) / scores[best] if scores[best] > 0 else 1.0
    return best, scores, (f"fastest of {len(scores)} measured (slowest rank, median of "
                          f"{timing.rounds} interleaved runs): {scores[best] * 1e3:.3f} ms, "
                          f"{speedup:.2f}x over serial")


def clear_memory() -> None:
    """Forget in-memory winners (tests; the file cache stays)."""
    CACHE.forget()
