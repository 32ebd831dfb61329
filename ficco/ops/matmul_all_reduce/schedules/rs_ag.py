"""``rs-ag-<reduce-scatter schedule>``: the all-reduce as a reduce-scatter overlapped with the
GEMM (any of ``matmul_reduce_scatter``'s schedules, run as they are) and an all-gather of the
reduced blocks pipelined behind it.

The reduce-scatter schedule's own plan for this rank is replayed into this plan, its ``out``
(this rank's block) landing in this rank's rows of ``reduced`` instead (symmetric with
``dma``). The all-gather moves each block one level finer, by the 1d chunks of the
reduce-scatter (``even_split(R_d, W)[c]`` of every block d): chunk c of every peer's block is
pulled as soon as every rank has written chunk c of its own for the last time. For the
``uniform-fused-1d`` reduce-scatter that is chunk c's reduction, a step after it was pulled, so
the all-gather of chunk c runs beside the GEMMs of later steps (W = 4; ``Ac``: the pulls of
chunk c of the three peers' reduced blocks)::

    copy0..   |     |b|c0 |b|c1 |a|A0 |b|c2 |a|A1 |b|c3 |b|  |a|A2 |a|A3 |b|
    compute   |G0|G1|G2 |R0|G3   |R1|       |R2|     |R3|

Schedules that finish their block at the end (``ring``, which adds each partial as it lands)
gather it whole once the reduce-scatter is done.

Where the all-gather's barriers go must be the same on every rank, and a rank's own last
write of a chunk must come before it: each chunk's barrier is put before the first
reduce-scatter barrier (``ccl``: collective) that follows the chunk's last write in rank 0's
plan (rank 0 holds the largest block, so every chunk that exists anywhere exists there), and a
rank checks that its own last write lies before that point too.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ....errors import InvalidArgumentError
from ....plan import (
    COMM,
    AllToAll,
    Barrier,
    Block,
    Copy,
    Plan,
    PlanBuilder,
    Record,
    Wait,
    copy_queue,
)
from ....plan.problem import Problem, even_split
from ....schedules.common import barrier, pad_barriers, pull_order
from ...matmul_reduce_scatter import schedules as reduce_scatter
from . import common

#: the reduce-scatter schedules registered as ``rs-ag-*``: the one that pipelines (its blocks
#: finish chunk by chunk) and the one that needs no more than one peer link at a time
REGISTERED = ("uniform-fused-1d", "ring")
_WRITES = ("out", "dst", "dsts", "recv")   # fields whose blocks an op writes
_BLOCK_FIELDS = ("src", "dst", "a", "out", "srcs", "dsts", "send", "recv")


@dataclass(frozen=True)
class RsAg:
    reduce_scatter: str = "uniform-fused-1d"
    op = "matmul_all_reduce"

    @property
    def name(self) -> str:
        return f"rs-ag-{self.reduce_scatter}"

    def plan(self, problem: Problem, transport: str = "dma",
             copy_engines: int | None = None) -> Plan:
        builder, whole = common.begin(self.name, problem, transport, copy_engines)
        if whole:
            return builder.build()
        schedule = _rs_schedule(self.reduce_scatter)
        rs = dataclasses.replace(problem, op="matmul_reduce_scatter")
        mine = schedule.plan(rs, transport, copy_engines)
        lead = mine if problem.rank == 0 else \
            schedule.plan(dataclasses.replace(rs, rank=0), transport, copy_engines)
        groups = _groups(lead, problem)
        if transport == "dma":
            # the reduce-scatter's barriers (an even count), one per group, the closing one
            pad_barriers(builder, len(groups) + 1)
        _Replay(builder, mine, groups, copy_engines or problem.world - 1).run()
        # The reduced rows travel in the outputs' dtype, float32 where the reduce-scatter adds
        # partial sums in place: rank 0's plan says so for every rank (a rank without rows has
        # no reductions to say it).
        return dataclasses.replace(builder.build(), wide=lead.wide_outputs())


def _rs_schedule(name: str):
    schedule = {s.name: s for s in reduce_scatter.SCHEDULES}.get(name)
    if schedule is None:
        raise InvalidArgumentError(
            f"rs-ag-{name}: {name!r} is not a matmul_reduce_scatter schedule; use one of "
            f"{', '.join(s.name for s in reduce_scatter.SCHEDULES)}")
    return schedule


def chunk(p: Problem, dest: int, c: int) -> tuple[int, int]:
    """(first row, rows) of chunk ``c`` of ``dest``'s block, in the M rows."""
    row0, rows = p.block(dest)
    start, length = even_split(rows, p.world)[c]
    return row0 + start, length


def _is_fence(op, transport: str) -> bool:
    """The ops every rank meets in one order: barriers (dma), collectives (ccl)."""
    return isinstance(op, Barrier) if transport == "dma" else op.queue == COMM


def _last_writes(plan: Plan, p: Problem) -> dict[int, int]:
    """Chunk -> index in ``plan`` of the last op that writes rows of it in ``out`` (this
    plan's rank's block, block-relative rows)."""
    r = plan.problem.rank
    last: dict[int, int] = {}
    for i, op in enumerate(plan.ops):
        for name in _WRITES:
            value = getattr(op, name, None)
            for blk in value if isinstance(value, tuple) else (value,):
                if not isinstance(blk, Block) or blk.buf != "out":
                    continue
                for c in range(p.world):
                    start, length = chunk(p, r, c)
                    start -= p.block(r)[0]
                    if length and blk.row0 < start + length and start < blk.row0 + blk.rows:
                        last[c] = i
    return last


def _groups(lead: Plan, p: Problem) -> list[tuple[int, list[int]]]:
    """(fence number, chunks) per all-gather group, in plan order: the chunks whose last
    write in ``lead`` (rank 0's plan) precedes the same fence go together, before it (the
    number of fences: at the end)."""
    fences = [i for i, op in enumerate(lead.ops) if _is_fence(op, lead.transport)]
    at: dict[int, list[int]] = {}
    for c, i in sorted(_last_writes(lead, p).items()):
        at.setdefault(sum(f < i for f in fences), []).append(c)
    return sorted(at.items())


def _runs(chunks: list[int]) -> list[list[int]]:
    """Consecutive chunk numbers, together: each run is one contiguous range of rows."""
    runs: list[list[int]] = []
    for c in chunks:
        if runs and runs[-1][-1] + 1 == c:
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs


class _Replay:
    """The reduce-scatter plan's ops added to ``builder`` in order (its events turned back into
    dependencies, its barriers renumbered, its ``out`` moved into ``reduced``), with the
    all-gather groups inserted before their fences."""

    def __init__(self, builder: PlanBuilder, rs_plan: Plan, groups, engines: int):
        self.builder, self.rs, self.groups, self.engines = builder, rs_plan, groups, engines
        self.p = builder.problem
        self.handle: dict[int, int] = {}     # rs op index -> handle
        self.reads: list[int] = []           # this rank's reads of peers' memory
        self.last = _last_writes(rs_plan, self.p)

    def run(self) -> None:
        b, transport = self.builder, self.rs.transport
        recorded: dict[int, int] = {}        # event -> handle of the op recorded
        waits: dict[str, list[int]] = {}     # queue -> handles its next op waits for
        last_on: dict[str, int] = {}         # queue -> its latest handle
        fence, groups = 0, list(self.groups)
        for i, op in enumerate(self.rs.ops):
            if isinstance(op, Record):
                recorded[op.event] = last_on[op.queue]
                continue
            if isinstance(op, Wait):
                waits.setdefault(op.queue, []).append(recorded[op.event])
                continue
            if _is_fence(op, transport):
                while groups and groups[0][0] == fence:
                    self.gather(groups.pop(0)[1], i)
                fence += 1
            if isinstance(op, Barrier):
                op = dataclasses.replace(op, channel=b.barriers() % 2)
            h = b.add(self.moved(op), after=waits.pop(op.queue, ()))
            self.handle[i] = last_on[op.queue] = h
            if isinstance(op, Copy) and op.src.peer is not None:   # a pull from a peer
                self.reads.append(h)
        for _, chunks in groups:                 # the groups after the last fence
            self.gather(chunks, len(self.rs.ops))
        common.close(b, transport, self.reads)

    def moved(self, op):
        """``op`` with this rank's block of ``out`` moved to its rows of ``reduced``."""
        row0 = self.p.block(self.p.rank)[0]

        def move(blk):
            if isinstance(blk, Block) and blk.buf == "out":
                return dataclasses.replace(blk, buf="reduced", row0=row0 + blk.row0)
            return blk

        changes = {}
        for name in _BLOCK_FIELDS:
            value = getattr(op, name, None)
            if isinstance(value, tuple):
                changes[name] = tuple(move(blk) for blk in value)
            elif isinstance(value, Block):
                changes[name] = move(value)
        return dataclasses.replace(op, **changes) if changes else op

    def gather(self, chunks: list[int], before: int) -> None:
        """The all-gather of ``chunks`` of every block, inserted before rs op ``before``: this
        rank's last writes of them must come earlier (see the module docstring)."""
        p, b = self.p, self.builder
        written = [self.last[c] for c in chunks if c in self.last]
        if any(i >= before for i in written):
            raise InvalidArgumentError(
                f"{b.schedule}: rank {p.rank} writes chunks {chunks} of its block after the "
                f"point rank 0's plan gathers them (op {max(written)} >= {before}); the "
                f"reduce-scatter schedule's plans differ in structure across ranks")
        final = [self.handle[i] for i in written]
        step = p.world + 1
        ready = barrier(b, step, after=final) if b.transport == "dma" else None
        for run in _runs(chunks):
            span = {d: _span(p, d, run) for d in range(p.world)}
            mine = span[p.rank]
            for j in range(len(p.ns)):
                if b.transport == "ccl":
                    b.add(AllToAll(COMM, tuple(
                        common.rows(p, "reduced", j, mine) if q != p.rank and mine[1] else None
                        for q in range(p.world)), tuple(
                        common.rows(p, "out", j, span[q]) if q != p.rank and span[q][1] else None
                        for q in range(p.world)), step), after=final)
                else:
                    for lane, q in enumerate(pull_order(p)):
                        if span[q][1]:
                            self.reads.append(b.add(Copy(
                                copy_queue(lane % self.engines),
                                common.rows(p, "reduced", j, span[q], q),
                                common.rows(p, "out", j, span[q]), step=step), after=[ready]))
            common.copy_own(b, mine, engines=self.engines, loads=False, step=step, after=final)


def _span(p: Problem, dest: int, run: list[int]) -> tuple[int, int]:
    """(first row, rows) of the consecutive chunks ``run`` of ``dest``'s block."""
    first = chunk(p, dest, run[0])
    rows = sum(chunk(p, dest, c)[1] for c in run)
    return first[0], rows
