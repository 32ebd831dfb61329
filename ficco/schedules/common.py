"""Pieces every schedule shares: the argument check, the pull order, the plan-barrier rule,
the ``avg`` factor; and the all-gather's publish/barrier prologue, closing barrier and block
constructors. Schedules build Plans only from these and :mod:`ficco.plan`."""
from __future__ import annotations

from typing import Protocol

from ..config import TRANSPORTS
from ..errors import InvalidArgumentError
from ..plan import (
    COMM,
    COMPUTE,
    AllGather,
    Barrier,
    Block,
    Copy,
    Gemm,
    Plan,
    PlanBuilder,
    copy_queue,
)
from ..plan.problem import Problem


class Schedule(Protocol):
    """What a registry holds: a frozen dataclass with a ``name`` whose ``plan`` gives one
    rank's :class:`~ficco.plan.Plan` (of a Problem, or of an expert op's problem)."""

    @property
    def name(self) -> str: ...

    def plan(self, problem, transport: str = "dma", copy_engines: int | None = None) -> Plan: ...


class OptionalSchedule(Schedule, Protocol):
    """A schedule that needs an optional extra (Triton's gated GEMM, the one-kernel all-reduce,
    torch's symmetric-memory kernels): it says where it runs."""

    #: its kernel multiplies plain operands only (no fp8 scales, out_dtype, bias, activation)
    plain_operands_only: bool

    def unavailable_reason(self, target: str, transport: str = "dma") -> str | None:
        """None when it can run on backend ``target`` over ``transport``."""

    def selectable_reason(self, target: str, transport: str = "dma") -> str | None:
        """Why selectors must not pick it there (None: they may)."""


def check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise InvalidArgumentError(
            f"transport must be one of {TRANSPORTS}; got {transport!r}")


def check_plan_args(op: str, problem, transport: str, copy_engines: int | None) -> None:
    """What every schedule's ``plan`` checks first: a known transport, a problem of the op the
    schedule belongs to (``op``), and a copy-engine count of at least one (None: one per
    peer)."""
    check_transport(transport)
    got = getattr(problem, "op", None)
    if got != op:
        raise InvalidArgumentError(
            f"a {op} schedule needs a problem with op={op!r}; got op={got!r} "
            f"(use ficco.schedules.get(name, op=problem.op))")
    if copy_engines is not None and copy_engines < 1:
        raise InvalidArgumentError(
            f"copy_engines must be >= 1 or None (one per peer); got {copy_engines}")


def pull_order(p) -> list[int]:
    """Remote ranks in pull order r+1, r+2, …: at any moment the ranks read different peers,
    so no rank's memory is read by everyone at once (``p``: any op's problem)."""
    return [(p.rank + i) % p.world for i in range(1, p.world)]


def avg_scale(p) -> float | None:
    """The factor ``reduce_op="avg"`` applies once to each output element (None for ``sum``)."""
    return 1.0 / p.world if p.reduce_op == "avg" and p.world > 1 else None


def barrier(builder: PlanBuilder, step: int, after=()) -> int:
    """The next plan barrier, on copy0 (all of a plan's barriers: one order on every rank);
    channels alternate 0, 1, … (:mod:`ficco.symm_mem.barrier`)."""
    return builder.add(Barrier(copy_queue(0), channel=builder.barriers() % 2, step=step),
                       after=after)


def pad_barriers(builder: PlanBuilder, total: int) -> None:
    """Plan barriers alternate channels 0, 1, … and must end on 1 (the flag protocol of
    :mod:`ficco.symm_mem.barrier`): with an odd ``total`` put one extra barrier first, on
    copy0, where it waits beside the first GEMM and costs no time on the critical path."""
    if total % 2:
        barrier(builder, step=0)


def shard_rows(p: Problem, peer: int, row0: int = 0, rows: int | None = None, *,
               col0: int = 0, cols: int | None = None, remote: bool = False) -> Block:
    """Rows ``[row0, row0+rows)`` of ``peer``'s shard in the gathered buffer; ``remote`` names
    the peer's own symmetric copy (the source of a pull) instead of this rank's."""
    rows = p.m - row0 if rows is None else rows
    cols = p.k - col0 if cols is None else cols
    return Block("gathered", p.shard_row0(peer) + row0, rows, col0, cols,
                 peer=peer if remote else None)


def out_rows(p: Problem, j: int, row0: int, rows: int) -> Block:
    return Block("out", row0, rows, 0, p.ns[j], index=j)


def publish(builder: PlanBuilder, transport: str) -> int:
    """Put the local shard in place in the gathered buffer; with ``dma`` every rank then
    waits for all peers to have published (barrier channel 0). Returns the handle copies and
    collectives wait on."""
    p = builder.problem
    h = builder.add(Copy(COMPUTE, Block("input", 0, p.m, 0, p.k), shard_rows(p, p.rank)))
    if transport == "dma" and p.world > 1:
        h = builder.add(Barrier(COMPUTE, channel=0), after=[h])
    return h


def pull(builder: PlanBuilder, queue_index: int, peer: int, row0: int, rows: int, *, col0: int = 0,
         cols: int | None = None, step: int = 0, after=()) -> int | None:
    """DMA-pull a rectangle of ``peer``'s shard into the same place of this rank's buffer.
    Empty rectangles are skipped (returns None)."""
    p = builder.problem
    cols = p.k - col0 if cols is None else cols
    if rows == 0 or cols == 0:
        return None
    src = shard_rows(p, peer, row0, rows, col0=col0, cols=cols, remote=True)
    dst = shard_rows(p, peer, row0, rows, col0=col0, cols=cols)
    return builder.add(Copy(copy_queue(queue_index), src, dst, two_d=cols != p.k, step=step),
                 after=after)


def all_gather_rows(builder: PlanBuilder, row0: int, rows: int, *, col0: int = 0,
                    cols: int | None = None, step: int = 0, after=()) -> int | None:
    """``ccl``: one all-gather of the same rectangle of every rank's shard, landing in place."""
    p = builder.problem
    cols = p.k - col0 if cols is None else cols
    if rows == 0 or cols == 0:
        return None
    src = shard_rows(p, p.rank, row0, rows, col0=col0, cols=cols)
    dsts = tuple(shard_rows(p, q, row0, rows, col0=col0, cols=cols) for q in range(p.world))
    return builder.add(AllGather(COMM, src, dsts, step=step), after=after)


def gemm_rows(builder: PlanBuilder, row0: int, rows: int, *, step: int = 0, after=()) -> list[int]:
    """One GEMM per ``b_j`` over gathered rows ``[row0, row0+rows)`` written in place."""
    p = builder.problem
    if rows == 0:
        return []
    a = Block("gathered", row0, rows, 0, p.k)
    return [builder.add(Gemm(COMPUTE, (a,), (out_rows(p, j, row0, rows),), j, 0, p.k, step=step),
                  after=after)
            for j in range(len(p.ns))]


def close(builder: PlanBuilder, transport: str, copies: list[int | None]) -> None:
    """With ``dma``: once this rank's pulls are done, tell peers they may reuse their buffers
    (barrier channel 1, on the first copy queue so compute never waits for it)."""
    if transport == "dma" and builder.problem.world > 1:
        builder.add(Barrier(copy_queue(0), channel=1, step=builder.problem.world),
              after=[h for h in copies if h is not None])


def publish_on_copy_engine(builder: PlanBuilder) -> tuple[int, int]:
    """``dma`` prologue that leaves the compute queue free: the local shard is copied into
    place on copy0 and the cross-rank barrier (channel 0) waits there too, so a GEMM that
    reads the caller's ``input`` can start at once. Returns ``(published, ready)``: the
    handle a GEMM reading this rank's rows of ``gathered`` waits on, and the one pulls wait
    on.

    >>> published, ready = publish_on_copy_engine(builder)   # doctest: +SKIP
    """
    p = builder.problem
    published = builder.add(Copy(copy_queue(0), Block("input", 0, p.m, 0, p.k),
                           shard_rows(p, p.rank)))
    ready = builder.add(Barrier(copy_queue(0), channel=0), after=[published])
    return published, ready


def coalesce(blocks: list[Block]) -> list[Block]:
    """Merge blocks that follow each other row-wise with the same columns into one."""
    merged: list[Block] = []
    for blk in blocks:
        last = merged[-1] if merged else None
        if (last is not None and (last.buf, last.peer, last.index, last.col0, last.cols)
                == (blk.buf, blk.peer, blk.index, blk.col0, blk.cols)
                and last.row0 + last.rows == blk.row0):
            merged[-1] = Block(last.buf, last.row0, last.rows + blk.rows, last.col0,
                               last.cols, last.peer, last.index)
        else:
            merged.append(blk)
    return merged
