"""Host time the executor alone spends enqueueing one call, per schedule, at W = 8.

The backend does nothing (every method returns at once) and the symmetric handle hands out
plain CPU tensors, so what is timed is ficco/executor.py: resolving blocks to views, events,
the op loop. Problem: rank 3 of 8, m=1024, K=8192, n=8192, bfloat16 (the GEMM of the GPU
enqueue table in docs/gpu.md); the gathered buffer comes from the handle every call, as in
ficco/api.py.

Usage::

    python bench/enqueue_overhead.py [--calls N] [--label TEXT] [--out FILE] [--cpu-e2e] [--gpu]

prints one row per schedule (ops, median us per call and per op). ``--out`` appends the
table to FILE. ``--cpu-e2e`` also times the real CPU backend end to end on 8 spawned ranks
(slow to start; small GEMMs so the enqueue shows). ``--gpu`` also times the real GPU backend
(rank 0 of a simulated 8-rank group on one GPU, peers are other buffers there): host us per
eager call and per op, and per CUDA-graph replay, for every schedule (issue 18's targets:
eager <= 150 us for serial, ring and the fused schedules, graph replay <= 60 us).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ficco import schedules  # noqa: E402
from ficco.backends.base import Backend  # noqa: E402
from ficco.executor import Buffers, execute  # noqa: E402
from ficco.problem import Problem  # noqa: E402

WORLD, RANK, M, K, N, DTYPE = 8, 3, 1024, 8192, 8192, torch.bfloat16


class NullBackend(Backend):
    """Every call returns at once: only the executor's own host time remains."""

    name = "null"

    @classmethod
    def unavailable_reason(cls):
        return None

    def target(self):
        return "null"

    def device(self):
        return torch.device("cpu")

    def queue(self, name):
        return name

    def new_event(self):
        return object()

    def plan_events(self, compiled, count):
        # as the GPU backends do: one set of events per compiled plan, reused every call
        events = self.__dict__.setdefault("_events", {})
        if id(compiled) not in events:
            events[id(compiled)] = (compiled, [object() for _ in range(count)])
        return events[id(compiled)][1]

    def record(self, event, queue):
        pass

    def wait(self, event, queue):
        pass

    def copy(self, dst, src, queue):
        pass

    def copy_2d(self, dst, src, queue):
        pass

    def gemm(self, a, b, out, accumulate, queue):
        pass

    def launch(self, queue, fn):
        pass

    # The barrier itself is the real protocol (ficco.symm_mem.barrier: cached program, one
    # signal_batch call); only the primitives do nothing.
    def signal_write(self, queue, slot, value):
        pass

    def signal_wait(self, queue, op, deadline):
        pass

    def signal_batch(self, queue, ops, deadline):
        pass

    def signal_now(self, ops, deadline):
        pass

    def finish(self, queues):
        pass

    def symm_provider(self):
        return None


class StubHandle:
    """A symmetric handle whose peers are plain (untouched, so unbacked) CPU tensors."""

    def __init__(self, world: int, numel: int):
        self.rank, self.world, self.nbytes = RANK, world, numel * 2
        self._data = [torch.empty(numel, dtype=DTYPE) for _ in range(world)]
        self._programs = {}

    def slot(self, owner, channel, writer):
        return 0x1000 * owner + 4 * (channel * self.world + writer)   # an address, as on GPUs

    def get_buffer(self, rank, shape, dtype, offset=0):
        numel = shape[0] * shape[1]
        return self._data[rank][:numel].view(dtype).view(tuple(shape))


def time_schedule(name: str, calls: int) -> tuple[int, float]:
    problem = Problem(m=M, k=K, ns=(N,), dtype="bfloat16", world=WORLD, rank=RANK)
    plan = schedules.get(name).plan(problem, "dma", None)
    backend, handle = NullBackend(), StubHandle(WORLD, WORLD * M * K)
    a, b = torch.empty(M, K, dtype=DTYPE), torch.empty(K, N, dtype=DTYPE)

    def call() -> float:
        # Fresh outputs and gathered tensor each call, as in api.py; only execute() is timed.
        out = torch.empty(WORLD * M, N, dtype=DTYPE)
        gathered = handle.get_buffer(RANK, (WORLD * M, K), DTYPE)
        buffers = Buffers(a, [b], [out], gathered, handle, None)
        t0 = time.perf_counter()
        execute(plan, backend, buffers, timeout_s=60.0)
        return time.perf_counter() - t0

    for _ in range(5):
        call()
    times = [call() for _ in range(calls)]
    return len(plan.ops), statistics.median(times)


def cpu_end_to_end(rank, world, names, calls):
    """On each of 8 spawned ranks: median seconds of ficco's real CPU path per schedule."""
    import ficco

    torch.manual_seed(rank)
    a = torch.randn(64, 256)
    b = torch.randn(256, 64)
    out = {}
    for name in names:
        for _ in range(3):
            ficco.all_gather_matmul(a, b, schedule=name)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            ficco.all_gather_matmul(a, b, schedule=name)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def gpu_rows() -> list[str]:
    """The same table on the real GPU backend, eager and graph replay (needs a GPU)."""
    from ficco.backends import get_backend
    from ficco.bench.gpu_probes import measure_enqueue

    backend = get_backend()
    lines = [f"# real {backend.name} backend on {backend.target()}, W=8 rank 0 of a simulated "
             f"group, m=1024 K=8192 n=8192 bf16, median of 20 eager calls",
             f"{'schedule':<20} {'ops':>4} {'us/call':>9} {'us/op':>7} {'replay us':>10} "
             f"{'wall ms':>8}"]
    print("\n".join(lines), flush=True)
    for rec in measure_enqueue(backend, quick=False):
        replay = rec.get("graph_replay_enqueue_s")
        replay_text = f"{replay * 1e6:>10.1f}" if replay is not None else \
            f"{'n/a':>10} ({rec.get('graph_error', '')[:60]})"
        lines.append(f"{rec['schedule']:<20} {rec['ops']:>4} {rec['enqueue_s'] * 1e6:>9.1f} "
                     f"{rec['enqueue_s'] * 1e6 / rec['ops']:>7.2f} {replay_text} "
                     f"{rec['call_wall_s'] * 1e3:>8.2f}")
        print(lines[-1], flush=True)
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None)
    parser.add_argument("--cpu-e2e", action="store_true")
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [f"# executor enqueue overhead, null backend, W={WORLD} rank {RANK}, "
             f"m={M} K={K} n={N} bf16, median of {args.calls} calls {args.label}".rstrip(),
             f"{'schedule':<20} {'ops':>4} {'us/call':>9} {'us/op':>7}"]
    for name in schedules.names():
        ops, seconds = time_schedule(name, args.calls)
        lines.append(f"{name:<20} {ops:>4} {seconds * 1e6:>9.1f} {seconds * 1e6 / ops:>7.2f}")
        print(lines[-1] if len(lines) > 3 else "\n".join(lines), flush=True)
    if args.cpu_e2e:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), "tests"))
        from harness import RankPool

        pool = RankPool(WORLD, {"FICCO_POISON": "0", "FICCO_BACKEND": "cpu"})
        try:
            results = pool.run(cpu_end_to_end, schedules.names(), 20)
        finally:
            pool.close()
        lines.append("# real CPU backend end to end, 8 ranks, 64x256 @ 256x64 fp32, "
                     "median of 20 calls, slowest rank")
        for name in schedules.names():
            worst = max(r[name] for r in results)
            lines.append(f"{name:<20} {'':>4} {worst * 1e6:>9.1f}")
            print(lines[-1], flush=True)
    if args.gpu:
        lines += gpu_rows()
    if args.out:
        with open(args.out, "a") as fh:
            fh.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
