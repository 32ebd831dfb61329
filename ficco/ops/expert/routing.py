"""Routing counts: checked on their own rank, then agreed across ranks with one bounded
exchange per call.

Counts are data: every call may route differently. Each rank knows only its own part (its row
of the W x E matrix for dispatch, its (L, W) ``recv_counts`` for combine); plans, symmetric
workspaces and pulls need all of it. One exchange through the group's store
(:func:`ficco.runtime.agreement.exchange`, bounded by FICCO_TIMEOUT) carries every rank's part and the
call's digest: ranks making different calls get MismatchError on every rank, a rank that never
arrives (it raised on bad counts, before communicating) is named in a CommTimeoutError.

Combine may skip the exchange when it is handed the matrix: a dispatch's ``routing`` (what
autograd passes), or ``send_counts=`` whose (send, receive) pair names one dispatch the group's
session remembers (:func:`remember` / :func:`recall`) so that *every* rank can tell it from the
others: the matrix is the only remembered one with its (send, receive) pair on each rank.
Otherwise (two dispatches in flight whose pairs coincide on some rank) every rank exchanges,
alike: the decision depends only on what every rank remembered, never on this rank's pair.

>>> check_counts([2, 0, 1], rows=3, experts_total=3, name="counts")
[2, 0, 1]
"""
from __future__ import annotations

import torch

from ...errors import InvalidArgumentError
from ...runtime import agreement
from ...runtime.session import ROUTINGS_KEPT

#: :func:`recall`'s answer for a pair that no remembered dispatch has on this rank
MISSING = ()


def as_int_list(counts, name: str, shape: tuple[int | None, ...]) -> list:
    """``counts`` (an integer tensor, or nested sequences of ints) as nested Python lists of
    ``shape`` (None: any length); anything else raises naming ``name``."""
    if isinstance(counts, torch.Tensor):
        if counts.device.type == "meta":
            raise InvalidArgumentError(f"{name} is on the meta device: it has shapes but no "
                                       f"values to route by; pass the counts themselves")
        if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
            raise InvalidArgumentError(f"{name} must hold integers (int64); got dtype "
                                       f"{counts.dtype}")
        if not _fits(tuple(counts.shape), shape):
            raise InvalidArgumentError(f"{name} must have shape {_show(shape)}; got "
                                       f"{tuple(counts.shape)}")
        return counts.tolist()
    try:
        values = _nested(counts)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name} must be an int64 tensor of shape {_show(shape)} or "
                                   f"a sequence of ints; got {type(counts).__name__}") from None
    if not _fits(_shape(values), shape):
        raise InvalidArgumentError(f"{name} must have shape {_show(shape)}; got "
                                   f"{_shape(values)}")
    return values


def _fits(got: tuple, want: tuple) -> bool:
    return len(got) == len(want) and all(w is None or g == w for g, w in zip(got, want))


def _show(shape: tuple) -> str:
    return "(" + ", ".join("E" if s is None else str(s) for s in shape) + \
        ("," if len(shape) == 1 else "") + ")"


def _nested(value):
    if isinstance(value, (list, tuple)):
        return [_nested(v) for v in value]
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(value)
    return int(value)


def _shape(values) -> tuple:
    shape = []
    while isinstance(values, list):
        shape.append(len(values))
        values = values[0] if values else None
    return tuple(shape)


def check_counts(row: list, *, rows: int, experts_total: int, name: str) -> list:
    """A dispatch rank's ``counts``: E non-negative entries summing to its rows."""
    if len(row) != experts_total:
        raise InvalidArgumentError(f"{name} has {len(row)} entries but there are "
                                   f"{experts_total} global experts; pass one count per "
                                   f"global expert")
    bad = [(e, c) for e, c in enumerate(row) if c < 0]
    if bad:
        raise InvalidArgumentError(f"{name} has negative entries {bad[:4]} (expert, count); "
                                   f"counts are rows per expert, >= 0")
    if sum(row) != rows:
        raise InvalidArgumentError(f"{name} sums to {sum(row)} but the input has {rows} rows; "
                                   f"every row goes to exactly one expert, so they must match")
    return row


def agree_counts(call, word: int, part) -> list:
    """Every rank's ``part`` (in rank order), exchanged with the call's digest ``word``;
    MismatchError on every rank, naming each rank's call, when the ranks are making different
    calls (a peer waiting in the per-call check of another call joins this exchange: see
    :func:`ficco.runtime.agreement.answer`)."""
    return agreement.exchange_call_data(
        call.group, call.rank, call.world, word, part,
        agreement.summary(call.op.signature(call)), what=f"{call.op.name} counts exchange")


def folded(word: int, counts) -> int:
    """The call's digest with the agreed matrix folded in: ranks that hold different routings
    fail the plan's call check (its barriers' flag, or the ccl call check)."""
    return agreement.digest({"call": word, "counts": counts})


# -- dispatch routings combine may reuse -------------------------------------------------------
def remember(session, counts, experts: int) -> None:
    """Keep dispatch matrix ``counts`` (W x E, agreed) on the group's ``session`` with every
    rank's (send, receive) pair (LRU: every rank remembers and recalls alike)."""
    routings = session.routings
    if counts in routings:
        routings.move_to_end(counts)
        return
    routings[counts] = tuple(_pair(counts, q, experts) for q in range(len(counts)))
    while len(routings) > ROUTINGS_KEPT:
        routings.popitem(last=False)


def recall(session, send_counts: list, recv_counts: list):
    """The remembered dispatch matrix that sent ``send_counts`` and received ``recv_counts``
    on this rank, when every rank can tell it apart (see the module docstring); None when
    some rank cannot (combine then exchanges, on every rank); :data:`MISSING` when no
    remembered dispatch has this pair here."""
    mine = (tuple(send_counts), tuple(map(tuple, recv_counts)))
    rank, routings = session.rank, session.routings
    found = [m for m, pairs in routings.items() if pairs[rank] == mine]
    if not found:
        return MISSING
    if len(found) > 1:
        return None
    pairs = routings[found[0]]
    for q, pair in enumerate(pairs):
        if sum(1 for other in routings.values() if other[q] == pair) > 1:
            return None      # rank q could not tell which dispatch this combine answers
    routings.move_to_end(found[0])
    return found[0]


def _pair(counts, rank: int, experts: int) -> tuple:
    world = len(counts)
    recv = tuple(tuple(counts[s][rank * experts + l] for s in range(world))
                 for l in range(experts))
    return tuple(counts[rank]), recv
