"""The FiCCO schedule family (paper §V, Fig. 11a): ``{uniform|hetero}-{fused|unfused}-{1d|2d}``.

PLACEHOLDER: being written (issue 3). Until then this module plans every FiCCO name as the
uniform-unfused-1d pattern so the registry and executor can be exercised.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan, PlanBuilder
from ..problem import Problem
from . import common


@dataclass(frozen=True)
class Ficco:
    uniform: bool = True
    fused: bool = True
    two_d: bool = False

    @property
    def name(self) -> str:
        return "-".join(["uniform" if self.uniform else "hetero",
                         "fused" if self.fused else "unfused", "2d" if self.two_d else "1d"])

    def plan(self, problem: Problem, transport: str = "dma", copy_engines: int | None = None) -> Plan:
        common.check_transport(transport)
        p, b = problem, PlanBuilder(self.name, transport, problem)
        engines = copy_engines or max(p.world - 1, 1)
        ready = common.publish(b, transport)
        copies = []
        for c, (row0, rows) in enumerate(p.row_chunks()):
            step_copies = []
            if transport == "dma":
                for i, q in enumerate(q for q in range(p.world) if q != p.rank):
                    step_copies.append(common.pull(b, i % engines, q, row0, rows, step=c,
                                                   after=[ready]))
            elif p.world > 1:
                step_copies.append(common.all_gather_rows(b, row0, rows, step=c, after=[ready]))
            copies += step_copies
            for q in range(p.world):
                common.gemm_rows(b, p.shard_row0(q) + row0, rows, step=c, after=step_copies)
        common.close(b, transport, copies)
        return b.build()


FICCO_SCHEDULES = tuple(Ficco(u, f, t) for t in (False, True) for u in (True, False)
                        for f in (True, False))
