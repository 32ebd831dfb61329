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
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from .. import config
from ..errors import (BackendCallError, BackendUnavailableError, CommTimeoutError, FiccoError,
                      InvalidArgumentError)
from .base import Backend
from .gpu_symm import PLAN_CHANNELS, AutoSymmProvider, GpuSymmHandle



# -- the vendor layer ----------------------------------------------------------------------------
class Vendor(ABC):
    """The runtime calls torch does not expose. Pointers and streams are plain ints (a
    ``torch.cuda.Stream``'s ``cuda_stream``); every call goes through the vendor's ``check``."""

    name: str

    def check(self, call: str, result):
        """Raise :class:`BackendCallError` naming ``call``, the status code and its meaning;
        return the call's outputs (one value, a tuple, or None)."""
        status, *values = result if isinstance(result, tuple) else (result,)
        if int(status) != 0:
            raise BackendCallError(f"{call} failed with status {int(status)} "
                                   f"({self._describe(status)})")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    @abstractmethod
    def _describe(self, status) -> str:
        """The status code's name and meaning, as the vendor's runtime words them."""

    @abstractmethod
    def bind_device(self, index: int) -> None:
        """Make ``index`` the current device of the calling thread (for driver calls)."""

    @abstractmethod
    def relax_capture_mode(self) -> None:
        """Let the calling (watchdog) thread query events while another thread captures a
        graph; in the default 'global' capture mode that query would invalidate the capture."""

    @abstractmethod
    def copy_1d(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...

    @abstractmethod
    def copy_2d(self, args: "Copy2D", stream: int) -> None: ...

    @abstractmethod
    def write_value32(self, stream: int, address: int, value: int) -> None:
        """Stream-ordered store of ``value`` at ``address``, fenced after earlier work."""

    @abstractmethod
    def wait_value32_geq(self, stream: int, address: int, value: int) -> None:
        """Later work on ``stream`` waits until the int32 at ``address`` is >= ``value``."""

    @abstractmethod
    def malloc(self, nbytes: int) -> int: ...

    @abstractmethod
    def free(self, address: int) -> None: ...

    @abstractmethod
    def ipc_export(self, address: int) -> bytes:
        """The IPC handle of an allocation made by :meth:`malloc`, as bytes."""

    @abstractmethod
    def ipc_open(self, handle: bytes) -> int:
        """Map a peer process's allocation; returns its address in this process."""

    @abstractmethod
    def ipc_close(self, address: int) -> None: ...


def handle_bytes(address: int, size: int = 64) -> bytes:
    """The ``size`` bytes of a C handle struct at ``address`` (IPC handles are 64 bytes)."""
    return ctypes.string_at(address, size)


# -- argument construction, pure so it is tested without a GPU ----------------------------------
@dataclass(frozen=True)
class Copy2D:
    """cudaMemcpy2DAsync / hipMemcpy2DAsync arguments, all in bytes: ``height`` rows of
    ``width`` bytes from ``src`` (rows ``spitch`` apart) to ``dst`` (rows ``dpitch`` apart)."""

    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int


def _row_pitch_bytes(t: torch.Tensor, name: str) -> int:
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise InvalidArgumentError(
            f"copy_2d needs 2-D {name} views with contiguous rows; got shape {tuple(t.shape)} "
            f"strides {t.stride()}")
    return max(t.stride(0), t.shape[1]) * t.element_size()


def copy_2d_args(dst: torch.Tensor, src: torch.Tensor) -> Copy2D | None:
    """The 2-D copy that moves ``src`` into ``dst`` (same shape), or None when it is empty.

    >>> g = torch.empty(8, 10, dtype=torch.bfloat16)        # gathered buffer, K = 10
    >>> a = copy_2d_args(g[0:4, 3:6], g[4:8, 3:6])          # a 4 x 3 column chunk
    >>> (a.dpitch, a.spitch, a.width, a.height)
    (20, 20, 6, 4)
    """
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise InvalidArgumentError(
            f"copy_2d: dst {tuple(dst.shape)} {dst.dtype} and src {tuple(src.shape)} "
            f"{src.dtype} must have the same shape and dtype")
    if dst.numel() == 0:
        return None
    return Copy2D(dst=dst.data_ptr(), dpitch=_row_pitch_bytes(dst, "dst"),
                  src=src.data_ptr(), spitch=_row_pitch_bytes(src, "src"),
                  width=dst.shape[1] * dst.element_size(), height=dst.shape[0])


# -- barrier deadline ----------------------------------------------------------------------------
@dataclass(eq=False)
class _PendingBarrier:
    event: torch.cuda.Event
    deadline: float
    symm: GpuSymmHandle
    channel: int
    generation: int
    step: int
    timeout_s: float


class Watchdog:
    """A stream wait cannot time out, so a host thread watches every barrier still pending.
    Past its deadline it names the peers whose slots are short, releases the stream by writing
    the awaited value into those slots itself, and leaves the error for the next ficco call."""

    POLL_S = 0.002

    def __init__(self, backend: "GpuBackend"):
        self.backend = backend
        self._pending: list[_PendingBarrier] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    def watch(self, item: _PendingBarrier) -> None:
        with self._cv:
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ficco-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def _loop(self):
        self.backend.bind_thread()
        self.backend.vendor.relax_capture_mode()
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                items = list(self._pending)
            now = time.monotonic()
            done = []
            for item in items:
                if item.event.query():
                    done.append(item)
                elif now > item.deadline:
                    self.backend.expire(item)
                    done.append(item)
            with self._cv:
                self._pending = [i for i in self._pending if i not in done]
            time.sleep(self.POLL_S)

    def stop(self):
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)


# -- the backend ---------------------------------------------------------------------------------
class GpuBackend(Backend):
    """Everything of a GPU backend but the vendor calls; subclasses set ``name`` and
    ``make_vendor`` and answer ``unavailable_reason``."""

    make_vendor: Callable[[], Vendor]

    def __init__(self, device=None):
        reason = type(self).unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"the {self.name} backend cannot run here: {reason}")
        index = torch.cuda.current_device() if device is None else torch.device(device).index
        self._device = torch.device("cuda", torch.cuda.current_device() if index is None
                                    else index)
        self.vendor = type(self).make_vendor()
        self.vendor.bind_device(self._device.index)
        self._copy_streams: dict[int, torch.cuda.Stream] = {}
        self._comm_stream: torch.cuda.Stream | None = None
        self._side_stream: torch.cuda.Stream | None = None
        self._rescue_stream: torch.cuda.Stream | None = None
        self._provider = AutoSymmProvider(self)
        self._watchdog = Watchdog(self)
        self._error: FiccoError | None = None
        self._error_lock = threading.Lock()

    def device(self):
        return self._device

    def bind_thread(self) -> None:
        torch.cuda.set_device(self._device)
        self.vendor.bind_device(self._device.index)

    # -- queues and events --------------------------------------------------------------------
    def queue(self, name):
        """The stream for plan queue ``name``. A side stream (copy, comm) is returned ordered
        after everything already enqueued on the caller's current stream: the executor fetches
        its queues when a call starts, so work there never overtakes the caller's producers
        of the inputs, and under CUDA graph capture the side streams join the capture."""
        self.raise_pending()
        compute = torch.cuda.current_stream(self._device)
        if name == "compute":
            return compute
        if name == "comm":
            if self._comm_stream is None:
                self._comm_stream = torch.cuda.Stream(self._device)
            stream = self._comm_stream
        elif name.startswith("copy") and name[4:].isdigit():
            index = int(name[4:])
            engines = config.copy_engines()
            if engines is not None:
                index %= engines
            stream = self._copy_streams.get(index)
            if stream is None:
                stream = self._copy_streams[index] = torch.cuda.Stream(self._device)
        else:
            raise InvalidArgumentError(f"unknown queue {name!r}; use compute, comm or copy<i>")
        stream.wait_stream(compute)
        return stream

    def new_event(self):
        # Timing on (the executor's trace reads elapsed times from the same events), except
        # while a CUDA graph is being captured, where only plain events may be recorded.
        return torch.cuda.Event(enable_timing=not torch.cuda.is_current_stream_capturing())

    def record(self, event, queue):
        event.record(queue)

    def wait(self, event, queue):
        queue.wait_event(event)

    def elapsed_s(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)
        self.raise_pending()

    # -- work ---------------------------------------------------------------------------------
    def copy(self, dst, src, queue):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise InvalidArgumentError(f"copy: dst {tuple(dst.shape)} {dst.dtype} and src "
                                       f"{tuple(src.shape)} {src.dtype} differ")
        if dst.numel() == 0:
            return
        if not (dst.is_contiguous() and src.is_contiguous()):
            self.copy_2d(dst, src, queue)
            return
        self.vendor.copy_1d(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(),
                            queue.cuda_stream)

    def copy_2d(self, dst, src, queue):
        args = copy_2d_args(dst, src)
        if args is not None:
            self.vendor.copy_2d(args, queue.cuda_stream)

    def gemm(self, a, b, out, accumulate, queue):
        if out.numel() == 0:
            return
        beta = 1 if accumulate else 0  # beta 0 never reads ``out`` (NaN poison stays out)
        with self._on(queue):
            if a.dim() == 2:
                out.addmm_(a, b, beta=beta)
            else:
                # One strided-batched GEMM over equally spaced row blocks; B broadcast with a
                # zero batch stride so nothing is copied.
                out.baddbmm_(a, b.expand(a.shape[0], *b.shape), beta=beta)

    def launch(self, queue, fn):
        with self._on(queue):
            fn()

    def _on(self, queue):
        # Switching streams costs host time per op; GEMMs mostly run on the current stream.
        if queue == torch.cuda.current_stream(self._device):
            return contextlib.nullcontext()
        return torch.cuda.stream(queue)

    # -- cross-rank ---------------------------------------------------------------------------
    def barrier(self, symm, channel, queue, timeout_s, step):
        """A plan's barrier, capture-safe: every value it writes is a constant, so a CUDA graph
        holding it replays correctly. Each rank sets its flag (1) in every peer's slot, waits
        for all its own slots to hold 1, then clears its own slots (0). Clearing cannot erase a
        peer's next flag because plans alternate channels 0 and 1 with a dependency between
        them (pulls wait on barrier 0, barrier 1 waits on the pulls, and the next call's
        barrier 0 comes after this call's barrier 1 on every stream of the rank): a peer can
        only set a slot again after this rank has passed the other channel's barrier."""
        self.raise_pending()
        if channel not in PLAN_CHANNELS:
            raise InvalidArgumentError(f"plan barriers use channels {PLAN_CHANNELS}; got "
                                       f"{channel}")
        self._enqueue_barrier(symm, channel, queue, timeout_s, step, target=1, clear=True)

    def _enqueue_barrier(self, symm, channel, queue, timeout_s, step, *, target=None,
                         clear=False) -> _PendingBarrier:
        generation = symm.next_generation(channel) if target is None else target
        stream = queue.cuda_stream
        for peer in range(symm.world):
            self.vendor.write_value32(stream, symm.slot_address(peer, channel, symm.rank),
                                      generation)
        for peer in range(symm.world):
            self.vendor.wait_value32_geq(stream, symm.slot_address(symm.rank, channel, peer),
                                         generation)
        if clear:
            for peer in range(symm.world):
                self.vendor.write_value32(stream, symm.slot_address(symm.rank, channel, peer), 0)
        item = _PendingBarrier(torch.cuda.Event(), time.monotonic() + timeout_s, symm, channel,
                               generation, step, timeout_s)
        if not torch.cuda.is_current_stream_capturing():
            item.event.record(queue)
            self._watchdog.watch(item)
        return item

    def host_barrier(self, symm, channel, timeout_s, step) -> None:
        """Block the host until every rank reached this barrier (runs on a private stream)."""
        self.raise_pending()
        item = self._enqueue_barrier(symm, channel, self._side(), timeout_s, step)
        while not item.event.query():
            if time.monotonic() > item.deadline + 1.0:
                break
            time.sleep(0.0005)
        item.event.synchronize()  # the watchdog released it if a peer never came
        self.raise_pending()

    def expire(self, item: _PendingBarrier) -> None:
        """Called by the watchdog: a barrier's stream wait outlived its deadline."""
        symm = item.symm
        # Never the host-barrier stream: that one may be the stream stuck in this very wait.
        if self._rescue_stream is None:
            self._rescue_stream = torch.cuda.Stream(self._device)
        side = self._rescue_stream
        with torch.cuda.stream(side):
            slots = symm.signal_pad(symm.rank)[item.channel].to("cpu", non_blocking=False)
        late = [p for p in range(symm.world) if int(slots[p]) < item.generation]
        for peer in late:  # release the stuck stream so the process can go on
            self.vendor.write_value32(side.cuda_stream,
                                      symm.slot_address(symm.rank, item.channel, peer),
                                      item.generation)
        side.synchronize()
        where = f" at step {item.step}" if item.step >= 0 else ""
        error = CommTimeoutError(
            f"rank {symm.rank}{where}: barrier channel {item.channel} (generation "
            f"{item.generation}) waited {item.timeout_s:.1f}s for rank(s) {late or '?'} whose "
            f"signal slots held {[int(slots[p]) for p in late]}; those peers are dead or stuck. "
            f"Raise FICCO_TIMEOUT if they are only slow")
        with self._error_lock:
            if self._error is None:
                self._error = error

    def raise_pending(self) -> None:
        if self._error is None:
            return
        with self._error_lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _side(self) -> torch.cuda.Stream:
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self._device)
        return self._side_stream

    def finish(self, queues):
        self.raise_pending()
        compute = torch.cuda.current_stream(self._device)
        for q in queues:
            if q != compute:
                done = torch.cuda.Event()
                done.record(q)
                compute.wait_event(done)

    def symm_provider(self):
        return self._provider

    def close(self):
        self._watchdog.stop()
        self._copy_streams.clear()
        self._comm_stream = self._side_stream = self._rescue_stream = None
