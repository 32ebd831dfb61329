"""Prices of the expert-parallel plan ops (:mod:`ficco.expert.plan_ops`) for the simulator.

Their plans name work by (source rank, chunk); the sizes come from the plan's problem, whose
counts are the routing being priced (for a decision: the representative of the call's bucketed
routing, :class:`~ficco.expert.problem.ExpertProblem`). Each op is priced with the simulator's
own primitives, so expert parallelism shares every profile number with the other ops:

- a pull of one peer's chunk (one copy per local expert) is one DMA copy on that peer's link,
  paying the copy latency once per non-empty expert block;
- a grouped GEMM is one launch over its experts' row blocks (tiles and waves over all of them,
  as :func:`ficco.heuristics.gemm.gemm_seconds` prices a batch), plus reading every expert's
  weight once; its contention exposure is the shard GEMM's, as for every other GEMM;
- an all-to-all is a collective whose per-peer volume is the largest peer's;
- the publish is a local memory-bound move.

``price(sim, op, task, mt_factor)`` is called by the simulator with its task type and its
contention function, so this module depends on neither.
"""
from __future__ import annotations

from ..expert.problem import DISPATCH, chunk_of
from . import gemm as gemm_cost


def price(sim, op, task, mt_factor):
    """The simulator task of expert-parallel op ``op`` on simulation ``sim``."""
    p = sim.problem
    lay, r = p.layout, p.rank
    cols = p.k if p.op == DISPATCH else p.n      # what crosses the links
    if op.kind == "expert_publish":
        return sim._memory_move(lay.send_rows(r) * p.k * sim.itemsize,
                                on_copy_engine=op.queue.startswith("copy"))
    if op.kind == "expert_copy":
        rows = [_pulled(p, op.peer, l, op.chunk) for l in range(p.experts)]
        pieces = sum(1 for x in rows if x)
        moved = sim._dma(op.peer, sum(rows) * cols * sim.itemsize, None)
        if pieces > 1:
            moved.fixed_s += (pieces - 1) * sim.profile.copy_latency_s
        return moved
    if op.kind == "expert_gemm":
        return _grouped_gemm(sim, p, op, task, mt_factor)
    if op.kind == "expert_all_to_all":
        volumes = [sum(_pulled(p, q, l, op.chunk) for l in range(p.experts)) * cols
                   * sim.itemsize for q in range(p.world) if q != r]
        busy = [v for v in volumes if v]
        return sim._collective(max(busy, default=0), len(busy))
    raise ValueError(f"not an expert-parallel op kind: {op.kind!r}")


def _pulled(p, peer: int, local: int, chunk) -> int:
    """Rows of local expert ``local``'s block that ``peer`` sends this rank in ``chunk``."""
    lay, r = p.layout, p.rank
    rows = lay.block_rows(r, local, peer) if p.op == DISPATCH else lay.block_rows(peer, local, r)
    return chunk_of(rows, p.world, chunk)[1]


def _grouped_gemm(sim, p, op, task, mt_factor):
    lay, r = p.layout, p.rank
    k, n = p.k, p.n
    blocks = [sum(chunk_of(lay.block_rows(r, l, s), p.world, op.chunk)[1] for s in op.sources)
              for l in range(p.experts)]
    blocks = [b for b in blocks if b]
    if not blocks:
        return task("gemm", 0.0, 0.0)
    prof = sim.profile
    seconds = gemm_cost.gemm_seconds(prof, p.dtype, blocks, n, k, sim.itemsize)
    # every expert's weight is read once (gemm_seconds counts one (k, n) operand)
    efficiency = prof.dil.get("gemm_memory_efficiency") or prof.dil["memory_efficiency"]
    seconds += (len(blocks) - 1) * k * n * sim.itemsize / (prof.hbm_bytes_per_s * efficiency)
    launch_s = prof.dil["launch_s"]
    shard_rows = max(p.big_m // max(p.world, 1), 1)
    exposure = mt_factor(prof, gemm_cost.traffic_bytes(shard_rows, n, k, sim.itemsize))
    return task("gemm", launch_s, seconds - launch_s, mt_factor=exposure)
