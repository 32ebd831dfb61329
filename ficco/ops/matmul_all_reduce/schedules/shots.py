"""``serial``, ``one-shot`` and ``two-shot`` (each ``-sm`` too) for ``matmul_all_reduce``: the
whole GEMM, then one all-reduce of its partial products.

``serial`` is the baseline speedups are relative to: over ``ccl`` the process group's
all-reduce (NCCL/RCCL), over ``dma`` the bandwidth-optimal all-reduce over symmetric memory
(what ``two-shot`` runs)::

    G        partial = a @ b                   (one GEMM per b; over ccl straight into out
                                                when nothing else is added to it)
    ccl      one all-reduce collective         (sums in the partials' dtype, as NCCL does)
    dma      two-shot, below

``one-shot``: every rank reads every peer's whole partial and sums all W itself, in rank
order (0, 1, …, W-1), so every rank computes the same bits. One barrier and one round of
reads: the latency-bound small messages of decode (M of 1-512 rows), at (W-1)x the bytes of
the output per rank::

    copy0..   |        |bar|P[r+1] P[r+2] …|                 |bar|
    compute   |== G ===|                   |R: out = sum of W|

``two-shot``: each rank sums its block of rows (``Problem.block``) from every peer's partial
into its ``reduced`` rows, a barrier, then every rank pulls every peer's reduced block: a
reduce-scatter and an all-gather, 2 (W-1)/W of the output per rank, two barriers::

    copy0..   |        |bar|P[r+1] …|   |bar|Q[r+1] Q[r+2] …|bar|
    compute   |== G ===|            |R_r|

(``P``: pulls of partials, ``Q``: pulls of reduced blocks.) ``-sm``: the reads are loads of a
kernel on the compute queue instead of copy-engine pulls (one-shot: the reduction reads the
peers' partials in place, as torch's ``one_shot_all_reduce`` and vLLM's custom all-reduce do;
two-shot: the reduction, then one copy kernel per peer's block). No copies, no landing
buffer; the reads cross the links from compute units and contend with the GEMM like a
collective. Over ``ccl`` one-shot is an all-gather of the partials and one local reduction,
two-shot a reduce-scatter and an all-gather collective, and each ``-sm`` plan is its copy
form's (loads need symmetric memory).
"""
from __future__ import annotations

from dataclasses import dataclass

from ....plan import (
    COMM,
    COMPUTE,
    AllGather,
    AllReduce,
    Copy,
    Plan,
    PlanBuilder,
    Reduce,
    copy_queue,
)
from ....plan.problem import Problem
from ....schedules.common import avg_scale, barrier, pad_barriers, pull_order
from . import common


def two_shot_rows(builder: PlanBuilder, row0: int, count: int, gemms: list[int], *,
                  engines: int, loads: bool = False, recv_row0: int = 0,
                  step: int = 0) -> tuple[list[int], int]:
    """The all-reduce of partial rows ``[row0, row0+count)`` once ``gemms`` computed them:
    over ``dma`` the two halves of :mod:`.common` between two barriers; over ``ccl`` their
    collectives. Returns (every read of a peer's memory, the recv rows it used)."""
    p = builder.problem
    split = common.pieces(p, row0, count)
    if builder.transport == "ccl":
        common.all_reduce_ccl(builder, split, step=step, after=gemms)
        return [], 0
    ready = barrier(builder, step, after=gemms)
    reductions, reads = common.reduce_piece(builder, split, engines=engines, loads=loads,
                                            recv_row0=recv_row0, step=step, after=[ready])
    done = barrier(builder, step, after=reductions)
    reads += common.gather_pieces(builder, split, engines=engines, loads=loads, step=step,
                                  after=[done], own_after=reductions)
    return reads, p.world * split[p.rank][1]


@dataclass(frozen=True)
class TwoShot:
    loads: bool = False
    op = "matmul_all_reduce"

    @property
    def name(self) -> str:
        return "two-shot-sm" if self.loads else "two-shot"

    def plan(self, problem: Problem, transport: str = "dma",
             copy_engines: int | None = None) -> Plan:
        builder, whole = common.begin(self.name, problem, transport, copy_engines)
        if not whole:
            self.fill(builder, copy_engines)
        return builder.build()

    def fill(self, builder: PlanBuilder, copy_engines: int | None) -> None:
        p = builder.problem
        if builder.transport == "dma":
            pad_barriers(builder, 3)
        gemms = common.gemms(builder, 0, p.m, "partial")
        reads, _ = two_shot_rows(builder, 0, p.m, gemms, engines=copy_engines or p.world - 1,
                                 loads=self.loads)
        if builder.transport == "dma":
            common.close(builder, "dma", reads)


@dataclass(frozen=True)
class Serial:
    name: str = "serial"
    op = "matmul_all_reduce"

    def plan(self, problem: Problem, transport: str = "dma",
             copy_engines: int | None = None) -> Plan:
        builder, whole = common.begin(self.name, problem, transport, copy_engines)
        if whole:
            return builder.build()
        if transport == "dma":
            TwoShot().fill(builder, copy_engines)
            return builder.build()
        p = problem
        target = "out" if common.straight_to_out(p) else "partial"
        gemms = common.gemms(builder, 0, p.m, target)
        for j in range(len(p.ns)):
            if p.m:
                everything = (0, p.m)
                builder.add(AllReduce(COMM, common.rows(p, target, j, everything),
                                      common.rows(p, "out", j, everything),
                                      scale=avg_scale(p)), after=gemms)
        return builder.build()


@dataclass(frozen=True)
class OneShot:
    loads: bool = False
    op = "matmul_all_reduce"

    @property
    def name(self) -> str:
        return "one-shot-sm" if self.loads else "one-shot"

    def plan(self, problem: Problem, transport: str = "dma",
             copy_engines: int | None = None) -> Plan:
        builder, whole = common.begin(self.name, problem, transport, copy_engines)
        if whole:
            return builder.build()
        p = problem
        everything = (0, p.m)
        gemms = common.gemms(builder, 0, p.m, "partial")
        ready = barrier(builder, 0, after=gemms) if transport == "dma" else -1
        engines = copy_engines or p.world - 1
        reads: list[int] = []
        for j in range(len(p.ns)):
            if not p.m:
                continue
            slots = [common.rows(p, "recv", j, (q * p.m, p.m)) for q in range(p.world)]
            if transport == "ccl":   # every rank's partial, its own included, in rank order
                landed = [builder.add(AllGather(COMM, common.rows(p, "partial", j, everything),
                                                tuple(slots)), after=gemms)]
                srcs = slots
            elif self.loads:
                landed = [ready]
                srcs = [common.rows(p, "partial", j, everything, None if q == p.rank else q)
                        for q in range(p.world)]
            else:
                landed = [builder.add(Copy(copy_queue(i % engines),
                                           common.rows(p, "partial", j, everything, q),
                                           slots[q]), after=[ready])
                          for i, q in enumerate(pull_order(p))]
                reads += landed
                srcs = [common.rows(p, "partial", j, everything) if q == p.rank else slots[q]
                        for q in range(p.world)]
            h = builder.add(Reduce(COMPUTE, tuple(srcs), common.rows(p, "out", j, everything),
                                   False, 1, avg_scale(p)), after=landed)
            if self.loads:
                reads.append(h)
        if transport == "dma":
            common.close(builder, transport, reads or [ready])
        return builder.build()
