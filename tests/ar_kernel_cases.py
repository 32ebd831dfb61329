"""Rank-side functions for the one-kernel all-reduce's fault tests (importable by spawned
ranks): a late peer, then the group made right again by ficco.shutdown()."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import ficco
from ficco import config
from ficco.errors import FiccoError


def _inputs(seed, world, rank, rows=5, k=6, n=4):
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(rows, k, generator=gen, dtype=torch.float64) for _ in range(world)]
    b = [torch.randn(k, n, generator=gen, dtype=torch.float64) for _ in range(world)]
    return a[rank].float(), b[rank].float(), sum(x @ y for x, y in zip(a, b))


def late_peer(rank, world, seed, schedule, late_s):
    """The last rank calls ``late_s`` (past FICCO_TIMEOUT) after the others: every rank must
    raise (never return data) and do so within FICCO_TIMEOUT of reaching the kernel's wait;
    after ficco.shutdown() on every rank the next call is exact. Returns (outcome, seconds
    the call took, error of the call after the shutdown)."""
    a, b, _ = _inputs(seed, world, rank)
    with config.scope(transport="dma"):
        ficco.matmul_all_reduce(a, b, schedule=schedule)     # agreed, warm: no exchange
        dist.barrier()
        if rank == world - 1:
            time.sleep(late_s)
        started = time.monotonic()
        try:
            out = ficco.matmul_all_reduce(a, b, schedule=schedule)
            outcome = "NaN" if bool(out.isnan().all()) else "data"
        except FiccoError as exc:
            outcome = type(exc).__name__
        took = time.monotonic() - started
        dist.barrier()
        ficco.shutdown()
        a, b, ref = _inputs(seed + 1, world, rank)
        out = ficco.matmul_all_reduce(a, b, schedule=schedule)
    ficco.shutdown()
    return outcome, took, float((out.double() - ref).abs().max() / ref.abs().max())
