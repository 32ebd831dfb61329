"""Plans: plain data describing one all-gather + matmul as ops on queues.

A schedule's ``plan(problem)`` returns a :class:`Plan`. The executor runs it on a backend, the
simulator times it on a device profile, the timeline drawer draws it. Nothing here calls a
vendor API.

Buffers an op may name (``Block.buf``), all 2-D, row-major:

- ``"input"``: the caller's shard in canonical form, ``m x K`` (read only).
- ``"gathered"``: the symmetric all-gather buffer, ``M x K``; rank p's shard lives at rows
  ``[p*m, (p+1)*m)`` of every rank's copy. ``Block.peer`` picks whose copy (None: this rank's).
- ``"out"``: output ``Block.index``, ``M x n_j``.
- ``"stage"``: scratch ``Block.index`` declared in :attr:`Plan.stages`, for gathers/scatters.

Queues: ``"compute"`` (the caller's stream), ``"copy0"`` … ``"copy{E-1}"`` (copy engines),
``"comm"`` (the process group's collectives). Ops on one queue run in list order; a dependency
across queues is an explicit :class:`Record` / :class:`Wait` pair, which :class:`PlanBuilder`
inserts from the ``after=`` handles a schedule gives it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Union

from .errors import InvalidArgumentError
from .problem import Problem

COMPUTE = "compute"
COMM = "comm"
BUFFERS = ("input", "gathered", "out", "stage")


def copy_queue(i: int) -> str:
    return f"copy{i}"


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
    """``out[i] (+)= a[i] @ b_j[k0:k0+kc, :]`` for every i, as ONE GEMM launch.

    With several blocks they must be the same shape and equally spaced in rows in the same
    buffer (one strided-batched GEMM); otherwise a schedule emits a :class:`Gather` first."""

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
class Gather:
    """Local compute-engine move: stack ``srcs`` by rows into ``dst`` (a stage block)."""

    queue: str
    srcs: tuple[Block, ...]
    dst: Block
    step: int = 0
    kind = "gather"


@dataclass(frozen=True)
class Scatter:
    """Local compute-engine move: split ``src`` by rows into ``dsts``."""

    queue: str
    src: Block
    dsts: tuple[Block, ...]
    step: int = 0
    kind = "scatter"


@dataclass(frozen=True)
class AllGather:
    """Collective over the process group: ``dsts[p] <- src of rank p`` for every rank p."""

    queue: str
    src: Block
    dsts: tuple[Block, ...]
    step: int = 0
    kind = "all_gather"


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
    ``channel`` numbers the barriers of one plan (0, 1, …) so a late peer is named exactly."""

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


Op = Union[Copy, Gemm, Gather, Scatter, AllGather, SendRecv, Barrier, Record, Wait]
WORK_OPS = (Copy, Gemm, Gather, Scatter, AllGather, SendRecv, Barrier)


@dataclass(frozen=True)
class Plan:
    """What one rank does for one call. Plain data: compare, hash, print, simulate."""

    schedule: str
    transport: str
    problem: Problem
    queues: tuple[str, ...]
    ops: tuple[Op, ...]
    stages: tuple[tuple[int, int], ...] = ()
    num_events: int = 0

    def steps(self) -> int:
        return 1 + max((getattr(op, "step", 0) for op in self.ops), default=0)

    def count(self) -> Counter:
        """How many ops of each kind the plan holds, e.g. ``{'copy_1d': 56, 'gemm': 8}``."""
        return Counter(op.kind for op in self.ops if isinstance(op, WORK_OPS))

    def count_by_step(self) -> dict[int, Counter]:
        out: dict[int, Counter] = {}
        for op in self.ops:
            if isinstance(op, WORK_OPS):
                out.setdefault(op.step, Counter())[op.kind] += 1
        return out

    def describe(self) -> str:
        """A short human summary: one line per step with its op counts."""
        lines = [f"{self.schedule} over {self.transport}: {dict(self.count())}"]
        for step, counts in sorted(self.count_by_step().items()):
            lines.append(f"  step {step}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
        return "\n".join(lines)


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
    _stages: list = field(default_factory=list)

    def add(self, op: Op, after=()) -> int:
        if not isinstance(op, WORK_OPS):
            raise InvalidArgumentError(f"PlanBuilder.add takes work ops, not {type(op).__name__}")
        deps = tuple(sorted({h for h in after if h is not None}))
        if any(not 0 <= h < len(self._ops) for h in deps):
            raise InvalidArgumentError(f"dependency handles {deps} must name earlier ops")
        self._ops.append(op)
        self._deps.append(deps)
        return len(self._ops) - 1

    def stage(self, rows: int, cols: int) -> int:
        """Declare a scratch buffer of the plan's dtype; returns its index."""
        self._stages.append((rows, cols))
        return len(self._stages) - 1

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
        for i, op in enumerate(self._ops):
            seen = waited.setdefault(op.queue, set())
            for d in self._deps[i]:
                if queue_of[d] != queue_of[i] and d not in seen:
                    seen.add(d)
                    ops.append(Wait(op.queue, event_of[d]))
            ops.append(op)
            if i in event_of:
                ops.append(Record(op.queue, event_of[i]))
        queues = tuple(dict.fromkeys([COMPUTE] + queue_of))
        return Plan(self.schedule, self.transport, self.problem, queues, tuple(ops),
                    tuple(self._stages), len(event_of))
