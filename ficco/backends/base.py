"""The contract every backend fulfils, whole: the executor, compiler, kernels and runtime call
a backend only through what this class declares (never ``getattr(backend, ...)``). Methods a
backend may skip have a default here; the class flags say which optional fast paths the
executor may take. Vendor files implement only this; the executor, the schedules, the barrier
protocol (:mod:`ficco.symm_mem.barrier`) and symmetric-memory bookkeeping live above it, once.

A *queue* is whatever the backend orders work on (a worker thread on CPU, a stream on GPUs).
Tensors handed to the methods are already views of the right rectangle: the executor resolves
plan :class:`~ficco.plan.Block` s to tensors, the backend only moves and multiplies them.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..symm_mem.barrier import WRITE


class Backend(ABC):
    #: short name used by FICCO_BACKEND, the name of the backend's package: "cpu", "cuda"…
    name: ClassVar[str]
    #: the torch device type of what it drives ("cpu", "cuda": torch's ROCm build too, "xpu"…):
    #: its GPU code reaches torch through ``torch.get_device_module(device_type)``
    #: (:meth:`device_module`), and its symmetric-memory provider is registered for it
    device_type: ClassVar[str]
    #: the automatic choice takes the usable backend of the highest priority
    #: (:func:`ficco.backends.auto_name`): a device over the CPU
    priority: ClassVar[int] = 0
    #: Compute-queue GEMMs and host tasks go through :meth:`gemm_current` and
    #: :meth:`launch_current`, no queue looked up per step (GPUs: the compute queue is the
    #: caller's current stream while the executor enqueues).
    compute_on_current: ClassVar[bool] = False
    #: Copies are prepared once per bound plan (:meth:`prepare_copy`) and the prepared call
    #: kept while the views' addresses and layouts hold (GPUs: the arguments are addresses).
    #: Not on CPU, where a copy holds its tensors: a fresh tensor at an old address is another
    #: tensor.
    prepares_copies: ClassVar[bool] = False
    #: :meth:`prepare_copies` submits several copies of one queue in ONE call whose copies run
    #: concurrently (CUDA >= 12.8: ``cudaMemcpyBatchAsync``), so the executor may put every
    #: copy queue's work on one queue (:func:`ficco.executor.lowering.coalesce`); else a queue's copies
    #: are one call each, in order, and the plan's copy queues stay apart.
    batches_copies: bool = False
    #: :meth:`plan_events` gives the same events to every call of one compiled plan, so event
    #: records and waits are bound once (:meth:`prepare_record`, :meth:`prepare_wait`).
    reuses_plan_events: ClassVar[bool] = False
    #: 2-D peer copies run on DMA engines (ROCm: no, ``hipMemcpy2DAsync`` uses compute units);
    #: the device profile's ``copy_2d_on_dma`` follows it.
    copy_2d_on_dma: ClassVar[bool] = True
    #: :meth:`before_dma` and :meth:`fence` have work to do (GPUs: a released barrier's error
    #: is raised or fenced after the call that hit it returned); else the runtime skips them.
    guards_dma: ClassVar[bool] = False
    #: :meth:`signal_batch` takes flag-barrier *templates*: ops whose value is None stand for
    #: the barrier deadline's ``target`` (the call's flag, which changes every call), so one
    #: program per channel serves every call (ficco.symm_mem.barrier); else the programs come
    #: with their values filled in.
    signal_templates: ClassVar[bool] = False
    #: :meth:`keep_alive` has work to do (set for every class that overrides it); else the
    #: executor skips it.
    keeps_alive: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.keeps_alive = cls.keep_alive is not Backend.keep_alive

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

    def device_module(self) -> Any:
        """torch's module of :attr:`device_type` (``torch.cuda``, ``torch.xpu``…): its streams,
        events, synchronize, properties and random state."""
        return torch.get_device_module(self.device_type)

    def fp8_forms(self) -> tuple[torch.dtype, ...]:
        """The fp8 dtypes this device's matrix units multiply, preferred first (the OCP forms
        here; MI300's CDNA3 takes only the fnuz ones)."""
        return (torch.float8_e4m3fn, torch.float8_e5m2)

    # -- queues and events ------------------------------------------------------------------
    @abstractmethod
    def queue(self, name: str) -> Any:
        """The queue for a plan queue name: "compute", "copy{i}", "comm". "compute" is the
        caller's current stream on GPUs. Copy queues beyond what exists wrap around. Its form
        is the backend's: a worker thread (CPU), a ``Stream`` of :meth:`device_module` (GPUs)."""

    def lane(self) -> Any:
        """A set of queues of its own for one session (a group's calls), so calls on two
        groups never share a queue, an abort switch or a stream: one group's barrier never
        holds the other's work. None: this backend's queues are shared."""
        return None

    def queues(self, names: tuple[str, ...], lane: Any = None) -> list:
        """:meth:`queue` of every name of one call, on ``lane`` (:meth:`lane`; None: the shared
        queues): the executor's per-call lookup; GPUs read their settings once here."""
        return [self.queue(name) for name in names]

    def close_lane(self, lane: Any) -> None:
        """Release ``lane``'s queues once they ran what they hold (its session was dropped)."""

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

    def prepare_record(self, event: Any) -> Callable[[Any], None]:
        """:meth:`record` of ``event`` as one call of the queue (bound once per compiled plan
        where :attr:`reuses_plan_events`)."""
        return lambda queue: self.record(event, queue)

    def prepare_wait(self, event: Any) -> Callable[[Any], None]:
        """:meth:`wait` on ``event`` as one call of the queue."""
        return lambda queue: self.wait(event, queue)

    # -- work -------------------------------------------------------------------------------
    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, queue: Any) -> None:
        """DMA copy of a contiguous block (1D) on a copy engine when ``queue`` is a copy queue."""

    @abstractmethod
    def copy_2d(self, dst: torch.Tensor, src: torch.Tensor, queue: Any) -> None:
        """DMA copy of a 2-D block whose rows are contiguous but whose row pitch
        (``stride(0)``) may differ between ``src`` and ``dst`` (cudaMemcpy2DAsync-style)."""

    def prepare_copy(self, dst: torch.Tensor, src: torch.Tensor,
                     two_d: bool = False) -> Callable[[Any], None]:
        """The copy of ``src`` into ``dst`` as one ready call of the queue (kept per bound plan
        where :attr:`prepares_copies`)."""
        copy = self.copy_2d if two_d else self.copy
        return lambda queue: copy(dst, src, queue)

    def prepare_copies(self, pairs: list) -> Callable[[Any], None]:
        """Copies ``[(dst, src, two_d), ...]`` of one queue as one ready call of the queue (a
        batched submission where :attr:`batches_copies`; here one prepared copy after the
        other)."""
        calls = [self.prepare_copy(dst, src, two_d) for dst, src, two_d in pairs]

        def run(queue) -> None:
            for call in calls:
                call(queue)
        return run

    @abstractmethod
    def gemm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool,
             queue: Any) -> None:
        """``out (+)= a @ b``. ``a`` and ``out`` may be 3-D strided-batched views."""

    def gemm_current(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                     accumulate: bool) -> None:
        """:meth:`gemm` on the compute queue (used where :attr:`compute_on_current`)."""
        self.gemm(a, b, out, accumulate, self.queue("compute"))

    @abstractmethod
    def launch(self, queue: Any, fn: Callable[[], None]) -> None:
        """Run host code ``fn`` in ``queue``'s order (collectives, local moves)."""

    def launch_current(self, fn: Callable[[], None]) -> None:
        """:meth:`launch` on the compute queue (used where :attr:`compute_on_current`)."""
        self.launch(self.queue("compute"), fn)

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

    @abstractmethod
    def finish(self, queues: list[Any], timeout_s: float | None = None) -> None:
        """End of one call: make the caller's compute queue wait for every other queue (GPU),
        or block until all queues drained and re-raise any worker error (CPU); ``timeout_s``:
        the call's FICCO_TIMEOUT (None: read it now), for a backend whose finish waits."""

    def keep_alive(self, buffers: Any) -> None:
        """End of one call, after :meth:`finish` (or :meth:`finish_failed`): the call's
        tensors (``buffers``) must outlive the work queued on them. Nothing here: a GPU's
        caching allocator hands a freed block only to work ordered after the caller's stream,
        which :meth:`finish` made wait for every queue; the CPU backend's finish drains its
        queues. A backend over host memory with queued work (the tests' fake GPU) holds them
        until that work ran."""

    def finish_failed(self, queues: list[Any]) -> None:
        """End of a call that raised while its plan was being enqueued (never raises): what
        its queues still hold must be ordered before the caller's next work (GPUs: the
        call's per-call tensors go back to the caller's stream's allocator while copies and
        collectives already queued on side streams may still write them). Nothing here."""

    # -- symmetric memory ---------------------------------------------------------------------
    @abstractmethod
    def symm_provider(self) -> Any:
        """The :class:`ficco.symm_mem.Provider` that allocates this backend's symmetric memory."""

    def close(self) -> None:
        """Release queues and handles; called by ``ficco.shutdown()`` and at exit."""

    def synchronize(self) -> None:
        """Block the host until all work queued so far has finished (benchmarks, tuning)."""

    def drain(self, lane: Any = None) -> None:
        """Block until ``lane``'s queues ran what they were given (bounded by FICCO_TIMEOUT;
        raises CommTimeoutError when they did not); default: :meth:`synchronize`."""
        self.synchronize()

    def cancel(self, lane: Any = None) -> None:
        """Make ``lane``'s queues (every lane's for None) skip what is left of a failed or
        interrupted call (CPU workers); a backend whose queued work cannot be skipped (GPU
        streams) does nothing."""

    def cancelled(self, lane: Any = None) -> bool:
        """Whether :meth:`cancel` (or a failed queue) told ``lane``'s queues to skip what is
        left."""
        return False

    def check_device(self, t: torch.Tensor, name: str) -> None:
        """Raise InvalidArgumentError when ``t`` (argument ``name``) lives on another device
        than the one this backend drives (GPUs: another GPU index)."""

    def before_dma(self, symm: Any, nbytes: int = 0, lane: Any = None) -> None:
        """Start of a dma call, before it allocates or enqueues anything (``symm``: the
        group's workspace, None before its first allocation; ``nbytes``: what the call needs
        of it; ``lane``: the session's queues, :meth:`lane`): raise what this backend must
        refuse now (GPUs: a graph capture it cannot replay, or one during which the
        workspace would have to be allocated), or what the group still owes from an earlier
        call whose error could not be raised by that call (GPUs: a barrier released after
        the call returned; its lowering of the error word is ordered after the session's
        last call). Here a failed call raised already."""

    def fence(self, outputs: list, symm: Any = None) -> None:
        """End of a dma call on group workspace ``symm``, after ``finish``: backends whose
        calls return before their barriers completed poison ``outputs`` when one of the
        group's barriers was released (GPUs, :mod:`ficco.backends.gpu.fence`). Here a
        released barrier has raised already."""

    def tensor_slot(self, t: torch.Tensor, index: int) -> Any:
        """Int32 ``t[index]`` as a slot for :meth:`signal_write` / :meth:`signal_wait` (the
        gated schedules' arrival flags): a (tensor, index) pair here, an address on GPUs."""
        return (t, index)

    def time_run(self, run: Callable[[], Any], lane: Any = None) -> float:
        """Seconds the work ``run`` enqueues on ``lane`` (:meth:`lane`) takes, from idle queues
        to its end (what the measuring selectors compare): here the host clock around it, the
        lane drained before and after; GPUs time it with events on the compute queue."""
        self.drain(lane)
        start = time.perf_counter()
        run()
        self.drain(lane)
        return time.perf_counter() - start

    def timing_blocked(self) -> str | None:
        """Why this rank cannot run and time a call now (GPUs: a graph is being captured, where
        a synchronize would break the capture), or None."""
        return None

    #: calls of a key after which a call's :meth:`stopped` watch may be read without waiting
    #: for its work (``auto``'s exploration reads its timings this many calls late): none
    #: here, where a call returns once its work ran
    timing_lag: int = 0

    def started(self) -> Any:
        """A watch started now around a call's own work, without a synchronize (``auto``'s
        exploration; read it with :meth:`seconds_of` once :meth:`stopped`): here the host
        clock, the call returning once its queues drained; GPUs record an event on the
        compute queue."""
        return time.perf_counter()

    def stopped(self, watch: Any) -> Any:
        """``watch`` (:meth:`started`) stopped after the call enqueued its work."""
        return time.perf_counter() - watch

    def seconds_of(self, watch: Any) -> float:
        """Seconds of a :meth:`stopped` watch (GPUs: waits for its end event, which a later
        call finds long done)."""
        return float(watch)

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Seconds between two recorded events of one call (tracing). Backends whose events
        carry no time raise BackendUnavailableError."""
        from ..errors import BackendUnavailableError

        raise BackendUnavailableError(f"the {self.name} backend does not time events")
