"""The ``tune`` selector: time every candidate on the live group once per problem key.

The runtime hands in the live group (``live``, :class:`ficco.heuristics.Live`: the call's
session), whose ``measure(name) -> seconds`` is already the slowest rank's time and the same on
every rank (it all-reduces MAX), so the argmin here is the same everywhere; ties go to the
alphabetically first name. Candidates are measured in one order on every rank, because each
measurement is itself collective.

Candidates: ``FICCO_TUNE_CANDIDATES`` (agreed by every rank like any setting) if set, else
every schedule offered on this backend, ``ficco.schedules.offered(target, transport)``: the
eleven, plus ``gated-1d``/``gated-2d`` where Triton and the GPU run the gated GEMM. Never the
gated ones on CPU by default: there the kernel runs in Triton's interpreter (correctness
only), so timing it would only cost a first call minutes. A forced list may name them on CPU
(tests do); a forced name that cannot run here (no Triton, transport ccl) raises ConfigError
before anything is measured. A candidate list other than ``names()`` is part of the cache key.

Winners are cached in memory and in ``<FICCO_CACHE_DIR>/tune.json`` (default
``~/.cache/ficco``), keyed by op, M, n, K, dtype, W, backend target, topology, transport and
ficco version; later calls cost a dictionary lookup. Every rank may write the file: the
content is identical and each write is atomic (temporary file + ``os.replace``).

Example::

    >>> from ficco.problem import Problem
    >>> p = Problem(4, 8, (8,), "float32", 2)
    >>> from ficco.heuristics import Timings
    >>> tune_choice(p, transport="dma", target="cpu", topology="switch",
    ...             live=Timings(lambda name: 1.0 if name == "ring" else 2.0), persist=False)[0]
    'ring'
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from .. import config, schedules
from ..errors import ConfigError, InvalidArgumentError
from ..problem import Problem
from .profiles import cache_root

CACHE_FILE = "tune.json"
_memory: dict[str, dict] = {}
_lock = threading.Lock()


def ficco_version() -> str:
    module = sys.modules.get("ficco")
    return str(getattr(module, "__version__", "unknown"))


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
    return cache_root() / CACHE_FILE


def _read_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}   # no cache yet, or a torn file from a crashed writer: re-tune
    return data if isinstance(data, dict) else {}


def write_file(path: Path, key: str, entry: dict) -> None:
    """Put ``entry`` under ``key`` in the cache file ``path`` (atomic: a temporary file, then
    ``os.replace``)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_file(path)
        data[key] = entry
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"tune cache {str(path)!r} cannot be written ({exc}); set "
                          f"FICCO_CACHE_DIR to a writable directory") from None


def lookup(key: str, persist: bool = True, known: list[str] | None = None) -> dict | None:
    """The cached entry ``{"schedule", "scores"}`` for ``key`` (memory, then file); a file
    entry counts only if its schedule is one of ``known`` (default: ``names()``)."""
    with _lock:
        entry = _memory.get(key)
    if entry is None and persist:
        entry = _read_file(cache_path()).get(key)
        if entry is not None and entry.get("schedule") in (known or schedules.names()):
            with _lock:
                _memory[key] = entry
        else:
            entry = None
    return entry


def tune_choice(problem: Problem, *, transport: str, target: str, topology: str,
                live, persist: bool = True) -> tuple[str, dict[str, float], str]:
    """(schedule, measured seconds per candidate, reason); measures only at first sight, on
    ``live`` (:class:`ficco.heuristics.Live`, None off a group).

    ``live.agree(found_in_file) -> bool`` (collective) says whether *every* rank found the
    key in its cache file: ranks on other hosts may not share the file, and one rank
    measuring while another reads its cache would deadlock, so a file entry is used only when
    all ranks have it. Memory hits need no agreement: every rank fills its memory at the same
    call."""
    names = candidates(problem, transport, target)
    key = cache_key(problem, transport, target, topology, names)
    entry = lookup(key, persist=False)
    if entry is None and persist:
        entry = lookup(key, persist=True, known=names)
        if live is not None and not live.agree(entry is not None):
            with _lock:
                _memory.pop(key, None)
            entry = None
    if entry is not None:
        scores = {k: float(v) for k, v in entry["scores"].items()}
        return entry["schedule"], scores, f"tuned earlier (cache {key})"
    if live is None:
        raise InvalidArgumentError(
            "selector 'tune' measures on a live group (the runtime gives it; off a group, "
            "ficco.heuristics.Timings(measure)). Use selector 'model' or 'paper' offline, or "
            "set FICCO_SELECTOR=model")
    scores = {name: float(live.measure(name)) for name in names}
    best = min(scores, key=lambda name: (scores[name], name))
    entry = {"schedule": best, "scores": scores}
    with _lock:
        _memory[key] = entry
    if persist:
        write_file(cache_path(), key, entry)
    speedup = scores.get("serial", scores[best]) / scores[best] if scores[best] > 0 else 1.0
    return best, scores, (f"fastest of {len(scores)} measured (slowest rank): "
                          f"{scores[best] * 1e3:.3f} ms, {speedup:.2f}x over serial")


def clear_memory() -> None:
    """Forget in-memory winners (tests; the file cache stays)."""
    with _lock:
        _memory.clear()
