"""Gated schedules ``gated-1d`` and ``gated-2d``: the FiCCO copy pattern on the copy engines,
consumed by ONE signal-gated Triton GEMM launch per ``b_j`` (:mod:`ficco.kernels`).

FiCCO trades decomposition (many smaller GEMMs, each a launch, each filling the machine worse:
DIL) against overlap. Here the GEMM is never cut: its tiles walk the output in arrival order
and wait, inside the kernel, for a per-copy arrival flag that the copy queue raises right
after the copy (a stream-ordered write). The copies stay on the copy engines, so no compute
unit moves bytes::

    publish  : input -> my rows of gathered (copy0), barrier 0 there
    for c    : for each peer q (queue (q - r - 1) % E): gathered[q, chunk c] <- peer q
                                                        then flag[c*W + q] = 1   (Signal)
    compute  : G = ONE gated GEMM per b_j, launched once its copies are queued; a persistent
               grid of fewer programs than the device has SMs/CUs:
               1d  tiles: my shard (no wait), then chunk 0 of every peer, chunk 1, ...
               2d  tiles: my shard (all K, no wait), then each peer's shard, accumulating
                   its K chunks c = 0, 1, ... as they land (fp32, rounded once)
    close    : barrier 1 after the last pull of each copy queue (copy0)

Timeline for W = 4 (``cN`` = chunk N's three copies, ``|`` = a flag raised)::

    copy0..2 |pub|bar|c0||c1||c2||c3||bar|
    compute  |==== G: my rows | c0 rows | c1 rows | c2 rows | c3 rows ====|

Only ``dma``: with ``ccl`` the collectives need compute units that the waiting tiles may hold,
so a gated GEMM could starve its own producer. The kernel needs Triton (``ficco[triton]``) and
a supported GPU; on CPU it runs in Triton's interpreter (tests). Where it cannot run the
schedules are not offered to selectors, and forcing one raises with the reason.

>>> from ficco.plan.problem import Problem
>>> plan = Gated(two_d=False).plan(Problem(m=8, k=16, ns=(32,), dtype="float32", world=4))
>>> plan.schedule, dict(plan.count())
('gated-1d', {'copy_1d': 13, 'barrier': 2, 'signal': 12, 'gated_gemm': 1})
"""
from __future__ import annotations

from dataclasses import dataclass

from ....errors import InvalidArgumentError
from ....plan import (
    COMPUTE,
    NO_FLAG,
    GatedGemm,
    Plan,
    PlanBuilder,
    Signal,
    copy_queue,
    flag_index,
)
from ....plan.problem import Problem
from ....schedules import common
from .ficco import chunks


@dataclass(frozen=True)
class Gated:
    """A gated schedule: ``two_d`` cuts shards by columns (the GEMM accumulates K chunks as
    they land) instead of rows. See the module docstring."""

    two_d: bool = False
    plain_operands_only = True    # the gated kernel multiplies plain operands

    @property
    def name(self) -> str:
        return "gated-2d" if self.two_d else "gated-1d"

    def unavailable_reason(self, target: str, transport: str = "dma") -> str | None:
        """None when this schedule can run on backend ``target`` over ``transport``."""
        if transport != "dma":
            return (f"{self.name} needs transport dma (copy engines): with {transport} the "
                    f"collectives need compute units that waiting tiles may hold")
        from .... import kernels

        return kernels.unavailable_reason(target)

    def selectable_reason(self, target: str, transport: str = "dma") -> str | None:
        """Why selectors must not pick this schedule here (None: they may)."""
        reason = self.unavailable_reason(target, transport)
        if reason is None:
            from .... import kernels

            reason = kernels.selectable_reason(target)
        return reason

    def plan(self, problem: Problem, transport: str = "dma",
             copy_engines: int | None = None) -> Plan:
        common.check_plan_args("all_gather_matmul", problem, transport, copy_engines)
        if transport != "dma" and problem.world > 1:
            raise InvalidArgumentError(self.unavailable_reason("any", transport))
        b = PlanBuilder(self.name, transport, problem)
        p = problem
        if p.m == 0:
            return b.build()
        local = (p.shard_row0(p.rank), p.m, ((0, p.k, NO_FLAG),))
        if p.world == 1:
            _gated_gemms(b, (local,))
            return b.build()
        engines = copy_engines or p.world - 1
        peers = common.pull_order(p)
        _, ready = common.publish_on_copy_engine(b)
        todo = chunks(p, self.two_d)
        if self.two_d:
            remote = tuple((p.shard_row0(q), p.m,
                            tuple((c.col0, c.cols, flag_index(p, q, c.index)) for c in todo))
                           for q in peers)
        else:
            remote = tuple((p.shard_row0(q) + c.row0, c.rows,
                            ((0, p.k, flag_index(p, q, c.index)),))
                           for c in todo for q in peers)
        last_pull = {}
        for chunk in todo:
            for lane, q in enumerate(peers):
                queue = lane % engines
                common.pull(b, queue, q, chunk.row0, chunk.rows, col0=chunk.col0,
                            cols=chunk.cols, step=chunk.index, after=[ready])
                # Same queue, right after the copy: queue order is the whole dependency.
                last_pull[queue] = b.add(Signal(copy_queue(queue),
                                                flag_index(p, q, chunk.index), step=chunk.index))
        # Launched after its copies and flag writes are queued: where they
        # share a hardware queue with the compute stream, or need compute units the waiting
        # tiles hold, a kernel launched first could starve its own producers. Its grid is
        # persistent and smaller than the device (ficco.kernels.configs.resident_programs).
        _gated_gemms(b, (local,) + remote)
        common.close(b, transport, list(last_pull.values()))
        return b.build()


def _gated_gemms(b: PlanBuilder, segments) -> None:
    for j in range(len(b.problem.ns)):
        b.add(GatedGemm(COMPUTE, segments, j))


GATED_SCHEDULES = (Gated(two_d=False), Gated(two_d=True))
