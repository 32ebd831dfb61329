"""Rank-side functions for tests/engine/test_state.py's warm-call counts (importable by spawned ranks).

A warm call is profiled with cProfile (the caller's thread only, as ``python -m ficco.bench
calls`` does) and counted: the Python calls whose code is ficco's, and the locks ficco's own
code takes (a lock's ``acquire``, or the ``__exit__`` of a ``with lock:`` block, whose
``__enter__`` cProfile does not see, called from a ficco function; the standard library's own
locks, e.g. inside ``queue.Queue``, are not ficco's)."""
from __future__ import annotations

import cProfile
import pstats
from pathlib import Path

import torch

import ficco
from ficco.bench.calls import count

PACKAGE = str(Path(ficco.__file__).resolve().parent)
_LOCK_CALLS = ("acquire", "__exit__")


def lock_acquisitions(stats: pstats.Stats, calls: int) -> float:
    total = 0
    raw = stats.stats  # type: ignore[attr-defined]  # the documented table; typeshed lacks it
    for (filename, _, name), (_cc, _nc, _tt, _ct, callers) in raw.items():
        if filename != "~" or "lock" not in name.lower() or \
                not any(f"'{method}'" in name for method in _LOCK_CALLS):
            continue
        total += sum(counts[0] for caller, counts in callers.items()
                     if caller[0].startswith(PACKAGE))
    return total / calls


def warm_call_counts(rank, world, op, warmup=3, calls=10):
    """``(ficco calls, lock acquisitions)`` per warm call of ``op`` on this rank, and the
    (schedule, transport) that ran."""
    gen = torch.Generator().manual_seed(100 + rank)
    b = torch.randn(64, 64, generator=gen)
    if op == "all_gather_matmul":
        a = torch.randn(64, 64, generator=gen)
        call = lambda: ficco.all_gather_matmul(a, b)
    else:
        a = torch.randn(world * 64, 64, generator=gen)
        call = lambda: ficco.matmul_reduce_scatter(a, b)
    for _ in range(warmup):
        call()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    stats = pstats.Stats(profiler)
    ran = ficco.session_of().last
    ficco.shutdown()
    return count(stats, calls)["ficco"], lock_acquisitions(stats, calls), ran


def fewest_warm_calls(rank, world, op, schedule, transport, warmup=3, calls=8):
    """The fewest ficco Python calls any of ``calls`` warm calls of ``op`` (``schedule`` over
    ``transport``) made on this rank, each profiled alone: what the warm path itself costs,
    without the polls a loaded host adds when a queue is slow to drain (and, as the benchmark
    runs, without FICCO_POISON's fills, which the test ranks' environment turns on)."""
    gen = torch.Generator().manual_seed(200 + rank)
    b = torch.randn(64, 64, generator=gen)
    rows = 64 if op == "all_gather_matmul" else world * 64
    a = torch.randn(rows, 64, generator=gen)
    fn = getattr(ficco, op)
    fewest = None
    with ficco.config.scope(transport=transport, poison=False):
        for i in range(warmup + calls):
            profiler = cProfile.Profile()
            if i >= warmup:
                profiler.enable()
            fn(a, b, schedule=schedule)
            profiler.disable()
            if i >= warmup:
                made = count(pstats.Stats(profiler), 1)["ficco"]
                fewest = made if fewest is None else min(fewest, made)
    ran = ficco.session_of().last
    ficco.shutdown()
    return fewest, (ran.schedule, ran.transport)
