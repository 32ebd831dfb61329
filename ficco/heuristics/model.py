"""The ``model`` selector: simulate every candidate schedule's Plan and pick the fastest.

Ranks can differ in their plans (a ``hetero-fused`` middle rank runs two GEMMs a step, rank 0
one), and the call takes as long as its slowest rank, so each candidate is simulated for rank
0 and for a middle rank (W // 2) and scored by the slower of the two. That makes the scores depend only
on (problem, profile, topology, transport): every rank computes the same decision.

Example::

    >>> from ficco.heuristics import profiles
    >>> from ficco.heuristics.scenarios import table_i_problem
    >>> times = predict_all(table_i_problem("g6"), profiles.load("mi300x"))
    >>> min(times, key=times.get) != "ring"
    True
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .. import schedules
from ..plan.problem import DtypeFields, Problem
from .profiles import Profile
from .simulator import SimResult, simulate

_CACHE_LIMIT = 4096
_cache: dict = {}


def clear_cache() -> None:
    """Forget memoised predictions (tests, or after editing a profile file in place)."""
    _cache.clear()


def representative_ranks(world: int) -> list[int]:
    """The ranks whose plans stand for all: 0 and a middle one."""
    return sorted({0, world // 2})


def simulate_schedule(name: str, problem: DtypeFields, profile: Profile,
                      topology: str | None = None, transport: str = "dma",
                      copy_engines: int | None = None, rank: int = 0) -> SimResult:
    """Simulate schedule ``name`` for ``problem`` (any op's: a frozen dataclass) as seen by
    ``rank``."""
    frozen: Any = problem
    plan = schedules.get(name, op=problem.op).plan(replace(frozen, rank=rank), transport,
                                                  copy_engines)
    return simulate(plan, profile, topology)


def predict(name: str, problem: DtypeFields, profile: Profile,
            topology: str | None = None, transport: str = "dma",
            copy_engines: int | None = None) -> float:
    """Predicted seconds of schedule ``name``: the slowest representative rank's makespan."""
    key = (name, problem.key(), profile.fingerprint(), topology, transport, copy_engines)
    if key not in _cache:
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        _cache[key] = max(
            simulate_schedule(name, problem, profile, topology, transport, copy_engines,
                              rank).makespan_s
            for rank in representative_ranks(problem.world))
    return _cache[key]


def predict_all(problem: Problem, profile: Profile, topology: str | None = None,
                transport: str = "dma", copy_engines: int | None = None,
                names: list[str] | None = None) -> dict[str, float]:
    """Predicted seconds of every schedule in ``names`` (default ``ficco.schedules.names()``;
    ``schedules.offered(target)`` adds the optional ones that run on ``target``)."""
    return {name: predict(name, problem, profile, topology, transport, copy_engines)
            for name in (schedules.names(op=problem.op) if names is None else names)}


def model_choice(problem: Problem, profile: Profile, topology: str | None = None,
                 transport: str = "dma", copy_engines: int | None = None,
                 names: list[str] | None = None) -> tuple[str, dict[str, float], str]:
    """(schedule, scores, reason): the fastest predicted schedule of ``names`` (default
    ``ficco.schedules.names()``); ties go to the name first in alphabetical order."""
    scores = predict_all(problem, profile, topology, transport, copy_engines, names)
    best = min(scores, key=lambda name: (scores[name], name))
    speedup = scores.get("serial", scores[best]) / scores[best] if scores[best] > 0 else 1.0
    reason = (f"fastest of {len(scores)} simulated on {profile.name}/"
              f"{topology or profile.topology}: {scores[best] * 1e3:.3f} ms, "
              f"{speedup:.2f}x over serial")
    return best, scores, reason


@dataclass(frozen=True)
class BandedChoice:
    """What the ``model`` selector decides once it knows its own error: ``schedule`` over
    ``transport``; ``fastest`` is the fastest predicted candidate of any transport, ``gain``
    its predicted gain over the baseline (``serial`` on the better transport), ``band`` the
    validated error of ``band_class`` (:mod:`ficco.heuristics.bands`); ``per_transport`` every
    candidate's predicted seconds per transport (what the ``auto`` selector shortlists from)."""

    schedule: str
    transport: str
    scores: dict
    reason: str
    fastest: str
    fastest_transport: str
    gain: float
    band: float
    band_class: str
    per_transport: dict


def banded_choice(problem: Problem, profile: Profile, topology: str | None,
                  transports: tuple[str, ...], copy_engines: int | None,
                  names_for, band: float, band_class: str) -> BandedChoice:
    """The fastest predicted schedule over every transport in ``transports`` (candidates
    ``names_for(transport)``), kept only when its predicted gain over the best baseline
    (``serial`` on the transport that runs it fastest) exceeds ``band``; else that baseline.
    A wider band never picks an overlapped schedule a narrower one would not have: the rule
    compares one predicted gain with the band.

    >>> from ficco.heuristics import profiles
    >>> from ficco.heuristics.scenarios import table_i_problem
    >>> names = lambda via: None
    >>> wide = banded_choice(table_i_problem("g6"), profiles.load("mi300x"), None, ("dma",),
    ...                      None, names, 10.0, "all_gather_matmul/balanced")
    >>> wide.schedule, wide.fastest != "serial"
    ('serial', True)
    """
    per_transport = {via: predict_all(problem, profile, topology, via, copy_engines,
                                      names_for(via)) for via in transports}
    base_via = min(transports, key=lambda via: (per_transport[via].get("serial", float("inf")),
                                                transports.index(via)))
    base_s = per_transport[base_via]["serial"]
    # (a tie goes to serial: a schedule that plans as serial for this problem, such as the
    # all-reduce's chunked-* of fewer rows than chunks, gains nothing over it)
    fast_via, fastest = min(((via, name) for via in transports for name in per_transport[via]),
                            key=lambda vn: (per_transport[vn[0]][vn[1]], transports.index(vn[0]),
                                            vn[1] != "serial", vn[1]))
    fast_s = per_transport[fast_via][fastest]
    gain = base_s / fast_s - 1 if fast_s > 0 else 0.0
    where = f"{profile.name}/{topology or profile.topology}"
    if fastest != "serial" and gain > band:
        reason = (f"{fastest}: the predicted {gain:.0%} gain over serial ({base_via}, "
                  f"{base_s * 1e3:.3f} ms) exceeds the model's \u00b1{band:.0%} "
                  f"({band_class}); simulated on {where}")
        return BandedChoice(fastest, fast_via, per_transport[fast_via], reason, fastest,
                            fast_via, gain, band, band_class, per_transport)
    if fastest == "serial":
        reason = (f"serial: predicted fastest over {base_via} ({base_s * 1e3:.3f} ms); "
                  f"simulated on {where}")
    else:
        reason = (f"serial: the predicted {gain:.0%} gain of {fastest} ({fast_via}) is inside "
                  f"the model's \u00b1{band:.0%} ({band_class}); simulated on {where}")
    return BandedChoice("serial", base_via, per_transport[base_via], reason, fastest, fast_via,
                        gain, band, band_class, per_transport)
