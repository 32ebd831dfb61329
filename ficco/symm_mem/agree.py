"""Collective success for the steps of a symmetric allocation: a rank that fails a local step
(allocation, mapping a peer) must make every rank raise, never leave the others waiting in a
collective it will not join. Each step ends in one exchange of ``(payload, failure)`` that
replaces the plain ``dist.barrier`` the step needed anyway."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import FiccoError, MismatchError

#: The bounded exchange through the group's store that every step ends in, handed in by the
#: runtime when it loads (:func:`ficco.runtime.agreement.exchange`: symmetric memory sits
#: below it): ``exchange(group, rank, world, payload, *, what) -> every rank's payload``.
_exchange: Callable[..., list] | None = None


def use_exchange(exchange: Callable[..., list]) -> None:
    """Hand in the group exchange the allocation steps end in."""
    global _exchange
    _exchange = exchange


class SymmAllocationError(FiccoError):
    """A rank could not allocate or map symmetric memory; raised on every rank."""


def exchange_or_fail(group, rank: int, world: int, payload: Any, failure: str | None, what: str,
                     on_failure: Callable[[], None] | None = None,
                     nbytes: int | None = None) -> list:
    """Every rank's ``payload`` in rank order, or :class:`SymmAllocationError` on every rank
    when any rank reports a ``failure`` (each rank first runs ``on_failure`` to release what
    it holds). ``nbytes``: the size this rank allocates, which every rank must share; ranks
    asking for different sizes are making different calls (ranks in step grow their
    workspaces at the same call): a MismatchError on every rank, before any rank maps a
    peer's allocation with its own size.

    >>> exchange_or_fail(None, 0, 1, "handle", None, "map")
    ['handle']
    """
    # Through the group's store, bounded by FICCO_TIMEOUT (a raw collective would wait for
    # the group's own timeout and stay pending after a peer is gone).
    if _exchange is None:
        raise FiccoError("symmetric memory has no group exchange: import ficco first")
    everyone = _exchange(group, rank, world, (payload, failure, nbytes),
                         what=f"symmetric memory: {what}")
    failed = [(r, f) for r, (_, f, _) in enumerate(everyone) if f is not None]
    sizes = [n for _, _, n in everyone]
    if (failed or len(set(sizes)) > 1) and on_failure is not None:
        on_failure()
    if failed:
        detail = "; ".join(f"rank {r}: {f}" for r, f in failed)
        raise SymmAllocationError(f"rank {rank}: could not {what} because {detail}. Every rank "
                                  f"of the group raised; nothing stays allocated")
    if len(set(sizes)) > 1:
        raise MismatchError(
            f"rank {rank}: could not {what}: the ranks asked for different sizes ("
            + ", ".join(f"rank {r}: {n} bytes" for r, n in enumerate(sizes)) + "), so they are "
            "making different calls (other shapes or dtypes). Every rank raised, nothing stays "
            "allocated; every rank must make the same calls in the same order")
    return [p for p, _, _ in everyone]
