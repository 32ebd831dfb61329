"""Where the host time of one eager W=8 call goes: cProfile of repeated enqueues of one
schedule (rank 0 of a simulated 8-rank group on one GPU, as in ficco.bench.gpu_probes.measure_enqueue).

Usage: ``python bench/gpu_enqueue_profile.py [schedule] [calls]``; prints the top functions.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ficco.bench.gpu_probes import DTYPE, fake_group_handle  # noqa: E402

from ficco import schedules  # noqa: E402
from ficco.backends import get_backend  # noqa: E402
from ficco.executor import Buffers, execute  # noqa: E402
from ficco.problem import Problem  # noqa: E402


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "hetero-unfused-1d"
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    backend, world, m, n, k = get_backend(), 8, 1024, 8192, 8192
    dev = backend.device()
    problem = Problem(m=m, k=k, ns=(n,), dtype="bfloat16", world=world, rank=0)
    handle, release = fake_group_handle(backend, world, world * m * k * 2)
    a = torch.randn(m, k, device=dev).to(DTYPE)
    b = torch.randn(k, n, device=dev).to(DTYPE)
    out = torch.empty(world * m, n, device=dev, dtype=DTYPE)
    plan = schedules.get(name).plan(problem, "dma", None)

    own_pad = handle.signal_pad(0)

    def call():
        own_pad[:2].fill_(1)   # no real peers: re-arm the plan channels (cleared after passing)
        gathered = handle.get_buffer(0, (world * m, k), DTYPE)
        execute(plan, backend, Buffers(a, [b], [out], gathered, handle, None), timeout_s=60.0)
        torch.cuda.synchronize()

    call()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(18)
    torch.cuda.synchronize()
    release()


if __name__ == "__main__":
    main()
