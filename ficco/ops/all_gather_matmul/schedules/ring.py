"""``ring`` and ``ring-bidir``: shard-level overlap as in PyTorch's Async-TP.

``ring``: the local shard goes into place and, over ``dma``, every rank waits at barrier 0
(both on the compute queue), then the local shard's GEMM runs. Step s (1 … W-1) pulls the
whole shard of rank (r+s) mod W and multiplies it, the pull and its GEMM on one queue, the two
queues taking turns (odd steps on copy0, even ones on compute), as Async-TP's
``_pipelined_all_gather_and_consume`` alternates its two streams (torch 2.13): a pull runs
beside the other queue's GEMM, the two queues' GEMMs may run side by side, and no event
orders a GEMM after its pull (a W = 8 call is 24 runtime calls, one pulling queue feeding the
compute queue made 36)::

    compute   |pub|b| C[r] |  A[r+2] C[r+2] |  A[r+4] C[r+4] |
    copy0     |       A[r+1] C[r+1] |  A[r+3] C[r+3] |

``ring-bidir``: the shards of r+1, r+2, … on copy0 and of r-1, r-2, … on compute (after the
local GEMM), each queue pulling and multiplying its side in turn: ceil((W-1)/2) steps.

With ``ccl`` each step is a send/recv pair over the process group instead of a pull, and the
GEMMs run on the compute queue. No gather or scatter: shards land in place and every GEMM
writes its own output rows. (The paper's shard-level baseline, one copy engine feeding the
compute queue, is priced by ``ficco.bench.paper_runs.paper_ring``.)
"""
from __future__ import annotations

from dataclasses import dataclass

from ....plan import COMM, COMPUTE, Block, Copy, Gemm, Plan, PlanBuilder, SendRecv, copy_queue
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
        # The local shard into place on the compute queue (dma: then barrier 0 there), and its
        # GEMM from the caller's input.
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
                    # Each shard's pull and GEMM on one queue, the queues taking turns (ring:
                    # odd steps on copy0, even ones on compute; ring-bidir: r+s on copy0,
                    # r-s on compute): no event between a pull and its GEMM.
                    queue = copy_queue(0) if (lane == 0 if self.bidirectional else s % 2) \
                        else COMPUTE
                    h = None
                    if p.m and p.k:
                        h = builder.add(Copy(queue, common.shard_rows(p, q, remote=True),
                                             common.shard_rows(p, q), step=s), after=[ready])
                    copies.append(h)
                    if p.m:
                        for j in range(len(p.ns)):
                            builder.add(Gemm(queue, (common.shard_rows(p, q),),
                                             (common.out_rows(p, j, p.shard_row0(q), p.m),),
                                             j, 0, p.k, step=s), after=[h])
                    continue
                # Rank q pulls from us at the step where we pull from it in the mirrored
                # direction: send to r-s while receiving from r+s.
                to = (2 * p.rank - q) % p.world
                h = builder.add(SendRecv(COMM, common.shard_rows(p, p.rank), to,
                                   common.shard_rows(p, q), q, step=s), after=[ready])
                copies.append(h)
                common.gemm_rows(builder, p.shard_row0(q), p.m, step=s, after=[h])
        common.close(builder, transport, copies)
        return builder.build()
