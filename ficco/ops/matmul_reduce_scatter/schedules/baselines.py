"""``serial``, ``ring`` and ``ring-bidir`` for ``matmul_reduce_scatter``.

``serial``: the whole GEMM, then one reduce-scatter — the baseline speedups are relative to::

    G        partial = a @ b                     (every destination block, one GEMM per b)
    dma      barrier; pull my block's partial from every peer at once; R: out = sum of W
    ccl      one reduce-scatter collective (it reduces inside, out = sum)

    copy0..   |         |bar|P[r+1] P[r+2] …|bar|
    compute   |=== G ===|                   |R|

``ring`` (PyTorch Async-TP's produce-and-all-to-all, pulled): step s = 1 … W-1 computes the
block owned by rank r-s into ``partial``, then a barrier says every rank's step-s partial is
ready, and rank r pulls its block's partial from r+s (who computed it at the same step) while
the next block is computed. This rank's own block never travels: it is computed last, so its
GEMM hides the last pull, and goes straight into ``out``::

    copy0     |    |bar|P[r+1]|bar|P[r+2]|bar|P[r+3]|bar|
    compute   |G[r-1]|G[r-2]|R1|G[r-3]|R2| G[r] (own) |R3|

``ring-bidir``: each step computes the blocks of r-s and r+s and pulls from r+s and r-s on
two copy queues, in ceil((W-1)/2) steps. With ``ccl`` each pull is a send/recv pair.

Reductions (``reduce_each_step``): each received partial is added as it lands (``R1 R2 …``
above), so only the last one's reduction is exposed; ``False`` reduces all W-1 at the end in
one op (Async-TP's way). Per step is the registered default: the simulator predicts it
faster for ring on most row-parallel llama GEMMs (see docs/reduce_scatter.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from ....plan import COMM, COMPUTE, Gemm, Plan, ReduceScatter, SendRecv
from ....plan.problem import Problem
from ....schedules.common import avg_scale, barrier, pad_barriers, pull_order
from . import common


@dataclass(frozen=True)
class Serial:
    name: str = "serial"
    op = "matmul_reduce_scatter"

    def plan(self, problem: Problem, transport: str = "dma",
             copy_engines: int | None = None) -> Plan:
        builder, whole = common.begin(self.name, problem, transport, copy_engines)
        if whole:
            return builder.build()
        p = problem
        gemms = []
        for j in range(len(p.ns)):
            if p.m:
                everything = (0, p.m, 0, p.ns[j])
                gemms.append(builder.add(Gemm(COMPUTE, (common.a_rows(p, 0, everything),),
                                              (common.partial(p, j, 0, everything),), j, 0,
                                              p.k)))
        if transport == "ccl":
            for j in range(len(p.ns)):
                srcs = tuple(common.partial(p, j, q, piece)
                             if (piece := common.whole(p, q, j)) else None
                             for q in range(p.world))
                mine = common.whole(p, p.rank, j)
                builder.add(ReduceScatter(COMM, srcs, common.out(p, j, mine) if mine else None,
                                          scale=avg_scale(p)), after=gemms)
            return builder.build()
        ready = barrier(builder, step=0, after=gemms)
        engines = copy_engines or p.world - 1
        copies: dict = {}
        landed = []
        for lane, q in enumerate(pull_order(p)):
            for j in range(len(p.ns)):
                piece = common.whole(p, p.rank, j)
                if piece:
                    copies[lane % engines] = common.pull(builder, lane % engines, q, j, piece,
                                                         step=0, after=[ready])
                    landed.append(copies[lane % engines])
        for j in range(len(p.ns)):
            piece = common.whole(p, p.rank, j)
            if piece:
                common.reduce(builder, j, piece, pull_order(p), own=True, accumulate=False,
                              final=True, step=1, after=landed)
        common.close(builder, transport, copies)
        return builder.build()


@dataclass(frozen=True)
class Ring:
    bidirectional: bool = False
    reduce_each_step: bool = True
    op = "matmul_reduce_scatter"

    @property
    def name(self) -> str:
        return "ring-bidir" if self.bidirectional else "ring"

    def steps(self, world: int, rank: int) -> list[list[tuple[int, int]]]:
        """Per step 1, 2, …: the (destination computed, source pulled) pairs of this rank.
        Each remote block is computed once and each peer pulled once."""
        out, seen = [], {rank}
        for s in range(1, world):
            pairs = [((rank - s) % world, (rank + s) % world)]
            if self.bidirectional:
                pairs.append(((rank + s) % world, (rank - s) % world))
            fresh = [pair for pair in dict.fromkeys(pairs) if pair[1] not in seen]
            if not fresh:
                break
            seen.update(src for _, src in fresh)
            out.append(fresh)
        return out

    def plan(self, problem: Problem, transport: str = "dma",
             copy_engines: int | None = None) -> Plan:
        builder, whole = common.begin(self.name, problem, transport, copy_engines)
        if whole:
            return builder.build()
        p = problem
        steps = self.steps(p.world, p.rank)
        if transport == "dma":
            pad_barriers(builder, len(steps) + 1)
        copies: dict = {}
        arrived: list[tuple[int, int, list[int]]] = []   # (step, source, handles)
        reduced, written = 0, False   # written: out holds something to accumulate onto

        def reduce_next(final: bool) -> None:
            nonlocal reduced, written
            step, src, handles = arrived[reduced]
            for j in range(len(p.ns)):
                piece = common.whole(p, p.rank, j)
                if piece:
                    common.reduce(builder, j, piece, [src], own=False, accumulate=written,
                                  final=final, step=step, after=handles)
            reduced, written = reduced + 1, True

        for s, pairs in enumerate(steps, start=1):
            gemms = []
            for dest, _ in pairs:
                for j in range(len(p.ns)):
                    piece = common.whole(p, dest, j)
                    if piece:
                        gemms.append(builder.add(Gemm(COMPUTE, (common.a_rows(p, dest, piece),),
                                                      (common.partial(p, j, dest, piece),), j,
                                                      0, p.k, step=s)))
            if transport == "dma":
                ready = barrier(builder, step=s, after=gemms)
            for lane, (dest, src) in enumerate(pairs):
                handles = []
                for j in range(len(p.ns)):
                    mine, theirs = common.whole(p, p.rank, j), common.whole(p, dest, j)
                    if transport == "dma":
                        if mine:
                            h = common.pull(builder, lane % (copy_engines or 2), src, j, mine,
                                            step=s, after=[ready])
                            copies[lane % (copy_engines or 2)] = h
                            handles.append(h)
                        continue
                    handles.append(builder.add(SendRecv(
                        COMM, common.partial(p, j, dest, theirs) if theirs else None,
                        dest if theirs else None,
                        common.recv(p, j, src, mine) if mine else None,
                        src if mine else None, step=s), after=gemms))
                arrived.append((s, src, handles))
            if self.reduce_each_step and p.block_rows:
                # Reduce what landed a step ago: the GEMM just queued hides this step's move.
                while reduced < len(arrived) - len(pairs):
                    reduce_next(final=False)
        if not p.block_rows:
            common.close(builder, transport, copies)
            return builder.build()
        if self.reduce_each_step:
            common.own_gemms(builder, written, len(steps) + 1)
            written = True
            while reduced < len(arrived):
                reduce_next(final=reduced == len(arrived) - 1)
        else:
            common.own_gemms(builder, False, len(steps) + 1)
            for j in range(len(p.ns)):
                piece = common.whole(p, p.rank, j)
                assert piece is not None    # this rank has rows (returned above otherwise)
                common.reduce(builder, j, piece, [src for _, src, _ in arrived], own=False,
                              accumulate=True, final=True, step=len(steps) + 1,
                              after=[h for _, _, hs in arrived for h in hs])
        common.close(builder, transport, copies)
        return builder.build()
