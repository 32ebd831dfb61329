"""Schedules of the Ulysses pair: ``serial`` and ``pieces`` (docs/ulysses.md).

``matmul_all_to_all`` (GEMM, then the all-to-all): ``serial`` makes the whole product, then moves
every chunk at once. ``pieces`` makes the product one destination's chunk at a time (a column
piece ``a @ b[:, n_j]`` when the scattered dim is the product's last, else a row piece
``a[rows_j] @ b``), own chunk first, then rank r+1's, r+2's, …; each chunk travels while the
next one is multiplied. Rank 0 of 4 (``G j``: the GEMM of rank j's chunk; ``<- q``: rank q's
chunk for this rank arriving; ``b``: a barrier)::

    serial   compute |====== G(all) ======|
             copy    |                    |b| <- 3, <- 2, <- 1 |b|
    pieces   compute |G 0|G 1|G 2|G 3|
             copy    |   |   |b|<-3|b|<-2|b|<-1|b|

``all_to_all_matmul`` (the all-to-all, then the GEMM) runs it backwards: ``serial`` moves every
chunk, then multiplies; ``pieces`` multiplies the own chunk at once (it never travels) and each
peer's as it lands, r+1's first: into its rows of the output, or, when the gathered dim is the
GEMM's K, ``C += a_j @ b[K_j]`` (partial sums of bf16/fp16 in float32, rounded once)::

    serial   copy    |pub|b| <- 1, <- 2, <- 3 |b|
             compute |                        |G 0|G 1|G 2|G 3|
    pieces   copy    |pub|b|<-1|<-2|<-3|b|
             compute |G 0   |G 1|G 2|G 3|

Over ``dma`` chunks are pulled from the peers' symmetric staging buffers (a barrier says every
rank staged; ``matmul_all_to_all`` needs one per step, since a chunk is staged only when its
GEMM is done); over ``ccl`` each step is one ``all_to_all_single`` of the process group that
sends to rank r + i and receives from rank r - i (``serial``: one for every peer).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...plan import COMM, COMPUTE, Plan, PlanBuilder, copy_queue
from ...schedules.common import barrier, check_plan_args, pad_barriers
from .layout import ALL_TO_ALL_MATMUL, MATMUL_ALL_TO_ALL, UlyssesProblem, check_op
from .plan_ops import Consume, Exchange, Produce, Publish, Pull


@dataclass(frozen=True)
class UlyssesSchedule:
    """``serial`` (``overlapped`` False) or ``pieces`` of one of the pair (the module
    docstring).

    >>> from ficco.ops.ulysses.layout import UlyssesProblem
    >>> p = UlyssesProblem((8, 4, 16), 1, 0, 16, 16, "float32", 4, op="matmul_all_to_all")
    >>> dict(UlyssesSchedule("matmul_all_to_all").plan(p, "dma").count())
    {'ulysses_gemm': 4, 'barrier': 4, 'ulysses_copy': 3}
    """

    op: str
    overlapped: bool = True

    def __post_init__(self):
        check_op(self.op, type(self).__name__)

    @property
    def name(self) -> str:
        return "pieces" if self.overlapped else "serial"

    def plan(self, problem, transport: str = "dma", copy_engines: int | None = None) -> Plan:
        check_plan_args(self.op, problem, transport, copy_engines)
        builder = PlanBuilder(self.name, transport, problem)
        engines = copy_engines or max(problem.world - 1, 1)
        if self.op == MATMUL_ALL_TO_ALL:
            self._matmul_first(builder, transport, engines)
        else:
            self._all_to_all_first(builder, transport, engines)
        return builder.build()

    # -- matmul_all_to_all: multiply, then move ----------------------------------------------
    def _matmul_first(self, builder: PlanBuilder, transport: str, engines: int) -> None:
        p = builder.problem
        r, w = p.rank, p.world
        if w == 1:
            builder.add(Produce(COMPUTE, None))
            return
        if not self.overlapped:
            made = builder.add(Produce(COMPUTE, None))
            if transport == "ccl":
                builder.add(Exchange(COMM, None, step=1), after=[made])
                return
            staged = barrier(builder, step=1, after=[made])
            pulls = [builder.add(Pull(copy_queue(i % engines), (r - i - 1) % w, step=1),
                                 after=[staged]) for i in range(w - 1)]
            barrier(builder, step=2, after=pulls)
            return
        if transport == "dma":
            pad_barriers(builder, w)    # a barrier per step and one to close: W in all
        builder.add(Produce(COMPUTE, r))
        pulls = []
        for c in range(1, w):
            made = builder.add(Produce(COMPUTE, (r + c) % w, step=c))
            if transport == "ccl":
                builder.add(Exchange(COMM, c, step=c), after=[made])
                continue
            staged = barrier(builder, step=c, after=[made])
            pulls.append(builder.add(Pull(copy_queue((c - 1) % engines), (r - c) % w, step=c),
                                     after=[staged]))
        if transport == "dma":
            barrier(builder, step=w, after=pulls)

    # -- all_to_all_matmul: move, then multiply ----------------------------------------------
    def _all_to_all_first(self, builder: PlanBuilder, transport: str, engines: int) -> None:
        p = builder.problem
        assert isinstance(p, UlyssesProblem)
        r, w = p.rank, p.world
        adds = p.accumulates
        if w == 1:
            builder.add(Consume(COMPUTE, r))
            return
        order = [(r + c) % w for c in range(1, w)]       # peers in pull order
        if transport == "ccl":
            order = [(r - c) % w for c in range(1, w)]   # the source of exchange step c
        arrived: dict[int, int] = {}
        if transport == "dma":
            published = builder.add(Publish(copy_queue(0)))
            staged = barrier(builder, step=0, after=[published])
            for i, q in enumerate(order):
                arrived[q] = builder.add(Pull(copy_queue(i % engines), q, step=i + 1),
                                         after=[staged])
        elif self.overlapped:
            for i, q in enumerate(order):
                arrived[q] = builder.add(Exchange(COMM, i + 1, step=i + 1))
        else:
            moved = builder.add(Exchange(COMM, None, step=1))
            arrived = dict.fromkeys(order, moved)
        every = list(arrived.values())
        builder.add(Consume(COMPUTE, r), after=[] if self.overlapped else every)
        for i, q in enumerate(order):
            builder.add(Consume(COMPUTE, q, step=i + 1, accumulate=adds),
                        after=[arrived[q]])
        if transport == "dma":
            barrier(builder, step=w, after=every)


SCHEDULES = {op: (UlyssesSchedule(op, overlapped=False), UlyssesSchedule(op))
             for op in (MATMUL_ALL_TO_ALL, ALL_TO_ALL_MATMUL)}
