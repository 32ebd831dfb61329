"""Runs a :class:`~ficco.plan.Plan` on a backend: resolves blocks to tensor views, turns each
op into backend calls on the op's queue, and joins the queues at the end. Shared by every
backend; nothing here is vendor specific.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .errors import InvalidArgumentError
from .plan import (COMPUTE, AllGather, Barrier, Block, Copy, Gather, Gemm, Plan, Record, Scatter,
                   SendRecv, Wait)


@dataclass
class Buffers:
    """The tensors one call's plan refers to. ``a`` is the caller's shard in canonical
    ``m x K`` form; ``gathered`` this rank's ``M x K`` buffer; ``symm`` the symmetric handle
    whose buffers hold every peer's ``gathered`` (None with ``ccl``)."""

    a: torch.Tensor
    bs: list[torch.Tensor]
    outs: list[torch.Tensor]
    gathered: torch.Tensor
    symm: Any = None
    group: Any = None
    stages: list[torch.Tensor] = field(default_factory=list)
    _peers: dict[int, torch.Tensor] = field(default_factory=dict)

    def base(self, block: Block) -> torch.Tensor:
        if block.buf == "input":
            return self.a
        if block.buf == "out":
            return self.outs[block.index]
        if block.buf == "stage":
            return self.stages[block.index]
        if block.peer is None:
            return self.gathered
        if self.symm is None:
            raise InvalidArgumentError(f"plan reads peer {block.peer}'s buffer but the call has "
                                       f"no symmetric memory (transport ccl)")
        if block.peer not in self._peers:
            g = self.gathered
            self._peers[block.peer] = self.symm.get_buffer(block.peer, tuple(g.shape), g.dtype)
        return self._peers[block.peer]

    def view(self, block: Block) -> torch.Tensor:
        t = self.base(block)
        return t[block.row0: block.row0 + block.rows, block.col0: block.col0 + block.cols]

    def batched_view(self, blocks: tuple[Block, ...]) -> torch.Tensor:
        """Equally spaced same-shape blocks of one buffer as one ``(n, rows, cols)`` view."""
        if len(blocks) == 1:
            return self.view(blocks[0])
        first = blocks[0]
        spacing = blocks[1].row0 - first.row0
        for i, blk in enumerate(blocks):
            if (blk.buf, blk.peer, blk.index, blk.rows, blk.col0, blk.cols) != \
                    (first.buf, first.peer, first.index, first.rows, first.col0, first.cols) \
                    or blk.row0 != first.row0 + i * spacing or spacing < first.rows:
                raise InvalidArgumentError(
                    f"a fused Gemm needs same-shape, equally spaced blocks; got {blocks}")
        t = self.base(first)
        ld = t.stride(0)
        return t.as_strided((len(blocks), first.rows, first.cols), (spacing * ld, ld, 1),
                            t.storage_offset() + first.row0 * ld + first.col0)


def _gather(srcs, dst):
    row = 0
    for s in srcs:
        dst[row: row + s.shape[0]].copy_(s)
        row += s.shape[0]


def _scatter(src, dsts):
    row = 0
    for d in dsts:
        d.copy_(src[row: row + d.shape[0]])
        row += d.shape[0]


def _global(group, rank):
    return rank if group is None else dist.get_global_rank(group, rank)


def _all_gather(src, dsts, group):
    packed = src.contiguous()
    outs = [d if d.is_contiguous() else torch.empty_like(packed) for d in dsts]
    dist.all_gather(outs, packed, group=group)
    for d, o in zip(dsts, outs):
        if o is not d:
            d.copy_(o)


def _send_recv(send, send_to, recv, recv_from, group):
    # gloo's point-to-point takes host tensors only (its all-gather accepts device ones).
    via_host = dist.get_backend(group) == "gloo"
    ops, landing = [], None
    if send is not None:
        payload = send.contiguous().cpu() if via_host else send.contiguous()
        ops.append(dist.P2POp(dist.isend, payload, _global(group, send_to), group))
    if recv is not None:
        on_host = via_host and recv.device.type != "cpu"
        landing = recv if recv.is_contiguous() and not on_host else torch.empty(
            recv.shape, dtype=recv.dtype, device="cpu" if on_host else recv.device)
        ops.append(dist.P2POp(dist.irecv, landing, _global(group, recv_from), group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if landing is not None and landing is not recv:
        recv.copy_(landing)


def execute(plan: Plan, backend, buffers: Buffers, *, timeout_s: float,
            trace: bool = False) -> list[dict] | None:
    """Enqueue every op of ``plan`` and join the queues (``backend.finish``). With ``trace``,
    returns per-op rows {op_index, queue, start_s, end_s, kind, label} of this rank."""
    p = plan.problem
    queues = {name: backend.queue(name) for name in plan.queues}
    events = [backend.new_event() for _ in range(plan.num_events)]
    buffers.stages = [torch.empty(rows, cols, dtype=p.torch_dtype, device=buffers.gathered.device)
                      for rows, cols in plan.stages]
    # Side queues start after everything the caller queued before this call (the input may
    # still be being written on the caller's stream).
    entry = backend.new_event()
    backend.record(entry, queues[COMPUTE])
    for name, q in queues.items():
        if name != COMPUTE:
            backend.wait(entry, q)
    marks = []
    for index, op in enumerate(plan.ops):
        q = queues[op.queue]
        if isinstance(op, Record):
            backend.record(events[op.event], q)
            continue
        if isinstance(op, Wait):
            backend.wait(events[op.event], q)
            continue
        if trace:
            start = backend.new_event()
            backend.record(start, q)
        _enqueue(op, q, backend, buffers, timeout_s)
        if trace:
            end = backend.new_event()
            backend.record(end, q)
            marks.append((index, op, start, end))
    backend.finish(list(queues.values()))
    if not trace:
        return None
    origin = marks[0][2] if marks else None
    return [{"op_index": i, "queue": op.queue, "kind": op.kind, "label": _label(op),
             "start_s": backend.elapsed_s(origin, s), "end_s": backend.elapsed_s(origin, e)}
            for i, op, s, e in marks]


def _enqueue(op, q, backend, buffers: Buffers, timeout_s: float) -> None:
    if isinstance(op, Copy):
        dst, src = buffers.view(op.dst), buffers.view(op.src)
        if op.src.buf == "input" and not op.two_d:
            backend.copy(dst, src, q)
        elif op.two_d:
            backend.copy_2d(dst, src, q)
        else:
            backend.copy(dst, src, q)
    elif isinstance(op, Gemm):
        a = buffers.batched_view(op.a)
        out = buffers.batched_view(op.out)
        b = buffers.bs[op.b][op.k0: op.k0 + op.kc]
        backend.gemm(a, b, out, op.accumulate, q)
    elif isinstance(op, Gather):
        srcs, dst = [buffers.view(s) for s in op.srcs], buffers.view(op.dst)
        backend.launch(q, lambda: _gather(srcs, dst))
    elif isinstance(op, Scatter):
        src, dsts = buffers.view(op.src), [buffers.view(d) for d in op.dsts]
        backend.launch(q, lambda: _scatter(src, dsts))
    elif isinstance(op, AllGather):
        src, dsts, group = buffers.view(op.src), [buffers.view(d) for d in op.dsts], buffers.group
        backend.launch(q, lambda: _all_gather(src, dsts, group))
    elif isinstance(op, SendRecv):
        send = buffers.view(op.send) if op.send is not None else None
        recv = buffers.view(op.recv) if op.recv is not None else None
        group = buffers.group
        backend.launch(q, lambda: _send_recv(send, op.send_to, recv, op.recv_from, group))
    elif isinstance(op, Barrier):
        backend.barrier(buffers.symm, op.channel, q, timeout_s, op.step)
    else:
        raise InvalidArgumentError(f"the executor does not know op {type(op).__name__}")


def _label(op) -> str:
    if isinstance(op, Copy):
        who = f"peer {op.src.peer}" if op.src.peer is not None else op.src.buf
        return f"{who} r{op.src.row0}+{op.src.rows} c{op.src.col0}+{op.src.cols}"
    if isinstance(op, Gemm):
        return f"b{op.b} {len(op.a)}x{op.a[0].rows}x{op.kc}{' +=' if op.accumulate else ''}"
    if isinstance(op, Barrier):
        return f"barrier {op.channel}"
    return op.kind
