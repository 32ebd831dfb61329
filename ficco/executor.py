"""Runs a :class:`~ficco.plan.Plan` (either op) on a backend: resolves blocks to tensor views,
turns each op into backend calls on the op's queue, and joins the queues at the end. Shared by
every backend; nothing here is vendor specific. Reductions and collectives are host tasks
launched in their queue's order (on GPUs they enqueue torch kernels on that stream).

Host time per call matters (an eager W=8 FiCCO call enqueues 32-250 ops), so a plan is compiled
once (:func:`compile_plan`, cached per Plan object) into flat steps that name views by slot
number. A call then only builds the views of tensors that are new each call (the caller's
input and weights, fresh outputs and landing buffers); views of the symmetric workspace (this
rank's gathered or partial buffers and every peer's) are kept per compiled plan while the
workspace handle and those tensors' addresses stay the same.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .errors import InvalidArgumentError
from . import profiling
from .kernels.launch import gated_task, raise_flag
from .kernels.launch import raise_pending as raise_pending_gated
from .plan import (COMPUTE, SYMMETRIC_BUFFERS, AllGather, AllToAll, Barrier, Block, Copy, Gemm,
                   GatedGemm, Plan, Record, Reduce, ReduceScatter, SendRecv, Signal, Wait,
                   buffer_shapes, op_label)


@dataclass
class Buffers:
    """The tensors one call's plan refers to. ``a`` is the caller's A operand in canonical
    ``m x K`` form. All-gather: ``gathered`` is this rank's ``M x K`` buffer. Reduce-scatter:
    ``partials[j]`` this rank's ``M x n_j`` partial products (at byte ``partial_offsets[j]``
    of the workspace with ``dma``) and ``recvs[j]`` the landing buffer of the peers' partials.
    ``symm`` is the symmetric handle whose buffers hold every peer's ``gathered`` or
    ``partials`` (None with ``ccl``)."""

    a: torch.Tensor
    bs: list[torch.Tensor]
    outs: list[torch.Tensor]
    gathered: torch.Tensor | None = None
    symm: Any = None
    group: Any = None
    partials: list[torch.Tensor] = field(default_factory=list)
    recvs: list[torch.Tensor] = field(default_factory=list)
    partial_offsets: tuple[int, ...] = ()
    flags: torch.Tensor | None = None   # arrival flags of gated plans (execute() zeroes them)
    _peers: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def peer(self, peer: int, buf: str = "gathered", index: int = 0) -> torch.Tensor:
        """Rank ``peer``'s copy of a symmetric buffer, through the symmetric handle."""
        if self.symm is None:
            raise InvalidArgumentError(f"plan reads peer {peer}'s buffer but the call has "
                                       f"no symmetric memory (transport ccl)")
        key = (buf, index, peer)
        if key not in self._peers:
            mine, offset = self.local(buf, index), 0
            if buf == "partial":
                offset = self.partial_offsets[index] if self.partial_offsets else 0
            self._peers[key] = self.symm.get_buffer(peer, tuple(mine.shape), mine.dtype, offset)
        return self._peers[key]

    def local(self, buf: str, index: int = 0) -> torch.Tensor:
        """This rank's copy of symmetric buffer ``buf``."""
        return self.gathered if buf == "gathered" else self.partials[index]


# -- compiling a plan ----------------------------------------------------------------------------
# Step codes; a step is (code, queue index, x, y, z, w) with slot / event numbers in x..w.
_COPY, _COPY_2D, _GEMM, _RECORD, _WAIT, _BARRIER, _LAUNCH, _SIGNAL, _GATED = range(9)


def _source_of(blk: Block) -> tuple:
    """The slot source of ``blk``: symmetric buffers carry the peer (None: this rank's)."""
    if blk.buf in SYMMETRIC_BUFFERS:
        return (blk.buf, blk.index, blk.peer)
    if blk.buf == "input":
        return ("input",)
    return (blk.buf, blk.index)


def _batched_spec(blocks: tuple[Block, ...]):
    """(n, rows, cols, row0, col0, spacing) of equally spaced same-shape row blocks."""
    first = blocks[0]
    spacing = blocks[1].row0 - first.row0
    for i, blk in enumerate(blocks):
        if (blk.buf, blk.peer, blk.index, blk.rows, blk.col0, blk.cols) != \
                (first.buf, first.peer, first.index, first.rows, first.col0, first.cols) \
                or blk.row0 != first.row0 + i * spacing or spacing < first.rows:
            raise InvalidArgumentError(
                f"a fused Gemm needs same-shape, equally spaced blocks; got {blocks}")
    return (len(blocks), first.rows, first.cols, first.row0, first.col0, spacing)


class CompiledPlan:
    """A plan lowered once to flat steps. ``slots`` lists every distinct view the plan
    touches as ``(source, spec)``: source ``("input",)``, ``("gathered", peer)``,
    ``("gathered", 0, peer)``, ``("partial", j, peer)``, ``("out", j)``, ``("recv", j)`` or
    ``("b", j)``; spec ``("rect", row0, rows, col0, cols)`` (what ``t[row0:row0+rows,
    col0:col0+cols]`` gives), ``("batched", n, rows, cols, row0, col0, spacing)`` or
    ``("krows", k0, kc, c0, nc)`` (``b[k0:k0+kc, c0:c0+nc]``)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.queue_names = plan.queues
        queue_index = {name: i for i, name in enumerate(plan.queues)}
        self.compute = queue_index[COMPUTE]
        self.side_queues = tuple(i for n, i in queue_index.items() if n != COMPUTE)
        self.slots: list[tuple] = []
        slot_of: dict[tuple, int] = {}

        def slot(source, spec) -> int:
            key = (source, spec)
            if key not in slot_of:
                slot_of[key] = len(self.slots)
                self.slots.append(key)
            return slot_of[key]

        def block_slot(blk: Block) -> int:
            return slot(_source_of(blk), ("rect", blk.row0, blk.rows, blk.col0, blk.cols))

        def blocks_slot(blocks: tuple[Block, ...]) -> int:
            if len(blocks) == 1:
                return block_slot(blocks[0])
            return slot(_source_of(blocks[0]), ("batched",) + _batched_spec(blocks))

        def maybe_slot(blocks) -> tuple:
            return tuple(None if blk is None else block_slot(blk) for blk in blocks)

        def like() -> int:
            # An empty view of the input: dtype and device for a collective's empty pieces.
            return slot(("input",), ("rect", 0, 0, 0, 0))

        steps, work = [], []   # work: (step number, op index) of every traced op
        for index, op in enumerate(plan.ops):
            q = queue_index[op.queue]
            if isinstance(op, Record):
                steps.append((_RECORD, q, op.event, 0, 0, 0))
                continue
            if isinstance(op, Wait):
                steps.append((_WAIT, q, op.event, 0, 0, 0))
                continue
            work.append((len(steps), index))
            if isinstance(op, Copy):
                steps.append((_COPY_2D if op.two_d else _COPY, q, block_slot(op.dst),
                               block_slot(op.src), 0, 0))
            elif isinstance(op, Gemm):
                out0 = op.out[0]
                weight = slot(("b", op.b), ("krows", op.k0, op.kc, out0.col0, out0.cols))
                steps.append((_GEMM, q, blocks_slot(op.a), weight, blocks_slot(op.out),
                              op.accumulate))
            elif isinstance(op, Barrier):
                steps.append((_BARRIER, q, op.channel, op.step, 0, 0))
            elif isinstance(op, Reduce):
                steps.append((_LAUNCH, q, _reduce_task,
                              (block_slot(op.dst), tuple(block_slot(s) for s in op.srcs),
                               op.accumulate, op.scale), 0, 0))
            elif isinstance(op, AllToAll):
                steps.append((_LAUNCH, q, _all_to_all_task,
                              (maybe_slot(op.srcs), maybe_slot(op.dsts), like()), 0, 0))
            elif isinstance(op, ReduceScatter):
                steps.append((_LAUNCH, q, _reduce_scatter_task,
                              (maybe_slot(op.srcs), maybe_slot((op.dst,))[0], op.scale, like()),
                              0, 0))
            elif isinstance(op, AllGather):
                steps.append((_LAUNCH, q, _all_gather_task,
                              (block_slot(op.src), tuple(block_slot(d) for d in op.dsts)), 0, 0))
            elif isinstance(op, SendRecv):
                send = block_slot(op.send) if op.send is not None else None
                recv = block_slot(op.recv) if op.recv is not None else None
                steps.append((_LAUNCH, q, _send_recv_task,
                              (send, op.send_to, recv, op.recv_from), 0, 0))
            elif isinstance(op, Signal):
                steps.append((_SIGNAL, q, op.flag, 0, 0, 0))
            elif isinstance(op, GatedGemm):
                p, n = plan.problem, plan.problem.ns[op.b]
                views = (block_slot(Block("input", 0, p.m, 0, p.k)),
                         block_slot(Block("gathered", 0, p.big_m, 0, p.k)),
                         slot(("b", op.b), ("krows", 0, p.k, 0, n)),
                         block_slot(Block("out", 0, p.big_m, 0, n, index=op.b)))
                steps.append((_GATED, q, views, (p, op), 0, 0))
            else:
                raise InvalidArgumentError(f"the executor does not know op {type(op).__name__}")
            if steps[-1][0] == _LAUNCH:
                # A host task (a collective, a reduction): if it fails or hangs, the error
                # names this step (z is free in launch steps).
                steps[-1] = steps[-1][:4] + (
                    f"plan step {index} ({op_label(op, plan.problem.rank)}, queue {op.queue})",
                    0)
        self.steps = tuple(steps)
        self.num_flags = max((op.num_flags for op in plan.ops if isinstance(op, GatedGemm)),
                             default=0)
        self.work = tuple(work)
        # Workspace views (this rank's symmetric buffers and the peers') vs per-call views.
        self.workspace_slots = tuple(i for i, (src, _) in enumerate(self.slots)
                                     if src[0] in SYMMETRIC_BUFFERS)
        self.splits, split_slots = self._plan_splits(plan)
        self.call_slots = tuple(i for i, (src, _) in enumerate(self.slots)
                                if src[0] not in SYMMETRIC_BUFFERS and i not in split_slots)
        self._cached = None   # (handle weakref, gathered key, views by slot)

    def _plan_splits(self, plan: Plan):
        """Full-width row blocks of a per-call buffer (an output's row chunks, the input's) come
        from ONE ``split_with_sizes`` per buffer: about a third of the host time of making
        each view on its own. Returns [(source, expected shape, sizes, ((slot, piece), ...))]
        and the set of slots so covered."""
        shapes = {source: shape for source, shape in buffer_shapes(plan.problem).items()
                  if source[0] not in SYMMETRIC_BUFFERS}
        rows_of: dict[tuple, list] = {}
        for i, (source, spec) in enumerate(self.slots):
            shape = shapes.get(source)
            if shape is None or spec[0] != "rect":
                continue
            _, row0, rows, col0, cols = spec
            if col0 == 0 and cols == shape[1] and rows > 0 and row0 + rows <= shape[0]:
                rows_of.setdefault(source, []).append((row0, rows, i))
        splits, covered = [], set()
        for source, blocks in rows_of.items():
            if len(blocks) < 2:
                continue
            total = shapes[source][0]
            cuts = sorted({0, total} | {r for r0, n, _ in blocks for r in (r0, r0 + n)})
            piece = {start: k for k, start in enumerate(cuts[:-1])}
            nxt = dict(zip(cuts[:-1], cuts[1:]))
            # A block must be exactly one piece: no cut strictly inside it.
            pieces = tuple((i, piece[r0]) for r0, n, i in blocks if nxt[r0] == r0 + n)
            if len(pieces) < 2:
                continue
            sizes = [b - a for a, b in zip(cuts[:-1], cuts[1:])]
            splits.append((source, shapes[source], sizes, pieces))
            covered.update(i for i, _ in pieces)
        return tuple(splits), covered

    # -- views ----------------------------------------------------------------------------------
    def views(self, buffers: Buffers) -> list:
        """Every slot's view for this call: the workspace's from the cache when it still
        holds, the rest made now."""
        views = list(self.workspace_views(buffers))
        self._make_views(self.call_slots, buffers, views)
        for source, shape, sizes, pieces in self.splits:
            t = _source_tensor(source, buffers)
            if t.shape != shape:   # not the canonical shape: one view at a time
                self._make_views([i for i, _ in pieces], buffers, views)
                continue
            parts = t.split_with_sizes(sizes)
            for i, k in pieces:
                views[i] = parts[k]
        return views

    def workspace_views(self, buffers: Buffers) -> list:
        """A list by slot with the views of the symmetric buffers filled in (None elsewhere),
        reused while the symmetric handle and this rank's symmetric tensors' addresses are."""
        symm = buffers.symm
        if symm is None:   # ccl: the buffers are fresh tensors every call
            return self._make_views(self.workspace_slots, buffers, [None] * len(self.slots))
        key = tuple((t.data_ptr(), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device)
                    for t in ([buffers.gathered] if buffers.gathered is not None else [])
                    + list(buffers.partials))
        cached = self._cached
        if cached is not None and cached[0]() is symm and cached[1] == key:
            return cached[2]
        views = self._make_views(self.workspace_slots, buffers, [None] * len(self.slots))
        try:
            # A weak reference: the views must not outlive the workspace they point into;
            # when the runtime drops a grown-out-of handle, the callback frees them.
            ref = weakref.ref(symm, self._forget)
        except TypeError:
            return views
        self._cached = (ref, key, views)
        return views

    def _forget(self, ref) -> None:
        cached = self._cached
        if cached is not None and cached[0] is ref:
            self._cached = None

    def _make_views(self, slots, buffers: Buffers, out: list) -> list:
        bases: dict[tuple, tuple] = {}
        for i in slots:
            source, spec = self.slots[i]
            base = bases.get(source)
            if base is None:
                t = _source_tensor(source, buffers)
                base = bases[source] = (t, t.shape, t.stride(), t.storage_offset())
            out[i] = _make_view(base, spec)
        return out


def _source_tensor(source, buffers: Buffers) -> torch.Tensor:
    kind = source[0]
    if kind in SYMMETRIC_BUFFERS:
        _, index, peer = source
        return buffers.local(kind, index) if peer is None else buffers.peer(peer, kind, index)
    if kind == "input":
        return buffers.a
    if kind == "out":
        return buffers.outs[source[1]]
    if kind == "recv":
        return buffers.recvs[source[1]]
    return buffers.bs[source[1]]


def _clamp(start: int, length: int, size: int) -> tuple[int, int]:
    """(start, length) of Python slicing ``[start:start+length]`` on a dimension of ``size``."""
    lo = min(start, size)
    return lo, max(min(start + length, size) - lo, 0)


def _make_view(base, spec) -> torch.Tensor:
    t, shape, stride, offset = base
    kind = spec[0]
    if kind == "rect":
        _, row0, rows, col0, cols = spec
        r0, nr = _clamp(row0, rows, shape[0])
        c0, nc = _clamp(col0, cols, shape[1])
        if nr == shape[0] and nc == shape[1]:
            return t   # the whole buffer (serial's input and output): no view to make
        return t.as_strided((nr, nc), stride, offset + r0 * stride[0] + c0 * stride[1])
    if kind == "krows":
        _, k0, kc, c0, nc = spec
        whole_rows, whole_cols = k0 == 0 and kc >= shape[0], c0 == 0 and nc >= shape[1]
        if whole_rows and whole_cols:
            return t   # b[0:K] is b itself: skip making a view per call
        r0, nr = _clamp(k0, kc, shape[0])
        c0, nc = _clamp(c0, nc, shape[1])
        return t.as_strided((nr, nc), stride, offset + r0 * stride[0] + c0 * stride[1])
    _, n, rows, cols, row0, col0, spacing = spec
    ld = stride[0]
    return t.as_strided((n, rows, cols), (spacing * ld, ld, 1), offset + row0 * ld + col0)


_compiled: dict[int, CompiledPlan] = {}
_compiled_lock = threading.Lock()
_MAX_COMPILED = 512


def compile_plan(plan: Plan) -> CompiledPlan:
    """The compiled form of ``plan``, made once per Plan object (api.plan_for caches Plans, so
    the same object comes back for the same call).

    >>> from ficco import schedules
    >>> from ficco.problem import Problem
    >>> plan = schedules.get("ring").plan(Problem(4, 8, (3,), "float32", 2, 0), "dma")
    >>> compile_plan(plan) is compile_plan(plan)
    True
    """
    compiled = _compiled.get(id(plan))
    if compiled is not None and compiled.plan is plan:
        return compiled
    compiled = CompiledPlan(plan)
    with _compiled_lock:
        if len(_compiled) >= _MAX_COMPILED:   # plans built outside api.plan_for: stay bounded
            _compiled.clear()
        _compiled[id(plan)] = compiled
    return compiled


# -- host tasks for launch() ---------------------------------------------------------------------
def _reduce(dst, srcs, accumulate, scale):
    """``dst = ((dst if accumulate else 0) + sum(srcs)) * scale``, summed in float32 (float64
    for float64) and rounded once into ``dst``. Never writes a source."""
    wide = torch.float64 if dst.dtype == torch.float64 else torch.float32
    parts = ([dst] if accumulate else []) + list(srcs)
    total = parts[0].to(wide, copy=True)
    for part in parts[1:]:
        total.add_(part)
    if scale is not None:
        total.mul_(scale)
    dst.copy_(total)


def _flat(views, like):
    return [v.reshape(-1) if v is not None else like.new_empty(0) for v in views]


def _all_to_all(srcs, dsts, group, like):
    """``srcs[q]`` to rank q, ``dsts[p]`` from rank p; pieces of any size (None: nothing), in
    one all_to_all_single over packed buffers (gloo's list form needs equal sizes)."""
    sends = _flat(srcs, like)
    inp = torch.cat([s.contiguous() for s in sends]) if sends else like.new_empty(0)
    out_sizes = [0 if d is None else d.numel() for d in dsts]
    out = like.new_empty(sum(out_sizes))
    dist.all_to_all_single(out, inp, out_sizes, [s.numel() for s in sends], group=group)
    for d, piece in zip(dsts, out.split(out_sizes)):
        if d is not None:
            d.copy_(piece.view(d.shape))


def _reduce_scatter(srcs, dst, scale, group, like):
    """Rank q's ``dst`` <- sum over ranks of ``srcs[q]`` (None: an empty block)."""
    inputs = [s.contiguous() for s in _flat(srcs, like)]
    out = like.new_empty(0 if dst is None else dst.numel())
    dist.reduce_scatter(out, inputs, op=dist.ReduceOp.SUM, group=group)
    if dst is not None:
        if scale is not None:
            out.mul_(scale)
        dst.copy_(out.view(dst.shape))


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
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    if landing is not None and landing is not recv:
        recv.copy_(landing)


# Each takes (views, group, slot arguments) and returns the host function to launch.
def _reduce_task(v, group, args):
    dst, srcs, accumulate, scale = v[args[0]], [v[s] for s in args[1]], args[2], args[3]
    return lambda: _reduce(dst, srcs, accumulate, scale)


def _pick(v, slots):
    return [None if s is None else v[s] for s in slots]


def _all_to_all_task(v, group, args):
    srcs, dsts, like = _pick(v, args[0]), _pick(v, args[1]), v[args[2]]
    return lambda: _all_to_all(srcs, dsts, group, like)


def _reduce_scatter_task(v, group, args):
    srcs, dst, scale, like = _pick(v, args[0]), _pick(v, (args[1],))[0], args[2], v[args[3]]
    return lambda: _reduce_scatter(srcs, dst, scale, group, like)


def _all_gather_task(v, group, args):
    src, dsts = v[args[0]], [v[d] for d in args[1]]
    return lambda: _all_gather(src, dsts, group)


def _send_recv_task(v, group, args):
    send_slot, send_to, recv_slot, recv_from = args
    send = v[send_slot] if send_slot is not None else None
    recv = v[recv_slot] if recv_slot is not None else None
    return lambda: _send_recv(send, send_to, recv, recv_from, group)


# -- running -------------------------------------------------------------------------------------
def execute(plan: Plan, backend, buffers: Buffers, *, timeout_s: float,
            trace: bool = False) -> list[dict] | None:
    """Enqueue every op of ``plan`` and join the queues (``backend.finish``). With ``trace``,
    returns per-op rows {op_index, queue, start_s, end_s, kind, label} of this rank.

    >>> import torch
    >>> from ficco import schedules
    >>> from ficco.backends.cpu import CpuBackend
    >>> from ficco.problem import Problem
    >>> p = Problem(m=4, k=8, ns=(3,), dtype="float32", world=1, rank=0)
    >>> plan = schedules.get("serial").plan(p, "ccl")
    >>> a, b = torch.randn(4, 8), torch.randn(8, 3)
    >>> out, g = torch.empty(4, 3), torch.empty(4, 8)
    >>> execute(plan, CpuBackend(), Buffers(a, [b], [out], g), timeout_s=10.0)
    >>> torch.allclose(out, a @ b)
    True
    """
    compiled = compile_plan(plan)
    queues = [backend.queue(name) for name in compiled.queue_names]
    # plan.num_events events and the entry event; GPUs reuse theirs per compiled plan.
    *events, entry = backend.plan_events(compiled, plan.num_events + 1)
    views = compiled.views(buffers)
    if compiled.num_flags:   # zeroed on the compute queue, before the side queues start
        raise_pending_gated()
        buffers.flags = torch.zeros(compiled.num_flags, dtype=torch.int32,
                                    device=buffers.a.device)
    # Side queues start after everything the caller queued before this call (the input may
    # still be being written on the caller's stream).
    backend.record(entry, queues[compiled.compute])
    for i in compiled.side_queues:
        backend.wait(entry, queues[i])
    if trace:
        return _run_traced(compiled, backend, buffers, queues, events, views, timeout_s)
    if profiling.recording():   # named ranges for torch.profiler traces; off: one flag read
        profiling.run_with_ranges(compiled, lambda steps: _run(
            steps, backend, buffers, queues, events, views, timeout_s),
            lambda op: op_label(op, plan.problem.rank))
    else:
        _run(compiled.steps, backend, buffers, queues, events, views, timeout_s)
    backend.finish(queues)
    return None


def _run(steps, backend, buffers, queues, events, v, timeout_s) -> None:
    # The hot loop: locals only, one integer compare chain per step.
    copy, copy_2d, gemm = backend.copy, backend.copy_2d, backend.gemm
    record, wait = backend.record, backend.wait
    for code, q, x, y, z, w in steps:
        if code == _COPY:
            copy(v[x], v[y], queues[q])
        elif code == _GEMM:
            gemm(v[x], v[y], v[z], w, queues[q])
        elif code == _WAIT:
            wait(events[x], queues[q])
        elif code == _RECORD:
            record(events[x], queues[q])
        elif code == _COPY_2D:
            copy_2d(v[x], v[y], queues[q])
        elif code == _BARRIER:
            backend.barrier(buffers.symm, x, queues[q], timeout_s, y)
        elif code == _SIGNAL:
            raise_flag(backend, queues[q], buffers.flags, x)
        elif code == _GATED:
            backend.launch(queues[q], gated_task(backend, y[0], y[1], v[x[0]], v[x[1]],
                                                 v[x[2]], v[x[3]], buffers.flags, timeout_s))
        else:
            task = x(v, buffers.group, y)
            task.ficco_step = z      # the queue names it if the task fails or hangs
            try:
                backend.launch(queues[q], task)
            except BaseException as exc:   # a backend that runs the task right here
                name_step(exc, z)
                raise


def name_step(exc: BaseException, step: str) -> BaseException:
    """Remember on ``exc`` the plan step it came from (``guard.failed`` puts it in the
    message); the first step named wins."""
    if getattr(exc, "ficco_step", None) is None:
        try:
            exc.ficco_step = step
        except AttributeError:      # an exception type without a __dict__
            pass
    return exc


def _run_traced(compiled, backend, buffers, queues, events, views, timeout_s) -> list[dict]:
    steps, ops, marks = compiled.steps, compiled.plan.ops, []
    work = dict(compiled.work)
    for number, step in enumerate(steps):
        index = work.get(number)
        if index is None:
            _run((step,), backend, buffers, queues, events, views, timeout_s)
            continue
        q = queues[step[1]]
        start = backend.new_event()
        backend.record(start, q)
        _run((step,), backend, buffers, queues, events, views, timeout_s)
        end = backend.new_event()
        backend.record(end, q)
        marks.append((index, ops[index], start, end))
    backend.finish(queues)
    origin = marks[0][2] if marks else None
    rank = compiled.plan.problem.rank
    return [{"op_index": i, "queue": op.queue, "kind": op.kind, "label": op_label(op, rank),
             "start_s": backend.elapsed_s(origin, s), "end_s": backend.elapsed_s(origin, e)}
            for i, op, s, e in marks]

