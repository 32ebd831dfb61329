"""The plan ops of Ulysses schedules: work named by peer, sized at launch from the call's
agreed problem (:mod:`.tasks`). Each is a :class:`~ficco.plan.HostOp`; the simulator prices
them with :mod:`.pricing`."""
from __future__ import annotations

from dataclasses import dataclass

from ...plan import HostOp
from . import pricing, tasks


@dataclass(frozen=True)
class Produce(HostOp):
    """``matmul_all_to_all``: the GEMM of the product's chunk for rank ``dest`` (None: the
    whole product), staged for it (its own chunk: into the output)."""

    queue: str
    dest: int | None
    step: int = 0
    kind = "ulysses_gemm"
    price = staticmethod(pricing.price)
    host_task = staticmethod(tasks.produce_task)


@dataclass(frozen=True)
class Consume(HostOp):
    """``all_to_all_matmul``: the GEMM of rank ``source``'s chunk; ``accumulate`` adds it into
    the output (gathering along K, every source after the first)."""

    queue: str
    source: int
    step: int = 0
    accumulate: bool = False
    kind = "ulysses_gemm"
    price = staticmethod(pricing.price)
    host_task = staticmethod(tasks.consume_task)


@dataclass(frozen=True)
class Publish(HostOp):
    """``all_to_all_matmul`` over ``dma``: ``a``'s chunks for the peers into the symmetric
    staging buffer."""

    queue: str
    step: int = 0
    kind = "ulysses_publish"
    price = staticmethod(pricing.price)
    host_task = staticmethod(tasks.publish_task)


@dataclass(frozen=True)
class Pull(HostOp):
    """``dma``: copy ``peer``'s chunk for this rank from its symmetric staging buffer."""

    queue: str
    peer: int
    step: int = 0
    kind = "ulysses_copy"
    price = staticmethod(pricing.price)
    host_task = staticmethod(tasks.pull_task)


@dataclass(frozen=True)
class Exchange(HostOp):
    """``ccl``: one all-to-all of the process group: every peer's chunk (``shift`` None), or
    only to rank r + shift and from rank r - shift."""

    queue: str
    shift: int | None
    step: int = 0
    kind = "ulysses_all_to_all"
    price = staticmethod(pricing.price)
    host_task = staticmethod(tasks.exchange_task)
