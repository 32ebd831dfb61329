"""Schedules of the two expert-parallel ops: ``serial`` and the FiCCO family applied to
all-to-all, ``{uniform|hetero}-{fused|unfused}-1d``.

Dispatch (``all_to_all_grouped_mm``) moves rows, then multiplies them; combine
(``grouped_mm_all_to_all``) multiplies, then moves the products back. Each peer's block
(its rows for one local expert) is cut one level finer into W row chunks. Step c moves chunk c
of every peer's blocks at once, one copy queue per peer (all links busy), pulled over DMA from
the peer's symmetric buffer (``dma``) or moved by one all-to-all of the process group
(``ccl``), while the grouped GEMM of the previous step's rows runs. Plans name work by
(source rank, chunk), never by rows: the rows are the call's routing, resolved at launch
(:mod:`ficco.expert.tasks`), so one plan serves every routing and an empty block costs
nothing. Dispatch, W = 4, rank 0 (``cN``: the pulls of chunk N from the three peers; ``G``:
a grouped GEMM over every local expert)::

    serial        copy0..2 |pub|b| all blocks     |b|
                  compute  |                      |======= G(all) =======|
    uniform-*     copy0..2 |pub|b|c0|c1|c2|c3|b|
                  compute  |G(own c0)|G(c0)|G(c1)|G(c2)|G(c3)|
    hetero-*      copy0..2 |pub|b|c0|c1|c2|c3|b|
                  compute  |== G(own) ==|G(c0)|G(c1)|G(c2)|G(c3)|

``hetero`` starts with the own block (rows that never travel, read straight from x: no wait);
``uniform`` puts the own chunk c into step c. ``fused``: one grouped GEMM per step over every
peer's chunk; ``unfused``: one per peer, started as soon as that peer's rows landed.

Combine runs it backwards (as ``matmul_reduce_scatter``'s family does): step c multiplies
chunk c of every block bound for a peer into the symmetric buffer, a barrier says every rank
did, and every rank pulls its rows of chunk c from all peers at once while step c+1
multiplies. Its own block (rows that stay) goes straight into z; ``hetero`` multiplies it
*last*, where it hides the last chunk's transfer (nothing else is left to overlap it then;
first, it would overlap nothing: the all-gather/reduce-scatter argument of
docs/reduce_scatter.md). No reductions: every row has one producer.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..expert.plan_ops import Exchange, GroupedGemm, Publish, Pull
from ..expert.problem import COMBINE, DISPATCH, EXPERT_OPS
from ..plan import COMM, COMPUTE, Plan, PlanBuilder, copy_queue
from .common import check_transport
from .reduce_scatter.common import barrier, pad_barriers


def _begin(schedule, problem, transport: str, copy_engines: int | None) -> PlanBuilder:
    check_transport(transport)
    if getattr(problem, "op", None) != schedule.op:
        raise InvalidArgumentError(
            f"a {schedule.op} schedule needs an ExpertProblem with op={schedule.op!r}; got "
            f"op={getattr(problem, 'op', None)!r} (use ficco.schedules.get(name, op=problem.op))")
    if copy_engines is not None and copy_engines < 1:
        raise InvalidArgumentError(
            f"copy_engines must be >= 1 or None (one per peer); got {copy_engines}")
    return PlanBuilder(schedule.name, transport, problem)


def _peers(rank: int, world: int) -> list[int]:
    """Remote ranks in pull order r+1, r+2, …: at any moment ranks read different peers."""
    return [(rank + i) % world for i in range(1, world)]


@dataclass(frozen=True)
class ExpertSchedule:
    """One expert-parallel schedule (see the module docstring): ``serial`` when ``chunked`` is
    False, else the FiCCO point ``{uniform|hetero}-{fused|unfused}-1d``.

    >>> from ficco.expert.problem import ExpertProblem
    >>> p = ExpertProblem(8, 4, 2, "float32", 4, rank=1)
    >>> dict(ExpertSchedule(DISPATCH).plan(p, "dma").count())
    {'expert_publish': 1, 'barrier': 2, 'expert_copy': 12, 'expert_gemm': 4}
    """

    op: str = DISPATCH
    chunked: bool = True
    uniform: bool = True
    fused: bool = True

    def __post_init__(self):
        if self.op not in EXPERT_OPS:
            raise InvalidArgumentError(f"op must be one of {EXPERT_OPS}; got {self.op!r}")

    @property
    def name(self) -> str:
        if not self.chunked:
            return "serial"
        return "-".join(["uniform" if self.uniform else "hetero",
                         "fused" if self.fused else "unfused", "1d"])

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

    # -- dispatch: move, then multiply ---------------------------------------------------------
    def _dispatch(self, builder: PlanBuilder, transport: str, engines: int) -> None:
        p = builder.problem
        r, peers = p.rank, _peers(p.rank, p.world)
        steps = [None] if not self.chunked else list(range(p.world))
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
                moved = builder.add(Exchange(COMM, c, step=_n(c)))
                landed = {q: moved for q in peers}
            else:
                for lane, q in enumerate(peers):
                    landed[q] = last[lane % engines] = builder.add(
                        Pull(copy_queue(lane % engines), q, c, step=_n(c)), after=[ready])
            every += list(landed.values())
            mine = () if own_first else (r,)
            if not self.chunked:           # serial: everything landed, then one GEMM
                builder.add(GroupedGemm(COMPUTE, tuple(sorted((r, *peers))), None),
                            after=every)
            elif self.fused:
                builder.add(GroupedGemm(COMPUTE, tuple(sorted((*mine, *peers))), c, step=_n(c)),
                            after=list(landed.values()))
            else:
                if mine:
                    builder.add(GroupedGemm(COMPUTE, mine, c, step=_n(c)))
                for q in peers:
                    builder.add(GroupedGemm(COMPUTE, (q,), c, step=_n(c)), after=[landed[q]])
        if transport == "dma":
            barrier(builder, step=p.world + 1, after=list(last.values()))

    # -- combine: multiply, then move back ------------------------------------------------------
    def _combine(self, builder: PlanBuilder, transport: str, engines: int) -> None:
        p = builder.problem
        r, peers = p.rank, _peers(p.rank, p.world)
        steps = [None] if not self.chunked else list(range(p.world))
        own_last = self.chunked and not self.uniform
        if transport == "dma":
            pad_barriers(builder, len(steps) + 1)
        last: dict = {}
        for c in steps:
            mine = () if own_last else (r,)
            if self.fused or not self.chunked:
                gemms = [builder.add(GroupedGemm(COMPUTE, tuple(sorted((*mine, *peers))), c,
                                                 step=_n(c)))]
            else:
                gemms = [builder.add(GroupedGemm(COMPUTE, (q,), c, step=_n(c)))
                         for q in (*peers, *mine)]
            if transport == "ccl":
                builder.add(Exchange(COMM, c, step=_n(c)), after=gemms)
                continue
            ready = barrier(builder, step=_n(c), after=gemms)
            for lane, q in enumerate(peers):
                last[lane % engines] = builder.add(
                    Pull(copy_queue(lane % engines), q, c, step=_n(c)), after=[ready])
        if own_last:
            builder.add(GroupedGemm(COMPUTE, (r,), None, step=p.world))
        if transport == "dma":
            barrier(builder, step=p.world + 1, after=list(last.values()))


def _n(chunk: int | None) -> int:
    return 0 if chunk is None else chunk


def schedules_of(op: str) -> tuple[ExpertSchedule, ...]:
    """The registered schedules of ``op``: ``serial``, then the four FiCCO points."""
    return (ExpertSchedule(op, chunked=False),
            *(ExpertSchedule(op, True, u, f) for u in (True, False) for f in (True, False)))


SCHEDULES = {op: schedules_of(op) for op in (DISPATCH, COMBINE)}
__all__ = ["ExpertSchedule", "SCHEDULES", "schedules_of"]
