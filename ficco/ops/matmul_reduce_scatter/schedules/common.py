"""Pieces the reduce-scatter schedules share: blocks of the ``partial``, ``recv`` and ``out``
buffers, the move of one step's partials to their owners (``dma``: pulls after a barrier;
``ccl``: one all-to-all), reductions and the closing barrier. Schedules build Plans only
from these, :mod:`..common` (pull order, barrier channels, ``avg``) and :mod:`ficco.plan`.

Why pull, not push: a rank pulls the partials of its own block from its peers' symmetric
``partial`` buffers into a per-call ``recv`` buffer. Only ``partial`` must be symmetric, no
rank ever writes into another's memory, and a producer's buffer is guarded by one closing
barrier (as the all-gather's is). A push would need the landing buffer symmetric too and one
more guard against a peer still reducing the previous call's landing. Both need one barrier
per step (a partial may move only once its producer has computed it), so pull costs nothing.
"""
from __future__ import annotations

from ....plan import COMM, COMPUTE, AllToAll, Block, Copy, Gemm, PlanBuilder, Reduce, copy_queue
from ....plan.problem import Problem, even_split
from ....schedules.common import avg_scale, barrier, check_plan_args

#: a rectangle of one destination block, relative to the block: (row0, rows, col0, cols)
Piece = tuple[int, int, int, int]


def check(problem: Problem, transport: str, copy_engines: int | None) -> None:
    check_plan_args("matmul_reduce_scatter", problem, transport, copy_engines)


def begin(name: str, problem: Problem, transport: str,
          copy_engines: int | None) -> tuple[PlanBuilder, bool]:
    """Check the arguments and start schedule ``name``'s plan: (builder, whole), ``whole``
    when one rank makes the plan its own GEMMs alone (already added)."""
    check(problem, transport, copy_engines)
    builder = PlanBuilder(name, transport, problem)
    if problem.world == 1:
        own_gemms(builder, False, 0)
        return builder, True
    return builder, False


def own_gemms(builder: PlanBuilder, accumulate: bool, step: int) -> list[int]:
    """This rank's own block of every output, computed straight into ``out``."""
    p = builder.problem
    handles = []
    for j in range(len(p.ns)):
        piece = whole(p, p.rank, j)
        if piece:
            handles.append(builder.add(Gemm(COMPUTE, (a_rows(p, p.rank, piece),),
                                            (out(p, j, piece),), j, 0, p.k, accumulate,
                                            step)))
    return handles


def whole(p: Problem, dest: int, j: int) -> Piece | None:
    rows = p.block(dest)[1]
    return (0, rows, 0, p.ns[j]) if rows else None


def chunk(p: Problem, dest: int, c: int, j: int, two_d: bool) -> Piece | None:
    """Chunk ``c`` of ``dest``'s block for ``b_j``: rows ``even_split(R, W)[c]`` (1d) or
    output columns ``p.col_chunks(n_j)[c]`` (2d); None when empty."""
    rows = p.block(dest)[1]
    if two_d:
        c0, nc = p.col_chunks(p.ns[j])[c]
        return (0, rows, c0, nc) if rows and nc else None
    r0, nr = even_split(rows, p.world)[c]
    return (r0, nr, 0, p.ns[j]) if nr else None


def a_rows(p: Problem, dest: int, piece: Piece) -> Block:
    """The rows of ``a`` whose products belong to ``piece`` of ``dest``'s block (all of K)."""
    return Block("input", p.block(dest)[0] + piece[0], piece[1], 0, p.k)


def partial(p: Problem, j: int, dest: int, piece: Piece, peer: int | None = None) -> Block:
    """``piece`` of ``dest``'s block in the partial products of ``b_j`` (``peer``'s copy)."""
    r0, rows, c0, cols = piece
    return Block("partial", p.block(dest)[0] + r0, rows, c0, cols, peer=peer, index=j)


def recv(p: Problem, j: int, src: int, piece: Piece) -> Block:
    """Where ``src``'s partial of ``piece`` of this rank's block lands."""
    r0, rows, c0, cols = piece
    return Block("recv", src * p.block_rows + r0, rows, c0, cols, index=j)


def out(p: Problem, j: int, piece: Piece) -> Block:
    r0, rows, c0, cols = piece
    return Block("out", r0, rows, c0, cols, index=j)


# -- the closing barrier --------------------------------------------------------------------------
def close(builder: PlanBuilder, transport: str, copies: dict) -> None:
    """With ``dma``: once this rank's pulls are done, tell peers they may overwrite their
    partials (the closing barrier, after the last pull of each copy queue)."""
    if transport == "dma" and builder.problem.world > 1:
        barrier(builder, step=builder.problem.world + 1, after=list(copies.values()))


# -- moving partials -----------------------------------------------------------------------------
def pull(builder: PlanBuilder, lane: int, src: int, j: int, piece: Piece, *, step: int,
         after) -> int:
    """DMA-pull ``src``'s partial of ``piece`` of this rank's block into its recv slot."""
    p = builder.problem
    return builder.add(Copy(copy_queue(lane), partial(p, j, p.rank, piece, peer=src),
                            recv(p, j, src, piece), two_d=piece[3] != p.ns[j], step=step),
                       after=after)


def all_to_all(builder: PlanBuilder, j: int, pieces: dict[int, Piece | None], *, step: int,
               after) -> int:
    """``ccl``: every rank sends each peer its partial of that peer's ``pieces[peer]`` and
    receives its own block's pieces from every peer, in one collective."""
    p = builder.problem
    srcs = tuple(partial(p, j, q, piece) if q != p.rank and (piece := pieces[q]) else None
                 for q in range(p.world))
    mine = pieces[p.rank]
    dsts = tuple(recv(p, j, q, mine) if q != p.rank and mine else None for q in range(p.world))
    return builder.add(AllToAll(COMM, srcs, dsts, step=step), after=after)


def reduce(builder: PlanBuilder, j: int, piece: Piece, srcs_from: list[int], *, own: bool,
           accumulate: bool, final: bool, step: int, after) -> int:
    """``out[piece] (+)= sum of the partials of srcs_from (+ this rank's own partial when
    ``own``)``; ``final`` applies the ``avg`` scale (the last op writing these elements)."""
    p = builder.problem
    srcs = tuple(recv(p, j, q, piece) for q in srcs_from)
    if own:
        srcs = (partial(p, j, p.rank, piece),) + srcs
    return builder.add(Reduce(COMPUTE, srcs, out(p, j, piece), accumulate, step,
                              avg_scale(p) if final else None), after=after)


def rescale(builder: PlanBuilder, j: int, piece: Piece, step: int) -> None:
    """``avg`` when the last writer of ``piece`` was a GEMM: one scaling pass."""
    p = builder.problem
    if avg_scale(p) is not None:
        builder.add(Reduce(COMPUTE, (), out(p, j, piece), True, step, avg_scale(p)))


def blocks_by_runs(p: Problem, dests: list[int], piece_of) -> list[list[int]]:
    """``dests`` cut into runs of consecutive ranks whose pieces have the same shape: the
    pieces of one run are equally spaced (blocks of equal length follow each other), so one
    strided-batched GEMM covers a run."""
    runs: list[list[int]] = []
    for d in sorted(dests):
        last = runs[-1][-1] if runs else None
        if last is not None and last + 1 == d and p.block(d)[1] == p.block(last)[1] \
                and piece_of(d) == piece_of(last):
            runs[-1].append(d)
        else:
            runs.append([d])
    return runs
