"""``one-shot-kernel`` and ``two-shot-kernel`` for ``matmul_all_reduce``: the GEMM into the
symmetric ``partial``, then the whole all-reduce as ONE Triton launch per ``b_j``
(:mod:`ficco.kernels.all_reduce`) that raises this rank's flag, waits for every peer's and
sums straight from the peers' memory, its barriers inside the kernel: the custom all-reduce
of serving engines (vLLM's, SGLang's, torch's ``symm_mem.one_shot_all_reduce``), over ficco's
workspace. Decode's small messages are fixed cost, and this pays one launch where
``one-shot-sm`` pays a barrier program, a reduction launch and another barrier::

    one-shot-kernel   compute |== G ==|K: flag, wait, out = sum_q partial_q, flag, wait|
    two-shot-kernel   copy0   |bar|                 (the plan's first barrier, beside G)
                      compute |== G ==|K: flag, wait, reduce mine, flag, wait, gather, flag, wait|

One-shot reads (W-1) x the output per rank; two-shot 2 (W-1)/W of it, in three barriers. The
kernel's barriers are the plans' flag protocol, so channels alternate across its launches and
end on 1: two-shot's three per launch start on channel 1 after one plan barrier (on copy0,
beside the GEMM) when the launches are odd in number. Only ``dma``; Triton needed (on CPU it
runs in the interpreter: tests). Selectors are offered them only where the kernel was
verified on a GPU (:data:`ficco.kernels.VERIFIED_TARGETS`); forcing one runs it anywhere
Triton does.

>>> from ficco.plan.problem import Problem
>>> p = Problem(8, 16, (32,), "bfloat16", 4, op="matmul_all_reduce")
>>> dict(ShotKernel().plan(p).count()), dict(ShotKernel(two_shot=True).plan(p).count())
({'gemm': 1, 'shot_all_reduce': 1}, {'barrier': 1, 'gemm': 1, 'shot_all_reduce': 1})
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ....errors import InvalidArgumentError
from ....heuristics import reductions
from ....plan import COMPUTE, HostOp, Plan
from ....plan.problem import Problem
from ....schedules.common import avg_scale, barrier
from . import common


@dataclass(frozen=True)
class ShotAllReduce(HostOp):
    """ONE launch of the one-kernel all-reduce of output ``b`` (``out[b] = scale * sum over
    ranks of partial[b]``, in rank order): ``two_shot`` reduces this rank's piece and gathers
    the peers'; its barriers start on channel ``first_channel`` (two per launch for
    one-shot, three for two-shot)."""

    queue: str
    b: int
    two_shot: bool = False
    first_channel: int = 0
    scale: float | None = None
    step: int = 1
    kind: ClassVar[str] = "shot_all_reduce"

    @staticmethod
    def price(sim, op, task, mt_factor):   # type: ignore[override]
        """The one-kernel all-reduce: :mod:`ficco.heuristics.reductions`."""
        return reductions.price_shot_kernel(sim, op, task)

    @staticmethod
    def host_task(views, buffers, op):   # type: ignore[override]
        from ....kernels.launch import shot_task

        return shot_task(buffers, op)

    @property
    def barriers(self) -> int:
        return 3 if self.two_shot else 2


@dataclass(frozen=True)
class ShotKernel:
    two_shot: bool = False
    op = "matmul_all_reduce"
    plain_operands_only = False   # it sums what a library GEMM made, epilogue included

    @property
    def name(self) -> str:
        return "two-shot-kernel" if self.two_shot else "one-shot-kernel"

    def unavailable_reason(self, target: str, transport: str = "dma") -> str | None:
        """None when this schedule can run on backend ``target`` over ``transport``."""
        if transport != "dma":
            return (f"{self.name} reads the peers' partials in symmetric memory: it needs "
                    f"transport dma, not {transport}")
        from .... import kernels

        return kernels.all_reduce_unavailable_reason(target)

    def selectable_reason(self, target: str, transport: str = "dma") -> str | None:
        """Why selectors must not pick this schedule here (None: they may)."""
        reason = self.unavailable_reason(target, transport)
        if reason is None:
            from .... import kernels

            reason = kernels.all_reduce_selectable_reason(target)
        return reason

    def plan(self, problem: Problem, transport: str = "dma",
             copy_engines: int | None = None) -> Plan:
        builder, whole = common.begin(self.name, problem, transport, copy_engines)
        if whole:
            return builder.build()
        if transport != "dma":
            raise InvalidArgumentError(self.unavailable_reason("any", transport))
        p = problem
        launches = len(p.ns) if p.m else 0
        per_launch = 3 if self.two_shot else 2
        # The plan's barriers (the kernels' included) alternate channels and end on 1.
        ready = [barrier(builder, step=0)] if launches * per_launch % 2 else []
        gemms = common.gemms(builder, 0, p.m, "partial")
        for j in range(launches):
            first = (len(ready) + j * per_launch) % 2
            builder.add(ShotAllReduce(COMPUTE, j, self.two_shot, first, avg_scale(p)),
                        after=gemms + ready)
        return builder.build()


KERNEL_SCHEDULES = (ShotKernel(), ShotKernel(two_shot=True))
