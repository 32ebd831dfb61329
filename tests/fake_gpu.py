"""A GPU made of host threads, so the GPU backend's host logic (``GpuBackend``, the compiled
plan binding, the watchdog, the error word, the fence) runs multi-rank on CPU in CI.

What is modelled, because ficco's GPU code relies on it:

- **hardware queues.** Streams are dealt to ``hw_queues`` queues round-robin as they are made
  (CUDA_DEVICE_MAX_CONNECTIONS, ROCm's GPU_MAX_HW_QUEUES). A queue runs its commands one at a
  time in submission order, so a stream memory wait at its head blocks every stream that
  shares it (head-of-line blocking: the reason a rescue through a stream can hang).
- **stream memory operations** over host memory: an int32 store, and a wait that polls an
  int32 until it is >= or == a value (``cuStreamWriteValue32`` / ``cuStreamWaitValue32``).
- **events**: record / wait / query / synchronize, a wait binding to the last record made.
- **kernels**: the torch work the backend issues (GEMMs, host tasks, the fence, the gated GEMM)
  runs in stream order on the CPU (:class:`FakeGpuBackend` queues it on the current stream).
- **memory**: allocations are unlinked /dev/shm files, so IPC handles (``pid:fd``) open in
  other rank processes and nothing outlives them; freed or closed memory is poisoned, and a copy or memory operation touching
  it later is a device fault raised by the next ``synchronize``.
- **graph capture**: work issued while capturing is recorded; ``replay`` issues it again;
  a synchronize during capture invalidates the capture, as on CUDA.
- **device-side argument checks**: what a real device refuses of its tensors, though these
  are host tensors: ficco's own GPU-only checks and code paths run
  (``ficco.plan.epilogue.device_side`` answers True), and ``torch._scaled_mm`` refuses what cuBLASLt does (:func:`checked_scaled_mm`:
  fp8 operands, mat1's K and mat2's dimensions multiples of 16, mat1 row-major and mat2
  column-major, row-wise scales 16-byte aligned); a stream memory operation refuses an address
  that is not 4-byte aligned or a value outside 32 bits; work issued while capturing may not
  query an event or allocate device memory (CUDA refuses both in a capture).
- **blocking host calls** (``Stream.synchronize``, ``Event.synchronize``, device
  synchronize) are logged per thread, so a test can assert the watchdog thread never blocks.

Use ``install(vendor="cuda", hw_queues=8)`` in a process (rank functions call :func:`ensure`,
which reads ``FICCO_FAKE_GPU`` = ``"cuda:8"``), then ``ficco`` runs on the fake backend; the
tensors are CPU tensors. :func:`uninstall` stops it.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import queue as queue_mod
import threading
import time
import uuid

import torch

SHM_DIR = "/dev/shm"
_tls = threading.local()


class DeviceFault(RuntimeError):
    """What a real device would report as an illegal address or a failed command."""


class _Stopped(BaseException):
    """Unblocks the device's threads at uninstall."""


# -- memory ---------------------------------------------------------------------------------------
class Memory:
    """/dev/shm-backed allocations, shared with other processes through their descriptors
    (``/proc/<pid>/fd/<fd>``, as ficco's host pads are): each file is unlinked as soon as it is
    made, so nothing outlives the processes. Nothing is ever unmapped (a late command must
    fault, not crash the process); freed ranges are poisoned (0xFF: NaN as floats, -1 as int32)
    and remembered."""

    def __init__(self):
        self._lock = threading.Lock()
        self.live: dict[int, tuple[int, int | None]] = {}  # address -> (end, own descriptor)
        self.dead: list[tuple[int, int, str]] = []         # (start, end, why)
        self._maps: list = []

    def _map(self, fd: int) -> tuple[int, int]:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        view = (ctypes.c_char * size).from_buffer(m)
        self._maps.append((m, view))
        return ctypes.addressof(view), size

    def alloc(self, nbytes: int) -> int:
        path = os.path.join(SHM_DIR, f"ficco-fakegpu-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)          # only descriptors keep it: nothing outlives the processes
        os.ftruncate(fd, max(nbytes, 1))
        address, size = self._map(fd)
        with self._lock:
            self.live[address] = (address + size, fd)
        return address

    def export(self, address: int) -> bytes:
        return f"{os.getpid()}:{self.live[address][1]}".encode().ljust(64, b"\0")

    def open(self, handle: bytes) -> int:
        pid, fd = bytes(handle).rstrip(b"\0").decode().split(":")
        peer_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        try:
            address, size = self._map(peer_fd)
        finally:
            os.close(peer_fd)
        with self._lock:
            self.live[address] = (address + size, None)
        return address

    def release(self, address: int, why: str) -> None:
        with self._lock:
            end, fd = self.live.pop(address)
            self.dead.append((address, end, why))
        ctypes.memset(address, 0xFF, end - address)
        if fd is not None:
            os.close(fd)

    def check(self, address: int, nbytes: int, what: str) -> None:
        with self._lock:
            for start, end, why in self.dead:
                if start < address + max(nbytes, 1) and address < end:
                    raise DeviceFault(f"{what} touches {address:#x} (+{nbytes} bytes): memory "
                                      f"{why} (illegal address)")

    def close(self) -> None:
        for _, fd in list(self.live.values()):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _read32(address: int) -> int:
    return ctypes.c_int32.from_address(address).value


def _write32(address: int, value: int) -> None:
    ctypes.c_int32.from_address(address).value = ctypes.c_int32(value).value


# -- the device: hardware queues, streams, events, capture ----------------------------------------
class Device:
    def __init__(self, hw_queues: int = 8, sms: int = 16):
        self.hw_queues, self.sms = hw_queues, sms
        self.memory = Memory()
        self.faults: list[BaseException] = []
        self.blocking: list[tuple[str, str]] = []    # (thread name, call) of blocking host calls
        self.cond = threading.Condition()
        self.stopped = False
        self._retired: list = []   # commands run since every queue was last idle
        self._fifos = [queue_mod.SimpleQueue() for _ in range(hw_queues)]
        self._threads = [threading.Thread(target=self._loop, args=(f,), daemon=True,
                                          name=f"fakegpu-hwq{i}")
                         for i, f in enumerate(self._fifos)]
        for t in self._threads:
            t.start()
        self.streams: dict[int, FakeStream] = {}
        self.made = 0
        self.default = FakeStream(self)

    # commands --------------------------------------------------------------------------------
    def submit(self, stream: FakeStream, fn) -> None:
        graph = getattr(_tls, "capture", None)
        if graph is not None:
            graph.nodes.append((stream, fn, False))
            return
        # commands this thread submitted (submitted()): a GPU runtime call each
        _tls.submitted = getattr(_tls, "submitted", 0) + 1
        with self.cond:
            stream.pending += 1
        self._fifos[stream.hw].put((stream, fn))

    def _loop(self, fifo):
        while True:
            stream, fn = fifo.get()
            if fn is None:
                return
            _tls.stream = stream
            try:
                if not self.stopped:
                    fn()
            except _Stopped:
                pass
            except BaseException as exc:  # noqa: BLE001 - a device fault, raised at sync
                with self.cond:
                    self.faults.append(exc)
            finally:
                with self.cond:
                    stream.pending -= 1
                    # The command's references (the tensors a host task closed over) live
                    # until a host wait finds every queue idle: a CUDA caching allocator hands
                    # a freed block only to work ordered after the work that used it, whereas
                    # the CPU allocator would hand it at once to a command of another queue
                    # while a copy engine still reads it by address. They are dropped on the
                    # host thread (:meth:`host_wait`), as CUDA programs free their tensors, so
                    # no finalizer runs on a queue's thread.
                    self._retired.append(fn)
                    self.cond.notify_all()
                fn = None

    def spin(self, ready, what: str) -> None:
        """Block the calling hardware queue until ``ready()`` (a stream wait)."""
        nap = 2e-5
        while not ready():
            if self.stopped:
                raise _Stopped()
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)

    def host_wait(self, done, what: str) -> None:
        """A blocking host call: logged with the calling thread's name."""
        self.blocking.append((threading.current_thread().name, what))
        with self.cond:
            while not done():
                if self.stopped:
                    raise _Stopped()
                self.cond.wait(0.01)
            retired = []
            if all(s.pending == 0 for s in list(self.streams.values())):
                retired, self._retired = self._retired, []
        del retired          # outside the lock: a finalizer may take other locks

    def synchronize(self) -> None:
        graph = getattr(_tls, "capture", None)
        if graph is not None:
            graph.invalidated = "synchronize() during capture"
            raise RuntimeError("operation not permitted when stream is capturing")
        self.host_wait(lambda: all(s.pending == 0 for s in list(self.streams.values())),
                       "device synchronize")
        if self.faults:
            fault = self.faults.pop(0)
            raise DeviceFault(f"fake device fault: {type(fault).__name__}: {fault}")

    def stop(self) -> None:
        self.stopped = True
        for f in self._fifos:
            f.put((None, None))
        for t in self._threads:
            t.join(timeout=5)
        self.memory.close()


class FakeStream:
    def __init__(self, device=None, priority=0):
        dev = _device() if not isinstance(device, Device) else device
        self.device = dev
        self.hw = dev.made % dev.hw_queues
        dev.made += 1
        self.cuda_stream = 0x5000 + 0x10 * dev.made
        self.pending = 0
        dev.streams[self.cuda_stream] = self

    def enqueue(self, fn) -> None:
        self.device.submit(self, fn)

    def wait_event(self, event) -> None:
        event.wait(self)

    def synchronize(self) -> None:
        self.device.host_wait(lambda: self.pending == 0, "Stream.synchronize")

    def query(self) -> bool:
        return self.pending == 0

    def __eq__(self, other):
        return isinstance(other, FakeStream) and other.cuda_stream == self.cuda_stream

    def __hash__(self):
        return self.cuda_stream


class FakeEvent:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.recorded = 0     # records enqueued
        self.reached = 0      # records the stream reached
        self.time_s = None

    def record(self, stream=None):
        stream = stream or current_stream()
        graph = getattr(_tls, "capture", None)
        if graph is not None:     # an event node: completes per replay
            self.graph, self.replays = graph, set()
            graph.nodes.append((stream, lambda run: self.replays.add(run), True))
            return
        self.recorded += 1
        gen = self.recorded

        def mark():
            self.time_s = time.perf_counter()
            self.reached = max(self.reached, gen)
            self._done(gen)
        stream.enqueue(mark)

    def wait(self, stream=None):
        stream = stream or current_stream()
        graph = getattr(_tls, "capture", None)
        if graph is not None and getattr(self, "graph", None) is graph:
            dev = stream.device
            graph.nodes.append((stream, lambda run: dev.spin(lambda: run in self.replays,
                                                             "event node"), True))
            return
        gen = self.recorded
        dev = stream.device
        stream.enqueue(lambda: dev.spin(lambda: self._reached(gen), "event wait"))

    def query(self) -> bool:
        if getattr(_tls, "capture", None) is not None:
            raise RuntimeError("cudaEventQuery while the stream is capturing: operation not "
                               "permitted when stream is capturing")
        return self._reached(self.recorded)

    def synchronize(self) -> None:
        gen = self.recorded
        _device().host_wait(lambda: self._reached(gen), "Event.synchronize")

    # Records of one event on several streams complete in any order; a wait (as CUDA's)
    # binds to the record made before it, which a later record's completion says nothing of.
    def _done(self, gen: int) -> None:
        done = self.__dict__.setdefault("done_gens", set())
        done.add(gen)

    def _reached(self, gen: int) -> bool:
        return gen == 0 or gen in self.__dict__.get("done_gens", ())

    def elapsed_time(self, end) -> float:
        return (end.time_s - self.time_s) * 1000.0


class FakeGraph:
    """What ``capture`` recorded; ``replay()`` issues it again, in order."""

    def __init__(self):
        self.nodes: list = []      # (stream, fn, whether fn takes the replay number)
        self.invalidated: str | None = None
        self.runs = 0

    def replay(self) -> None:
        assert self.invalidated is None, self.invalidated
        self.runs += 1
        run = self.runs
        for stream, fn, per_run in self.nodes:
            stream.device.submit(stream, (lambda f=fn: f(run)) if per_run else fn)


@contextlib.contextmanager
def capture():
    """Record every command this thread issues (``torch.cuda.graph`` stand-in)."""
    graph = FakeGraph()
    _tls.capture = graph
    try:
        yield graph
    finally:
        _tls.capture = None


def current_stream(device=None) -> FakeStream:
    return getattr(_tls, "stream", None) or _device().default


@contextlib.contextmanager
def stream_context(s):
    saved = getattr(_tls, "stream", None)
    _tls.stream = s
    try:
        yield
    finally:
        _tls.stream = saved


# -- the vendor: copies and memory operations as stream commands -----------------------------------
def vendor_class(vendor_name: str):
    from ficco.backends.gpu.vendor import Vendor
    from ficco.symm_mem.barrier import WRITE

    class FakeVendor(Vendor):
        name = vendor_name

        def __init__(self):
            self.dev = _device()
            self.calls: list[tuple[str, int]] = []     # (call, stream) in issue order
            # cudaMemcpyBatchAsync / cudaMemcpy3DBatchAsync (CUDA >= 12.8): one command whose
            # copies run in any order (here: the reverse of theirs)
            self.batches_copies = _state.get("batch_copies", False)

        def _describe(self, status):
            return str(status)

        def bind_device(self, index):
            pass

        def relax_capture_mode(self):
            pass

        def _on(self, stream: int, call: str, fn):
            self.calls.append((call, stream))
            self.dev.streams[stream].enqueue(fn)

        def copy_1d(self, dst, src, nbytes, stream):
            def run():
                self.dev.memory.check(src, nbytes, "copy source")
                self.dev.memory.check(dst, nbytes, "copy destination")
                ctypes.memmove(dst, src, nbytes)
            self._on(stream, "copy_1d", run)

        def copy_2d(self, args, stream):
            def run():
                for row in range(args.height):
                    s, d = args.src + row * args.spitch, args.dst + row * args.dpitch
                    self.dev.memory.check(s, args.width, "2-D copy source")
                    self.dev.memory.check(d, args.width, "2-D copy destination")
                    ctypes.memmove(d, s, args.width)
            self._on(stream, "copy_2d", run)

        def copy_batch(self, dsts, srcs, sizes, stream):
            if not self.batches_copies:
                return Vendor.copy_batch(self, dsts, srcs, sizes, stream)
            moves = list(zip(dsts, srcs, sizes))

            def run():
                for dst, src, nbytes in reversed(moves):
                    self.dev.memory.check(src, nbytes, "copy source")
                    self.dev.memory.check(dst, nbytes, "copy destination")
                    ctypes.memmove(dst, src, nbytes)
            self._on(stream, "copy_batch", run)

        def copy_batch_2d(self, copies, stream):
            if not self.batches_copies:
                return Vendor.copy_batch_2d(self, copies, stream)

            def run():
                for args in reversed(copies):
                    for row in range(args.height):
                        s, d = args.src + row * args.spitch, args.dst + row * args.dpitch
                        self.dev.memory.check(s, args.width, "2-D copy source")
                        self.dev.memory.check(d, args.width, "2-D copy destination")
                        ctypes.memmove(d, s, args.width)
            self._on(stream, "copy_batch_2d", run)

        def write_value32(self, stream, address, value):
            _check_word(address, value, "cuStreamWriteValue32")

            def run():
                self.dev.memory.check(address, 4, "stream write")
                _write32(address, value)
            self._on(stream, "write_value32", run)

        def wait_value32(self, stream, address, value, exact):
            _check_word(address, value, "cuStreamWaitValue32")

            def met():
                self.dev.memory.check(address, 4, "stream wait")
                seen = _read32(address)
                return seen == value if exact else seen >= value
            self._on(stream, "wait_value32",
                     lambda: self.dev.spin(met, f"wait {address:#x}"))

        def mem_ops(self, stream, ops, capturing):
            for op in ops:
                if op.kind == WRITE:
                    self.write_value32(stream, op.slot, op.value)
                else:
                    self.wait_value32(stream, op.slot, op.value, op.exact)

        def malloc(self, nbytes):
            if getattr(_tls, "capture", None) is not None:
                raise DeviceFault("cudaMalloc while the stream is capturing: operation not "
                                  "permitted when stream is capturing")
            return self.dev.memory.alloc(nbytes)

        def free(self, address):
            self.dev.memory.release(address, "freed")

        def ipc_export(self, address):
            return self.dev.memory.export(address)

        def ipc_open(self, handle):
            return self.dev.memory.open(handle)

        def ipc_close(self, address):
            self.dev.memory.release(address, "closed (IPC import)")

        def host_register(self, address, nbytes):
            pass

        def host_device_pointer(self, address):
            return address       # unified addressing: the host address

        def host_unregister(self, address):
            pass

    return FakeVendor


# -- the device's own argument checks -------------------------------------------------------------
def _check_word(address: int, value: int, call: str) -> None:
    """What the driver refuses of a 32-bit stream memory operation: an address that is not
    4-byte aligned, a value that does not fit 32 bits (the binding's cuuint32_t)."""
    if address % 4:
        raise DeviceFault(f"{call}: address {address:#x} is not 4-byte aligned "
                          f"(CUDA_ERROR_INVALID_VALUE)")
    if not -2 ** 31 <= int(value) < 2 ** 32:
        raise OverflowError(f"{call}: value {value} does not fit 32 bits")


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def check_scaled_mm(mat1, mat2, scale_a, scale_b) -> None:
    """Raise RuntimeError where CUDA's ``torch._scaled_mm`` (cuBLASLt) refuses its arguments,
    though the CPU one would run them: fp8 operands, mat1's trailing dimension and both of
    mat2's multiples of 16, mat1 row-major and mat2 column-major (cuBLASLt multiplies only
    that pairing), row-wise scales float32 and 16-byte aligned."""
    for name, t in (("mat1", mat1), ("mat2", mat2)):
        if t.dtype not in _FP8:
            raise RuntimeError(f"Expected {name} to be a float8 matrix, got {t.dtype}")
    if mat1.shape[1] % 16:
        raise RuntimeError(f"the trailing dimension of mat1 must be a multiple of 16; mat1 is "
                           f"{tuple(mat1.shape)}")
    if mat2.shape[0] % 16 or mat2.shape[1] % 16:
        raise RuntimeError(f"both dimensions of mat2 must be multiples of 16; mat2 is "
                           f"{tuple(mat2.shape)}")
    row_major = mat1.stride(1) == 1 and mat1.stride(0) >= max(1, mat1.shape[1])
    col_major = mat2.stride(0) == 1 and mat2.stride(1) >= max(1, mat2.shape[0])
    if not (row_major and col_major):
        raise RuntimeError(f"cuBLASLt multiplies a row-major mat1 by a column-major mat2 only; "
                           f"got strides {mat1.stride()} and {mat2.stride()}")
    for name, sc in (("scale_a", scale_a), ("scale_b", scale_b)):
        if sc.dtype != torch.float32:
            raise RuntimeError(f"{name} must be float32, got {sc.dtype}")
        if sc.numel() > 1 and sc.data_ptr() % 16:
            raise RuntimeError(f"{name}: row-wise scales must be 16-byte aligned "
                               f"(address {sc.data_ptr():#x})")


def checked_scaled_mm(real):
    """``torch._scaled_mm`` as a device runs it: its checks first (:func:`check_scaled_mm`),
    then the CPU kernel."""
    def scaled_mm(mat1, mat2, scale_a, scale_b, *args, **kwargs):
        check_scaled_mm(mat1, mat2, scale_a, scale_b)
        return real(mat1, mat2, scale_a, scale_b, *args, **kwargs)
    scaled_mm.real = real  # type: ignore[attr-defined]
    return scaled_mm


def stream_ordered(real):
    """``real`` (torch work the caller issues on its stream after a plan, such as
    :func:`ficco.plan.epilogue.finish`'s rounding of the float32 outputs) run once the caller's
    stream got there: on a GPU those ops are kernels queued after the plan's work, whereas on
    the fake GPU's host tensors they would run at once, before the queued GEMMs wrote what they
    read. The caller waits for its stream instead (a logged blocking host call)."""
    def ordered(*args, **kwargs):
        if not capturing():
            current_stream().synchronize()
        return real(*args, **kwargs)
    ordered.real = real  # type: ignore[attr-defined]
    return ordered


# -- the backend -----------------------------------------------------------------------------------
def capturing() -> bool:
    """Whether this thread captures a graph on the fake device."""
    return getattr(_tls, "capture", None) is not None


def backend_class(vendor_name: str, base=None):
    """A CudaBackend / RocmBackend (or ``base``, a GpuBackend of another device module, with
    the ``vendor_name`` vendor's calls) whose torch work runs in stream order on the fake
    device."""
    from ficco.backends.cuda import CudaBackend
    from ficco.backends.gpu import GpuBackend
    from ficco.backends.rocm import RocmBackend

    if base is None:
        base = CudaBackend if vendor_name == "cuda" else RocmBackend

    class FakeGpuBackend(base):
        make_vendor = vendor_class(vendor_name)

        @classmethod
        def unavailable_reason(cls):
            return None

        @staticmethod
        def _torch_device(device):
            return torch.device("cpu")             # tensors are CPU tensors

        def target(self):
            return "cuda:sm_90" if vendor_name == "cuda" else "rocm:gfx942"

        def check_device(self, t, name):
            pass

        def gemm_current(self, a, b, out, accumulate):
            current_stream().enqueue(
                lambda: GpuBackend.gemm_current(self, a, b, out, accumulate))

        def launch(self, queue, fn):
            queue.enqueue(fn)

        def launch_current(self, fn):
            current_stream().enqueue(fn)

        def keep_alive(self, buffers):
            # Host tensors come from the CPU allocator, which reuses a freed block at once,
            # while a queued copy may still read or write it by address: the call's tensors
            # are retired with its commands (dropped once every queue was idle), as a device's
            # caching allocator reuses them only for work ordered after the call.
            if not capturing():
                device = _device()
                with device.cond:
                    device._retired.append(buffers)

        def fence(self, outputs, *args):
            if capturing():
                return GpuBackend.fence(self, outputs, *args)
            current_stream().enqueue(lambda: GpuBackend.fence(self, outputs, *args))

    return FakeGpuBackend


# -- install ---------------------------------------------------------------------------------------
_state: dict = {}
_MISSING = object()
_PATCHED = ("Stream", "Event", "current_stream", "stream", "current_device", "set_device",
            "synchronize", "is_current_stream_capturing", "get_device_properties",
            "get_device_capability", "device_count")


def _device() -> Device:
    return _state["device"]


class _Properties:
    def __init__(self, sms):
        self.multi_processor_count = sms
        self.name, self.gcnArchName, self.major, self.minor = "fake GPU", "gfx942", 9, 0


def install(vendor: str = "cuda", hw_queues: int = 8, sms: int = 16,
            batch_copies: bool = False, device_type: str = "cuda"):
    """Replace the streams and events of torch's ``device_type`` module (``torch.cuda``) by
    the fake device's and make the fake backend ficco's ``vendor`` backend
    (``FICCO_BACKEND=vendor``; a vendor other than cuda and rocm is a backend package of
    ``ficco.backends`` found by its name). Returns the device. ``batch_copies``: the vendor
    submits a queue's copies in one call (as CUDA >= 12.8)."""
    from ficco import backends

    uninstall()
    device = Device(hw_queues, sms)
    module = getattr(torch, device_type)
    _state.update(device=device, vendor=vendor, hw_queues=hw_queues, batch_copies=batch_copies,
                  module=module,
                  saved={name: getattr(module, name, _MISSING) for name in _PATCHED})
    patched = {"Stream": FakeStream, "Event": FakeEvent, "current_stream": current_stream,
               "stream": stream_context, "current_device": lambda: 0,
               "set_device": lambda d: None,
               "synchronize": lambda device=None: _device().synchronize(),
               "is_current_stream_capturing": capturing,
               "get_device_properties": lambda d=None: _Properties(_device().sms),
               "get_device_capability": lambda d=None: (9, 0), "device_count": lambda: 1}
    for name, value in patched.items():
        setattr(module, name, value)
    # the device's own argument checks, on host tensors
    from ficco.plan import epilogue as scaled

    _state["saved_checks"] = (scaled.device_side, torch._scaled_mm)
    scaled.device_side = lambda t: True
    torch._scaled_mm = checked_scaled_mm(torch._scaled_mm)
    # the caller's own torch work after a plan, in the caller's stream order
    from ficco.ops.all_gather_matmul import spec as ag_spec
    from ficco.ops.matmul_reduce_scatter import spec as rs_spec

    _state["saved_finish"] = [(m, m.finish) for m in (ag_spec, rs_spec)]
    for m, real in _state["saved_finish"]:
        m.finish = stream_ordered(real)
    os.environ["FICCO_BACKEND"] = vendor
    backends.install(vendor, _make(vendor))
    return device


def _make(vendor: str):
    """The fake backend of ``vendor``: cuda's or rocm's here, another one's from its package."""
    from ficco import backends

    if vendor in ("cuda", "rocm"):
        return backend_class(vendor)()
    return backends.backend_class(vendor)()


def uninstall() -> None:
    from ficco import backends

    if "device" not in _state:
        return
    backend = backends.install(_state["vendor"], None)
    if backend is not None:
        backend.close()
    _state["device"].stop()
    for name, value in _state["saved"].items():
        if value is _MISSING:
            delattr(_state["module"], name)
        else:
            setattr(_state["module"], name, value)
    if "saved_checks" in _state:
        from ficco.plan import epilogue as scaled

        scaled.device_side, torch._scaled_mm = _state["saved_checks"]
    for m, real in _state.get("saved_finish", ()):
        m.finish = real
    os.environ.pop("FICCO_BACKEND", None)
    _state.clear()


def ensure(vendor: str = "cuda", hw_queues: int = 8) -> Device:
    """The fake device of this process with this configuration, (re)installed as needed (rank
    functions call it first; ``ficco.shutdown()`` closes the backend, so a new one is made)."""
    from ficco import backends

    if _state.get("vendor") != vendor or _state.get("hw_queues") != hw_queues:
        install(vendor, hw_queues)
    elif not backends.installed(vendor):
        backends.install(vendor, _make(vendor))
    os.environ["FICCO_BACKEND"] = vendor
    return _device()


def device() -> Device:
    return _device()


def submitted() -> int:
    """Commands the calling thread submitted to the device so far (each a runtime call on a
    GPU: a copy or batch of copies, an event record or wait, a stream memory operation, a
    kernel)."""
    return getattr(_tls, "submitted", 0)


def installed() -> bool:
    """Whether a fake device is installed in this process."""
    return "device" in _state
