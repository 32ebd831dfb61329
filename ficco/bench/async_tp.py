"""PyTorch's Async-TP GEMM + reduce-scatter, replayed as it runs, for the published rows.

``torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, "sum", scatter_dim=0, group)`` is not
one of ficco's schedules. In torch 2.11 and 2.13 alike
(``torch/distributed/_symmetric_memory/__init__.py``: ``_fused_matmul_reduce_scatter_impl``
and ``_pipelined_produce_and_all2all``) each rank of ``W``:

1. waits at a symmetric-memory barrier on the current stream (``symm_mem.barrier(channel=0)``)
   and makes a second, "backend" stream wait for it;
2. for ``step`` in 1 .. W-1, on the backend stream for odd steps and the current stream for
   even ones: multiplies the ``M/W`` rows of A bound for rank ``rank + step`` by the whole B
   into its own symmetric buffer (one of two, by step parity), waits at a barrier (every rank
   has written its buffer), copies rank ``rank - step``'s buffer into its stacked partials with
   ``Tensor.copy_`` (same dtype, contiguous: ``cudaMemcpyAsync`` device to device, a copy-engine
   copy from peer memory), and waits at a second barrier (every peer has read its buffer
   before the step after next overwrites it). So each stream's next GEMM waits for its own
   copy and two barriers: with both streams' GEMMs starting together (the first two are
   independent), the two streams run in lockstep and every pair of copies is exposed;
3. multiplies its own rows on the current stream, joins the backend stream, waits at a
   barrier, and sums the ``W`` stacked partials (``torch.sum`` over a ``(W, M/W, N)`` view,
   in the operands' dtype: no float32 output).

:func:`plan` builds that as a ficco :class:`~ficco.plan.Plan` (rank 0; ranks are symmetric)
that the simulator times with the profile's numbers: the chunk GEMMs priced as GEMMs of
``M/W`` rows (each reads all of B again), the two streams' GEMMs sharing the machine
(:mod:`ficco.heuristics.simulator`), copies as copy-engine copies of the profile, barriers at
``barrier_latency_s``. ``torch.cuda._sleep(100)`` before step 2 (100 cycles, to order the
first two GEMMs' launch) is left out.

Example::

    >>> from ficco.bench.paper_runs import load_profile
    >>> round(async_tp_us(load_profile("h100:graphs"), 512, 4096, 14336)) > 500
    True
"""
from __future__ import annotations

from ..heuristics import simulator
from ..plan import COMPUTE, Barrier, Block, Copy, Gemm, Op, Plan, Record, Reduce, Wait
from ..plan.problem import Problem

#: the second stream of ``_pipelined_produce_and_all2all`` (``_get_backend_stream()``)
BACKEND = "backend"


def plan(problem: Problem) -> Plan:
    """Rank 0's Async-TP plan for ``problem`` (``matmul_reduce_scatter``: every rank
    multiplies ``(m, k) @ (k, n)`` and receives ``m / W`` rows of the sum)."""
    world, k, n = problem.world, problem.k, problem.ns[0]
    rows, rank = problem.m // world, 0

    def partial(index, peer=None):
        return Block("partial", index * rows, rows, 0, n, peer=peer)

    ops: list[Op] = [Barrier(COMPUTE, 0), Record(COMPUTE, 0), Wait(BACKEND, 0)]
    for step in range(1, world):
        queue = BACKEND if step % 2 else COMPUTE
        target, source = (rank + step) % world, (rank - step) % world
        buffer = world + step % 2       # the two symmetric buffers sit after the stack
        ops += [Gemm(queue, (Block("input", target * rows, rows, 0, k),), (partial(buffer),),
                     0, 0, k, step=step),
                Barrier(queue, step % 2, step=step),
                Copy(queue, partial(buffer, peer=source), partial(source), step=step),
                Barrier(queue, step % 2, step=step)]
    ops += [Gemm(COMPUTE, (Block("input", rank * rows, rows, 0, k),), (partial(rank),), 0, 0, k,
                 step=world),
            Record(BACKEND, 1), Wait(COMPUTE, 1), Barrier(COMPUTE, 0, step=world),
            Reduce(COMPUTE, tuple(partial(q) for q in range(world)),
                   Block("out", 0, rows, 0, n), step=world)]
    return Plan("async-tp", "dma", problem, (COMPUTE, BACKEND), tuple(ops), num_events=2,
                wide=False)


def async_tp_us(prof, m: int | str, n: int | str, k: int | str, world: int | str = "8",
                dtype: str = "bfloat16") -> float:
    """Microseconds of one ``fused_matmul_reduce_scatter`` of ``(m, k) @ (k, n)`` over
    ``world`` ranks on ``prof`` (:func:`plan`, simulated)."""
    problem = Problem(int(m), int(k), (int(n),), dtype, int(world), op="matmul_reduce_scatter")
    return simulator.simulate(plan(problem), prof, wide_outputs=False).makespan_s * 1e6
