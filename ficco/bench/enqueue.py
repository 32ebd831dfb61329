"""``characterize --parts enqueue`` on a CPU: the host's seconds per plan op, measured.

The simulator charges every plan op ``host_op_s`` of host time before it can start (eager
calls). On a CPU target this measures it with the real CPU backend: rank 0 of a pretend
W = 8 group in this process (:class:`LoopbackHandle`: every "peer" is another buffer here, and
a flag written to a peer's pad lands in this rank's own pad where that peer would have written
it, so every plan barrier runs its real signal ops and passes). For each schedule of both ops
the host time from the call's start to the moment the executor hands the queues to
``finish`` is timed (the CPU backend's ``finish`` then waits for the worker threads; the GPU
backends' returns at once), and :func:`ficco.bench.fit.fit_host_op` turns the records into
``host_op_s``. On a GPU, :func:`ficco.bench.gpu_probes.measure_enqueue` makes the same records.

Example::

    >>> recs = measure_cpu_enqueue(quick=True, names=["serial"])
    >>> recs[0]["kind"], recs[0]["ops"] > 0, recs[0]["enqueue_s"] > 0
    ('enqueue', True, True)
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ..symm_mem import SIGNAL_CHANNELS, SymmHandle
from . import results

WORLD = 8


class LoopbackHandle(SymmHandle):
    """Symmetric memory of rank 0 of a ``world``-rank group that lives in this process: one
    buffer per "peer" (so copies move real bytes) and one signal pad. A write meant for peer
    ``p``'s pad (writer 0) lands in rank 0's own pad in ``p``'s column, as ``p``'s own write
    would have: barriers run their real signal ops and always pass."""

    def __init__(self, backend, world: int, nbytes: int):
        self.rank, self.world, self.nbytes = 0, world, nbytes
        self._init_signals(backend)
        self._data = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(world)]
        self._pad = np.zeros(SIGNAL_CHANNELS * world, dtype=np.int32)
        self._channels = SIGNAL_CHANNELS

    def get_buffer(self, rank, shape, dtype, offset=0):
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = int(np.prod(shape))
        return self._data[rank][offset: offset + numel * itemsize].view(dtype).view(tuple(shape))

    def signal_pad(self, rank):
        return torch.from_numpy(self._pad.reshape(self._channels, self.world))

    def slot(self, owner, channel, writer):
        column = writer if owner == self.rank else owner
        return (self._pad, channel * self.world + column)

    def close(self):
        self._data = []


def _timed_backend():
    """The CPU backend, noting when the executor reaches ``finish`` (the host is done)."""
    from ..backends.cpu import CpuBackend

    class HostTimedCpuBackend(CpuBackend):
        handed_over_at = 0.0

        def finish(self, queues, timeout_s=None):
            self.handed_over_at = time.perf_counter()
            return super().finish(queues, timeout_s)

    return HostTimedCpuBackend()


def _buffers(problem, handle, dtype):
    from ..plan.buffers import Buffers

    a = torch.randn(problem.m, problem.k, dtype=dtype)
    b = torch.randn(problem.k, problem.ns[0], dtype=dtype)
    if not problem.reduces:
        gathered = handle.get_buffer(0, (problem.big_m, problem.k), dtype)
        out = torch.empty(problem.big_m, problem.ns[0], dtype=dtype)
        return Buffers(a, [b], [out], gathered, handle, None)
    rows, n = problem.block_rows, problem.ns[0]
    partial = handle.get_buffer(0, (problem.m, n), dtype)
    return Buffers(a, [b], [torch.empty(rows, n, dtype=dtype)], None, handle, None,
                   partials=[partial], recvs=[torch.empty(problem.world * rows, n, dtype=dtype)],
                   partial_offsets=(0,))


def measure_cpu_enqueue(quick: bool, names: list[str] | None = None, progress=None) -> list[dict]:
    """One ``kind="enqueue"`` record per (op, schedule): ``ops``, the runtime calls a warm call
    of the W = 8 plan makes (``plan_ops``: the plan's ops), and ``enqueue_s``, the median host
    seconds to enqueue one eager call."""
    from .. import schedules
    from ..executor import execute
    from ..executor.compiler import compile_plan
    from ..plan.problem import Problem

    backend = _timed_backend()
    m, n, k = (16, 32, 32) if quick else (64, 128, 128)
    problems = [Problem(m, k, (n,), "float32", WORLD),
                Problem(WORLD * m, k, (n,), "float32", WORLD, op="matmul_reduce_scatter")]
    recs = []
    try:
        for problem in problems:
            handle = LoopbackHandle(backend, WORLD, 4 * max(problem.big_m * problem.k,
                                                            problem.m * n))
            buffers = _buffers(problem, handle, torch.float32)
            for name in names or schedules.names(op=problem.op):
                plan = schedules.get(name, op=problem.op).plan(problem, "dma")
                times = []
                for i in range(3 + (5 if quick else 15)):
                    start = time.perf_counter()
                    execute(plan, backend, buffers, timeout_s=60.0)
                    if i >= 3:
                        times.append(backend.handed_over_at - start)
                recs.append({"schema": results.CHARACTERIZE_SCHEMA, "kind": "enqueue",
                                 "op": problem.op, "schedule": name, "world": WORLD,
                                 "shape": [problem.big_m, n, k],
                                 "ops": compile_plan(plan).issue_calls(
                                     backend.batches_copies)[1],
                                 "plan_ops": len(plan.ops),
                                 "enqueue_s": statistics.median(times)})
                if progress is not None:
                    progress.update(1)
    finally:
        backend.close()
    return recs
