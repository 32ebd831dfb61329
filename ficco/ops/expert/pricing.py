"""Prices of the expert-parallel plan ops (:mod:`ficco.ops.expert.plan_ops`) for the simulator.

Their plans name work by (source rank, chunk); the sizes come from the plan's problem, whose
counts are the routing being priced (for a decision: the representative of the call's bucketed
routing, :class:`~ficco.ops.expert.problem.ExpertProblem`). Each op is priced with the simulator's
own primitives, so expert parallelism shares every profile number with the other ops:

- a pull of one peer's chunk (one copy per local expert) is one DMA copy on that peer's link,
  paying the copy latency for its first non-empty expert block and, for each block after it
  (queued behind it on the same engine), the engine's issue interval
  (:meth:`~ficco.heuristics.profiles.Profile.queued_copy_s`: the copy latency where the
  profile gives none) (a 2d chunk is a strided copy, at
  the efficiency its row length gives, as for the other ops' 2d copies);
- a grouped GEMM is one launch over its experts' row blocks (tiles and waves over all of them,
  as :func:`ficco.heuristics.gemm.gemm_seconds` prices a batch), plus reading every expert's
  weight once; its contention exposure is the shard GEMM's, as for every other GEMM. A 2d
  chunk multiplies its columns only (dispatch: K columns, reading and adding into the output
  after the first chunk, float32 for bf16/fp16; combine: output columns);
- an all-to-all is a collective whose per-peer volume is the largest peer's (a ring step's:
  one peer's);
- the publish is a local memory-bound move.

``price(sim, op, task, mt_factor)`` is called by the simulator with its task type and its
contention function, so this module depends on neither.
"""
from __future__ import annotations

from ...heuristics import gemm as gemm_cost
from .problem import DISPATCH, piece_of


def price(sim, op, task, mt_factor):
    """The simulator task of expert-parallel op ``op`` on simulation ``sim``."""
    p = sim.problem
    lay, r = p.layout, p.rank
    if op.kind == "expert_publish":
        return sim._memory_move(lay.send_rows(r) * p.k * sim.itemsize,
                                on_copy_engine=op.queue.startswith("copy"))
    if op.kind == "expert_copy":
        pieces = [_moved(p, op.peer, l, op) for l in _experts(p, op)]
        pieces = [(rows, cols) for rows, cols in pieces if rows * cols]
        cols = pieces[0][1] if pieces else 0
        row_bytes = cols * sim.itemsize if op.two_d else None
        moved = sim._dma(op.peer, sum(rows for rows, _ in pieces) * cols * sim.itemsize,
                         row_bytes)
        if len(pieces) > 1:     # the blocks after the first are queued behind it
            moved.fixed_s += (len(pieces) - 1) * sim.profile.queued_copy_s()
        return moved
    if op.kind == "expert_gemm":
        return _grouped_gemm(sim, p, op, task, mt_factor)
    if op.kind == "expert_all_to_all":
        peers = [q for q in range(p.world) if q != r]
        if op.shift is not None:    # a ring step: one peer each way
            peers = [(r + op.shift) % p.world]
        volumes = [sum(rows * cols for rows, cols in (_moved(p, q, l, op)
                                                      for l in _experts(p, op)))
                   * sim.itemsize for q in peers]
        busy = [v for v in volumes if v]
        return sim.collective("all_to_all", max(busy, default=0), len(busy))
    raise ValueError(f"not an expert-parallel op kind: {op.kind!r}")


def _experts(p, op) -> range | tuple[int, ...]:
    """The local experts ``op`` covers (``op.experts``; None: every one)."""
    return range(p.experts) if op.experts is None else op.experts


def _moved(p, peer: int, local: int, op) -> tuple[int, int]:
    """(rows, columns) of local expert ``local``'s block that ``peer`` sends this rank in
    ``op``'s chunk."""
    lay, r = p.layout, p.rank
    rows = lay.block_rows(r, local, peer) if p.op == DISPATCH else lay.block_rows(peer, local, r)
    _, rn, _, cn = piece_of(rows, p.moved_cols, p.world, op.chunk, op.two_d)
    return rn, cn


def _grouped_gemm(sim, p, op, task, mt_factor):
    lay, r = p.layout, p.rank
    k, n = p.k, p.n
    cols = piece_of(0, p.moved_cols, p.world, op.chunk, op.two_d)[3]
    if p.op == DISPATCH:
        k = cols          # 2d: K columns of the rows times those rows of each weight
    else:
        n = cols          # 2d: output columns
    blocks = [sum(piece_of(lay.block_rows(r, l, s), p.moved_cols, p.world, op.chunk,
                           op.two_d)[1] for s in op.sources) for l in _experts(p, op)]
    blocks = [b for b in blocks if b]
    if not blocks or not k or not n:
        return task("gemm", 0.0, 0.0)
    prof = sim.profile
    seconds = gemm_cost.gemm_seconds(prof, p.dtype, blocks, n, k, sim.itemsize, op.accumulate,
                                     sim.out_itemsize)
    # every expert's weight is read once (gemm_seconds counts one (k, n) operand)
    efficiency = prof.dil.get("gemm_memory_efficiency") or prof.dil["memory_efficiency"]
    seconds += (len(blocks) - 1) * k * n * sim.itemsize / (prof.hbm_bytes_per_s * efficiency)
    launch_s = prof.dil["launch_s"]
    shard_rows = max(p.big_m // max(p.world, 1), 1)
    exposure = mt_factor(prof, gemm_cost.traffic_bytes(shard_rows, p.n, p.k, sim.itemsize))
    return task("gemm", launch_s, seconds - launch_s, mt_factor=exposure)
