"""The FiCCO family for ``matmul_reduce_scatter``: ``{uniform|hetero}-{fused|unfused}-{1d|2d}``,
the all-gather family (paper §V, Fig. 11a) run backwards.

Each destination block (the rows rank d receives) is cut one level finer into W chunks: by
rows (``1d``, ``even_split(R_d, W)``) or by output columns (``2d``, ``Problem.col_chunks(n_j)``:
strided 2-D copies). Step c computes chunk c of every destination block, then every rank
pulls chunk c of its own block from all W-1 peers at once, one copy per peer on its own copy
queue (all links busy), while step c+1 computes; ``ccl`` moves a step with one all-to-all.
DMA engines cannot add: the partials are summed on the compute queue by ``Reduce`` ops::

    for c      : G(chunk c of every destination)          partial (own: see below)
                 dma: barrier c (all ranks computed c); for q != r: recv[q][c] <- peer q
    reduce     : R(c): out[c] = own[c] + sum_q recv[q][c]  one op per chunk, a step later
    close      : barrier after the last pull (peers may overwrite their partials)

Variants (``G`` = one GEMM launch per ``b_j``; "own" = this rank's block, which never travels):

    uniform-fused-1d    for c: G(chunk c of all W blocks)   one strided-batched GEMM (two when
                                                             W does not divide the rows: one
                                                             per run of equal blocks); own
                                                             chunk in partial, R sums W
    uniform-unfused-1d  for c: for d: G(chunk c of block d) own chunk straight into out; R adds
                                                             the W-1 received
    hetero-fused-1d     for c: G(chunk c of the peers' blocks) (a run below r, a run above r);
                        then G(own block) LAST
    hetero-unfused-1d   for c: for d != r: G(chunk c of block d); then G(own block) last
    *-2d                the same over output column chunks: a fused step is one plain GEMM of
                        all rows (uniform) or of the rows below and above the own block

Why ``hetero`` computes the own block last, not first as in the all-gather: there the exposed
transfer is the first chunk (nothing to multiply yet) and the local shard fills it; here it is
the last chunk (nothing left to multiply while it travels) and the own block, which needs no
transfer, fills that. Computed first it would overlap nothing, and hetero would equal uniform
with a worse first step. Timelines for W = 4 (``cN``: the three pulls of chunk N; ``Rn``: the
reduction of chunk n)::

    uniform-*   copy0..2 |     |b|c0 |b|c1 |b|c2 |b|c3 |b|
                compute  |G0|G1|R0|G2|R1|G3|R2|      |R3|          R3 exposed
    hetero-*    copy0..2 |     |b|c0 |b|c1 |b|c2 |b|c3 |b|
                compute  |G0|G1|R0|G2|R1|G3|R2|== own ==|R3|       own hides c3

In ``hetero`` with per-step reductions the own block is two GEMMs: the rows (1d) or columns
(2d) of the chunks already reduced accumulate onto them, the last chunk's are written fresh
and its reduction (``R3``) adds the received partials last. ``avg`` scales in the last Reduce
of each element (one more scaling pass over the chunks an own GEMM finished, hetero only).

Reductions (``reduce_each_step``): per chunk a step after it was pulled (above), or all at
once at the end (one Reduce of the whole block, after the last pull). The registered schedules
take whichever the simulator predicts faster for them: per step for the fused 1d points, at
the end for the unfused and 2d points (docs/reduce_scatter.md has the numbers).

Coinciding variants: W = 1: all are one GEMM per b into out. W = 2: hetero-fused-Xd and
hetero-unfused-Xd hold the same ops (one peer block per step). 2d with one destination run
(uniform) is one plain GEMM per step in fused form. Empty chunks (a block of fewer than W rows
in 1d, n_j < W in 2d) are skipped; a step no rank has work in is dropped on every rank, so
all ranks meet the same barriers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ....plan import COMPUTE, Block, Gemm, Plan, PlanBuilder
from ....plan.problem import Problem
from ....schedules.common import barrier, coalesce, pad_barriers, pull_order
from . import common


@dataclass(frozen=True)
class Ficco:
    """One FiCCO reduce-scatter schedule (see the module docstring).

    >>> from ficco.plan.problem import Problem
    >>> p = Problem(16, 8, (12,), "float32", 4, 1, op="matmul_reduce_scatter")
    >>> dict(Ficco(uniform=True, fused=True).plan(p, "dma").count())
    {'barrier': 6, 'gemm': 4, 'copy_1d': 12, 'reduce': 4}
    """

    uniform: bool = True
    fused: bool = True
    two_d: bool = False
    reduce_each_step: bool = True
    op = "matmul_reduce_scatter"

    @property
    def name(self) -> str:
        return "-".join(["uniform" if self.uniform else "hetero",
                         "fused" if self.fused else "unfused", "2d" if self.two_d else "1d"])

    def plan(self, problem: Problem, transport: str = "dma",
             copy_engines: int | None = None) -> Plan:
        builder, whole = common.begin(self.name, problem, transport, copy_engines)
        if not whole:
            _Planner(self, builder, transport, copy_engines or problem.world - 1).run()
        return builder.build()


@dataclass
class _Planner:
    schedule: Ficco
    builder: PlanBuilder
    transport: str
    engines: int
    copies: dict = field(default_factory=dict)     # copy queue -> its latest pull
    pending: list = field(default_factory=list)    # (step, j, piece, handles) not yet reduced

    @property
    def own_in_partial(self) -> bool:
        # uniform-fused: one strided GEMM covers every block, the own one included.
        return self.schedule.uniform and self.schedule.fused

    def chunk(self, dest: int, c: int, j: int):
        return common.chunk(self.builder.problem, dest, c, j, self.schedule.two_d)

    def run(self) -> None:
        p, s = self.builder.problem, self.schedule
        steps = [c for c in range(p.world)
                 if any(self.chunk(d, c, j) for d in range(p.world) for j in range(len(p.ns)))]
        if not steps:
            return
        if self.transport == "dma":
            pad_barriers(self.builder, len(steps) + 1)
        last_mine = {j: max((c for c in steps if self.chunk(p.rank, c, j)), default=None)
                     for j in range(len(p.ns))}
        # The host enqueues in plan order: step c+1's GEMMs go before step c's copies, so the
        # compute queue never waits behind the host issuing W-1 copies (eager launch cost).
        gemms = self.compute(steps[0])
        for i, c in enumerate(steps):
            ahead = self.compute(steps[i + 1]) if i + 1 < len(steps) else []
            self.move(c, gemms)
            gemms = ahead
            if s.reduce_each_step:
                # Reduce what was pulled a step ago; hetero keeps each b's last chunk for
                # after the own block.
                for item in [i for i in self.pending if i[0] < c
                             and (s.uniform or i[0] != last_mine[i[1]])]:
                    self.reduce_item(item)
        if s.uniform:
            self.finish_uniform()
        else:
            self.finish_hetero(len(steps), last_mine)
        common.close(self.builder, self.transport, self.copies)

    # -- compute ------------------------------------------------------------------------------
    def compute(self, c: int) -> list[int]:
        p, s = self.builder.problem, self.schedule
        dests = [p.rank] + pull_order(p) if s.uniform else pull_order(p)
        handles = []
        for j in range(len(p.ns)):
            pieces = {d: piece for d in dests if (piece := self.chunk(d, c, j))}
            if not s.fused:
                groups = [[d] for d in pieces]
            elif s.two_d:   # rows of consecutive blocks are contiguous: one plain GEMM a run
                groups = _consecutive(list(pieces))
            else:
                groups = common.blocks_by_runs(p, list(pieces), lambda d: pieces[d])
            for group in groups:
                a = coalesce([common.a_rows(p, d, pieces[d]) for d in group])
                outs = coalesce([self.target(j, d, pieces[d]) for d in group])
                handles.append(self.builder.add(Gemm(COMPUTE, tuple(a), tuple(outs), j, 0, p.k,
                                                     step=c)))
        return handles

    def target(self, j: int, dest: int, piece) -> Block:
        p = self.builder.problem
        if dest == p.rank and not self.own_in_partial:
            return common.out(p, j, piece)
        return common.partial(p, j, dest, piece)

    # -- communication ------------------------------------------------------------------------
    def move(self, c: int, gemms: list[int]) -> None:
        p = self.builder.problem
        if self.transport == "dma":
            ready = barrier(self.builder, step=c, after=gemms)
        for j in range(len(p.ns)):
            mine = self.chunk(p.rank, c, j)
            if self.transport == "ccl":
                pieces = {d: self.chunk(d, c, j) for d in range(p.world)}
                if not any(pieces.values()):
                    continue
                handles = [common.all_to_all(self.builder, j, pieces, step=c, after=gemms)]
            else:
                handles = []
                for lane, q in enumerate(pull_order(p)):
                    if mine:
                        h = common.pull(self.builder, lane % self.engines, q, j, mine, step=c,
                                        after=[ready])
                        self.copies[lane % self.engines] = h
                        handles.append(h)
            if mine:
                self.pending.append((c, j, mine, handles))

    # -- reductions ---------------------------------------------------------------------------
    def reduce_item(self, item, *, accumulate: bool | None = None, final: bool | None = None):
        step, j, piece, handles = item
        uniform = self.schedule.uniform
        common.reduce(self.builder, j, piece, pull_order(self.builder.problem),
                      own=self.own_in_partial,
                      accumulate=(uniform and not self.own_in_partial) if accumulate is None
                      else accumulate,
                      final=uniform if final is None else final, step=step, after=handles)
        self.pending.remove(item)

    def finish_uniform(self) -> None:
        p = self.builder.problem
        if self.schedule.reduce_each_step:
            for item in list(self.pending):
                self.reduce_item(item)
            return
        for j in range(len(p.ns)):   # one Reduce of the whole block per b
            items = [i for i in self.pending if i[1] == j]
            whole = common.whole(p, p.rank, j)
            if whole:
                common.reduce(self.builder, j, whole, pull_order(p), own=self.own_in_partial,
                              accumulate=not self.own_in_partial, final=True, step=p.world,
                              after=[h for i in items for h in i[3]])
            for item in items:
                self.pending.remove(item)

    def finish_hetero(self, step: int, last_mine: dict) -> None:
        p, builder = self.builder.problem, self.builder
        if not self.schedule.reduce_each_step:
            common.own_gemms(builder, False, step)
            for j in range(len(p.ns)):
                items = [i for i in self.pending if i[1] == j]
                whole = common.whole(p, p.rank, j)
                if whole:
                    common.reduce(builder, j, whole, pull_order(p), own=False,
                                  accumulate=True, final=True, step=step,
                                  after=[h for i in items for h in i[3]])
            self.pending.clear()
            return
        for j in range(len(p.ns)):
            if last_mine[j] is None:
                continue
            last = next(i for i in self.pending if i[1] == j)   # only the last is left
            r0, rows, c0, cols = last[2]
            # The chunks before the last one were reduced already: the own GEMM adds onto them.
            done = (0, r0, 0, cols) if not self.schedule.two_d else (0, rows, 0, c0)
            for piece, accumulate in ((done, True), (last[2], False)):
                if piece[1] and piece[3]:
                    builder.add(Gemm(COMPUTE, (common.a_rows(p, p.rank, piece),),
                                     (common.out(p, j, piece),), j, 0, p.k, accumulate, step))
            self.reduce_item(last, accumulate=True, final=True)
            if done[1] and done[3]:
                common.rescale(builder, j, done, step)


def _consecutive(dests: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for d in sorted(dests):
        if runs and runs[-1][-1] + 1 == d:
            runs[-1].append(d)
        else:
            runs.append([d])
    return runs
