"""What NVIDIA and AMD GPUs share, written once: streams and events from ``torch.cuda`` (torch's
ROCm build exposes HIP through the same module), GEMMs through torch (cuBLAS / hipBLASLt),
stream-ordered barriers over signal pads with a host-side deadline, and symmetric memory over
IPC handles. The vendor packages (:mod:`ficco.backends.cuda`, :mod:`ficco.backends.rocm`) only
supply a :class:`Vendor`: the handful of runtime calls torch does not expose.

Queues are torch streams::

    compute  = the caller's current stream (so CUDA graph capture and user streams compose)
    copy{i}  = a pool of side streams, one per index asked for (one per peer with the FiCCO
               schedules), wrapping around at FICCO_COPY_ENGINES when that is set
    comm     = one side stream; process-group collectives run with it current

Each session (a group's calls) has its own pool of copy and comm streams (:meth:`lane`), so a
barrier of one group never holds another group's copies on a shared stream.
"""
from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ... import config
from ...errors import BackendUnavailableError, FiccoError, InvalidArgumentError
from ...symm_mem.barrier import WAIT, WRITE, Deadline, SignalOp
from ...symm_mem.torch_symm import AutoSymmProvider
from ..base import Backend
from .fence import poison_if_raised
from .rescue import Rescue
from .vendor import Copy2D, Vendor, copy_call_args, copy_nothing
from .watchdog import PendingBarrier, Watchdog


# -- the backend ---------------------------------------------------------------------------------
def torch_lacks_gpu_gemms() -> str | None:
    """Why this torch cannot run the GPU backends' GEMMs, or None: a GEMM whose output is wider
    than its bf16/fp16 inputs (float32 partial sums, rounded once) is ``torch.mm(...,
    out_dtype=)``, torch's ``aten::mm.dtype`` (torch >= 2.8 on CUDA).

    >>> torch_lacks_gpu_gemms() is None        # every torch ficco accepts (>= 2.11) has it
    True
    """
    if hasattr(torch.ops.aten.mm, "dtype"):
        return None
    return (f"torch {torch.__version__} has no torch.mm(..., out_dtype=) (aten::mm.dtype, torch "
            f">= 2.8), which ficco's GPU GEMMs with float32 partial sums need; install torch "
            f">= 2.11, the oldest ficco has run on")


class GpuBackend(Backend):
    """Everything of a GPU backend but the vendor calls; subclasses set ``name`` and
    ``make_vendor`` and answer ``unavailable_reason``."""

    make_vendor: Callable[[], Vendor]
    #: torch's ROCm build exposes HIP through ``torch.cuda`` as well
    device_type = "cuda"
    #: a stream's native handle, as the vendor's calls take it (``Stream.cuda_stream``)
    native: ClassVar[Any] = operator.attrgetter("cuda_stream")
    # The compute queue is the caller's current stream; copies are driver calls on addresses;
    # plan events are one reused set per compiled plan; a released barrier's error reaches
    # the group's next call and the call's outputs (see Backend).
    compute_on_current = prepares_copies = reuses_plan_events = guards_dma = True
    #: whether stream memory operations can be captured into graphs (HIP cannot: CLR has no
    #: capture path for hipStreamWaitValue32/WriteValue32, so a replay would skip barriers)
    captures_signals = True

    def __init__(self, device=None) -> None:
        reason = type(self).unavailable_reason() or torch_lacks_gpu_gemms()
        if reason is not None:
            raise BackendUnavailableError(f"the {self.name} backend cannot run here: {reason}")
        #: torch's module of the device type (torch.cuda…): every stream, event and
        #: synchronize goes through it
        self.dm = self.device_module()
        self._device = self._torch_device(device)
        self.vendor = type(self).make_vendor()
        self.vendor.bind_device(self._device.index)
        self.batches_copies = self.vendor.batches_copies
        self._copy_streams: dict[int, Any] = {}
        self._comm_stream: Any = None
        self._side_stream: Any = None
        self._shared_lane: dict = {}   # the caller's stream of the last call on no lane
        self._provider = AutoSymmProvider(self)
        # Failures of a group live with the group (its workspace's GroupFault);
        # only the watchdog's own death concerns every group.
        self._died: FiccoError | None = None
        self._watchdog = Watchdog(Rescue(self._device, self.vendor, self.bind_thread,
                                         self._watchdog_died, self.dm, self.native))
        self._plan_events: dict = {}
        self._join_events: dict = {}   # (stream handle, capturing) -> event, for finish()

    def device(self):
        return self._device

    def _torch_device(self, device) -> torch.device:
        """The torch device this backend drives: ``device``'s index, else the current one."""
        index = self.dm.current_device() if device is None else torch.device(device).index
        return torch.device(self.device_type, self.dm.current_device() if index is None
                            else index)

    def bind_thread(self) -> None:
        self.dm.set_device(self._device)
        self.vendor.bind_device(self._device.index)

    def check_device(self, t: torch.Tensor, name: str) -> None:
        """Clear error when ``t`` lives on another GPU than the one this backend drives (every
        rank would otherwise bind GPU 0 when nobody called ``set_device``)."""
        if t.device.type != self.device_type or t.device.index != self._device.index:
            raise InvalidArgumentError(
                f"{name} is on {t.device} but ficco's {self.name} backend of this process drives "
                f"{self._device}; call torch.{self.device_type}.set_device(local_rank) before "
                f"the first ficco "
                f"call (or move {name} to {self._device})")

    # -- queues and events --------------------------------------------------------------------
    def queue(self, name):
        """The stream for plan queue ``name``. The executor orders side streams after the
        caller's current stream with one entry event per call (so work there never overtakes
        the caller's producers of the inputs, and under graph capture the side streams join
        the capture)."""
        self._raise_died()
        return self._queue(name, config.copy_engines() if name.startswith("copy") else None)

    def lane(self):
        """A session's own side streams: its copy streams by index and its comm stream."""
        return {}

    def queues(self, names, lane=None):
        """:meth:`queue` of every name of one call, FICCO_COPY_ENGINES read once (the
        executor's per-call lookup; reading a setting costs about a microsecond)."""
        self._raise_died()
        engines = config.copy_engines()
        current = self.dm.current_stream(self._device)   # the compute queue
        self._after_last_call(self._shared_lane if lane is None else lane, current)
        return [current if name == "compute" else self._queue(name, engines, lane)
                for name in names]

    def _after_last_call(self, lane, current) -> None:
        """A call whose caller's stream is not the last call's (same session): make it wait
        for everything the last call's stream holds (that call joined its side streams into
        it). The workspace is the session's, not the caller's: without this, this call's
        compute-stream work (the serial all-gather's publish into ``gathered``, the
        reduce-scatter GEMMs writing the symmetric partials) runs beside the last call's
        GEMMs and reductions reading that memory, and before its closing barrier told the
        peers' pulls are done. Not while capturing: ``torch.cuda.graph`` synchronizes the
        device before it begins, and a capture may not wait on an event recorded outside."""
        if self.dm.is_current_stream_capturing():
            return
        last = lane.get("caller")
        if last is None or last == current:
            lane["caller"] = current
            return
        event = lane.get("caller_event")
        if event is None:
            event = lane["caller_event"] = self.dm.Event()
        event.record(last)
        current.wait_event(event)
        lane["caller"] = current

    def _queue(self, name, engines, lane=None):
        if name == "compute":
            return self.dm.current_stream(self._device)
        copy = name.startswith("copy") and name[4:].isdigit()
        if lane is not None and (copy or name == "comm"):   # a session's own streams
            key = int(name[4:]) % (engines or 1 << 30) if copy else name
            stream = lane.get(key)
            if stream is None:
                stream = lane[key] = self.dm.Stream(self._device)
            return stream
        if name == "comm":
            if self._comm_stream is None:
                self._comm_stream = self.dm.Stream(self._device)
            return self._comm_stream
        if copy:
            index = int(name[4:])
            if engines is not None:
                index %= engines
            stream = self._copy_streams.get(index)
            if stream is None:
                stream = self._copy_streams[index] = self.dm.Stream(self._device)
            return stream
        raise InvalidArgumentError(f"unknown queue {name!r}; use compute, comm or copy<i>")

    def new_event(self):
        # Timing on (traces and benchmarks read elapsed times from these events), except
        # while a CUDA graph is being captured, where only plain events may be recorded.
        return self.dm.Event(enable_timing=not self.dm.is_current_stream_capturing())

    def plan_events(self, compiled, count):
        # Re-recording an event is how CUDA/HIP events are meant to be reused: a wait binds to
        # the record made before it, and within one call every event is recorded before it is
        # waited on. Timing off (cheaper records); traces make their own timed events. Calls
        # on one group are serialised by the runtime, so one set per compiled plan suffices.
        key = (id(compiled), self.dm.is_current_stream_capturing())
        cached = self._plan_events.get(key)
        if cached is None or cached[0] is not compiled or len(cached[1]) != count:
            if len(self._plan_events) > 1024:
                self._plan_events.clear()
            cached = self._plan_events[key] = (compiled, [self.dm.Event()
                                                          for _ in range(count)])
        return cached[1]

    def record(self, event, queue):
        event.record(queue)

    def wait(self, event, queue):
        queue.wait_event(event)

    def prepare_record(self, event):
        """:meth:`record` of a plan event as one call of the queue (bound once per plan)."""
        return event.record

    def prepare_wait(self, event):
        """:meth:`wait` of a plan event as one call of the queue (``Stream.wait_event`` only
        calls ``event.wait(stream)``)."""
        return event.wait

    def elapsed_s(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def time_run(self, run, lane=None) -> float:
        """Events on the compute queue (the caller's stream) around the work ``run`` enqueues,
        the device idle before (every lane's streams: ``lane`` needs no wait of its own): a
        plan's side streams join the compute queue before it ends (:meth:`finish`), so the end
        event follows all of it."""
        self.synchronize()
        stream = self.dm.current_stream(self._device)
        start = self.dm.Event(enable_timing=True)
        end = self.dm.Event(enable_timing=True)
        start.record(stream)
        run()
        end.record(stream)
        seconds = self.elapsed_s(start, end)
        self.synchronize()
        return seconds

    #: an exploring call's events are read two calls of its key later (by then long done)
    timing_lag = 2

    def started(self):
        """An event recorded on the compute queue (the caller's stream) before a call's work;
        no synchronize."""
        event = self.dm.Event(enable_timing=True)
        event.record(self.dm.current_stream(self._device))
        return event

    def stopped(self, watch):
        """``(start, end)``: the end event recorded after the call's work, which its side
        streams joined (:meth:`finish`)."""
        end = self.dm.Event(enable_timing=True)
        end.record(self.dm.current_stream(self._device))
        return watch, end

    def seconds_of(self, watch) -> float:
        return self.elapsed_s(*watch)

    def timing_blocked(self) -> str | None:
        if self.dm.is_current_stream_capturing():
            return "a CUDA/HIP graph is being captured (a synchronize would break it)"
        return None

    def synchronize(self) -> None:
        """Block until this device finished everything queued; raise the watchdog's death.
        A group's failure is raised by that group's next call (:meth:`before_dma`)."""
        self.dm.synchronize(self._device)
        self._raise_died()

    # -- work ---------------------------------------------------------------------------------
    def copy(self, dst, src, queue):
        self.prepare_copy(dst, src)(queue)

    def copy_2d(self, dst, src, queue):
        self.prepare_copy(dst, src, True)(queue)

    def prepare_copy(self, dst, src, two_d=False):
        """The copy of ``src`` into ``dst`` as one ready vendor call, a function of the queue:
        addresses, byte counts and 2-D pitches are computed now, once (the executor keeps it
        per bound plan while the views' addresses hold)."""
        args = copy_call_args(dst, src, two_d)
        if args is None:
            return copy_nothing
        native = self.native
        if type(args) is Copy2D:
            copy_2d = self.vendor.copy_2d
            return lambda queue: copy_2d(args, native(queue))
        copy_1d, (d, s, n) = self.vendor.copy_1d, args
        return lambda queue: copy_1d(d, s, n, native(queue))

    def prepare_copies(self, pairs):
        """Copies of one queue as one ready call of the queue: where the vendor batches
        copies, the 1-D ones in one :meth:`Vendor.copy_batch` and the 2-D ones in one
        :meth:`Vendor.copy_batch_2d` (one vendor call each while a graph is captured: the batch
        calls' capture has not run on a GPU here); else one vendor call per copy."""
        args = [copy_call_args(dst, src, two_d) for dst, src, two_d in pairs]
        flat = [a for a in args if a is not None and type(a) is not Copy2D]
        pitched = [a for a in args if type(a) is Copy2D]
        vendor = self.vendor
        copy_1d, copy_2d = vendor.copy_1d, vendor.copy_2d
        native = self.native
        if not self.batches_copies:
            def one_by_one(queue):
                stream = native(queue)
                for d, s, n in flat:
                    copy_1d(d, s, n, stream)
                for a in pitched:
                    copy_2d(a, stream)
            return one_by_one
        batch, batch_2d = vendor.copy_batch, vendor.copy_batch_2d
        dsts, srcs, sizes = ([a[i] for a in flat] for i in range(3))
        capturing = self.dm.is_current_stream_capturing

        def batched(queue):
            stream = native(queue)
            if capturing():
                for d, s, n in flat:
                    copy_1d(d, s, n, stream)
                for a in pitched:
                    copy_2d(a, stream)
                return
            if len(flat) > 1:
                batch(dsts, srcs, sizes, stream)
            elif flat:
                copy_1d(dsts[0], srcs[0], sizes[0], stream)
            if len(pitched) > 1:
                batch_2d(pitched, stream)
            elif pitched:
                copy_2d(pitched[0], stream)
        return batched

    def gemm(self, a, b, out, accumulate, queue):
        if out.numel() == 0:
            return
        with self._on(queue):
            self.gemm_current(a, b, out, accumulate)

    def gemm_current(self, a, b, out, accumulate):
        """:meth:`gemm` on the current stream: the executor's compute-queue GEMMs (the compute
        queue is the caller's current stream while the executor enqueues), so no stream is
        looked up or entered per GEMM."""
        if out.numel() == 0:
            return
        if out.dtype != a.dtype:
            # A wider (fp32) output for bf16/fp16 inputs: the GEMM writes its fp32 result
            # unrounded and partial sums add up in fp32; the caller rounds once.
            prod = torch.mm(a, b, out_dtype=out.dtype) if a.dim() == 2 else \
                torch.bmm(a, b.expand(a.shape[0], *b.shape), out_dtype=out.dtype)
            out.add_(prod) if accumulate else out.copy_(prod)
            return
        beta = 1 if accumulate else 0  # beta 0 never reads ``out`` (NaN poison stays out)
        if a.dim() == 2:
            out.addmm_(a, b, beta=beta)
        else:
            # One strided-batched GEMM over equally spaced row blocks; B broadcast with a
            # zero batch stride so nothing is copied.
            out.baddbmm_(a, b.expand(a.shape[0], *b.shape), beta=beta)

    def launch(self, queue, fn):
        with self._on(queue):
            fn()

    def launch_current(self, fn):
        """:meth:`launch` on the current stream (the executor's compute-queue host tasks,
        such as the reduce-scatter's reductions): no stream lookup per task."""
        fn()

    def _on(self, queue):
        # Switching streams costs host time per op; GEMMs mostly run on the current stream.
        if queue == self.dm.current_stream(self._device):
            return contextlib.nullcontext()
        return self.dm.stream(queue)

    # -- signals: the primitives of ficco.symm_mem.barrier ---------------------------------
    def signal_write(self, queue, slot, value):
        self.signal_batch(queue, (SignalOp(WRITE, slot, value, -1),), None)

    def signal_wait(self, queue, op, deadline):
        self.signal_batch(queue, (op,), deadline)

    def signal_batch(self, queue, ops, deadline):
        self.enqueue_signals(queue, ops, deadline)

    def enqueue_signals(self, queue, ops, deadline: Deadline | None):
        capturing = self.dm.is_current_stream_capturing()
        if capturing and not self.captures_signals:
            raise self.capture_refusal()    # before_dma refuses earlier; never mid-capture
        if capturing:
            # Graphs are replayed without a host watching them; the runtime must keep this
            # memory alive while such a graph exists.
            owner = deadline.handle if deadline is not None else None
            if owner is not None:
                owner.captured = True
            self.vendor.mem_ops(self.native(queue), ops, True)
            return None
        watched = deadline is not None and any(op.kind == WAIT for op in ops)
        if not watched:
            self.vendor.mem_ops(self.native(queue), ops, False)
            return None
        arrived, done = self._watchdog.event(), self._watchdog.event()
        arrived.record(queue)
        self.vendor.mem_ops(self.native(queue), ops, False)
        done.record(queue)
        item = PendingBarrier(arrived, done, deadline, queue)
        self._watchdog.watch(item)
        return item

    def signal_now(self, ops, deadline):
        """Host barrier: the program runs on a private stream; the host waits for it."""
        self._raise_died()
        item = self.enqueue_signals(self._side(), ops, deadline)
        if item is not None:
            self._watchdog.wait_done(item)
        self._raise_died()
        if deadline.fired:
            # This barrier expired (or its group had failed): raise now, and only once.
            error = self._take(deadline.handle) if deadline.handle is not None else None
            raise error if error is not None else deadline.error([])

    def capture_refusal(self) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"the {self.name} backend cannot capture cross-rank barriers into a graph (its "
            f"stream memory operations are not captured, so a replay would run without "
            f"barriers and race); run multi-rank calls eagerly or with FICCO_TRANSPORT=ccl "
            f"under graph capture")

    # -- a group's failures (ficco.symm_mem.fault) ------------------------------------------
    def before_dma(self, symm, nbytes: int = 0, lane=None) -> None:
        """Start of a dma call, before it allocates or enqueues anything: refuse a graph
        capture this backend cannot replay (HIP: refusing later would break the caller's
        capture) or one during which the group's workspace must be
        allocated or grown to ``nbytes``; order the caller's stream after the last call's of
        the session (``lane``, :meth:`_after_last_call`); then raise what the group still
        owes: the error of an earlier call's released barrier or of a gated GEMM that gave
        up. ``symm`` is the group's workspace, None before its first allocation.

        The ordering comes first because everything after it is enqueued on the caller's
        stream and touches what the last call may still be using: the error word's lowering
        (the last call's fence, still queued on its stream, must see the word raised) and
        the FICCO_POISON fill of the symmetric buffers (the last call's GEMMs and the peers'
        pulls still read them)."""
        self._raise_died()
        if self.dm.is_current_stream_capturing():
            if not self.captures_signals:
                raise self.capture_refusal()
            if symm is None or symm.nbytes < nbytes:
                # Allocating synchronizes the device, frees the old workspace and maps
                # peers' memory: each of these ends the caller's capture with an opaque
                # error. Refused here, with nothing captured yet.
                raise InvalidArgumentError(
                    f"this dma call needs {nbytes} bytes of symmetric workspace per rank and "
                    f"the group has {symm.nbytes if symm is not None else 0}: it cannot be "
                    f"allocated during a CUDA graph capture. Run the call (at the largest "
                    f"shape the graph will use) once eagerly on every rank before capturing")
        self._after_last_call(self._shared_lane if lane is None else lane,
                              self.dm.current_stream(self._device))
        if symm is not None:
            error = self._take(symm)
            if error is not None:
                raise error

    def raise_pending(self, symm) -> None:
        """Raise the group's pending error now (tests, tools); as :meth:`before_dma`."""
        self.before_dma(symm)

    def _take(self, symm) -> FiccoError | None:
        """The group's pending error, consumed, with its error word lowered in stream order
        (fences already queued still see it raised)."""
        fault = symm.fault
        if fault is None:
            return None
        error = fault.gated_error() if fault.error is None else None
        if error is not None:
            return error
        if not fault.failed():
            return None
        error = fault.take()
        if self.dm.is_current_stream_capturing():
            fault.lower()
        else:
            self.vendor.write_value32(self.native(self.dm.current_stream(self._device)),
                                      fault.address, 0)
        return error

    def _watchdog_died(self, error: FiccoError) -> None:
        self._died = error

    def _raise_died(self) -> None:
        if self._died is not None:
            error, self._died = self._died, None
            raise error

    def fence(self, outputs, symm=None) -> None:
        """End of an eager dma call, on the caller's stream: its outputs become NaN if the
        group's error word is raised when the stream gets there (:mod:`.fence`)."""
        if symm is None or symm.fault is None or self.dm.is_current_stream_capturing():
            return        # a replayed graph has no watchdog: nothing can raise the word
        poison_if_raised(outputs, symm.fault.word_device)

    def tensor_slot(self, t: torch.Tensor, index: int) -> int:
        """The device address of int32 ``t[index]``, as signal primitives take slots."""
        return t.data_ptr() + 4 * index

    def _side(self) -> Any:
        if self._side_stream is None:
            self._side_stream = self.dm.Stream(self._device)
        return self._side_stream

    def finish(self, queues, timeout_s=None):
        """The caller's stream waits for every side stream: one reused event per stream
        (``wait_stream`` would create an event per stream per call)."""
        compute = self.dm.current_stream(self._device)
        capturing = self.dm.is_current_stream_capturing()
        native = self.native
        joined = {native(compute)}
        for q in queues:
            handle = native(q)
            if handle in joined:   # the compute stream, or copy queues wrapped onto one stream
                continue
            joined.add(handle)
            # Kept apart for captures, as plan_events are; a wait binds to the record made
            # right before it, so re-recording next call is safe.
            key = (handle, capturing)
            event = self._join_events.get(key)
            if event is None:
                event = self._join_events[key] = self.dm.Event()
            event.record(q)
            compute.wait_event(event)

    def finish_failed(self, queues):
        """The caller's stream waits for the side streams of a call that raised mid-enqueue,
        as :meth:`finish` (no host wait: a side stream held by a barrier is released by the
        watchdog at its deadline). The call's recv buffers, outputs and temporaries go back
        to the caller's stream's caching allocator when the exception drops them; without the
        join, copies already queued (peers' partials pulled into recv) would write into
        whatever the caller's next kernel is given there."""
        with contextlib.suppress(Exception):   # the call's own error is the one to raise
            self.finish(queues)

    def symm_provider(self):
        return self._provider

    def close(self):
        self._watchdog.stop()
        self._copy_streams.clear()
        self._join_events.clear()
        self._shared_lane.clear()
        self._comm_stream = self._side_stream = None
