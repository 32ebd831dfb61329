"""The host tasks of expert-parallel plans (:mod:`ficco.ops.expert.plan_ops`), the grouped GEMM they
run, and the rows of one call they read (:class:`ExpertContext`, ``Buffers.tasks``). Each task
sizes its work at launch from the call's routing (the executor hands every host task the call's
:class:`~ficco.plan.buffers.Buffers`), so one plan serves every routing and the work of a block that
is empty in this call is skipped at no cost.

An expert-parallel plan names work by (source rank, chunk), never by rows: the rows are data
(the routing counts), resolved here at launch from the call's agreed
:class:`~ficco.ops.expert.problem.Layout`. A chunk is a row chunk (``1d``) or a column chunk
(``2d``) of every block, :func:`~ficco.ops.expert.problem.piece_of`; the columns a ``2d`` chunk
cuts are those that cross the links (dispatch: K, combine: n).

On GPUs each task enqueues torch kernels or copies on its queue's stream (the executor makes
it current); on CPU a worker thread runs them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...plan.buffers import Buffers
from ...plan.epilogue import gemm_into_view
from ...plan.tasks import local
from .problem import DISPATCH, Layout, piece_of


@dataclass
class ExpertContext:
    """What the host tasks of one call read besides the rest of its
    :class:`~ficco.plan.buffers.Buffers` (its ``group``, and its ``symm`` through ``Buffers.peer``).
    Dispatch: ``inp`` is x (T, K), ``out`` is y (R, n) (float32 when a ``2d`` plan
    accumulates bf16/fp16 products into it), ``landing`` receives the peers' rows in y's order
    (R, K), ``shared`` is this rank's symmetric copy of x (dma; peers pull from theirs).
    Combine: ``inp`` is h (R, K2), ``out`` is z (T, n2), ``shared`` holds this rank's products
    in h's order (symmetric with dma, peers pull their rows from it)."""

    kind: str
    layout: Layout
    rank: int
    inp: torch.Tensor
    weights: list
    out: torch.Tensor
    shared: torch.Tensor | None = None
    landing: torch.Tensor | None = None
    stacked: torch.Tensor | None = None     # (L, K, n) when torch._grouped_mm runs

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def experts(self) -> int:
        return self.layout.experts

    @property
    def shared_name(self) -> str:
        """The name ``Buffers.peer`` knows ``shared`` by."""
        return "gathered" if self.kind == DISPATCH else "partial"

    @property
    def moved_cols(self) -> int:
        return self.inp.shape[1] if self.kind == DISPATCH else self.out.shape[1]

    # landing (dispatch) and shared (combine; dma: dispatch too) exist wherever rows travel:
    # None only in a world of one with ccl, whose plans have no piece that reads them.
    def landed(self) -> torch.Tensor:
        """``landing``, where a peer's rows are read or written."""
        assert self.landing is not None, "dispatch lands its peers' rows in landing"
        return self.landing

    def staged(self) -> torch.Tensor:
        """``shared``, where a peer's rows are read or written."""
        assert self.shared is not None, "rows that travel are staged in shared"
        return self.shared

    def _piece(self, rows: int, chunk, two_d: bool) -> tuple[int, int, slice]:
        r0, rn, c0, cn = piece_of(rows, self.moved_cols, self.world, chunk, two_d)
        return r0, (rn if cn else 0), slice(c0, c0 + cn)

    # -- the rows of one piece of work -------------------------------------------------------
    def local_experts(self, experts: tuple[int, ...] | None) -> range | tuple[int, ...]:
        """The local experts an op covers: ``experts``, or every one (None)."""
        return range(self.experts) if experts is None else experts

    def pulls(self, peer: int, chunk: int | None, two_d: bool, src_buf: torch.Tensor,
              experts: tuple[int, ...] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) blocks ``peer`` contributes to this rank in ``chunk``, for
        ``experts`` (None: all; ``src_buf``: ``peer``'s copy of the symmetric buffer; 2d:
        strided column blocks)."""
        lay, r, big_l, out = self.layout, self.rank, self.experts, []
        for l in self.local_experts(experts):
            if self.kind == DISPATCH:   # peer's rows for my expert l -> block (l, peer)
                rows = lay.block_rows(r, l, peer)
                src0, dst0, dst = lay.send_offset(peer, r * big_l + l), \
                    lay.block_offset(r, l, peer), self.landed()
            else:                       # my rows back from peer's expert l -> where they were
                rows = lay.block_rows(peer, l, r)
                src0, dst0, dst = lay.block_offset(peer, l, r), \
                    lay.send_offset(r, peer * big_l + l), self.out
            c0, cn, cols = self._piece(rows, chunk, two_d)
            if cn:
                out.append((dst[dst0 + c0: dst0 + c0 + cn, cols],
                            src_buf[src0 + c0: src0 + c0 + cn, cols]))
        return out

    def gemm_pieces(self, sources, chunk, two_d: bool,
                    experts: tuple[int, ...] | None = None) -> list[tuple]:
        """(local expert, rows in, weight, rows out) of blocks ``(l, s)`` for s in
        ``sources`` and l in ``experts`` (None: all): 2d dispatch multiplies K columns ``c``
        by weight rows ``c`` (partial products, accumulated), 2d combine makes output
        columns ``c``."""
        lay, r, big_l, out = self.layout, self.rank, self.experts, []
        for l in self.local_experts(experts):
            for s in sources:
                c0, cn, cols = self._piece(lay.block_rows(r, l, s), chunk, two_d)
                if not cn:
                    continue
                at = lay.block_offset(r, l, s) + c0
                home = lay.send_offset(r, r * big_l + l) + c0   # the own block in x / z
                if self.kind == DISPATCH:
                    a = self.inp[home: home + cn] if s == r else self.landed()[at: at + cn]
                    out.append((l, a[:, cols], self.weights[l][cols], self.out[at: at + cn]))
                else:
                    dst = self.out[home: home + cn] if s == r else self.staged()[at: at + cn]
                    out.append((l, self.inp[at: at + cn], self.weights[l][:, cols],
                                dst[:, cols]))
        return out

    def stacked_piece(self, chunk, two_d: bool) -> torch.Tensor | None:
        """The (L, K, n) weights cut like :meth:`gemm_pieces` cuts each one (None without)."""
        if self.stacked is None or not two_d:
            return self.stacked
        _, _, cols = self._piece(1, chunk, True)
        return self.stacked[:, cols] if self.kind == DISPATCH else self.stacked[:, :, cols]

    def exchange_pieces(self, chunk, two_d: bool, send_to: int | None = None,
                        recv_from: int | None = None, experts: tuple[int, ...] | None = None
                        ) -> tuple[list[list], list[list]]:
        """Per peer, the blocks this rank sends it and those it receives from it in ``chunk``
        (the own rank's lists stay empty: its block never travels), for ``experts`` (None:
        all). ``send_to``/``recv_from`` (ring): only that peer's blocks, every other list
        empty."""
        lay, r, big_l, w = self.layout, self.rank, self.experts, self.world
        sends: list[list[torch.Tensor]] = [[] for _ in range(w)]
        recvs: list[list[torch.Tensor]] = [[] for _ in range(w)]
        for q in range(w):
            if q == r:
                continue
            for l in self.local_experts(experts):
                if self.kind == DISPATCH:
                    send_rows, send0 = lay.counts[r][q * big_l + l], \
                        lay.send_offset(r, q * big_l + l)
                    recv_rows, recv0 = lay.block_rows(r, l, q), lay.block_offset(r, l, q)
                    src, dst = self.inp, self.landed()
                else:
                    send_rows, send0 = lay.block_rows(r, l, q), lay.block_offset(r, l, q)
                    recv_rows, recv0 = lay.counts[r][q * big_l + l], \
                        lay.send_offset(r, q * big_l + l)
                    src, dst = self.staged(), self.out
                c0, cn, cols = self._piece(send_rows, chunk, two_d)
                if cn and send_to in (None, q):
                    sends[q].append(src[send0 + c0: send0 + c0 + cn, cols])
                c0, cn, cols = self._piece(recv_rows, chunk, two_d)
                if cn and recv_from in (None, q):
                    recvs[q].append(dst[recv0 + c0: recv0 + c0 + cn, cols])
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


def grouped_view_runs(stacked: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes this (L, k, n) view of the stacked weights (a 2d
    chunk's columns): the same rule as the whole, and a 16-byte aligned start and row."""
    size = stacked.element_size()
    return grouped_mm_runs(stacked.dtype, stacked.shape[1], stacked.shape[2], stacked.device) \
        and (stacked.storage_offset() * size) % 16 == 0 and (stacked.stride(1) * size) % 16 == 0


def _write(out: torch.Tensor, product: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        out.add_(product)
    else:
        out.copy_(product)


def run_grouped(pieces, stacked: torch.Tensor | None, accumulate: bool = False) -> None:
    """``out (+)= a @ b`` for every piece ``(l, a, b, out)``: one ``torch._grouped_mm`` over
    all pieces when ``stacked`` (the (L, k, n) weights the ``b`` are cut from) is given and
    there is more than one, else one GEMM each, written in place. Products are made in the
    operands' dtype, except into a wider ``out`` (float32 for bf16/fp16 2d plans): there in
    float32, unrounded, so that the sum of the K chunks is rounded once, by the caller, as
    every other schedule rounds (``torch._grouped_mm`` has no wider output: one GEMM each)."""
    pieces = [p for p in pieces if p[1].shape[0]]
    if stacked is None or len(pieces) < 2 or pieces[0][3].dtype != pieces[0][1].dtype:
        for _, a, b, out in pieces:
            gemm_into_view(a, b, out, accumulate)
        return
    pieces.sort(key=lambda p: p[0])       # groups in expert order; sort is stable
    rows = [0] * stacked.shape[0]
    for l, a, _, _ in pieces:
        rows[l] += a.shape[0]
    ends = torch.tensor(rows, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    a = torch.cat([a for _, a, _, _ in pieces])
    result = torch._grouped_mm(a, stacked, offs=ends.to(a.device))
    for (_, _, _, out), part in zip(pieces, result.split([p[1].shape[0] for p in pieces])):
        _write(out, part, accumulate)


def context_of(buffers: Buffers) -> ExpertContext:
    """The expert part of an expert call's Buffers (:meth:`ficco.ops.expert.spec.ExpertSpec.buffers`
    always sets it; other ops' Buffers never reach these tasks)."""
    ctx = buffers.task_state
    assert ctx is not None, "an expert op's Buffers hold its ExpertContext"
    return ctx


# -- the tasks (the executor calls task(views, buffers, op) -> fn, launched on op.queue) ------
# GEMMs and copies are this rank's own work (``host_tasks.local``): a backend that bounds its
# queues by FICCO_TIMEOUT (the CPU's) lets them take as long as they take; the exchange is a
# collective, bounded.
def publish_task(views, buffers: Buffers, op):
    """Dispatch, dma: x into this rank's symmetric buffer, where its peers pull from."""
    ctx = context_of(buffers)
    rows, shared = ctx.inp.shape[0], ctx.staged()
    return local(lambda: shared[:rows].copy_(ctx.inp))


def move_pairs(views, buffers: Buffers, op) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) of every copy of a pull: ``op.chunk`` of every block ``op.peer``
    holds for this rank (one per expert; 2d: a strided column block each). A backend that
    prepares copies submits them itself (:attr:`ficco.plan.HostOp.copy_pairs`)."""
    ctx = context_of(buffers)
    return ctx.pulls(op.peer, op.chunk, op.two_d, buffers.peer(op.peer, ctx.shared_name),
                     op.experts)


def move_task(views, buffers: Buffers, op):
    """The copies of :func:`move_pairs` as one host task (backends that do not prepare
    copies: the CPU's)."""
    pairs = move_pairs(views, buffers, op)

    def run():
        for dst, src in pairs:
            dst.copy_(src)
    return local(run)     # the peer's rows are there (a barrier came before): a copy


def gemm_task(views, buffers: Buffers, op):
    """One grouped GEMM over ``op.chunk`` of the blocks of ``op.sources`` (every expert)."""
    ctx = context_of(buffers)
    pieces = ctx.gemm_pieces(op.sources, op.chunk, op.two_d, op.experts)
    stacked = ctx.stacked_piece(op.chunk, op.two_d)
    if stacked is not None and op.two_d and not grouped_view_runs(stacked):
        stacked = None
    return local(lambda: run_grouped(pieces, stacked, op.accumulate))


def exchange_task(views, buffers: Buffers, op):
    """``ccl``: ``op.chunk`` of every block moved by one ``all_to_all_single`` of the process
    group (packed: gloo needs one flat buffer, NCCL is faster with one). ``op.shift`` (ring):
    only to rank r - shift and from rank r + shift; the other peers' sizes are zero."""
    ctx = context_of(buffers)
    send_to = recv_from = None
    if op.shift is not None:
        send_to, recv_from = (ctx.rank - op.shift) % ctx.world, (ctx.rank + op.shift) % ctx.world
    sends, recvs = ctx.exchange_pieces(op.chunk, op.two_d, send_to, recv_from, op.experts)
    like = ctx.inp

    def run():
        send_sizes = [sum(t.numel() for t in pieces) for pieces in sends]
        recv_sizes = [sum(t.numel() for t in pieces) for pieces in recvs]
        flat = [t.reshape(-1) for pieces in sends for t in pieces]
        packed = torch.cat(flat) if flat else like.new_empty(0)
        got = like.new_empty(sum(recv_sizes))
        dist.all_to_all_single(got, packed, recv_sizes, send_sizes, group=buffers.group)
        at = 0
        for pieces in recvs:
            for t in pieces:
                t.copy_(got[at: at + t.numel()].view(t.shape))
                at += t.numel()
    return run
