"""The host tasks of expert-parallel plans (:mod:`ficco.expert.plan_ops`) and the grouped GEMM
they run. Each sizes its work at launch from the call's routing (``Buffers.expert``, an
:class:`~ficco.expert.context.ExpertContext`; the executor hands every host task the call's
:class:`~ficco.buffers.Buffers`), so one plan serves every routing and the work of a block that
is empty in this call is skipped at no cost.

On GPUs each task enqueues torch kernels or copies on its queue's stream (the executor makes
it current); on CPU a worker thread runs them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..buffers import Buffers
from ..host_tasks import local
from .context import ExpertContext


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


def _wide_product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` as ``dtype`` (float32), never rounded to the operands' bf16/fp16."""
    if a.device.type == "cuda":   # (ROCm too) a float32 result of the low-precision GEMM
        return torch.mm(a, b, out_dtype=dtype)
    return a.to(dtype) @ b.to(dtype)


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
            if out.dtype != a.dtype:
                _write(out, _wide_product(a, b, out.dtype), accumulate)
            elif accumulate:
                out.addmm_(a, b)
            else:
                torch.matmul(a, b, out=out)
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
    """The expert part of an expert call's Buffers (:meth:`ficco.expert.spec.ExpertSpec.buffers`
    always sets it; other ops' Buffers never reach these tasks)."""
    ctx = buffers.expert
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


def move_task(views, buffers: Buffers, op):
    """Pull ``op.chunk`` of every block ``op.peer`` holds for this rank (one copy per expert;
    2d: a strided column block each)."""
    ctx = context_of(buffers)
    pairs = ctx.pulls(op.peer, op.chunk, op.two_d, buffers.peer(op.peer, ctx.shared_name),
                      op.experts)

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
