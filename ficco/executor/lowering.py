"""Lowering a :class:`~ficco.plan.Plan` to flat executor steps: one small function per op type
(:data:`LOWER`), each turning one op into one step ``(code, queue index, x, y, z, w)`` whose
views are slot numbers of the plan's :class:`Slots` and whose events are indices. The compiler
(:mod:`ficco.executor.compiler`) lowers a plan once and binds the steps per backend and workspace.

>>> from ficco import schedules
>>> from ficco.plan.problem import Problem
>>> plan = schedules.get("ring").plan(Problem(4, 8, (3,), "float32", 2, 0), "dma")
>>> slots, steps, work = lower(plan)
>>> len(steps) == len(plan.ops) and all(step[0] in range(LAUNCH_HERE + 1) for step in steps)
True
"""
from __future__ import annotations

from collections.abc import Callable

from ..errors import InvalidArgumentError
from ..plan import (
    SCALE_OF,
    SYMMETRIC_BUFFERS,
    AllGather,
    AllReduce,
    AllToAll,
    Barrier,
    Block,
    Copy,
    GatedGemm,
    Gemm,
    HostOp,
    Plan,
    Record,
    Reduce,
    ReduceScatter,
    SendRecv,
    Signal,
    Wait,
    op_label,
)
from ..plan import tasks as host_tasks

# Step codes; a step is (code, queue index, x, y, z, w) with slot / event numbers in x..w.
# CALL (x: a prepared copy, called with the queue), GEMM_HERE and LAUNCH_HERE (a GEMM or host
# task on the compute queue, which is the current stream while the executor enqueues) appear
# only in bound steps. COPIES (x: ``((dst, src, two_d), ...)``, copies of one queue submitted
# together) and SIGNALS (x: arrival flags raised by one barrier-program call) appear only in
# coalesced steps (:func:`coalesce`). MOVES (x: HostOps with ``copy_pairs``, z: the first's
# label) are copies sized at launch: one submission of all their copies where the backend
# prepares copies, else each op's host task.
(COPY, COPY_2D, GEMM, RECORD, WAIT, BARRIER, LAUNCH, SIGNAL, GATED, CALL, GEMM_HERE,
 LAUNCH_HERE, COPIES, SIGNALS, MOVES) = range(15)


def slot_source(blk: Block) -> tuple:
    """The slot source of ``blk``: symmetric buffers carry the peer (None: this rank's)."""
    if blk.buf in SYMMETRIC_BUFFERS:
        return (blk.buf, blk.index, blk.peer)
    if blk.buf in ("input", "input_scale"):
        return (blk.buf,)
    return (blk.buf, blk.index)


def batched_spec(blocks: tuple[Block, ...]):
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


class Slots:
    """Every distinct view a plan touches, numbered in order of first use: ``(source, spec)``
    (see :class:`ficco.executor.compiler.CompiledPlan`)."""

    def __init__(self) -> None:
        self.slots: list[tuple] = []
        self._number: dict[tuple, int] = {}

    def slot(self, source, spec) -> int:
        key = (source, spec)
        number = self._number.get(key)
        if number is None:
            number = self._number[key] = len(self.slots)
            self.slots.append(key)
        return number

    def block(self, blk: Block) -> int:
        return self.slot(slot_source(blk), ("rect", blk.row0, blk.rows, blk.col0, blk.cols))

    def blocks(self, blocks: tuple[Block, ...]) -> int:
        if len(blocks) == 1:
            return self.block(blocks[0])
        return self.slot(slot_source(blocks[0]), ("batched",) + batched_spec(blocks))

    def maybe(self, blocks) -> tuple:
        return tuple(None if blk is None else self.block(blk) for blk in blocks)

    def like(self) -> int:
        """An empty view of the input: dtype and device for a collective's empty pieces."""
        return self.slot(("input",), ("rect", 0, 0, 0, 0))


def _epilogue_args(s: Slots, plan: Plan, op: Gemm) -> tuple:
    """Slots of a GEMM's fp8 scales and bias (None: none), then accumulate and the activation:
    the args of host_tasks.gemm_task. The bias and activation go with the GEMM only when it
    writes the final value (no wide outputs)."""
    p, out0 = plan.problem, op.out[0]
    cols = ("rect", 0, 1, out0.col0, out0.cols)
    a_scale: int | None
    b_scale: int | None
    if p.scaling == "row":
        a_scale = s.blocks(tuple(Block(SCALE_OF[blk.buf], blk.row0, blk.rows, 0, 1, blk.peer)
                                 for blk in op.a))
        b_scale = s.slot(("b_scale", op.b), cols)
    elif p.scaling:
        a_scale = s.slot(("input_scale",), ("whole",))
        b_scale = s.slot(("b_scale", op.b), ("whole",))
    else:
        a_scale = b_scale = None
    last = not plan.wide_outputs()
    bias = s.slot(("bias", op.b), cols) if p.bias and last else None
    return (a_scale, b_scale, bias, op.accumulate, p.activation if last else "")


def _record(s: Slots, plan: Plan, op: Record, q: int) -> tuple:
    return (RECORD, q, op.event, 0, 0, 0)


def _wait(s: Slots, plan: Plan, op: Wait, q: int) -> tuple:
    return (WAIT, q, op.event, 0, 0, 0)


def _copy(s: Slots, plan: Plan, op: Copy, q: int) -> tuple:
    return (COPY_2D if op.two_d else COPY, q, s.block(op.dst), s.block(op.src), 0, 0)


def _gemm(s: Slots, plan: Plan, op: Gemm, q: int) -> tuple:
    out0 = op.out[0]
    weight = s.slot(("b", op.b), ("krows", op.k0, op.kc, out0.col0, out0.cols))
    p = plan.problem
    if p.scaling or p.bias or p.activation:   # fp8, bias, activation: torch ops, a host task
        return (LAUNCH, q, host_tasks.gemm_task,
                (s.blocks(op.a), weight, s.blocks(op.out)) + _epilogue_args(s, plan, op), 0, 0)
    return (GEMM, q, s.blocks(op.a), weight, s.blocks(op.out), op.accumulate)


def _barrier(s: Slots, plan: Plan, op: Barrier, q: int) -> tuple:
    return (BARRIER, q, op.channel, op.step, 0, 0)


def _signal(s: Slots, plan: Plan, op: Signal, q: int) -> tuple:
    return (SIGNAL, q, op.flag, 0, 0, 0)


def _reduce(s: Slots, plan: Plan, op: Reduce, q: int) -> tuple:
    return (LAUNCH, q, host_tasks.reduce_task,
            (s.block(op.dst), tuple(s.block(src) for src in op.srcs), op.accumulate, op.scale),
            0, 0)


def _all_to_all(s: Slots, plan: Plan, op: AllToAll, q: int) -> tuple:
    return (LAUNCH, q, host_tasks.all_to_all_task, (s.maybe(op.srcs), s.maybe(op.dsts),
                                                    s.like()), 0, 0)


def _reduce_scatter(s: Slots, plan: Plan, op: ReduceScatter, q: int) -> tuple:
    return (LAUNCH, q, host_tasks.reduce_scatter_task,
            (s.maybe(op.srcs), s.maybe((op.dst,))[0], op.scale, s.like()), 0, 0)


def _all_reduce(s: Slots, plan: Plan, op: AllReduce, q: int) -> tuple:
    return (LAUNCH, q, host_tasks.all_reduce_task, (s.block(op.src), s.block(op.dst), op.scale),
            0, 0)


def _all_gather(s: Slots, plan: Plan, op: AllGather, q: int) -> tuple:
    return (LAUNCH, q, host_tasks.all_gather_task,
            (s.block(op.src), tuple(s.block(dst) for dst in op.dsts)), 0, 0)


def _send_recv(s: Slots, plan: Plan, op: SendRecv, q: int) -> tuple:
    send = s.block(op.send) if op.send is not None else None
    recv = s.block(op.recv) if op.recv is not None else None
    return (LAUNCH, q, host_tasks.send_recv_task, (send, op.send_to, recv, op.recv_from), 0, 0)


def _host_op(s: Slots, plan: Plan, op: HostOp, q: int) -> tuple:
    if op.copy_pairs is not None:    # copies only: submitted as copies where a backend can
        return (MOVES, q, (op,), 0, 0, 0)
    return (LAUNCH, q, op.host_task, op, 0, 0)   # sized at launch from the call's task_state


def _gated_gemm(s: Slots, plan: Plan, op: GatedGemm, q: int) -> tuple:
    p, n = plan.problem, plan.problem.ns[op.b]
    views = (s.block(Block("input", 0, p.m, 0, p.k)),
             s.block(Block("gathered", 0, p.big_m, 0, p.k)),
             s.slot(("b", op.b), ("krows", 0, p.k, 0, n)),
             s.block(Block("out", 0, p.big_m, 0, n, index=op.b)))
    return (GATED, q, views, (p, op), 0, 0)


#: How each op type lowers; a HostOp subclass lowers as HostOp.
LOWER: dict[type, Callable[..., tuple]] = {
    Record: _record, Wait: _wait, Copy: _copy, Gemm: _gemm, Barrier: _barrier, Signal: _signal,
    Reduce: _reduce, AllToAll: _all_to_all, ReduceScatter: _reduce_scatter,
    AllReduce: _all_reduce, AllGather: _all_gather, SendRecv: _send_recv, HostOp: _host_op,
    GatedGemm: _gated_gemm,
}


def lower(plan: Plan) -> tuple[list[tuple], tuple, tuple]:
    """``(slots, steps, work)`` of ``plan``: its views, its steps, and ``(step number, op
    index)`` of every traced op (all but records and waits)."""
    s, steps, work = lower_slots(plan)
    return s.slots, steps, work


def lower_slots(plan: Plan) -> tuple[Slots, tuple, tuple]:
    """:func:`lower` with the :class:`Slots` themselves (:func:`coalesce` adds views)."""
    queue_index = {name: i for i, name in enumerate(plan.queues)}
    s = Slots()
    steps: list[tuple] = []
    work = []
    for index, op in enumerate(plan.ops):
        lower_op: Callable[..., tuple] | None = LOWER.get(type(op))
        if lower_op is None and isinstance(op, HostOp):
            lower_op = _host_op
        if lower_op is None:
            raise InvalidArgumentError(f"the executor does not know op {type(op).__name__}")
        step = lower_op(s, plan, op, queue_index[op.queue])
        if step[0] not in (RECORD, WAIT):
            work.append((len(steps), index))
        if step[0] in (LAUNCH, MOVES):
            # A host task (a collective, a reduction): if it fails or hangs, the error names
            # this step (z is free in launch steps).
            step = step[:4] + (
                f"plan step {index} ({op_label(op, plan.problem.rank)}, queue {op.queue})", 0)
        steps.append(step)
    return s, tuple(steps), tuple(work)


# -- coalescing: the fewest backend calls that keep the plan's order ---------------------------
def coalesce(plan: Plan, s: Slots, steps: tuple, merge_copy_queues: bool
             ) -> tuple[tuple, tuple, tuple, tuple]:
    """The steps a warm call runs: ``steps`` (:func:`lower`'s, one per plan op) with every
    record and wait that orders nothing new left out, copies of one queue that follow each
    other submitted as one ``COPIES`` step, and row blocks that continue each other moved as
    one copy. Returns ``(steps, work, queues)``: ``work`` maps each step that stands for plan
    ops to the first op's index (error messages), ``queues`` the queue indices still used.

    With ``merge_copy_queues`` (a backend that submits a queue's copies in one call whose
    copies run concurrently: ``cudaMemcpyBatchAsync``), every copy queue's work goes on the
    first copy queue, and copies there that only records separate become one submission with
    one record at its end: whoever waited for one of them waits for the submission. Without
    it, the queues stay as the plan has them (one call per copy runs in order on its stream,
    so merging queues would serialise the engines). A run is the copies of one plan step;
    arrival flags raised between them (gated GEMMs) are raised after the run, together.

    Order is kept: a wait is left out only when its queue is already ordered after the
    event's record (vector clocks over the queues' positions, waits of one queue taken
    together before that queue's next op); a wait with no later op on its queue orders
    nothing (the call's end joins every queue). Also returns ``stands``: per step, the
    indices of the plan ops it runs (none for records and waits)."""
    queue_of = list(range(len(plan.queues)))
    if merge_copy_queues:
        copies = [i for i, name in enumerate(plan.queues) if name.startswith("copy")]
        for i in copies:
            queue_of[i] = copies[0]
    # items: (step, the plan op indices it runs); steps number like plan ops here
    items = [((step[0], queue_of[step[1]]) + step[2:],
              () if step[0] in (RECORD, WAIT) else (n,)) for n, step in enumerate(steps)]
    if merge_copy_queues:
        items = _records_after_runs(items, plan)
    items = _prune_waits(items, len(plan.queues))
    items = _batch_copies(items, s)
    items = _batch_moves(items, plan)
    items = _batch_signals(items)
    used = sorted({step[1] for step, _ in items})
    return (tuple(step for step, _ in items),
            tuple((n, ops[0]) for n, (_, ops) in enumerate(items) if ops),
            tuple(used), tuple(ops for _, ops in items))


def _records_after_runs(items: list, plan: Plan) -> list:
    """Copies (sized at launch too: ``MOVES``) of one queue and plan step that only records
    and arrival flags of that queue separate: their records move to the end of the run as ONE
    record (the others' waiters
    wait for it, renamed), their flags after it, in order."""
    out: list = []
    alias: dict[int, int] = {}
    i = 0

    def plan_step(item) -> int:
        return getattr(plan.ops[item[1][0]], "step", 0)

    while i < len(items):
        step = items[i][0]
        if step[0] not in (COPY, COPY_2D, MOVES):
            if step[0] == WAIT and step[2] in alias:
                step = (WAIT, step[1], alias[step[2]], 0, 0, 0)
            out.append((step, items[i][1]))
            i += 1
            continue
        q, j, first = step[1], i, plan_step(items[i])
        run: list = []
        records: list = []
        flags: list = []
        while j < len(items) and items[j][0][1] == q:
            code = items[j][0][0]
            if code == RECORD:
                records.append(items[j])
            elif code == SIGNAL:
                flags.append(items[j])
            elif code in (COPY, COPY_2D, MOVES) and plan_step(items[j]) == first:
                run.append(items[j])
            else:
                break
            j += 1
        out.extend(run)
        if records:
            last = records[-1][0][2]
            for rec, _ in records[:-1]:
                alias[rec[2]] = last
            out.append(records[-1])
        out.extend(flags)
        i = j
    return out


def _batch_moves(items: list, plan: Plan) -> list:
    """Copies sized at launch (``MOVES``) of one plan step that follow each other on a queue:
    one step, so one submission (their copies write apart: :class:`ficco.plan.HostOp`)."""
    out: list = []
    for step, op in items:
        prev = out[-1] if out else None
        if step[0] == MOVES and prev is not None and prev[0][0] == MOVES and \
                prev[0][1] == step[1] and prev[0][2][0].step == step[2][0].step:
            out[-1] = (prev[0][:2] + (prev[0][2] + step[2],) + prev[0][3:], prev[1] + op)
            continue
        out.append((step, op))
    return out


def _batch_signals(items: list) -> list:
    """Arrival flags raised one after the other on one queue: one SIGNALS step."""
    out: list = []
    for step, op in items:
        prev = out[-1][0] if out else None
        if step[0] == SIGNAL and prev is not None and prev[1] == step[1] and \
                prev[0] in (SIGNAL, SIGNALS):
            flags = prev[2] if prev[0] == SIGNALS else (prev[2],)
            out[-1] = ((SIGNALS, step[1], flags + (step[2],), 0, 0, 0), out[-1][1] + op)
            continue
        out.append((step, op))
    return out


def _prune_waits(items: list, queues: int) -> list:
    pos = [0] * queues
    clock = [[0] * queues for _ in range(queues)]
    event_clock: dict[int, list] = {}
    pending: dict[int, list] = {}
    out: list = []

    def covers(big, small) -> bool:
        return all(b >= x for b, x in zip(big, small))

    def flush(q: int) -> None:
        waits = pending.pop(q, [])
        keep = []
        for n, (event, item) in enumerate(waits):
            c = event_clock.get(event)
            if c is None:    # recorded after (not a PlanBuilder plan): keep it as it is
                out.append(item)
                continue
            if covers(clock[q], c):
                continue
            if any(e in event_clock and covers(event_clock[e], c) and
                   (event_clock[e] != c or m < n) for m, (e, _) in enumerate(waits) if m != n):
                continue     # another wait of this group covers it
            keep.append(item)
        for item in keep:
            clock[q] = [max(a, b) for a, b in zip(clock[q], event_clock[item[0][2]])]
            out.append(item)

    for step, op in items:
        code, q = step[0], step[1]
        if code == WAIT:
            pending.setdefault(q, []).append((step[2], (step, op)))
            continue
        flush(q)
        if code == RECORD:
            event_clock[step[2]] = clock[q][:q] + [pos[q]] + clock[q][q + 1:]
        else:
            pos[q] += 1
            clock[q][q] = pos[q]
        out.append((step, op))
    # (waits still pending have no later op on their queue: dropped)
    waited = {step[2] for step, _ in out if step[0] == WAIT}
    return [(step, op) for step, op in out if step[0] != RECORD or step[2] in waited]


def _batch_copies(items: list, s: Slots) -> list:
    out: list = []
    for step, op in items:
        prev = out[-1][0] if out else None
        if step[0] in (COPY, COPY_2D) and prev is not None and prev[1] == step[1] and \
                prev[0] in (COPY, COPY_2D, COPIES):
            pairs = list(prev[2]) if prev[0] == COPIES else [(prev[2], prev[3],
                                                              prev[0] == COPY_2D)]
            pair = (step[2], step[3], step[0] == COPY_2D)
            if any(_overlap(s, pair[1], d) or _overlap(s, pair[0], d) or
                   _overlap(s, pair[0], src) for d, src, _ in pairs):
                out.append((step, op))   # it reads or writes what the group writes: after it
                continue
            joined = _continued(s, pairs[-1], pair)
            if joined is not None:
                pairs[-1] = joined
            else:
                pairs.append(pair)
            merged = (COPIES, step[1], tuple(pairs), 0, 0, 0) if len(pairs) > 1 else \
                (COPY_2D if pairs[0][2] else COPY, step[1], pairs[0][0], pairs[0][1], 0, 0)
            out[-1] = (merged, out[-1][1] + op)
            continue
        out.append((step, op))
    return out


def _overlap(s: Slots, a: int, b: int) -> bool:
    """Whether views ``a`` and ``b`` (slot numbers) may share memory: the same buffer (and
    peer) and rectangles that intersect."""
    (src_a, spec_a), (src_b, spec_b) = s.slots[a], s.slots[b]
    if src_a != src_b:
        return False
    if spec_a[0] != "rect" or spec_b[0] != "rect":
        return True
    _, r0, nr, c0, nc = spec_a
    _, r1, mr, c1, mc = spec_b
    return r0 < r1 + mr and r1 < r0 + nr and c0 < c1 + mc and c1 < c0 + nc


def _continued(s: Slots, first: tuple, then: tuple) -> tuple | None:
    """One copy for two whose rows continue each other in both buffers (same columns), or
    None."""
    (d0, s0, two_d), (d1, s1, two_d1) = first, then
    if two_d != two_d1:
        return None
    blocks = []
    for a, b in ((d0, d1), (s0, s1)):
        (src_a, spec_a), (src_b, spec_b) = s.slots[a], s.slots[b]
        if src_a != src_b or spec_a[0] != "rect" or spec_b[0] != "rect":
            return None
        _, row0, rows, col0, cols = spec_a
        if spec_b[1:] != (row0 + rows, spec_b[2], col0, cols) or not two_d and rows < 1:
            return None
        blocks.append(s.slot(src_a, ("rect", row0, rows + spec_b[2], col0, cols)))
    return (blocks[0], blocks[1], two_d)
