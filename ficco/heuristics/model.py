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

from dataclasses import replace

from .. import schedules
from ..problem import Problem
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


def simulate_schedule(name: str, problem: Problem, profile: Profile, topology: str | None = None,
                      transport: str = "dma", copy_engines: int | None = None,
                      rank: int = 0) -> SimResult:
    """Simulate schedule ``name`` for ``problem`` as seen by ``rank``."""
    plan = schedules.get(name, op=problem.op).plan(replace(problem, rank=rank), transport,
                                                  copy_engines)
    return simulate(plan, profile, topology)


def predict(name: str, problem: Problem, profile: Profile, topology: str | None = None,
            transport: str = "dma", copy_engines: int | None = None) -> float:
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
