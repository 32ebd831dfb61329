"""Compiling a :class:`~ficco.plan.Plan` for the executor, and binding it to one backend and one
workspace.

Host time per call matters (an eager W=8 FiCCO call enqueues 32-430 ops), so the work is done
as early as it can be:

- once per Plan (:func:`compile_plan`): flat steps ``(code, queue, x, y, z, w)`` that name
  views by slot number and events by index (:class:`CompiledPlan`);
- once per (compiled plan, backend, workspace) (:meth:`CompiledPlan.bind`): the views of the
  symmetric workspace (this rank's gathered or partial buffers and every peer's), and, on a
  backend that can prepare copies (GPUs), every copy as one ready driver call with its
  integer addresses and 2-D arguments computed, and the compute queue's GEMMs marked to run on
  the current stream without looking it up;
- per call: only what is new each call. Views of the caller's input and weights and of fresh
  outputs are made every call; copies that touch such a buffer (the own shard's copy from the
  input, the reduce-scatter's landing buffers) keep their prepared call while that buffer's
  address and layout are those of the call that prepared it (the caching allocator mostly
  hands back the same block), and only those copies are prepared again when it moved.

A binding holds integers and views of the workspace, never a per-call tensor; it is dropped
when the workspace handle dies or the call brings another handle or other workspace tensors.
"""
from __future__ import annotations

import functools
import itertools
import weakref

import torch

from ..errors import InvalidArgumentError
from ..plan import COMPUTE, SYMMETRIC_BUFFERS, GatedGemm, Plan, buffer_shapes
from ..plan.buffers import Buffers
from .lowering import (
    CALL,
    COPIES,
    COPY,
    COPY_2D,
    GATED,
    GEMM,
    GEMM_HERE,
    LAUNCH,
    LAUNCH_HERE,
    MOVES,
    RECORD,
    WAIT,
    coalesce,
    lower_slots,
)


class Binding:
    """A compiled plan bound to one backend and one workspace (see the module docstring);
    ``backend`` and ``ref`` (the workspace handle, None without one) are weak references.
    Never changed once made: a call that needs other steps makes a new one, so a thread that
    read the old one still runs consistent steps."""

    __slots__ = ("backend", "call_key", "events", "ref", "steps", "variant", "ws_key",
                 "ws_views")

    def __init__(self, backend, ref, ws_key, ws_views, call_key, steps, events, variant):
        self.backend, self.ref, self.ws_key, self.ws_views = backend, ref, ws_key, ws_views
        self.call_key, self.steps, self.events, self.variant = call_key, steps, events, variant


class Steps:
    """One way to run a compiled plan: its steps, ``work`` (step number -> plan op index,
    for traces and error messages), the queue indices it uses (``side_queues``: those but the
    compute queue; ``entry_waits``: those that wait for the call's entry record, see
    :func:`_entry_waits`), ``stands`` (per step, the plan ops it runs) and the copies a backend
    may prepare (step number, sources touched)."""

    __slots__ = ("copies", "entry_waits", "side_queues", "stands", "steps", "used", "work")

    def __init__(self, steps: tuple, work: tuple, used: tuple, stands: tuple, compute: int,
                 slots: list):
        self.steps, self.work, self.used, self.stands = steps, work, used, stands
        self.side_queues = tuple(i for i in used if i != compute)
        self.entry_waits = _entry_waits(steps, self.side_queues, compute)

        def sources(step) -> frozenset:
            pairs = step[2] if step[0] == COPIES else ((step[2], step[3], False),)
            return frozenset(slots[x][0] for d, src, _ in pairs for x in (d, src))

        self.copies = tuple((i, sources(step)) for i, step in enumerate(steps)
                            if step[0] in (COPY, COPY_2D, COPIES))


class CompiledPlan:
    """A plan lowered once to flat steps. ``slots`` lists every distinct view the plan
    touches as ``(source, spec)``: source ``("input",)``, ``("gathered", 0, peer)``,
    ``("partial", j, peer)``, ``("out", j)``, ``("recv", j)``, ``("b", j)`` or an epilogue
    operand (``("input_scale",)``, ``("gathered_scale", 0, peer)``, ``("b_scale", j)``,
    ``("bias", j)``); spec ``("whole",)`` (the tensor itself), ``("rect",
    row0, rows, col0, cols)`` (what ``t[row0:row0+rows, col0:col0+cols]`` gives), ``("batched",
    n, rows, cols, row0, col0, spacing)`` or ``("krows", k0, kc, c0, nc)``
    (``b[k0:k0+kc, c0:c0+nc]``)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.queue_names = plan.queues
        self.compute = plan.queues.index(COMPUTE)
        self.side_queues = tuple(i for i, n in enumerate(plan.queues) if n != COMPUTE)
        s, self.steps, self.work = lower_slots(plan)
        steps = self.steps
        # Three ways to run it: every op as its own step (traces, profiler ranges), and
        # coalesced (:func:`~ficco.executor.lowering.coalesce`) for backends that submit a queue's copies
        # one call each or all in one call (``Backend.batches_copies``).
        lean = {merge: coalesce(plan, s, steps, merge) for merge in (False, True)}
        self.slots = s.slots
        self.variants = {
            "full": Steps(steps, self.work, tuple(range(len(plan.queues))),
                          tuple(() if st[0] in (RECORD, WAIT) else (n,)
                                for n, st in enumerate(steps)), self.compute, self.slots),
            **{("batched" if merge else "lean"): Steps(*lean[merge], self.compute, self.slots)
               for merge in (False, True)}}
        self.num_flags = max((op.num_flags for op in plan.ops if isinstance(op, GatedGemm)),
                             default=0)
        # Workspace views (this rank's symmetric buffers and the peers') vs per-call views.
        self.workspace_slots = tuple(i for i, (src, _) in enumerate(self.slots)
                                     if src[0] in SYMMETRIC_BUFFERS)
        self.splits, split_slots = self._plan_splits(plan)
        self.call_slots = tuple(i for i, (src, _) in enumerate(self.slots)
                                if src[0] not in SYMMETRIC_BUFFERS and i not in split_slots)
        # Copies a backend may prepare: (step number, the sources they read or write). With a
        # workspace (dma) only the per-call sources key a prepared copy; without one (ccl)
        # the symmetric buffers are fresh tensors too.
        every = sorted({src for v in self.variants.values() for _, sources in v.copies
                        for src in sources}, key=repr)
        self.copy_sources = {True: tuple(s for s in every if s[0] not in SYMMETRIC_BUFFERS),
                             False: tuple(every)}
        # Per-call views only prepared copies use (the reduce-scatter's 2-D landing chunks,
        # coalesced copies' blocks): not made while the prepared copies hold.
        copy_only = set()
        for v in self.variants.values():
            for st in v.steps:
                if st[0] in (COPY, COPY_2D):
                    copy_only.update(st[2:4])
                elif st[0] == COPIES:
                    copy_only.update(x for d, src, _ in st[2] for x in (d, src))
        for v in self.variants.values():
            copy_only -= _slots_used_by(v.steps)
        self.lean_call_slots = tuple(i for i in self.call_slots if i not in copy_only)
        self._binding: Binding | None = None

    @property
    def bound(self) -> bool:
        """Whether a binding (workspace views, prepared copies) is kept for the next call."""
        return self._binding is not None

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
        splits: list[tuple] = []
        covered: set[int] = set()
        for source, blocks in rows_of.items():
            if len(blocks) < 2:
                continue
            total = shapes[source][0]
            cuts = sorted({0, total} | {r for r0, n, _ in blocks for r in (r0, r0 + n)})
            piece = {start: k for k, start in enumerate(cuts[:-1])}
            nxt = dict(itertools.pairwise(cuts))
            # A block must be exactly one piece: no cut strictly inside it.
            pieces = tuple((i, piece[r0]) for r0, n, i in blocks if nxt[r0] == r0 + n)
            if len(pieces) < 2:
                continue
            sizes = [b - a for a, b in itertools.pairwise(cuts)]
            splits.append((source, shapes[source], sizes, pieces))
            covered.update(i for i, _ in pieces)
        return tuple(splits), covered

    # -- runtime calls ---------------------------------------------------------------------------
    def issue_calls(self, batched: bool) -> tuple[list[int], int]:
        """What a warm call asks of a GPU runtime, as the coalesced steps issue it
        (``batched``: on a backend that submits a queue's copies in one call): per plan op,
        the runtime calls the host has made once it issued that op (a record or wait left
        out is issued with the op before it), and the call's total. Counted as
        ``python -m ficco.bench overhead`` counts: the entry record and the side queues' waits
        for it (``Steps.entry_waits``), one call per step (a batched submission once, each of its copies
        without batching; ``MOVES``: once batched, else once per op), and the join of each
        side queue at the end (a record and a wait)."""
        v = self.variants["batched" if batched else "lean"]
        calls = (1 if v.entry_waits else 0) + len(v.entry_waits)
        at: dict[int, int] = {}
        for step, ops in zip(v.steps, v.stands):
            code = step[0]
            if code == COPIES:
                calls += len({two_d for _, _, two_d in step[2]}) if batched else len(step[2])
            elif code == MOVES:
                calls += 1 if batched else len(step[2])
            else:
                calls += 1
            for i in ops:
                at[i] = calls
        issued, last = [], (1 if v.entry_waits else 0) + len(v.entry_waits)
        for i in range(len(self.plan.ops)):
            last = at.get(i, last)
            issued.append(last)
        return issued, calls + 2 * len(v.side_queues)

    # -- binding -------------------------------------------------------------------------------
    def variant(self, backend, every_op: bool = False) -> Steps:
        """How a call on ``backend`` runs: one step per plan op with ``every_op`` (traces,
        profiler ranges), else coalesced, copy queues merged where the backend submits a
        queue's copies in one call (:attr:`Backend.batches_copies`)."""
        if every_op:
            return self.variants["full"]
        return self.variants["batched" if backend.batches_copies else "lean"]

    def bind(self, backend, buffers: Buffers, events: list | None = None,
             every_view: bool = False, variant: Steps | None = None) -> tuple[tuple, list]:
        """``(steps, views)`` of one call on ``backend``: the steps to run (of
        :meth:`variant`; ``every_view``: one per plan op, as ``self.steps``), with the copies
        prepared by the backend (when it can) and kept from the last call while the addresses
        they were prepared for still hold, and the views by slot (those only prepared copies
        use are None unless ``every_view``). ``events``: this call's plan events; a backend
        that prepares event records and waits (GPUs, whose events are one set per compiled
        plan) gets them bound into the steps."""
        symm = buffers.symm
        old = self._binding
        if variant is None:     # (the executor passes the one it chose)
            variant = self.variant(backend, every_view)
        # Events key the binding only where they are bound into it (the CPU backend makes
        # fresh events every call).
        if not backend.reuses_plan_events:
            events = None
        if old is not None and (old.backend() is not backend or old.events is not events or
                                old.variant is not variant or
                                (old.ref() if old.ref is not None else None) is not symm):
            old = None
        if symm is None:
            ws_key, ws_views = None, None
        else:
            ws_key = tuple([(t.data_ptr(), t.shape, t.stride(), t.storage_offset(), t.dtype,
                             t.device)
                            for t in [buffers.gathered, buffers.gathered_scale,
                                      *buffers.partials, *buffers.reduced] if t is not None])
            if old is not None and old.ws_key != ws_key:
                old = None
            ws_views = old.ws_views if old is not None else \
                self._make_views(self.workspace_slots, buffers, [None] * len(self.slots))
        prepare = backend.prepare_copy if backend.prepares_copies else None
        call_key = None
        if prepare is not None:
            # Geometry, not identity: a fresh tensor at the same address with the same layout
            # takes the same copy arguments. (The device is the backend's.)
            call_key = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in
                             (_source_tensor(s, buffers)
                              for s in self.copy_sources[symm is not None]))
        if old is not None and old.call_key == call_key:
            lean = prepare is not None and not every_view
            return old.steps, self.views(buffers, ws_views, lean)
        views = self.views(buffers, ws_views)
        steps = self._bound_steps(backend, prepare, old, call_key, symm is not None, views,
                                  events, variant)
        ref = None
        if symm is not None:
            try:
                # A weak reference: the workspace views must not outlive the workspace they
                # point into; when the runtime drops a grown-out-of handle, the callback
                # frees them.
                ref = weakref.ref(symm, self._forget)
            except TypeError:
                return steps, views
        # The backend weakly too: a closed backend is not kept alive by a plan it ran.
        self._binding = Binding(weakref.ref(backend), ref, ws_key, ws_views, call_key, steps,
                                events, variant)
        return steps, views

    def _bound_steps(self, backend, prepare, old: Binding | None, call_key, dma: bool,
                     views: list, events: list | None, variant: Steps) -> tuple:
        if old is not None:
            steps = list(old.steps)
            moved = {s for s, was, now in zip(self.copy_sources[dma], old.call_key, call_key)
                     if was != now}
        else:
            steps = list(variant.steps)
            moved = None   # every copy is prepared
            here = {GEMM: GEMM_HERE, LAUNCH: LAUNCH_HERE} if backend.compute_on_current else {}
            compute = self.compute
            steps = [(here[s[0]],) + s[1:] if s[0] in here and s[1] == compute else s
                     for s in steps]
            if events is not None:
                # Each record / wait as the event's own bound call (no backend frame, no
                # event lookup per step): GPUs reuse one event set per compiled plan.
                record, wait = backend.prepare_record, backend.prepare_wait
                steps = [(CALL, s[1], record(events[s[2]]), 0, 0, 0) if s[0] == RECORD else
                         (CALL, s[1], wait(events[s[2]]), 0, 0, 0) if s[0] == WAIT else s
                         for s in steps]
        if prepare is not None:
            for i, sources in variant.copies:
                if moved is None or not moved.isdisjoint(sources):
                    code, q, dst, src, _, _ = variant.steps[i]
                    if code == COPIES:
                        call = backend.prepare_copies([(views[d], views[s], two_d)
                                                       for d, s, two_d in dst])
                    else:
                        call = prepare(views[dst], views[src], code == COPY_2D)
                    steps[i] = (CALL, q, call, 0, 0, 0)
        return tuple(steps)

    def _forget(self, ref) -> None:
        binding = self._binding
        if binding is not None and binding.ref is ref:
            self._binding = None

    # -- views ----------------------------------------------------------------------------------
    def views(self, buffers: Buffers, ws_views: list | None = None,
              lean: bool = False) -> list:
        """Every slot's view for this call: the workspace's from ``ws_views`` when given
        (kept by the binding), the rest made now (with ``lean``, not those only prepared
        copies use)."""
        if ws_views is None:
            views = self._make_views(self.workspace_slots, buffers, [None] * len(self.slots))
        else:
            views = list(ws_views)
        self._make_views(self.lean_call_slots if lean else self.call_slots, buffers, views)
        for source, shape, sizes, pieces in self.splits:
            t = _source_tensor(source, buffers)
            if t.shape != shape:   # not the canonical shape: one view at a time
                self._make_views([i for i, _ in pieces], buffers, views)
                continue
            parts = t.split_with_sizes(sizes)
            for i, k in pieces:
                views[i] = parts[k]
        return views

    def _make_views(self, slots, buffers: Buffers, out: list) -> list:
        bases: dict[tuple, tuple] = {}
        for i in slots:
            source, spec = self.slots[i]
            base = bases.get(source)
            if base is None:
                t = _source_tensor(source, buffers)
                if t is None:   # a b without a bias while another b has one
                    out[i] = None
                    continue
                base = bases[source] = (t, (t.shape, t.stride(), t.storage_offset()))
            args = _view_args(*base[1], spec)
            out[i] = base[0] if args is None else base[0].as_strided(*args)
        return out


def _entry_waits(steps, side_queues: tuple, compute: int) -> tuple:
    """The side queues that must wait for the call's entry record (made on the compute queue,
    the caller's stream, before any step): all but those whose first steps include a wait for
    a record the compute queue made earlier in the call, which orders them after the entry
    record already (stream order). When none is left, the entry record goes too."""
    recorded_on: dict[int, int] = {}
    started: set[int] = set()
    covered: set[int] = set()
    for step in steps:
        code, q = step[0], step[1]
        if code == WAIT and q not in started:
            if recorded_on.get(step[2]) == compute:
                covered.add(q)
            continue
        started.add(q)
        if code == RECORD:
            recorded_on[step[2]] = q
    return tuple(q for q in side_queues if q not in covered)


def _slots_used_by(steps) -> set:
    """Slot numbers GEMMs, host tasks and gated GEMMs read (any int in a host task's
    arguments counts: a rank number taken for a slot only keeps a view that is not needed)."""
    used: set = set()

    def walk(x):
        if isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif isinstance(x, int) and not isinstance(x, bool):
            used.add(x)

    for code, _, x, y, z, _w in steps:
        if code in (GEMM, GEMM_HERE):
            used.update((x, y, z))
        elif code == LAUNCH:
            walk(y)
        elif code == GATED:
            walk(x)
    return used


def _source_tensor(source, buffers: Buffers) -> torch.Tensor:
    kind = source[0]
    if kind in SYMMETRIC_BUFFERS:
        _, index, peer = source
        return buffers.local(kind, index) if peer is None else buffers.peer(peer, kind, index)
    if kind == "input":
        return buffers.a
    if kind == "input_scale":
        if buffers.a_scale is None:
            raise InvalidArgumentError("plan reads the input's fp8 scale but the call has none")
        return buffers.a_scale
    if kind == "b_scale":
        return buffers.b_scales[source[1]]
    if kind == "bias":
        return buffers.biases[source[1]]
    if kind == "out":
        return buffers.outs[source[1]]
    if kind == "recv":
        return buffers.recvs[source[1]]
    return buffers.bs[source[1]]


def _clamp(start: int, length: int, size: int) -> tuple[int, int]:
    """(start, length) of Python slicing ``[start:start+length]`` on a dimension of ``size``."""
    lo = min(start, size)
    return lo, max(min(start + length, size) - lo, 0)


@functools.lru_cache(maxsize=4096)
def _view_args(shape, stride, offset: int, spec) -> tuple | None:
    """``as_strided`` arguments of the view ``spec`` (a slot's) of a tensor with this shape,
    stride and storage offset; None for the tensor itself. Once per geometry: a warm call's
    views are a cache hit each (the caching allocator mostly returns the same layouts)."""
    kind = spec[0]
    if kind == "whole":   # a tensor-wise scale
        return None
    if kind == "rect":
        _, row0, rows, col0, cols = spec
        r0, nr = _clamp(row0, rows, shape[0])
        c0, nc = _clamp(col0, cols, shape[1])
        if nr == shape[0] and nc == shape[1]:
            return None   # the whole buffer (serial's input and output): no view to make
        return (nr, nc), stride, offset + r0 * stride[0] + c0 * stride[1]
    if kind == "krows":
        _, k0, kc, c0, nc = spec
        whole_rows, whole_cols = k0 == 0 and kc >= shape[0], c0 == 0 and nc >= shape[1]
        if whole_rows and whole_cols:
            return None   # b[0:K] is b itself: skip making a view per call
        r0, nr = _clamp(k0, kc, shape[0])
        c0, nc = _clamp(c0, nc, shape[1])
        return (nr, nc), stride, offset + r0 * stride[0] + c0 * stride[1]
    _, n, rows, cols, row0, col0, spacing = spec
    # The tensor's own strides, both of them: a column-major operand (a transposed view) has
    # a column stride other than 1.
    row_stride, col_stride = stride
    return (n, rows, cols), (spacing * row_stride, row_stride, col_stride), \
        offset + row0 * row_stride + col0 * col_stride


def compile_plan(plan: Plan) -> CompiledPlan:
    """The compiled form of ``plan``, made once per Plan object and kept on it (the runtime
    keeps Plans per session, so the same object comes back for the same call).

    >>> from ficco import schedules
    >>> from ficco.plan.problem import Problem
    >>> plan = schedules.get("ring").plan(Problem(4, 8, (3,), "float32", 2, 0), "dma")
    >>> compile_plan(plan) is compile_plan(plan)
    True
    """
    compiled = plan.__dict__.get("_compiled")
    if compiled is None:
        compiled = CompiledPlan(plan)
        object.__setattr__(plan, "_compiled", compiled)   # a frozen dataclass: set once
    return compiled
