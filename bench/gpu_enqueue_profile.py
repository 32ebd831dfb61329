"""Where the host time of one eager W=8 call goes: cProfile of repeated enqueues of one
schedule on the real GPU backend, as rank 0 of the pretend 8-rank group of
``bench/enqueue_overhead.py --gpu`` (peers are other buffers on this GPU, barriers signal this
rank's own pad, so any number of them pass).

Usage: ``python bench/gpu_enqueue_profile.py [schedule] [calls] [op]``; prints the top
functions by own time (op: all_gather_matmul, the default, or matmul_reduce_scatter).
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from enqueue_overhead import (DTYPE, WORLD, Loopback, make_call, problem_of,  # noqa: E402
                              workspace_numel)

from ficco import executor, schedules  # noqa: E402
from ficco.backends import get_backend  # noqa: E402
from ficco.symm_mem.device import single_gpu_group  # noqa: E402


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "hetero-unfused-1d"
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    op = sys.argv[3] if len(sys.argv) > 3 else "all_gather_matmul"
    backend = get_backend()
    if not hasattr(backend, "vendor"):
        sys.exit(f"needs a GPU backend (cuda or rocm); this process got {backend.name!r}")
    dev = backend.device()
    p = problem_of(op, rank=0)
    real = single_gpu_group(backend, WORLD, workspace_numel(p) * 2)
    handle = Loopback(real)
    a = torch.randn(p.m, p.k, device=dev).to(DTYPE)
    bs = [torch.randn(p.k, n, device=dev).to(DTYPE) for n in p.ns]
    plan = schedules.get(name, op=op).plan(p, "dma", None)
    call, _ = make_call(executor, plan, backend, handle, a, bs, dev)

    def synced():
        call()
        torch.cuda.synchronize()

    synced()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        synced()
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(18)
    torch.cuda.synchronize()
    real.close()


if __name__ == "__main__":
    main()
