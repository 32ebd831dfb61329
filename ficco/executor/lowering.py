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
# only in bound steps.
(COPY, COPY_2D, GEMM, RECORD, WAIT, BARRIER, LAUNCH, SIGNAL, GATED, CALL, GEMM_HERE,
 LAUNCH_HERE) = range(12)


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
        if step[0] == LAUNCH:
            # A host task (a collective, a reduction): if it fails or hangs, the error names
            # this step (z is free in launch steps).
            step = step[:4] + (
                f"plan step {index} ({op_label(op, plan.problem.rank)}, queue {op.queue})", 0)
        steps.append(step)
    return s.slots, tuple(steps), tuple(work)
