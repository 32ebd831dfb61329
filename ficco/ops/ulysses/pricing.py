"""Prices of the Ulysses plan ops (:mod:`.plan_ops`) for the simulator, with its own primitives
(so the pair shares every profile number with the other ops), sized from the plan's problem
(every rank's length along ``gather_dim``, as agreed):

- a GEMM piece is priced as :func:`ficco.heuristics.gemm.gemm_seconds` prices one GEMM of its
  rows, K and n (the whole product for ``serial``; adding into the output: read it too);
  its contention exposure is the whole GEMM's;
- a pull of one peer's chunk is one DMA copy on that peer's link;
- an all-to-all is a collective whose per-peer volume is the largest peer's (the expert ops'
  all-to-all price; a step that moves one peer's chunk: that peer's);
- the publish (``a``'s chunks into the staging buffer) is a local memory-bound move.

``price(sim, op, task, mt_factor)`` is called by the simulator (``HostOp.price``) with its task
type and contention function, so this module depends on neither.
"""
from __future__ import annotations

from ...heuristics import gemm as gemm_cost
from .layout import MATMUL_ALL_TO_ALL, numel


def price(sim, op, task, mt_factor):
    """The simulator task of Ulysses plan op ``op`` on simulation ``sim``."""
    p = sim.problem
    itemsize = sim.itemsize
    if op.kind == "ulysses_gemm":
        return _gemm(sim, p, op, task, mt_factor)
    if op.kind == "ulysses_copy":
        return sim._dma(op.peer, numel(p.recv_shape(op.peer)) * itemsize, None)
    if op.kind == "ulysses_publish":
        moved = sum(numel(p.send_shape(j)) for j in range(p.world) if j != p.rank)
        return sim._memory_move(moved * itemsize, on_copy_engine=op.queue.startswith("copy"))
    if op.kind == "ulysses_all_to_all":
        r, w = p.rank, p.world
        frm = [q for q in range(w) if q != r] if op.shift is None else [(r - op.shift) % w]
        to = [q for q in range(w) if q != r] if op.shift is None else [(r + op.shift) % w]
        volumes = [numel(p.recv_shape(q)) * itemsize for q in frm] + \
            [numel(p.send_shape(j)) * itemsize for j in to]
        busy = [v for v in volumes if v]
        return sim.collective("all_to_all", max(busy, default=0), len(frm))
    raise ValueError(f"not an Ulysses op kind: {op.kind!r}")


def _gemm(sim, p, op, task, mt_factor):
    if p.op == MATMUL_ALL_TO_ALL:
        dest = op.dest
        if dest is None:
            rows, k, n = numel(p.shape[:-1]), p.k, p.n
        else:
            rows, (k, n) = p.piece_rows(dest), p.piece_cols(dest)
        accumulate = False
    else:
        rows, (k, n) = p.piece_rows(op.source), p.piece_cols(op.source)
        accumulate = op.accumulate
    if not rows or not k or not n:
        return task("gemm", 0.0, 0.0)
    prof = sim.profile
    seconds = gemm_cost.gemm_seconds(prof, p.dtype, [rows], n, k, sim.itemsize, accumulate,
                                     sim.out_itemsize)
    launch_s = prof.dil["launch_s"]
    exposure = mt_factor(prof, gemm_cost.traffic_bytes(max(p.m, 1), p.n, p.k, sim.itemsize))
    return task("gemm", launch_s, max(seconds - launch_s, 0.0), mt_factor=exposure)
