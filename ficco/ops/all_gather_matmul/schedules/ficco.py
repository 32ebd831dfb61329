"""The FiCCO schedule family (paper §V, Fig. 11a): ``{uniform|hetero}-{fused|unfused}-{1d|2d}``.

Communication is cut one level below the shard: chunk c is rows ``problem.row_chunks()[c]``
of every shard (``1d``, contiguous) or columns ``problem.col_chunks()[c]`` of every shard
(``2d``, strided: real 2-D copies, and GEMMs that accumulate over K). In step c every rank
pulls chunk c of every peer at once, one copy per peer, round-robin over the copy queues, so
all links of a full mesh are busy (``ccl``: one all-gather of chunk c instead)::

    publish  : input -> my rows of gathered   (dma: on copy0, then barrier 0 there, so the
                                               compute queue never waits; ccl: on compute)
    for c    : for each peer q: gathered[q, chunk c] <- peer q   (copy queue (q - r - 1) % E)
    compute  : per variant, below; every GEMM waits only for the transfers it reads
    close    : barrier 1 after the last pull of each copy queue    (dma only, on copy0)

Compute, per variant (``G`` = one GEMM launch per ``b_j``; ``rows(q, c)`` = chunk c of q)::

    uniform-fused-1d    for c: G(rows(q, c) for all q)      W blocks m rows apart: ONE strided-
                                                            batched GEMM, no gather/scatter
    uniform-unfused-1d  for c: for q: G(rows(q, c))         local first (reads input, no wait)
    hetero-fused-1d     G(my shard); for c: G(rows(q, c) for q != r)
    hetero-unfused-1d   G(my shard); for c: for q != r: G(rows(q, c))
    uniform-fused-2d    for c: G(all M rows, cols c)        one strided view, C (+)= A[:, c] B[c]
    uniform-unfused-2d  for c: for q: G(shard q, cols c)
    hetero-fused-2d     G(my shard, all K); for c: G(shards q != r, cols c)
    hetero-unfused-2d   G(my shard, all K); for c: for q != r: G(shard q, cols c)

"my shard" is read straight from ``input``: it needs no transfer. Timelines for W = 4
(``cN`` = the three copies of chunk N, one per copy queue; ``Gn`` = the GEMM(s) of chunk n;
``L`` = the whole local shard; with ``ccl`` the copy rows become one ``comm`` row of
all-gathers ``AG0 AG1 AG2 AG3``)::

    uniform-*   copy0..2 |pub|bar|c0 |c1 |c2 |c3 |bar|
                compute  |           |G0 |G1 |G2 |G3 |     unfused: G0's local piece at t=0
    hetero-*    copy0..2 |pub|bar|c0 |c1 |c2 |c3 |bar|
                compute  |===== L =====|G0 |G1 |G2 |G3 |   L starts at t=0, hides c0
    hetero-fused on ranks 1..W-2:   Gn = two GEMM launches, peers below r and peers above r

Gathers and scatters still needed: none. ``uniform-fused`` chunks are m rows apart (1d) or
one strided view (2d). In ``hetero-fused`` the local shard sits between the remote chunks on
ranks 1 … W-2, so their step is two in-place GEMMs (peers below r, peers above r; each run
equally spaced in 1d, contiguous in 2d) instead of one; ranks 0 and W-1 (and every rank when
W = 2) have one run. An earlier version stacked the remote chunks in a stage (a gather of
(W-1)·m·K elements and a scatter of (W-1)·m·sum(n) per middle rank); the simulator predicts
the two launches faster for most Table I shapes on MI300X and H100 (g14 1d on MI300X is the
exception: two smaller GEMMs fill fewer waves). Recomputing the local chunk instead would break
"hetero steps hold remote chunks only" and, in 2d, count the local product twice.

Coinciding variants: W = 1: all eight are one GEMM per b on the input, no copy, no barrier
(the caller's shard is the gathered matrix). W = 2: hetero-fused-Xd and hetero-unfused-Xd
hold the same ops (one peer, so every step has one remote chunk). Empty chunks (m < W, or
K < W in 2d) are skipped; with m = 0 the plan is empty.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ....plan import COMPUTE, Block, Gemm, Plan, PlanBuilder
from ....plan.problem import Problem
from ....schedules import common
from ....schedules.common import coalesce


@dataclass(frozen=True)
class Chunk:
    """Chunk ``index`` of every shard, relative to the shard's first row."""

    index: int
    row0: int
    rows: int
    col0: int
    cols: int


def chunks(problem: Problem, two_d: bool) -> list[Chunk]:
    """The non-empty chunks of one shard: row blocks (1d) or column blocks (2d).

    >>> [c.rows for c in chunks(Problem(m=5, k=8, ns=(4,), dtype="float32", world=4), False)]
    [2, 1, 1, 1]
    """
    p = problem
    if two_d:
        out = [Chunk(i, 0, p.m, k0, kc) for i, (k0, kc) in enumerate(p.col_chunks())]
    else:
        out = [Chunk(i, r0, rows, 0, p.k) for i, (r0, rows) in enumerate(p.row_chunks())]
    return [c for c in out if c.rows and c.cols]


@dataclass(frozen=True)
class Ficco:
    """One FiCCO schedule: ``uniform`` (local chunk joins every step) or hetero (local shard
    first, alone); ``fused`` (one GEMM per step) or unfused (one per received chunk);
    ``two_d`` (column chunks, accumulating GEMMs) or 1d (row chunks). See the module
    docstring for pseudo-code, timelines and the gathers/scatters each one needs.

    >>> plan = Ficco(uniform=True, fused=True, two_d=False).plan(
    ...     Problem(m=8, k=16, ns=(32,), dtype="float32", world=4, rank=1))
    >>> plan.schedule, dict(plan.count())
    ('uniform-fused-1d', {'copy_1d': 13, 'barrier': 2, 'gemm': 4})
    """

    uniform: bool = True
    fused: bool = True
    two_d: bool = False

    @property
    def name(self) -> str:
        return "-".join(["uniform" if self.uniform else "hetero",
                         "fused" if self.fused else "unfused", "2d" if self.two_d else "1d"])

    def plan(self, problem: Problem, transport: str = "dma", copy_engines: int | None = None) -> Plan:
        common.check_plan_args("all_gather_matmul", problem, transport, copy_engines)
        builder = PlanBuilder(self.name, transport, problem)
        if problem.m == 0:
            return builder.build()
        if problem.world == 1:
            _local_shard_gemms(builder, step=0)
            return builder.build()
        _Planner(self, builder, transport, copy_engines or problem.world - 1).run()
        return builder.build()


def _local_shard_gemms(builder: PlanBuilder, step: int) -> None:
    """GEMM the caller's whole shard straight from ``input``: it needs no copy at all."""
    p = builder.problem
    for j, n in enumerate(p.ns):
        builder.add(Gemm(COMPUTE, (Block("input", 0, p.m, 0, p.k),),
                   (common.out_rows(p, j, p.shard_row0(p.rank), p.m),), j, 0, p.k, step=step))


@dataclass
class _Planner:
    """Builds one FiCCO plan for W >= 2; one method per compute pattern."""

    schedule: Ficco
    builder: PlanBuilder
    transport: str
    engines: int
    ready: int | None = None                  # what every transfer waits for
    last_pull: dict = field(default_factory=dict)   # copy queue -> its latest transfer

    @property
    def peers(self) -> list[int]:
        return common.pull_order(self.builder.problem)

    def run(self) -> None:
        p, s = self.builder.problem, self.schedule
        if self.transport == "dma":
            _, self.ready = common.publish_on_copy_engine(self.builder)
        else:
            self.ready = common.publish(self.builder, self.transport)
        todo = chunks(p, s.two_d)
        self.first_index = todo[0].index
        if not s.uniform:
            _local_shard_gemms(self.builder, step=0)
        for chunk in todo:
            step = chunk.index + (0 if s.uniform else 1)
            arrived = self.move(chunk, step)
            if s.uniform and s.fused:
                self.uniform_fused(chunk, arrived, step)
            elif s.uniform:
                self.per_chunk(chunk, arrived, step, [p.rank] + self.peers)
            elif s.fused:
                self.hetero_fused(chunk, arrived, step)
            else:
                self.per_chunk(chunk, arrived, step, self.peers)
        # The closing barrier needs only the last pull of each copy queue: queues run in order.
        common.close(self.builder, self.transport, list(self.last_pull.values()))

    # -- blocks -------------------------------------------------------------------------------
    def shard_block(self, q: int, chunk: Chunk) -> Block:
        return common.shard_rows(self.builder.problem, q, chunk.row0, chunk.rows, col0=chunk.col0,
                                 cols=chunk.cols)

    def out_block(self, j: int, q: int, chunk: Chunk) -> Block:
        p = self.builder.problem
        return common.out_rows(p, j, p.shard_row0(q) + chunk.row0, chunk.rows)

    def accumulate(self, chunk: Chunk) -> bool:
        # Outputs arrive poisoned: the first K block of a row must overwrite, not add.
        return self.schedule.two_d and chunk.index != self.first_index

    # -- communication ------------------------------------------------------------------------
    def move(self, chunk: Chunk, step: int) -> dict[int, int | None]:
        """Bring chunk ``chunk`` of every peer; returns peer -> handle of the op that wrote it
        (None: an empty chunk, nothing moved; ``after=`` lists skip it)."""
        if self.transport == "ccl":
            h = common.all_gather_rows(self.builder, chunk.row0, chunk.rows, col0=chunk.col0,
                                       cols=chunk.cols, step=step, after=[self.ready])
            self.last_pull["comm"] = h
            return {q: h for q in range(self.builder.problem.world)}
        arrived: dict[int, int | None] = {}
        for lane, q in enumerate(self.peers):
            arrived[q] = common.pull(self.builder, lane % self.engines, q, chunk.row0, chunk.rows,
                                     col0=chunk.col0, cols=chunk.cols, step=step,
                                     after=[self.ready])
            self.last_pull[lane % self.engines] = arrived[q]
        return arrived

    # -- compute ------------------------------------------------------------------------------
    def gemm(self, a: list[Block], outs_by_b: list[list[Block]], chunk: Chunk, step: int,
             after) -> None:
        """One GEMM launch per ``b_j`` over the columns of ``chunk`` (all of K in 1d)."""
        for j, outs in enumerate(outs_by_b):
            self.builder.add(Gemm(COMPUTE, tuple(a), tuple(outs), j, chunk.col0, chunk.cols,
                            self.accumulate(chunk), step=step), after=after)

    def per_chunk(self, chunk: Chunk, arrived: dict, step: int, owners: list[int]) -> None:
        """Unfused: one GEMM per received chunk, in arrival order, written in place; the local
        chunk reads ``input`` so it never waits."""
        p = self.builder.problem
        for q in owners:
            if q == p.rank:
                a = Block("input", chunk.row0, chunk.rows, chunk.col0, chunk.cols)
                after = []
            else:
                a, after = self.shard_block(q, chunk), [arrived[q]]
            outs = [[self.out_block(j, q, chunk)] for j in range(len(p.ns))]
            self.gemm([a], outs, chunk, step, after)

    def uniform_fused(self, chunk: Chunk, arrived: dict, step: int) -> None:
        """Chunk c of all W shards is m rows apart in ``gathered`` and in ``out``: one
        strided-batched GEMM (2d: one strided view of all M rows)."""
        p = self.builder.problem
        owners = range(p.world)
        a = coalesce([self.shard_block(q, chunk) for q in owners])
        outs = [coalesce([self.out_block(j, q, chunk) for q in owners]) for j in range(len(p.ns))]
        # This rank's rows were published on copy0 before the chunk's first pull there, so
        # waiting for the pulls covers them too.
        self.gemm(a, outs, chunk, step, list(arrived.values()))

    def hetero_fused(self, chunk: Chunk, arrived: dict, step: int) -> None:
        """The remote chunks of a step, fused in place: one GEMM over the peers below this
        rank and one over the peers above it. Each run is equally spaced (1d: m rows apart;
        2d: one contiguous block), so no gather or scatter is needed; ranks 0 and W-1 have a
        single run."""
        p = self.builder.problem
        below = [q for q in sorted(self.peers) if q < p.rank]
        above = [q for q in sorted(self.peers) if q > p.rank]
        for run in (below, above):
            if not run:
                continue
            a = coalesce([self.shard_block(q, chunk) for q in run])
            outs = [coalesce([self.out_block(j, q, chunk) for q in run])
                    for j in range(len(p.ns))]
            self.gemm(a, outs, chunk, step, [arrived[q] for q in run])


FICCO_SCHEDULES = tuple(Ficco(u, f, t) for t in (False, True) for u in (True, False)
                        for f in (True, False))
