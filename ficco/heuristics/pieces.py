"""The simulator's view of a gated GEMM (:class:`~ficco.plan.GatedGemm`, the gated schedules'
one kernel launch): pieces of tiles, each behind the arrival flags it reads."""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import NO_FLAG, GatedGemm, Op, Plan, Record, Signal, Wait


@dataclass(frozen=True)
class GatedPiece:
    """The simulator's view of one stretch of a :class:`~ficco.plan.GatedGemm`: the tiles of
    ``rows`` rows over ``kc`` of K (kind ``gated_gemm``, so it is priced and drawn as the
    gated GEMM it is part of). ``first`` pays the launch."""

    queue: str
    b: int
    rows: int
    kc: int
    first: bool
    step: int = 0
    label: str = ""
    kind = "gated_gemm"


def lower_for_simulation(plan: Plan) -> tuple[tuple[Op | GatedPiece, ...], list[int]]:
    """The ops of ``plan`` with every GatedGemm split into :class:`GatedPiece` s in the
    kernel's tile order, each behind a Wait for the flags it reads, and every Signal turned
    into a Record of one event (numbered after the plan's own) per flag; plus, per op of the
    result, the index of the op it came from (the host enqueues a gated GEMM once, so all its
    pieces share its issue time). Not a Plan: pieces are the simulator's, never executed. A
    plan without gated ops gives its own ops.

    2d pieces advance in K-lockstep: part c of every peer's tiles waits for chunk c of every
    peer, which the copies deliver at about the same time.
    """
    # A schedule's plan: of its ops only GatedGemm has kind gated_gemm, only Signal signal.
    if not any(isinstance(op, GatedGemm) for op in plan.ops):
        return plan.ops, list(range(len(plan.ops)))
    base = plan.num_events
    ops: list[Op | GatedPiece] = []
    origin: list[int] = []
    for i, op in enumerate(plan.ops):
        if isinstance(op, Signal):
            ops.append(Record(op.queue, base + op.flag))
            origin.append(i)
        elif isinstance(op, GatedGemm):
            for piece, waits in _pieces(op):
                for flag in waits:
                    ops.append(Wait(op.queue, base + flag))
                    origin.append(i)
                ops.append(piece)
                origin.append(i)
        else:
            ops.append(op)
            origin.append(i)
    return tuple(ops), origin


def _pieces(op: GatedGemm) -> list[tuple[GatedPiece, tuple[int, ...]]]:
    """(piece, flags it waits for) in tile order."""
    out: list[tuple[GatedPiece, tuple[int, ...]]] = []
    first = True
    plain = [s for s in op.segments if len(s[2]) == 1]
    accumulating = [s for s in op.segments if len(s[2]) > 1]
    for row0, rows, ((k0, kc, flag),) in plain:
        waits: tuple[int, ...] = () if flag == NO_FLAG else (flag,)
        out.append((GatedPiece(op.queue, op.b, rows, kc, first, op.step,
                               f"gated r{row0}+{rows}"), waits))
        first = False
    if accumulating:   # 2d: all peers' tiles take part c together
        rows = sum(s[1] for s in accumulating)
        for c in range(max(len(s[2]) for s in accumulating)):
            parts = [s[2][c] for s in accumulating if c < len(s[2])]
            waits = tuple(f for _, _, f in parts if f != NO_FLAG)
            out.append((GatedPiece(op.queue, op.b, rows, parts[0][1], first, op.step,
                                   f"gated k{parts[0][0]}+{parts[0][1]}"), waits))
            first = False
    return out
