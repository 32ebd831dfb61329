"""``ring`` and ``ring-bidir``: shard-level overlap as in PyTorch's Async-TP.

``ring``: step s (1 … W-1) pulls the whole shard of rank (r+s) mod W while the GEMM of the
shard that arrived at step s-1 runs; step 0 multiplies the local shard with no wait. Only one
peer link is busy at a time (on a full mesh, one of W-1)::

    copy0     |pub|  A[r+1]  |  A[r+2]  |  A[r+3]  |
    compute   | C[r] (from input) |  C[r+1]  |  C[r+2]  |  C[r+3] |

``ring-bidir``: each step pulls from (r+s) and (r-s) on two copy queues, so it needs
ceil((W-1)/2) steps; its GEMMs are per shard, as above.

With ``ccl`` each step is a send/recv pair over the process group instead of a pull. No gather
or scatter: shards land in place and every GEMM writes its own output rows.
"""
from __future__ import annotations

from dataclasses import dataclass

from ....plan import COMM, COMPUTE, Block, Gemm, Plan, PlanBuilder, SendRecv
from ....plan.problem import Problem
from ....schedules import common


@dataclass(frozen=True)
class Ring:
    bidirectional: bool = False

    @property
    def name(self) -> str:
        return "ring-bidir" if self.bidirectional else "ring"

    def peers_by_step(self, world: int, rank: int) -> list[list[int]]:
        """Peers pulled at steps 1, 2, …; each remote rank exactly once."""
        if not self.bidirectional:
            return [[(rank + s) % world] for s in range(1, world)]
        steps, seen = [], {rank}
        for s in range(1, world):
            fresh = [q for q in dict.fromkeys([(rank + s) % world, (rank - s) % world])
                     if q not in seen]
            if not fresh:
                break
            seen.update(fresh)
            steps.append(fresh)
        return steps

    def plan(self, problem: Problem, transport: str = "dma", copy_engines: int | None = None) -> Plan:
        common.check_transport(transport)
        p, builder = problem, PlanBuilder(self.name, transport, problem)
        if transport == "dma" and p.world > 1:
            # Publish and barrier on copy0, so the local GEMM (reading the caller's input)
            # starts at once, as in Async-TP.
            _, ready = common.publish_on_copy_engine(builder)
        else:
            ready = common.publish(builder, transport)
        local = Block("input", 0, p.m, 0, p.k)
        for j in range(len(p.ns)):
            if p.m:
                builder.add(Gemm(COMPUTE, (local,), (common.out_rows(p, j, p.shard_row0(p.rank), p.m),),
                           j, 0, p.k, step=0))
        copies: list[int | None] = []
        for s, peers in enumerate(self.peers_by_step(p.world, p.rank), start=1):
            for lane, q in enumerate(peers):
                if transport == "dma":
                    h = common.pull(builder, lane % (copy_engines or 2), q, 0, p.m, step=s,
                                    after=[ready])
                else:
                    # Rank q pulls from us at the step where we pull from it in the mirrored
                    # direction: send to r-s while receiving from r+s.
                    to = (2 * p.rank - q) % p.world
                    h = builder.add(SendRecv(COMM, common.shard_rows(p, p.rank), to,
                                       common.shard_rows(p, q), q, step=s), after=[ready])
                copies.append(h)
                common.gemm_rows(builder, p.shard_row0(q), p.m, step=s, after=[h])
        common.close(builder, transport, copies)
        return builder.build()
