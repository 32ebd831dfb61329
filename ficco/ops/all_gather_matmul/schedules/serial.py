"""``serial``: gather everything, then one GEMM — the baseline every speedup is measured
against.

::

    for p != r: A[p] <- peer p          (dma: W-1 copies on the copy engines at once;
                                          ccl: one all-gather)
    C = A @ B                            (one GEMM per b, after every copy)

    copy0..   |A[r+1]|A[r+2]| …|
    compute   |pub|         ...|====== GEMM(M) ======|

No gather or scatter: every copy lands where the GEMM reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ....plan import Plan, PlanBuilder
from ....plan.problem import Problem
from ....schedules import common


@dataclass(frozen=True)
class Serial:
    name: str = "serial"

    def plan(self, problem: Problem, transport: str = "dma", copy_engines: int | None = None) -> Plan:
        common.check_transport(transport)
        p, builder = problem, PlanBuilder(self.name, transport, problem)
        engines = copy_engines or max(p.world - 1, 1)
        ready = common.publish(builder, transport)
        copies: list[int | None] = []
        if transport == "dma":
            peers = [q for q in range(p.world) if q != p.rank]
            copies = [common.pull(builder, i % engines, q, 0, p.m, after=[ready])
                      for i, q in enumerate(peers)]
        elif p.world > 1:
            copies = [common.all_gather_rows(builder, 0, p.m, after=[ready])]
        common.gemm_rows(builder, 0, p.big_m, after=copies)
        common.close(builder, transport, copies)
        return builder.build()
