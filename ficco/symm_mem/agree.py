"""Collective success for the steps of a symmetric allocation: a rank that fails a local step
(allocation, mapping a peer) must make every rank raise, never leave the others waiting in a
collective it will not join. Each step ends in one exchange of ``(payload, failure)`` that
replaces the plain ``dist.barrier`` the step needed anyway."""
from __future__ import annotations

from typing import Any, Callable

from ..agreement import exchange
from ..errors import FiccoError


class SymmAllocationError(FiccoError):
    """A rank could not allocate or map symmetric memory; raised on every rank."""


def exchange_or_fail(group, rank: int, world: int, payload: Any, failure: str | None, what: str,
                     on_failure: Callable[[], None] | None = None) -> list:
    """Every rank's ``payload`` in rank order, or :class:`SymmAllocationError` on every rank
    when any rank reports a ``failure`` (each rank first runs ``on_failure`` to release what
    it holds).

    >>> exchange_or_fail(None, 0, 1, "handle", None, "map")
    ['handle']
    """
    # Through the group's store, bounded by FICCO_TIMEOUT (a raw collective would wait for
    # the group's own timeout and stay pending after a peer is gone).
    everyone = exchange(group, rank, world, (payload, failure), what=f"symmetric memory: {what}")
    failed = [(r, f) for r, (_, f) in enumerate(everyone) if f is not None]
    if failed:
        if on_failure is not None:
            on_failure()
        detail = "; ".join(f"rank {r}: {f}" for r, f in failed)
        raise SymmAllocationError(f"rank {rank}: could not {what} because {detail}. Every rank "
                                  f"of the group raised; nothing stays allocated")
    return [p for p, _ in everyone]
