"""Schedules of the two expert-parallel ops: ``serial``, ``ring`` and the FiCCO family applied
to all-to-all, ``{uniform|hetero}-{fused|unfused}-{1d|2d}``.

Dispatch (``all_to_all_grouped_mm``) moves rows, then multiplies them; combine
(``grouped_mm_all_to_all``) multiplies, then moves the products back. Each peer's block
(its rows for one local expert) is cut one level finer into W chunks: by rows (``1d``) or by
the columns that cross the links (``2d``: dispatch's K, combine's n; strided column blocks).
Step c moves chunk c of every peer's blocks at once, one copy queue per peer (all links
busy), pulled over DMA from the peer's symmetric buffer (``dma``) or moved by one all-to-all
of the process group (``ccl``), while the grouped GEMM of the previous step's chunk runs.
Plans name work by (source rank, chunk), never by rows: the rows are the call's routing,
resolved at launch (:mod:`ficco.ops.expert.tasks`), so one plan serves every routing and an
empty block costs nothing. Dispatch, W = 4, rank 0 (``cN``: the pulls of chunk N from the
three peers; ``G``: a grouped GEMM over every local expert)::

    serial        copy0..2 |pub|b| all blocks     |b|
                  compute  |                      |======= G(all) =======|
    uniform-*     copy0..2 |pub|b|c0|c1|c2|c3|b|
                  compute  |G(own c0)|G(c0)|G(c1)|G(c2)|G(c3)|
    hetero-*      copy0..2 |pub|b|c0|c1|c2|c3|b|
                  compute  |== G(own) ==|G(c0)|G(c1)|G(c2)|G(c3)|
    ring          compute  |pub|b|== G(own) ==|peer 2 G(peer 2)|
                  copy0    |     |peer 1 G(peer 1)|peer 3 G(peer 3)|b|

``hetero`` starts with the own block (rows that never travel, read straight from x: no wait);
``uniform`` puts the own chunk c into step c. ``fused``: one grouped GEMM per step over every
peer's chunk; ``unfused``: one per peer, started as soon as that peer's rows landed. ``2d``
dispatch multiplies K columns c of every block by rows c of its expert's weight and adds the
product into y (the first chunk writes; bf16/fp16 sums go to a float32 y rounded once, as the
all-gather family's 2d points do). ``ring`` (PyTorch Async-TP's pipeline, as the all-gather's
``ring``): over ``dma`` the publish and barrier 0 run on the compute queue, then the own
block's GEMM; step i pulls the whole blocks of one peer, rank r + i, and multiplies them, the
pull and its GEMM on one queue, copy0 (odd steps) and compute (even ones) taking turns, so a
pull runs beside the other queue's GEMM with no event between a pull and its GEMM (``ccl``:
an all-to-all in which each rank sends to r - i and receives from r + i only, while the GEMM
of peer r + i - 1's rows runs).

Combine runs it backwards (as ``matmul_reduce_scatter``'s family does): step c multiplies
chunk c of every block bound for a peer into the symmetric buffer (2d: output columns c, a
whole-K product: nothing to add up), a barrier says every rank did, and every rank pulls its
rows of chunk c from all peers at once while step c+1 multiplies. Its own block (rows that
stay) goes straight into z; ``hetero`` multiplies it *last*, where it hides the last chunk's
transfer (nothing else is left to overlap it then; first, it would overlap nothing: the
all-gather/reduce-scatter argument of docs/reduce_scatter.md). ``ring``: step i multiplies the
blocks bound for rank r - i, a barrier, then pulls this rank's rows from rank r + i (which
multiplied them in the same step); the own block last. No reductions: every row has one
producer.

2d column chunks are the same on every rank (K and n are agreed), so a chunk with no columns
(K or n < W) is left out of every rank's plan; 1d row chunks are data and an empty one is
skipped at launch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ....plan import COMM, COMPUTE, Barrier, Plan, PlanBuilder, copy_queue
from ....schedules.common import Schedule, barrier, check_plan_args, pad_barriers, pull_order
from ..plan_ops import Exchange, GroupedGemm, Publish, Pull
from ..problem import COMBINE, DISPATCH, check_op, chunk_of
from .by_expert import ByExpert


def _begin(schedule, problem, transport: str, copy_engines: int | None) -> PlanBuilder:
    check_plan_args(schedule.op, problem, transport, copy_engines)
    return PlanBuilder(schedule.name, transport, problem)


@dataclass(frozen=True)
class ExpertSchedule:
    """One expert-parallel schedule (see the module docstring): ``serial`` when ``chunked`` is
    False, else the FiCCO point ``{uniform|hetero}-{fused|unfused}-{1d|2d}``.

    >>> from ficco.ops.expert.problem import ExpertProblem
    >>> p = ExpertProblem(8, 4, 2, "float32", 4, rank=1)
    >>> dict(ExpertSchedule(DISPATCH).plan(p, "dma").count())
    {'expert_publish': 1, 'barrier': 2, 'expert_copy': 12, 'expert_gemm': 4}
    """

    op: str = DISPATCH
    chunked: bool = True
    uniform: bool = True
    fused: bool = True
    two_d: bool = False

    def __post_init__(self):
        check_op(self.op, type(self).__name__)

    @property
    def name(self) -> str:
        if not self.chunked:
            return "serial"
        return "-".join(["uniform" if self.uniform else "hetero",
                         "fused" if self.fused else "unfused", "2d" if self.two_d else "1d"])

    def plan(self, problem, transport: str = "dma", copy_engines: int | None = None) -> Plan:
        builder = _begin(self, problem, transport, copy_engines)
        p = problem
        if p.world == 1:
            builder.add(GroupedGemm(COMPUTE, (0,), None))
        elif self.op == DISPATCH:
            self._dispatch(builder, transport, copy_engines or p.world - 1)
        else:
            self._combine(builder, transport, copy_engines or p.world - 1)
        return builder.build()

    def _steps(self, problem) -> list:
        """The chunks of every block, in order: one whole block (serial), W row chunks
        (1d), or the column chunks that have columns (2d)."""
        if not self.chunked:
            return [None]
        if self.two_d:
            return [c for c in range(problem.world)
                    if chunk_of(problem.moved_cols, problem.world, c)[1]]
        return list(range(problem.world))

    # -- dispatch: move, then multiply ---------------------------------------------------------
    def _dispatch(self, builder: PlanBuilder, transport: str, engines: int) -> None:
        p, two_d = builder.problem, self.two_d
        r, peers = p.rank, pull_order(p)
        steps = self._steps(p)
        own_first = self.chunked and not self.uniform
        if own_first:
            builder.add(GroupedGemm(COMPUTE, (r,), None))
        if transport == "dma":
            published = builder.add(Publish(copy_queue(0)))
            ready = barrier(builder, step=0, after=[published])
        last: dict = {}
        every: list[int] = []
        for c in steps:
            landed = {}
            if transport == "ccl":
                moved = builder.add(Exchange(COMM, c, step=_n(c), two_d=two_d))
                landed = {q: moved for q in peers}
            else:
                for lane, q in enumerate(peers):
                    landed[q] = last[lane % engines] = builder.add(
                        Pull(copy_queue(lane % engines), q, c, step=_n(c), two_d=two_d),
                        after=[ready])
            every += list(landed.values())
            mine = () if own_first else (r,)
            # 2d: every chunk after the first adds its partial products (the own block of
            # hetero was written whole, before the first chunk)
            gemm = functools.partial(GroupedGemm, COMPUTE, step=_n(c), two_d=two_d,
                                     accumulate=two_d and c != steps[0])
            if not self.chunked:           # serial: everything landed, then one GEMM
                builder.add(GroupedGemm(COMPUTE, tuple(sorted((r, *peers))), None),
                            after=every)
            elif self.fused:
                builder.add(gemm(tuple(sorted((*mine, *peers))), c), after=list(landed.values()))
            else:
                if mine:
                    builder.add(gemm(mine, c))
                for q in peers:
                    builder.add(gemm((q,), c), after=[landed[q]])
        if transport == "dma":
            barrier(builder, step=p.world + 1, after=list(last.values()))

    # -- combine: multiply, then move back ------------------------------------------------------
    def _combine(self, builder: PlanBuilder, transport: str, engines: int) -> None:
        p, two_d = builder.problem, self.two_d
        r, peers = p.rank, pull_order(p)
        steps = self._steps(p)
        own_last = self.chunked and not self.uniform
        if transport == "dma":
            pad_barriers(builder, len(steps) + 1)
        last: dict = {}
        for c in steps:
            mine = () if own_last else (r,)
            if self.fused or not self.chunked:
                gemms = [builder.add(GroupedGemm(COMPUTE, tuple(sorted((*mine, *peers))), c,
                                                 step=_n(c), two_d=two_d))]
            else:
                gemms = [builder.add(GroupedGemm(COMPUTE, (q,), c, step=_n(c), two_d=two_d))
                         for q in (*peers, *mine)]
            if transport == "ccl":
                builder.add(Exchange(COMM, c, step=_n(c), two_d=two_d), after=gemms)
                continue
            ready = barrier(builder, step=_n(c), after=gemms)
            for lane, q in enumerate(peers):
                last[lane % engines] = builder.add(
                    Pull(copy_queue(lane % engines), q, c, step=_n(c), two_d=two_d),
                    after=[ready])
        if own_last:
            builder.add(GroupedGemm(COMPUTE, (r,), None, step=p.world))
        if transport == "dma":
            barrier(builder, step=p.world + 1, after=list(last.values()))


@dataclass(frozen=True)
class ExpertRing:
    """``ring``: one peer's whole blocks per step (see the module docstring: dispatch pulls and
    multiplies each on copy0 and compute in turn, combine pulls on copy0); the own block first
    (dispatch) or last (combine).

    >>> from ficco.ops.expert.problem import ExpertProblem
    >>> p = ExpertProblem(8, 4, 2, "float32", 4, rank=1)
    >>> dict(ExpertRing(DISPATCH).plan(p, "dma").count())
    {'expert_publish': 1, 'barrier': 2, 'expert_gemm': 4, 'expert_copy': 3}
    """

    op: str = DISPATCH
    name = "ring"

    def __post_init__(self):
        check_op(self.op, type(self).__name__)

    def plan(self, problem, transport: str = "dma", copy_engines: int | None = None) -> Plan:
        builder = _begin(self, problem, transport, copy_engines)
        p = problem
        r, world = p.rank, p.world
        if world == 1:
            builder.add(GroupedGemm(COMPUTE, (0,), None))
            return builder.build()
        last = None
        if self.op == DISPATCH:
            if transport == "dma":
                ready = builder.add(Barrier(COMPUTE, channel=0, step=0),
                                    after=[builder.add(Publish(COMPUTE))])
            builder.add(GroupedGemm(COMPUTE, (r,), None))
            pulls = []
            for i in range(1, world):
                q = (r + i) % world
                queue = COMPUTE
                if transport == "ccl":
                    landed = builder.add(Exchange(COMM, None, step=i, shift=i))
                else:
                    queue = copy_queue(0) if i % 2 else COMPUTE
                    landed = builder.add(Pull(queue, q, None, step=i), after=[ready])
                    pulls.append(landed)
                builder.add(GroupedGemm(queue, (q,), None, step=i), after=[landed])
            if transport == "dma":
                barrier(builder, step=world + 1, after=pulls)
            return builder.build()
        else:
            if transport == "dma":
                pad_barriers(builder, world)
            for i in range(1, world):
                made = builder.add(GroupedGemm(COMPUTE, ((r - i) % world,), None, step=i))
                if transport == "ccl":
                    builder.add(Exchange(COMM, None, step=i, shift=i), after=[made])
                    continue
                ready = barrier(builder, step=i, after=[made])
                last = builder.add(Pull(copy_queue(0), (r + i) % world, None, step=i),
                                   after=[ready])
            builder.add(GroupedGemm(COMPUTE, (r,), None, step=world))
        if transport == "dma":
            barrier(builder, step=world + 1, after=[last])
        return builder.build()


def _n(chunk: int | None) -> int:
    return 0 if chunk is None else chunk


def schedules_of(op: str) -> tuple[Schedule, ...]:
    """The registered schedules of ``op``: ``serial``, ``ring``, the eight FiCCO points (the
    all-gather registry's order), then ``by-expert`` (:mod:`ficco.ops.expert.schedules.by_expert`: every
    GEMM whole, one expert at a time)."""
    return (ExpertSchedule(op, chunked=False), ExpertRing(op),
            *(ExpertSchedule(op, True, u, f, t) for t in (False, True) for u in (True, False)
              for f in (True, False)), ByExpert(op))


SCHEDULES = {op: schedules_of(op) for op in (DISPATCH, COMBINE)}
__all__ = ["SCHEDULES", "ExpertRing", "ExpertSchedule", "schedules_of"]
