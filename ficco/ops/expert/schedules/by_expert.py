"""``by-expert``: the expert-parallel schedule that never cuts a GEMM. Each local expert's
GEMM runs whole, over every source's rows at once, and the unit of overlap is the expert:
dispatch moves expert l+1's rows while expert l multiplies; combine multiplies expert l+1
while expert l's products travel back.

Why: the FiCCO points cut every block into W chunks, so each step multiplies a W-th of every
expert's rows (small GEMMs: decomposition loss) and a 2d chunk adds partial products. The
fastest published GEMM + all-to-all kernels keep each GEMM whole and let its output travel
as it is finished (tile by tile, inside one kernel); without a fused kernel, ficco's
nearest form is the expert: a whole GEMM of a grouped GEMM, after which its rows may leave.
Each expert costs a copy per peer (the copy engines' per-copy cost) and, in combine, a
barrier; with one local expert there is nothing to pipeline and the plan is ``serial``'s.

Dispatch, W = 4, L = 3 experts (``eN``: expert N's rows from the three peers; ``G(eN)``: the
whole GEMM of expert N over every source)::

    copy0..2  |pub|b| e0 | e1 | e2 |b|
    compute   |        |G(e0)|G(e1)|G(e2)|

Combine runs it backwards: ``G(eN)`` into the symmetric buffer, a barrier (every rank made
it), every rank pulls its rows of expert N from every peer while ``G(eN+1)`` runs::

    compute   |G(e0)|G(e1)|G(e2)|
    copy0..2        |b| e0 |b| e1 |b| e2 |b|

``ccl``: one all-to-all of expert N's blocks per expert, on the comm queue.

>>> from ficco.ops.expert.problem import ExpertProblem
>>> p = ExpertProblem(8, 4, 3, "float32", 4, rank=1)
>>> dict(ByExpert(DISPATCH).plan(p, "dma").count())
{'expert_publish': 1, 'barrier': 2, 'expert_copy': 9, 'expert_gemm': 3}
"""
from __future__ import annotations

from dataclasses import dataclass

from ....plan import COMM, COMPUTE, Plan, PlanBuilder, copy_queue
from ....schedules.common import barrier, check_plan_args, pad_barriers, pull_order
from ..plan_ops import Exchange, GroupedGemm, Publish, Pull
from ..problem import DISPATCH, check_op


@dataclass(frozen=True)
class ByExpert:
    """``by-expert`` of ``op`` (dispatch or combine): see the module docstring."""

    op: str = DISPATCH
    name = "by-expert"

    def __post_init__(self):
        check_op(self.op, type(self).__name__)

    def plan(self, problem, transport: str = "dma", copy_engines: int | None = None) -> Plan:
        check_plan_args(self.op, problem, transport, copy_engines)
        builder = PlanBuilder(self.name, transport, problem)
        p = problem
        if p.world == 1:
            builder.add(GroupedGemm(COMPUTE, (0,), None))
        elif self.op == DISPATCH:
            self._dispatch(builder, p, transport, copy_engines or p.world - 1)
        else:
            self._combine(builder, p, transport, copy_engines or p.world - 1)
        return builder.build()

    def _dispatch(self, builder: PlanBuilder, p, transport: str, engines: int) -> None:
        everyone = tuple(range(p.world))
        peers = pull_order(p)
        last: dict[int, int] = {}
        if transport == "dma":
            ready = barrier(builder, step=0, after=[builder.add(Publish(copy_queue(0)))])
        for l in range(p.experts):
            if transport == "ccl":
                landed = [builder.add(Exchange(COMM, None, step=l, experts=(l,)))]
            else:
                landed = []
                for lane, q in enumerate(peers):
                    last[lane % engines] = builder.add(
                        Pull(copy_queue(lane % engines), q, None, step=l, experts=(l,)),
                        after=[ready])
                    landed.append(last[lane % engines])
            builder.add(GroupedGemm(COMPUTE, everyone, None, step=l, experts=(l,)),
                        after=landed)
        if transport == "dma":
            barrier(builder, step=p.experts, after=list(last.values()))

    def _combine(self, builder: PlanBuilder, p, transport: str, engines: int) -> None:
        everyone = tuple(range(p.world))
        peers = pull_order(p)
        last: dict[int, int] = {}
        if transport == "dma":
            pad_barriers(builder, p.experts + 1)
        for l in range(p.experts):
            made = builder.add(GroupedGemm(COMPUTE, everyone, None, step=l, experts=(l,)))
            if transport == "ccl":
                builder.add(Exchange(COMM, None, step=l, experts=(l,)), after=[made])
                continue
            ready = barrier(builder, step=l, after=[made])
            for lane, q in enumerate(peers):
                last[lane % engines] = builder.add(
                    Pull(copy_queue(lane % engines), q, None, step=l, experts=(l,)),
                    after=[ready])
        if transport == "dma":
            barrier(builder, step=p.experts, after=list(last.values()))
