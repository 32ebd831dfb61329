"""The plan ops of expert-parallel schedules: work named by (source rank, chunk), sized at
launch from the call's routing (:mod:`ficco.ops.expert.tasks`), so a plan never depends on the
counts. Each is a :class:`~ficco.plan.HostOp`; the simulator prices them from the problem's
counts (:mod:`ficco.ops.expert.pricing`).

``chunk`` is the FiCCO chunk index: chunk c of every block is ``even_split(rows, W)[c]`` of
its rows (1d) or, with ``two_d``, of the columns that cross the links (dispatch: K, combine:
n; :func:`~ficco.ops.expert.problem.piece_of`); ``None`` is the whole block. ``experts`` names the
local experts an op covers (``None``: every one): the ``by-expert`` schedules move and multiply
one expert at a time, each expert's GEMM whole.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...plan import HostOp
from . import pricing, tasks


@dataclass(frozen=True)
class Publish(HostOp):
    """Dispatch over ``dma``: this rank's x into its symmetric buffer."""

    queue: str
    step: int = 0
    kind = "expert_publish"
    host_task = staticmethod(tasks.publish_task)
    price = staticmethod(pricing.price)


@dataclass(frozen=True)
class Pull(HostOp):
    """Copy ``chunk`` of every block ``peer`` holds for this rank, from its symmetric buffer
    (one DMA copy per local expert): dispatch pulls the peer's rows for this rank's experts,
    combine pulls this rank's rows back from the peer's experts."""

    queue: str
    peer: int
    chunk: int | None
    step: int = 0
    two_d: bool = False
    experts: tuple[int, ...] | None = None
    kind = "expert_copy"
    host_task = staticmethod(tasks.move_task)
    price = staticmethod(pricing.price)
    copy_pairs = staticmethod(tasks.move_pairs)


@dataclass(frozen=True)
class GroupedGemm(HostOp):
    """One grouped GEMM over ``chunk`` of blocks ``(l, s)`` for every local expert l and every
    s in ``sources``: block rows times ``w[l]``. 2d dispatch: K columns ``chunk`` times those
    rows of ``w[l]``, added into the output with ``accumulate`` (every chunk after the first);
    2d combine: output columns ``chunk``."""

    queue: str
    sources: tuple[int, ...]
    chunk: int | None
    step: int = 0
    two_d: bool = False
    accumulate: bool = False
    experts: tuple[int, ...] | None = None
    kind = "expert_gemm"
    host_task = staticmethod(tasks.gemm_task)
    price = staticmethod(pricing.price)


@dataclass(frozen=True)
class Exchange(HostOp):
    """``ccl``: ``chunk`` of every block to and from every peer in one all-to-all; with
    ``shift`` (ring) only to rank r - shift and from rank r + shift."""

    queue: str
    chunk: int | None
    step: int = 0
    two_d: bool = False
    shift: int | None = None
    experts: tuple[int, ...] | None = None
    kind = "expert_all_to_all"
    host_task = staticmethod(tasks.exchange_task)
    price = staticmethod(pricing.price)
