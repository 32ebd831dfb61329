"""Plans: plain data describing one call (either op) as ops on queues.

A schedule's ``plan(problem)`` returns a :class:`Plan`. The executor runs it on a backend, the
simulator times it on a device profile, the timeline drawer draws it. Nothing here calls a
vendor API.

Buffers an op may name (``Block.buf``), all 2-D, row-major (shapes: :func:`buffer_shapes`):

- ``"input"``: the caller's A operand in canonical form, ``m x K`` (read only).
- ``"gathered"`` (all-gather): the symmetric all-gather buffer, ``M x K``; rank p's shard
  lives at rows ``[p*m, (p+1)*m)`` of every rank's copy. ``Block.peer`` picks whose copy
  (None: this rank's).
- ``"partial"`` (reduce-scatter): ``Block.index`` j's partial products ``a @ b_j`` of this
  rank, ``M x n_j``; symmetric with ``dma`` (``Block.peer`` names a peer's copy, the source
  of a pull).
- ``"recv"`` (reduce-scatter): where the peers' partials of this rank's block land before they
  are reduced, ``W*R x n_j`` for a block of R rows: peer p's at rows ``[p*R, (p+1)*R)``.
  All-reduce: where pulled or collected partials land, laid out by the schedule (a one-shot
  lands every peer's whole partial, ``W*M`` rows at most); the runtime sizes it by the plan
  (:meth:`Plan.rows_of`).
- ``"reduced"`` (all-reduce): ``M x n_j``, symmetric with ``dma``: the sums of the rows this
  rank reduced (its block, or its piece of a chunk), from where peers pull them; in the
  outputs' dtype (float32 when the plan's outputs are wide), so what travels is final.
- ``"out"``: output ``Block.index`` j: ``M x n_j`` (all-gather, all-reduce) or this rank's
  block, ``R x n_j`` (reduce-scatter).
- ``"input_scale"``, ``"gathered_scale"`` (all-gather of fp8 with row-wise scales): the
  float32 scale of every row of ``input`` (``m x 1``) and of ``gathered`` (``M x 1``,
  symmetric). Schedules never name them: :class:`PlanBuilder` moves a row's scale with the
  copy or collective that moves the row's first column (:func:`scale_companion`).

Queues: ``"compute"`` (the caller's stream), ``"copy0"`` … ``"copy{E-1}"`` (copy engines),
``"comm"`` (the process group's collectives). Ops on one queue run in list order; a dependency
across queues is an explicit :class:`Record` / :class:`Wait` pair, which :class:`PlanBuilder`
inserts from the ``after=`` handles a schedule gives it.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import InvalidArgumentError
from .problem import Problem

COMPUTE = "compute"
COMM = "comm"
BUFFERS = ("input", "gathered", "partial", "recv", "reduced", "out", "input_scale",
           "gathered_scale")
#: buffers other ranks may read (symmetric memory with ``dma``)
SYMMETRIC_BUFFERS = ("gathered", "partial", "reduced", "gathered_scale")
#: the row-scale buffer of each buffer that holds rows of A (row-wise fp8 scaling)
SCALE_OF = {"input": "input_scale", "gathered": "gathered_scale"}


def copy_queue(i: int) -> str:
    return f"copy{i}"


def buffer_shapes(problem: Problem) -> dict[tuple, tuple[int, int]]:
    """(rows, cols) of every buffer a plan of ``problem`` may name, keyed like the executor's
    sources: ``("input",)``, ``("gathered",)``, ``("partial", j)``, ``("recv", j)``,
    ``("out", j)``.

    >>> p = Problem(m=10, k=4, ns=(3,), dtype="float32", world=4, op="matmul_reduce_scatter")
    >>> buffer_shapes(p)[("recv", 0)], buffer_shapes(p)[("out", 0)]
    ((12, 3), (3, 3))
    """
    p = problem
    shapes: dict[tuple, tuple[int, int]] = {("input",): (p.m, p.k)}
    if p.scaling == "row":
        shapes[("input_scale",)] = (p.m, 1)
        if not p.reduces:
            shapes[("gathered_scale",)] = (p.big_m, 1)
    if p.all_reduces:
        for j, n in enumerate(p.ns):
            shapes[("partial", j)] = shapes[("reduced", j)] = shapes[("out", j)] = (p.m, n)
            shapes[("recv", j)] = (p.world * p.m, n)    # the most a plan lands (one-shot)
    elif p.reduces:
        rows = p.block_rows
        for j, n in enumerate(p.ns):
            shapes[("partial", j)] = (p.m, n)
            shapes[("recv", j)] = (p.world * rows, n)
            shapes[("out", j)] = (rows, n)
    else:
        shapes[("gathered",)] = (p.big_m, p.k)
        shapes.update({("out", j): (p.big_m, n) for j, n in enumerate(p.ns)})
    return shapes


def source_of(blk: Block) -> tuple:
    """The :func:`buffer_shapes` key of the buffer ``blk`` lies in (peer not included)."""
    if blk.buf in ("input", "gathered", "input_scale", "gathered_scale"):
        return (blk.buf,)
    return (blk.buf, blk.index)


def item_bytes(problem: Problem, buf: str, wide: bool = False) -> int:
    """Bytes of one element of buffer ``buf``: A's rows in the operands' dtype, row scales in
    float32, reduce-scatter partials as they travel (:attr:`Problem.partial_itemsize`),
    outputs and the all-reduce's reduced rows in the output dtype (float32 when the plan's
    outputs are ``wide``).

    >>> item_bytes(Problem(4, 32, (16,), "float8_e4m3fn", 2, scaling="row",
    ...                    out_dtype="bfloat16"), "out")
    2
    """
    if buf in ("input", "gathered"):
        return problem.itemsize
    if buf in ("input_scale", "gathered_scale"):
        return 4
    if buf in ("out", "reduced"):
        return 4 if wide and problem.out_itemsize < 4 else problem.out_itemsize
    return problem.partial_itemsize


@dataclass(frozen=True)
class Block:
    """A rectangle ``[row0, row0+rows) x [col0, col0+cols)`` of a named 2-D buffer."""

    buf: str
    row0: int
    rows: int
    col0: int
    cols: int
    peer: int | None = None
    index: int = 0

    def __post_init__(self):
        if self.buf not in BUFFERS:
            raise InvalidArgumentError(f"Block.buf must be one of {BUFFERS}; got {self.buf!r}")
        if min(self.row0, self.rows, self.col0, self.cols) < 0:
            raise InvalidArgumentError(f"Block has a negative extent: {self}")

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class Copy:
    """A DMA copy ``dst <- src`` (same rows x cols). ``two_d`` when either side is a column
    block narrower than its buffer (a strided copy: height=rows, width=cols*itemsize)."""

    queue: str
    src: Block
    dst: Block
    two_d: bool = False
    step: int = 0

    @property
    def kind(self) -> str:
        return "copy_2d" if self.two_d else "copy_1d"


@dataclass(frozen=True)
class Gemm:
    """``out[i] (+)= a[i] @ b_j[k0:k0+kc, c0:c0+nc]`` for every i, as ONE GEMM launch, where
    ``c0, nc`` are the output blocks' columns (all of ``n_j`` except in 2-D reduce-scatter).

    With several blocks they must be the same shape and equally spaced in rows in the same
    buffer (one strided-batched GEMM)."""

    queue: str
    a: tuple[Block, ...]
    out: tuple[Block, ...]
    b: int
    k0: int
    kc: int
    accumulate: bool = False
    step: int = 0
    kind = "gemm"


@dataclass(frozen=True)
class Reduce:
    """``dst = (dst if accumulate else 0) + sum(srcs)``, then ``*= scale`` when set (``avg``):
    local, memory-bound, on a compute queue. Summed in float32 and rounded once into ``dst``'s
    dtype. DMA engines cannot add, so this is where reduce-scatter's partials meet."""

    queue: str
    srcs: tuple[Block, ...]
    dst: Block
    accumulate: bool = False
    step: int = 0
    scale: float | None = None
    kind = "reduce"


@dataclass(frozen=True)
class AllGather:
    """Collective over the process group: ``dsts[p] <- src of rank p`` for every rank p."""

    queue: str
    src: Block
    dsts: tuple[Block, ...]
    step: int = 0
    kind = "all_gather"


@dataclass(frozen=True)
class AllToAll:
    """Collective over the process group: ``srcs[q]`` goes to rank q, ``dsts[p]`` receives rank
    p's block for this rank. Entries may be None (nothing to or from that rank; this rank's
    own entries always are)."""

    queue: str
    srcs: tuple[Block | None, ...]
    dsts: tuple[Block | None, ...]
    step: int = 0
    kind = "all_to_all"


@dataclass(frozen=True)
class ReduceScatter:
    """Collective over the process group: rank q's ``dst`` <- the sum over ranks of their
    ``srcs[q]`` (then ``*= scale``). The reduction runs inside the collective (NCCL/RCCL's
    kernels): the ``ccl`` baseline of ``serial``. Entries and ``dst`` may be None (an empty
    block: a rank with no rows)."""

    queue: str
    srcs: tuple[Block | None, ...]
    dst: Block | None
    step: int = 0
    scale: float | None = None
    kind = "reduce_scatter"


@dataclass(frozen=True)
class AllReduce:
    """Collective over the process group: ``dst`` <- the sum over ranks of their ``src`` (the
    same rectangle on every rank), then ``*= scale``; NCCL/RCCL's all-reduce, which leaves
    the same values on every rank (``ccl``). It sums in ``src``'s dtype (the process group's
    reduction)."""

    queue: str
    src: Block
    dst: Block
    step: int = 0
    scale: float | None = None
    kind = "all_reduce"


@dataclass(frozen=True)
class SendRecv:
    """Point-to-point over the process group: send ``send`` to ``send_to`` and receive
    ``recv`` from ``recv_from`` (either side may be None)."""

    queue: str
    send: Block | None
    send_to: int | None
    recv: Block | None
    recv_from: int | None
    step: int = 0
    kind = "send_recv"


@dataclass(frozen=True)
class Barrier:
    """Every rank of the group reaches this point on ``queue`` before any goes on.
    ``channel`` is 0 or 1: a plan's barriers alternate 0, 1, 0, … and end on 1 (the flag
    protocol of :mod:`ficco.symm_mem.barrier` relies on it)."""

    queue: str
    channel: int
    step: int = 0
    kind = "barrier"


@dataclass(frozen=True)
class Record:
    queue: str
    event: int
    kind = "record"


@dataclass(frozen=True)
class Wait:
    queue: str
    event: int
    kind = "wait"


# -- the gated schedules' arrival flags: one int32 word per (chunk, peer) of a call ---------
#: a GatedGemm part that waits for no flag (this rank's own rows)
NO_FLAG = -1


def flag_index(problem: Problem, peer: int, chunk: int) -> int:
    """Arrival flag of chunk ``chunk`` of ``peer``'s shard: ``chunk * W + peer``."""
    return chunk * problem.world + peer


def describe_flag(problem: Problem, flag: int) -> str:
    """What arrival flag ``flag`` stands for, in error messages.

    >>> describe_flag(Problem(m=8, k=8, ns=(4,), dtype="float32", world=4, rank=0), 6)
    'chunk 1 of peer 2 (rank 0 waiting)'
    """
    chunk, peer = divmod(flag, problem.world)
    return f"chunk {chunk} of peer {peer} (rank {problem.rank} waiting)"


@dataclass(frozen=True)
class Signal:
    """Stream-ordered write of 1 into arrival flag ``flag`` (a local int32 word of this call),
    after everything before it on ``queue``: a copy queue raises it right after a copy so a
    :class:`GatedGemm` may read the rows (ficco.kernels)."""

    queue: str
    flag: int
    step: int = 0
    kind = "signal"


@dataclass(frozen=True)
class GatedGemm:
    """ONE launch of the signal-gated GEMM ``out[b] = gathered @ b_b`` (ficco.kernels). Its
    tiles walk ``segments`` in order; a segment ``(row0, rows, parts)`` covers rows
    ``[row0, row0+rows)`` of ``gathered`` and ``out[b]`` (this rank's own rows are read from
    ``input``) and accumulates each part ``(k0, kc, flag)`` once arrival flag ``flag`` is
    raised (``NO_FLAG``: no wait). It waits on flags, not events: the copies it reads run alongside."""

    queue: str
    segments: tuple[tuple[int, int, tuple[tuple[int, int, int], ...]], ...]
    b: int
    step: int = 0
    kind = "gated_gemm"

    @property
    def num_flags(self) -> int:
        return 1 + max((f for _, _, parts in self.segments for _, _, f in parts), default=-1)


class HostOp:
    """Base of plan ops whose work is one host task sized at launch from the call's buffers
    (``Buffers.task_state``), for op families whose sizes are data: expert parallelism's routing
    counts change every call, so its plans name (expert, source, chunk) and one plan serves
    every routing (:mod:`ficco.ops.expert.plan_ops`). Subclasses are frozen dataclasses with
    ``queue`` and ``step``, a ``kind``, a static ``host_task(views, buffers, op) -> fn`` that
    the executor launches on the op's queue and a static ``price(sim, op, task, mt_factor)``:
    its solo cost on a simulation (:mod:`ficco.heuristics.simulator`), built from the
    simulation's primitives.

    An op whose work is only copies also sets ``copy_pairs(views, buffers, op) -> [(dst, src),
    ...]`` (the same copies as its host task, sized at launch): a backend that prepares copies
    (GPUs) then submits them as copies, and the ops of one plan step that follow each other
    on a queue as one submission (:func:`ficco.executor.lowering.coalesce`). Their copies
    must write memory no other such op of that step reads or writes."""

    queue: str
    step: int
    kind: ClassVar[str]
    host_task: ClassVar[Callable[..., Callable[[], object]]]
    price: ClassVar[Callable[..., Any]]
    copy_pairs: ClassVar[Callable[..., list] | None] = None


Op = (Copy | Gemm | Reduce | AllGather | AllToAll | ReduceScatter | AllReduce | SendRecv
      | Barrier | Record | Wait | Signal | GatedGemm | HostOp)
WORK_OPS = (Copy, Gemm, Reduce, AllGather, AllToAll, ReduceScatter, AllReduce, SendRecv, Barrier,
            Signal, GatedGemm, HostOp)


def op_label(op, rank: int) -> str:
    """The short name of ``op`` on ``rank``'s timelines, measured (executor) and predicted
    (simulator) alike.

    >>> op_label(Barrier("copy0", 1), rank=0)
    'barrier 1'
    """
    step = getattr(op, "step", 0)
    kind = op.kind
    if kind in ("copy_1d", "copy_2d"):
        peer = op.src.peer if op.src.peer is not None else op.dst.peer
        if peer is None or peer == rank:
            return "publish" if op.src.buf == "input" else f"local c{step}"
        return f"peer {peer} c{step}"
    if kind == "gemm":
        rows = sum(block.rows for block in op.a)
        return f"gemm {rows}r s{step}" + (f" x{len(op.a)}" if len(op.a) > 1 else "")
    if kind == "reduce":
        return f"reduce {len(op.srcs)}x{op.dst.rows}r s{step}"
    if kind == "barrier":
        return f"barrier {op.channel}"
    if kind == "gated_gemm":   # a GatedGemm, or one of its pieces in the simulator
        return getattr(op, "label", "") or f"gated b{op.b} {len(op.segments)} segments"
    if kind == "signal":
        return f"flag {op.flag} s{step}"
    if kind == "send_recv":
        return f"recv {op.recv_from} s{step}"
    return f"{kind.replace('_', '-')} s{step}"


@dataclass(frozen=True)
class Plan:
    """What one rank does for one call. Plain data: compare, hash, print, simulate."""

    schedule: str
    transport: str
    problem: Problem
    queues: tuple[str, ...]
    ops: tuple[Op, ...]
    num_events: int = 0
    #: whether the outputs are float32 (see :meth:`wide_outputs`), when the schedule says so
    #: rather than its ops (the all-reduce's ``rs-ag-*``: what travels must be alike on every
    #: rank, and a rank with no rows to reduce has no ops that would say); None: its ops say
    wide: bool | None = None

    def count(self) -> Counter:
        """How many ops of each kind the plan holds, e.g. ``{'copy_1d': 56, 'gemm': 8}``."""
        return Counter(op.kind for op in self.ops if isinstance(op, WORK_OPS))

    def rows_of(self, buf: str, index: int = 0) -> int:
        """Rows of buffer ``buf`` (output ``index``) this plan touches: one past the last row
        any of its blocks names (this rank's copy or a peer's), 0 for none. The all-reduce's
        ``recv`` is allocated this size: its layout is the schedule's. Found once per plan.

        >>> from ficco import schedules
        >>> p = Problem(6, 4, (3,), "float32", 2, op="matmul_all_reduce")
        >>> schedules.get("one-shot", op=p.op).plan(p, "dma").rows_of("recv")
        12
        """
        seen = self.__dict__.setdefault("_rows_of", {})
        rows = seen.get((buf, index))
        if rows is None:
            rows = 0
            for op in self.ops:
                for blk in _blocks(op):
                    if blk.buf == buf and blk.index == index:
                        rows = max(rows, blk.row0 + blk.rows)
            seen[(buf, index)] = rows
        return rows

    def wide_outputs(self) -> bool:
        """Whether this plan's outputs are float32, rounded once at the end (DESIGN §7), which
        the runtime allocates and the simulator prices (float32 output traffic plus one cast
        pass): when it adds partial products into a bf16/fp16/fp8 output, or adds them at all
        while an epilogue (bias, activation) must follow the last one, and for the
        reduce-scatter's bias (added once, to the float32 sum)."""
        wide = self.__dict__.get("_wide", self.wide)   # asked every call: found once
        if wide is None:
            p = self.problem
            adds = any(getattr(op, "accumulate", False) for op in self.ops)
            wide = (p.reduces and p.bias) or (
                adds and (p.out_itemsize <= 2 or p.bias or bool(p.activation)))
            object.__setattr__(self, "_wide", bool(wide))
        return wide


def _blocks(op) -> list[Block]:
    """Every block ``op`` names (None entries of collectives left out)."""
    found = []
    for name in ("src", "dst", "a", "out", "srcs", "dsts", "send", "recv"):
        value = getattr(op, name, None)
        for blk in value if isinstance(value, tuple) else (value,):
            if isinstance(blk, Block):
                found.append(blk)
    return found


def scale_companion(op: Op) -> Op | None:
    """The op that moves the row scales of the rows ``op`` moves (row-wise fp8 scaling of
    the all-gather's A), or None. A row's scale travels with the piece holding the row's
    first column, so 1-D pieces carry their scales and of the 2-D column chunks only the
    first does (a GEMM of a later chunk waits for that one through queue order: every
    schedule moves chunk 0 of a row before its other chunks, on the same queue).

    >>> op = Copy("copy0", Block("gathered", 4, 2, 0, 8, peer=1), Block("gathered", 4, 2, 0, 8))
    >>> scale_companion(op).dst
    Block(buf='gathered_scale', row0=4, rows=2, col0=0, cols=1, peer=None, index=0)
    """
    def scale(blk: Block | None) -> Block | None:
        if blk is None or blk.buf not in SCALE_OF or blk.col0 != 0:
            return None
        return Block(SCALE_OF[blk.buf], blk.row0, blk.rows, 0, 1, blk.peer)

    if isinstance(op, Copy):
        src, dst = scale(op.src), scale(op.dst)
        if src and dst:
            return Copy(op.queue, src, dst, False, op.step)
    if isinstance(op, AllGather) and (src := scale(op.src)):
        dsts = tuple(map(scale, op.dsts))
        # an all-gather lands every rank's rectangle in place (same buffer and columns as src)
        assert all(dsts), f"an all-gather's src moves column 0 but a dst does not: {op}"
        return AllGather(op.queue, src, tuple(d for d in dsts if d), op.step)
    if isinstance(op, SendRecv) and (scale(op.send) or scale(op.recv)):
        return SendRecv(op.queue, scale(op.send), op.send_to if op.send else None,
                        scale(op.recv), op.recv_from if op.recv else None, op.step)
    return None


@dataclass
class PlanBuilder:
    """Collects work ops with dependencies and lowers them to a :class:`Plan` with explicit
    Record/Wait ops. ``add`` returns a handle for later ``after=`` lists; a dependency on an op
    of the same queue is implied by queue order and costs nothing."""

    schedule: str
    transport: str
    problem: Problem
    _ops: list = field(default_factory=list)
    _deps: list = field(default_factory=list)

    def add(self, op: Op, after=()) -> int:
        if not isinstance(op, WORK_OPS):
            raise InvalidArgumentError(f"PlanBuilder.add takes work ops, not {type(op).__name__}")
        deps = tuple(sorted({h for h in after if h is not None}))
        if any(not 0 <= h < len(self._ops) for h in deps):
            raise InvalidArgumentError(f"dependency handles {deps} must name earlier ops")
        self._ops.append(op)
        self._deps.append(deps)
        return len(self._ops) - 1

    def barriers(self) -> int:
        """How many barriers were added so far (the next one's channel is this mod 2)."""
        return sum(isinstance(op, Barrier) for op in self._ops)

    def build(self) -> Plan:
        queue_of = [op.queue for op in self._ops]
        event_of: dict[int, int] = {}
        for i, deps in enumerate(self._deps):
            for d in deps:
                if queue_of[d] != queue_of[i] and d not in event_of:
                    event_of[d] = len(event_of)
        # Events numbered in op order, so Plan equality does not depend on dict order.
        event_of = {d: n for n, d in enumerate(sorted(event_of))}
        ops: list[Op] = []
        waited: dict[str, set] = {}   # a queue that waited for an event once need not again
        row_scaled = self.problem.scaling == "row" and not self.problem.reduces
        for i, op in enumerate(self._ops):
            seen = waited.setdefault(op.queue, set())
            for d in self._deps[i]:
                if queue_of[d] != queue_of[i] and d not in seen:
                    seen.add(d)
                    ops.append(Wait(op.queue, event_of[d]))
            ops.append(op)
            companion = scale_companion(op) if row_scaled else None
            if companion is not None:   # before the Record: whoever waits for op waits for it
                ops.append(companion)
            if i in event_of:
                ops.append(Record(op.queue, event_of[i]))
        queues = tuple(dict.fromkeys([COMPUTE] + queue_of))
        return Plan(self.schedule, self.transport, self.problem, queues, tuple(ops),
                    len(event_of))
