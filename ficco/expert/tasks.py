"""The host tasks of expert-parallel plans, and the per-call context they read.

An expert-parallel plan names work by (local expert, source rank, chunk), never by rows: the
rows are data (the routing counts), resolved here at launch from the call's :class:`Context`
(the executor hands it to every host task as ``Buffers.group``). So one plan serves every
routing, and the work of a block that is empty in this call is skipped at no cost.

On GPUs each task enqueues torch kernels or copies on its queue's stream (the executor makes
it current); on CPU a worker thread runs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .problem import DISPATCH, Layout, chunk_of


@dataclass
class Context:
    """What the host tasks of one call read. Dispatch: ``inp`` is x (T, K), ``out`` is y (R, n),
    ``landing`` receives the peers' rows in y's order (R, K), ``shared`` is this rank's
    symmetric copy of x (dma; peers pull from theirs). Combine: ``inp`` is h (R, K2), ``out`` is
    z (T, n2), ``shared`` holds this rank's products in h's order (symmetric with dma, peers
    pull their rows from it)."""

    kind: str
    group: Any
    layout: Layout
    rank: int
    inp: torch.Tensor
    weights: list
    out: torch.Tensor
    shared: torch.Tensor | None = None
    landing: torch.Tensor | None = None
    symm: Any = None
    stacked: torch.Tensor | None = None     # (L, K, n) when torch._grouped_mm runs
    _peers: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def experts(self) -> int:
        return self.layout.experts

    def peer_shared(self, peer: int) -> torch.Tensor:
        """``peer``'s copy of the symmetric buffer (the source of a pull)."""
        view = self._peers.get(peer)
        if view is None:
            view = self._peers[peer] = self.symm.get_buffer(peer, tuple(self.shared.shape),
                                                            self.shared.dtype)
        return view

    # -- the rows of one piece of work -------------------------------------------------------
    def pulls(self, peer: int, chunk: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) row blocks ``peer`` contributes to this rank in ``chunk``."""
        lay, r, big_l, out = self.layout, self.rank, self.experts, []
        src_buf = self.peer_shared(peer)
        for l in range(big_l):
            if self.kind == DISPATCH:   # peer's rows for my expert l -> block (l, peer)
                rows = lay.block_rows(r, l, peer)
                src0, dst0, dst = lay.send_offset(peer, r * big_l + l), \
                    lay.block_offset(r, l, peer), self.landing
            else:                       # my rows back from peer's expert l -> where they were
                rows = lay.block_rows(peer, l, r)
                src0, dst0, dst = lay.block_offset(peer, l, r), \
                    lay.send_offset(r, peer * big_l + l), self.out
            c0, cn = chunk_of(rows, self.world, chunk)
            if cn:
                out.append((dst[dst0 + c0: dst0 + c0 + cn], src_buf[src0 + c0: src0 + c0 + cn]))
        return out

    def gemm_pieces(self, sources, chunk) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(local expert, rows in, rows out) of blocks ``(l, s)`` for s in ``sources``."""
        lay, r, big_l, out = self.layout, self.rank, self.experts, []
        for l in range(big_l):
            for s in sources:
                c0, cn = chunk_of(lay.block_rows(r, l, s), self.world, chunk)
                if not cn:
                    continue
                at = lay.block_offset(r, l, s) + c0
                home = lay.send_offset(r, r * big_l + l) + c0   # the own block in x / z
                if self.kind == DISPATCH:
                    a = self.inp[home: home + cn] if s == r else self.landing[at: at + cn]
                    dst = self.out[at: at + cn]
                else:
                    a = self.inp[at: at + cn]
                    dst = self.out[home: home + cn] if s == r else self.shared[at: at + cn]
                out.append((l, a, dst))
        return out

    def exchange_pieces(self, chunk) -> tuple[list[list], list[list]]:
        """Per peer, the row blocks this rank sends it and those it receives from it in
        ``chunk`` (the own rank's lists stay empty: its block never travels)."""
        lay, r, big_l, w = self.layout, self.rank, self.experts, self.world
        sends, recvs = [[] for _ in range(w)], [[] for _ in range(w)]
        for q in range(w):
            if q == r:
                continue
            for l in range(big_l):
                if self.kind == DISPATCH:
                    send_rows, send0 = lay.counts[r][q * big_l + l], \
                        lay.send_offset(r, q * big_l + l)
                    recv_rows, recv0 = lay.block_rows(r, l, q), lay.block_offset(r, l, q)
                    src, dst = self.inp, self.landing
                else:
                    send_rows, send0 = lay.block_rows(r, l, q), lay.block_offset(r, l, q)
                    recv_rows, recv0 = lay.counts[r][q * big_l + l], \
                        lay.send_offset(r, q * big_l + l)
                    src, dst = self.shared, self.out
                c0, cn = chunk_of(send_rows, w, chunk)
                if cn:
                    sends[q].append(src[send0 + c0: send0 + c0 + cn])
                c0, cn = chunk_of(recv_rows, w, chunk)
                if cn:
                    recvs[q].append(dst[recv0 + c0: recv0 + c0 + cn])
        return sends, recvs


# -- grouped GEMMs ---------------------------------------------------------------------------
def grouped_mm_runs(dtype: torch.dtype, k: int, n: int, device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` runs for these operands: on CPU (torch 2.13) for
    float32/bfloat16/float16 with rows of a multiple of 16 bytes; on CUDA for bfloat16 on
    sm_90 and newer. Elsewhere a loop of GEMMs does the same work."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    itemsize = torch.empty(0, dtype=dtype).element_size()
    aligned = (k * itemsize) % 16 == 0 and (n * itemsize) % 16 == 0
    if device.type == "cpu":
        return aligned and dtype in (torch.float32, torch.bfloat16, torch.float16)
    if device.type == "cuda" and torch.version.hip is None:
        return aligned and dtype == torch.bfloat16 and \
            torch.cuda.get_device_capability(device) >= (9, 0)
    return False


def run_grouped(pieces, weights: list, stacked: torch.Tensor | None) -> None:
    """``out = a @ weights[l]`` for every piece ``(l, a, out)``: one ``torch._grouped_mm`` over
    all pieces when ``stacked`` (the (L, K, n) weights) is given and there is more than one,
    else one GEMM each, written in place."""
    pieces = [p for p in pieces if p[1].shape[0]]
    if stacked is None or len(pieces) < 2:
        for l, a, out in pieces:
            torch.matmul(a, weights[l], out=out)
        return
    pieces.sort(key=lambda p: p[0])       # groups in expert order; sort is stable
    rows = [0] * stacked.shape[0]
    for l, a, _ in pieces:
        rows[l] += a.shape[0]
    ends = torch.tensor(rows, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    a = torch.cat([a for _, a, _ in pieces])
    result = torch._grouped_mm(a, stacked, offs=ends.to(a.device))
    for (_, _, out), part in zip(pieces, result.split([p[1].shape[0] for p in pieces])):
        out.copy_(part)


# -- the tasks (the executor calls task(views, context, op) -> fn, launched on op.queue) ------
def publish_task(views, ctx: Context, op):
    """Dispatch, dma: x into this rank's symmetric buffer, where its peers pull from."""
    rows = ctx.inp.shape[0]
    return lambda: ctx.shared[:rows].copy_(ctx.inp)


def move_task(views, ctx: Context, op):
    """Pull ``op.chunk`` of every block ``op.peer`` holds for this rank (one copy per expert)."""
    pairs = ctx.pulls(op.peer, op.chunk)

    def run():
        for dst, src in pairs:
            dst.copy_(src)
    return run


def gemm_task(views, ctx: Context, op):
    """One grouped GEMM over ``op.chunk`` of the blocks of ``op.sources`` (every expert)."""
    pieces = ctx.gemm_pieces(op.sources, op.chunk)
    return lambda: run_grouped(pieces, ctx.weights, ctx.stacked)


def exchange_task(views, ctx: Context, op):
    """``ccl``: ``op.chunk`` of every block moved by one ``all_to_all_single`` of the process
    group (packed: gloo needs one flat buffer, NCCL is faster with one)."""
    sends, recvs = ctx.exchange_pieces(op.chunk)
    like = ctx.inp

    def run():
        send_sizes = [sum(t.numel() for t in pieces) for pieces in sends]
        recv_sizes = [sum(t.numel() for t in pieces) for pieces in recvs]
        flat = [t.reshape(-1) for pieces in sends for t in pieces]
        packed = torch.cat(flat) if flat else like.new_empty(0)
        got = like.new_empty(sum(recv_sizes))
        dist.all_to_all_single(got, packed, recv_sizes, send_sizes, group=ctx.group)
        at = 0
        for pieces in recvs:
            for t in pieces:
                t.copy_(got[at: at + t.numel()].view(t.shape))
                at += t.numel()
    return run
