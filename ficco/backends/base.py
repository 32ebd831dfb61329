"""The contract every backend fulfils. Vendor files implement only this; the executor, the
schedules and symmetric-memory bookkeeping live above it, once.

A *queue* is whatever the backend orders work on (a worker thread on CPU, a stream on GPUs).
Tensors handed to the methods are already views of the right rectangle: the executor resolves
plan :class:`~ficco.plan.Block` s to tensors, the backend only moves and multiplies them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar

import torch

from ..symm_mem.barrier import WRITE, plan_barrier


class Backend(ABC):
    #: short name used by FICCO_BACKEND: "cpu", "cuda", "rocm"
    name: ClassVar[str]

    # -- availability -----------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def unavailable_reason(cls) -> str | None:
        """None when this backend can run here, else one sentence saying why not and how to
        fix it (install what, set what)."""

    @abstractmethod
    def target(self) -> str:
        """What the code runs on, for cache keys and result files: "cpu", "cuda:sm_90"…"""

    @abstractmethod
    def device(self) -> torch.device:
        """The torch device tensors of this backend live on."""

    # -- queues and events ------------------------------------------------------------------
    @abstractmethod
    def queue(self, name: str) -> Any:
        """The queue for a plan queue name: "compute", "copy{i}", "comm". "compute" is the
        caller's current stream on GPUs. Copy queues beyond what exists wrap around."""

    @abstractmethod
    def new_event(self) -> Any: ...

    def plan_events(self, compiled: Any, count: int) -> list:
        """``count`` events for one call of compiled plan ``compiled`` (the executor's hook).
        Fresh ones here; backends whose events can be re-recorded (GPUs) reuse one set per
        compiled plan, without timing."""
        return [self.new_event() for _ in range(count)]

    @abstractmethod
    def record(self, event: Any, queue: Any) -> None: ...

    @abstractmethod
    def wait(self, event: Any, queue: Any) -> None: ...

    # -- work -------------------------------------------------------------------------------
    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, queue: Any) -> None:
        """DMA copy of a contiguous block (1D) on a copy engine when ``queue`` is a copy queue."""

    @abstractmethod
    def copy_2d(self, dst: torch.Tensor, src: torch.Tensor, queue: Any) -> None:
        """DMA copy of a 2-D block whose rows are contiguous but whose row pitch
        (``stride(0)``) may differ between ``src`` and ``dst`` (cudaMemcpy2DAsync-style)."""

    @abstractmethod
    def gemm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool,
             queue: Any) -> None:
        """``out (+)= a @ b``. ``a`` and ``out`` may be 3-D strided-batched views."""

    @abstractmethod
    def launch(self, queue: Any, fn: Callable[[], None]) -> None:
        """Run host code ``fn`` in ``queue``'s order (collectives, local moves)."""

    # -- signals: the two primitives of the one barrier protocol (ficco.symm_mem.barrier) ----
    @abstractmethod
    def signal_write(self, queue: Any, slot: Any, value: int) -> None:
        """Store int32 ``value`` at pad ``slot`` (a handle's ``slot()``) in ``queue``'s order,
        after all earlier work of ``queue`` is complete and visible to peers."""

    @abstractmethod
    def signal_wait(self, queue: Any, op: Any, deadline: Any) -> None:
        """Later work of ``queue`` waits until the int32 at ``op.slot`` meets ``op`` (a
        :class:`ficco.symm_mem.barrier.SignalOp`: >= ``op.value``, or == when ``op.exact``). Past
        ``deadline`` (a :class:`ficco.symm_mem.barrier.Deadline`, counted from when the queue
        reaches the wait) the call that owns the wait raises ``deadline.error(...)``."""

    @abstractmethod
    def signal_now(self, ops: tuple, deadline: Any) -> None:
        """Run a barrier program on the host's behalf and block until it completed (host
        barriers); raises the deadline's error on expiry."""

    def signal_batch(self, queue: Any, ops: tuple, deadline: Any) -> None:
        """Enqueue a whole barrier program (``SignalOp`` s in order). GPU backends override
        it with one driver call where the API has a batch form."""
        for op in ops:
            if op.kind == WRITE:
                self.signal_write(queue, op.slot, op.value)
            else:
                self.signal_wait(queue, op, deadline)

    def barrier(self, symm: Any, channel: int, queue: Any, timeout_s: float, step: int) -> None:
        """A plan's cross-rank barrier ordered on ``queue`` over the signal pads of symmetric
        handle ``symm``: the one protocol of :func:`ficco.symm_mem.barrier.plan_barrier`."""
        plan_barrier(self, symm, channel, queue, timeout_s, step)

    @abstractmethod
    def finish(self, queues: list[Any]) -> None:
        """End of one call: make the caller's compute queue wait for every other queue (GPU),
        or block until all queues drained and re-raise any worker error (CPU)."""

    # -- symmetric memory ---------------------------------------------------------------------
    @abstractmethod
    def symm_provider(self) -> Any:
        """The :class:`ficco.symm_mem.Provider` that allocates this backend's symmetric memory."""

    def close(self) -> None:
        """Release queues and handles; called by ``ficco.shutdown()`` and at exit."""

    def synchronize(self) -> None:
        """Block the host until all work queued so far has finished (benchmarks, tuning)."""

    def before_dma(self, symm: Any) -> None:
        """Start of a dma call, before it allocates or enqueues anything (``symm``: the
        group's workspace, None before its first allocation): raise what this backend must
        refuse now, or what the group still owes from an earlier call whose error could not
        be raised by that call (GPUs: a barrier released after the call returned). Here a
        failed call raised already."""

    def fence(self, outputs: list, symm: Any = None) -> None:
        """End of a dma call on group workspace ``symm``, after ``finish``: backends whose
        calls return before their barriers completed poison ``outputs`` when one of the
        group's barriers was released (GPUs, :mod:`ficco.backends.gpu_fence`). Here a
        released barrier has raised already."""

    def tensor_slot(self, t: torch.Tensor, index: int) -> Any:
        """Int32 ``t[index]`` as a slot for :meth:`signal_write` / :meth:`signal_wait` (the
        gated schedules' arrival flags): a (tensor, index) pair here, an address on GPUs."""
        return (t, index)

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Seconds between two recorded events of one call (tracing). Backends whose events
        carry no time raise BackendUnavailableError."""
        from ..errors import BackendUnavailableError

        raise BackendUnavailableError(f"the {self.name} backend does not time events")
