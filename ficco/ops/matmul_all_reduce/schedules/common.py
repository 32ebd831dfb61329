"""Pieces the all-reduce schedules share: blocks of the ``partial``, ``recv``, ``reduced`` and
``out`` buffers, the closing barrier, and the two halves of a bandwidth-optimal all-reduce of a
range of rows (each rank reduces its piece, then pulls every peer's), which ``serial``,
``two-shot`` and ``chunked-*`` run; ``rs-ag-*`` gets its reduce-scatter half from the
reduce-scatter schedules instead (:mod:`.rs_ag`).

Three rules every all-reduce plan keeps:

- **One sum, the same on every rank.** Tensor parallelism keeps activations replicated, so
  every rank must hold bit-identical outputs: each output element is summed once, by one
  rank (the owner of its piece) which the others copy, or by every rank in the same order
  (rank 0, 1, …, W-1; one-shot). Never "own partial first".
- **Pull, never push** (as the reduce-scatter, ``ops/matmul_reduce_scatter/schedules/common.py``): only
  ``partial`` and ``reduced`` are symmetric, no rank writes into another's memory, and one
  closing barrier guards both for the next call.
- **What travels is final**: ``reduced`` holds the sums in the outputs' dtype (float32 when the
  plan's outputs are wide: a bias still to add, partial sums added in place), so a peer's copy
  and the owner's value round alike when the call's result is made.
"""
from __future__ import annotations

from ....plan import (
    COMM,
    COMPUTE,
    AllGather,
    AllToAll,
    Block,
    Copy,
    Gemm,
    PlanBuilder,
    Reduce,
    ReduceScatter,
    copy_queue,
)
from ....plan.problem import Problem, even_split
from ....schedules.common import avg_scale, barrier, check_plan_args, pull_order

#: (first row, rows) of one rank's piece of a range of rows
Piece = tuple[int, int]


def begin(name: str, problem: Problem, transport: str,
          copy_engines: int | None) -> tuple[PlanBuilder, bool]:
    """Check the arguments and start schedule ``name``'s plan: (builder, whole), ``whole``
    when one rank makes the plan its own GEMMs alone (already added)."""
    check_plan_args("matmul_all_reduce", problem, transport, copy_engines)
    builder = PlanBuilder(name, transport, problem)
    if problem.world == 1:
        gemms(builder, 0, problem.m, "out")
        return builder, True
    return builder, False


def rows(p: Problem, buf: str, j: int, piece: Piece, peer: int | None = None) -> Block:
    """Rows ``piece`` of buffer ``buf`` for ``b_j`` (all its columns); ``peer``'s copy."""
    return Block(buf, piece[0], piece[1], 0, p.ns[j], peer=peer, index=j)


def gemms(builder: PlanBuilder, row0: int, count: int, target: str, *, step: int = 0,
          after=()) -> list[int]:
    """One GEMM per ``b_j`` of rows ``[row0, row0+count)`` of ``a`` (all of K) into the same
    rows of ``target`` (``partial``, or ``out`` when nothing else is summed into it)."""
    p = builder.problem
    if not count:
        return []
    return [builder.add(Gemm(COMPUTE, (Block("input", row0, count, 0, p.k),),
                             (rows(p, target, j, (row0, count)),), j, 0, p.k, step=step),
                        after=after) for j in range(len(p.ns))]


def straight_to_out(p: Problem) -> bool:
    """Whether a GEMM may write the rows a collective then sums in place in ``out``: the
    partials travel in the outputs' dtype and no bias waits for the sum (a bias makes the
    outputs float32, the partials stay in theirs)."""
    return p.partial_itemsize == p.out_itemsize and not p.bias


def pieces(p: Problem, row0: int, count: int) -> list[Piece]:
    """Every rank's piece of rows ``[row0, row0+count)`` (``even_split``: longer pieces first,
    as :meth:`Problem.block` splits all M rows)."""
    return [(row0 + start, length) for start, length in even_split(count, p.world)]


def close(builder: PlanBuilder, transport: str, after) -> None:
    """With ``dma``: once every read of a peer's buffer is done, tell peers they may overwrite
    their ``partial`` and ``reduced`` (the closing barrier)."""
    if transport == "dma":
        barrier(builder, step=builder.problem.world + 1, after=[h for h in after if h is not None])


# -- the two halves of a bandwidth-optimal all-reduce ----------------------------------------------
def reduce_piece(builder: PlanBuilder, split: list[Piece], *, engines: int, loads: bool,
                 recv_row0: int, step: int, after) -> tuple[list[int], list[int]]:
    """dma: ``reduced[mine] = scale * sum over ranks (0..W-1) of their partial[mine]``, once
    ``after`` (the barrier saying every rank computed these rows). Copy engines pull the W-1
    peers' rows into ``recv`` at ``recv_row0`` (peer q at ``recv_row0 + q * rows``) and the
    compute queue sums them (``loads=False``), or the sum reads the peers' ``partial`` in
    place over the links (``loads=True``: one kernel, no copies). Returns (the reductions,
    every read of a peer's memory)."""
    p = builder.problem
    mine = split[p.rank]
    if not mine[1]:
        return [], []
    reductions, reads = [], []
    for j in range(len(p.ns)):
        if loads:
            srcs = [rows(p, "partial", j, mine, None if q == p.rank else q)
                    for q in range(p.world)]
            landed = list(after)
        else:
            slot = {q: (recv_row0 + q * mine[1], mine[1]) for q in pull_order(p)}
            landed = [builder.add(Copy(copy_queue(i % engines),
                                       rows(p, "partial", j, mine, q), rows(p, "recv", j, slot[q]),
                                       step=step), after=after)
                      for i, q in enumerate(pull_order(p))]
            reads += landed
            srcs = [rows(p, "partial", j, mine) if q == p.rank else rows(p, "recv", j, slot[q])
                    for q in range(p.world)]
        h = builder.add(Reduce(COMPUTE, tuple(srcs), rows(p, "reduced", j, mine), False, step,
                                 avg_scale(p)), after=landed)
        reductions.append(h)
        if loads:
            reads.append(h)
    return reductions, reads


def gather_pieces(builder: PlanBuilder, split: list[Piece], *, engines: int, loads: bool,
                  step: int, after, own_after=()) -> list[int]:
    """dma: ``out[q's piece] <- reduced[q's piece]`` of every peer q (pulled by copy engines,
    or read by a one-source Reduce on the compute queue with ``loads``) once ``after`` (the
    barrier saying every piece is reduced), and this rank's own piece copied locally once
    ``own_after`` (its reductions). Returns every read of a peer's memory."""
    p = builder.problem
    reads = []
    for i, q in enumerate(pull_order(p)):
        if not split[q][1]:
            continue
        for j in range(len(p.ns)):
            src, dst = rows(p, "reduced", j, split[q], q), rows(p, "out", j, split[q])
            op = Reduce(COMPUTE, (src,), dst, False, step) if loads else \
                Copy(copy_queue(i % engines), src, dst, step=step)
            reads.append(builder.add(op, after=after))
    copy_own(builder, split[p.rank], engines=engines, loads=loads, step=step, after=own_after)
    return reads


def copy_own(builder: PlanBuilder, mine: Piece, *, engines: int, loads: bool, step: int,
             after) -> None:
    """``out[mine] <- reduced[mine]``: a local copy (a copy engine's, or a kernel's)."""
    p = builder.problem
    if not mine[1]:
        return
    for j in range(len(p.ns)):
        src, dst = rows(p, "reduced", j, mine), rows(p, "out", j, mine)
        op = Reduce(COMPUTE, (src,), dst, False, step) if loads else \
            Copy(copy_queue((engines - 1) % engines), src, dst, step=step)
        builder.add(op, after=after)


def all_reduce_ccl(builder: PlanBuilder, split: list[Piece], *, step: int, after) -> None:
    """ccl: the same two halves as collectives: one reduce-scatter of the pieces into
    ``reduced``, then the pieces to every rank (one all-gather when they are all one length,
    else an all-to-all that sends this rank's piece to each peer, and a local copy of it)."""
    p = builder.problem
    mine = split[p.rank]
    for j in range(len(p.ns)):
        srcs = tuple(rows(p, "partial", j, piece) if piece[1] else None for piece in split)
        reduced = builder.add(ReduceScatter(
            COMM, srcs, rows(p, "reduced", j, mine) if mine[1] else None, step, avg_scale(p)),
            after=after)
        if len({length for _, length in split}) == 1:
            builder.add(AllGather(COMM, rows(p, "reduced", j, mine),
                                  tuple(rows(p, "out", j, piece) for piece in split), step))
            continue
        builder.add(AllToAll(COMM, tuple(
            rows(p, "reduced", j, mine) if q != p.rank and mine[1] else None
            for q in range(p.world)), tuple(
            rows(p, "out", j, split[q]) if q != p.rank and split[q][1] else None
            for q in range(p.world)), step))
        if mine[1]:
            builder.add(Copy(COMPUTE, rows(p, "reduced", j, mine), rows(p, "out", j, mine),
                             step=step), after=[reduced])
