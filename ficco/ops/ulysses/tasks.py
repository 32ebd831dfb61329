"""The host tasks of Ulysses plans (:mod:`.plan_ops`) and the tensors one call's tasks read
(:class:`UlyssesContext`, ``Buffers.task_state``). Each task resolves its rows at launch from
the call's :class:`~.layout.UlyssesProblem` (every rank's length along ``gather_dim``, agreed),
so a plan names work by peer only.

``staging`` holds the chunks this rank sends, packed in destination order (symmetric with
``dma``: peers pull their chunk from it): the pieces of ``a @ b`` (``matmul_all_to_all``) or
``a``'s chunks (``all_to_all_matmul``). ``landing`` receives the peers' chunks packed in source
order (``ccl``, and ``all_to_all_matmul`` over ``dma``); ``matmul_all_to_all`` pulls straight
into its output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...plan.buffers import Buffers
from ...plan.tasks import local
from .layout import MATMUL_ALL_TO_ALL, UlyssesProblem, numel


@dataclass
class UlyssesContext:
    """What one call's host tasks read: the agreed problem, ``a`` and ``b`` as the caller gave
    them, ``out`` (the op's output; float32 when a bf16/fp16 plan adds products into it),
    ``staging`` (flat) and ``landing`` (flat, or None where nothing lands)."""

    problem: UlyssesProblem
    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor
    staging: torch.Tensor
    landing: torch.Tensor | None = None

    # -- views -----------------------------------------------------------------------------
    def sent(self, j: int, buf: torch.Tensor | None = None, q: int | None = None) -> torch.Tensor:
        """Rank ``q``'s (default: this rank's) chunk for rank ``j`` in staging buffer ``buf``
        (default: this rank's)."""
        p = self.problem
        buf = self.staging if buf is None else buf
        shape, at = p.send_shape(j, q), p.send_offset(j, q)
        return buf[at: at + numel(shape)].view(shape)

    def landed(self, q: int) -> torch.Tensor:
        """Where rank ``q``'s chunk lands in ``landing``."""
        p = self.problem
        assert self.landing is not None, "this plan lands peers' chunks"
        shape, at = p.recv_shape(q), p.recv_offset(q)
        return self.landing[at: at + numel(shape)].view(shape)

    def placed(self, q: int) -> torch.Tensor:
        """Rank ``q``'s rows of the output, along ``gather_dim`` (``matmul_all_to_all``: its
        chunk of the product; ``all_to_all_matmul`` not gathering along K: the product of its
        chunk)."""
        p = self.problem
        return self.out.narrow(p.gather, p.gather_offset(q), p.all_sizes[q])

    def own_chunk(self, j: int) -> torch.Tensor:
        """``a``'s chunk for rank ``j`` (``all_to_all_matmul``), read in place."""
        p = self.problem
        start, length = p.chunk(j)
        return self.a.narrow(p.scatter, start, length)

    # -- the GEMM pieces -------------------------------------------------------------------
    def produce(self, dest: int | None) -> None:
        """``matmul_all_to_all``: the product's chunk for ``dest`` (None: the whole product, one
        GEMM, then every chunk staged), staged for its destination, or placed in the output
        when it is this rank's own."""
        p = self.problem
        if dest is None:
            whole = torch.matmul(self.a, self.b)
            for j in range(p.world):
                start, length = p.chunk(j)
                piece = whole.narrow(p.scatter, start, length)
                (self.placed(p.rank) if j == p.rank else self.sent(j)).copy_(piece)
            return
        start, length = p.chunk(dest)
        if p.columns_scattered:
            piece = torch.matmul(self.a, self.b[:, start: start + length])
        else:
            piece = torch.matmul(self.a.narrow(p.scatter, start, length), self.b)
        (self.placed(p.rank) if dest == p.rank else self.sent(dest)).copy_(piece)

    def consume(self, source: int, accumulate: bool) -> None:
        """``all_to_all_matmul``: the GEMM of ``source``'s chunk (the own chunk read from
        ``a``): ``out += chunk @ b[K_source]`` when gathering along K, else its rows of the
        output."""
        p = self.problem
        chunk = self.own_chunk(p.rank) if source == p.rank else self.landed(source)
        if p.accumulates:
            start = p.gather_offset(source)
            b = self.b[start: start + p.all_sizes[source]]
            if self.out.dtype != chunk.dtype:     # a wide output: products unrounded
                chunk, b = chunk.to(self.out.dtype), b.to(self.out.dtype)
            product = torch.matmul(chunk, b)
            if accumulate:
                self.out.add_(product)
            else:
                self.out.copy_(product)
            return
        self.placed(source).copy_(torch.matmul(chunk, self.b))

    def publish(self) -> None:
        """``all_to_all_matmul`` over ``dma``: ``a``'s chunks for the peers into ``staging``."""
        p = self.problem
        for j in range(p.world):
            if j != p.rank:
                self.sent(j).copy_(self.own_chunk(j))

    def pull(self, peer: int, source_buf: torch.Tensor) -> None:
        """``dma``: ``peer``'s chunk for this rank from its staging buffer ``source_buf``."""
        p = self.problem
        src = self.sent(p.rank, source_buf, peer)
        dst = self.placed(peer) if p.op == MATMUL_ALL_TO_ALL else self.landed(peer)
        dst.copy_(src)

    def exchange(self, shift: int | None, group) -> None:
        """``ccl``: one ``all_to_all_single`` of the process group: every peer's chunk (None),
        or only to rank r + shift and from rank r - shift. What lands goes to the output
        (``matmul_all_to_all``) or stays in ``landing`` for its GEMM."""
        p = self.problem
        r, w = p.rank, p.world
        to = [q for q in range(w) if q != r] if shift is None else [(r + shift) % w]
        frm = [q for q in range(w) if q != r] if shift is None else [(r - shift) % w]
        if p.op == MATMUL_ALL_TO_ALL:
            sends = [self.sent(j).reshape(-1) if j in to else None for j in range(w)]
        else:
            sends = [self.own_chunk(j).reshape(-1) if j in to else None for j in range(w)]
        send_sizes = [0 if t is None else t.numel() for t in sends]
        recv_sizes = [numel(p.recv_shape(q)) if q in frm else 0 for q in range(w)]
        parts = [t for t in sends if t is not None]
        packed = torch.cat(parts) if parts else self.staging.new_empty(0)
        got = self.staging.new_empty(sum(recv_sizes))
        dist.all_to_all_single(got, packed, recv_sizes, send_sizes, group=group)
        at = 0
        for q in range(w):
            size = recv_sizes[q]
            if size:
                chunk = got[at: at + size].view(p.recv_shape(q))
                (self.placed(q) if p.op == MATMUL_ALL_TO_ALL else self.landed(q)).copy_(chunk)
            at += size


def context_of(buffers: Buffers) -> UlyssesContext:
    ctx = buffers.task_state
    assert isinstance(ctx, UlyssesContext), "an Ulysses op's Buffers hold its context"
    return ctx


# -- the tasks (the executor calls task(views, buffers, op) -> fn, launched on op.queue) ------
# GEMMs and copies are this rank's own work (plan.tasks.local); the exchange is a collective.
def produce_task(views, buffers: Buffers, op):
    ctx = context_of(buffers)
    return local(lambda: ctx.produce(op.dest))


def consume_task(views, buffers: Buffers, op):
    ctx = context_of(buffers)
    return local(lambda: ctx.consume(op.source, op.accumulate))


def publish_task(views, buffers: Buffers, op):
    ctx = context_of(buffers)
    return local(lambda: ctx.publish())


def pull_task(views, buffers: Buffers, op):
    ctx = context_of(buffers)
    source = buffers.peer(op.peer, "gathered")
    return local(lambda: ctx.pull(op.peer, source))


def exchange_task(views, buffers: Buffers, op):
    ctx = context_of(buffers)
    group = buffers.group
    return lambda: ctx.exchange(op.shift, group)
