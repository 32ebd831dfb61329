"""The CUDA backend without a GPU: 2-D copy arguments for uneven chunks (checked by replaying
them as a byte-level memcpy2D against torch's strided copy), the cuda-python calls it makes
(against cuda.bindings' real signatures), check() messages, availability, and the shared
backend contract."""
from __future__ import annotations

import inspect
import random

import pytest
import torch

from ficco.backends.base import Backend
from ficco.backends.cuda import CudaBackend, CudaVendor
from ficco.backends.gpu.vendor import Copy2D, copy_2d_args
from ficco.backends.rocm import RocmBackend
from ficco.errors import BackendCallError, BackendUnavailableError, InvalidArgumentError
from ficco.plan.problem import Problem


def replay_memcpy_2d(args: Copy2D, base: int, memory: bytearray) -> None:
    """What cudaMemcpy2DAsync does with ``args``, on a byte array whose address 0 is ``base``."""
    for row in range(args.height):
        s = args.src - base + row * args.spitch
        d = args.dst - base + row * args.dpitch
        memory[d: d + args.width] = memory[s: s + args.width]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k,world", [(8, 64, 4), (13, 10, 3), (5, 3, 4), (7, 24, 8), (1, 9, 2)])
def test_copy_2d_args_for_uneven_column_chunks(dtype, m, k, world):
    """Every column chunk of every peer's shard from one M x K buffer into another: the replayed
    arguments reproduce torch's strided copy exactly, and pitches/widths are what they say."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = torch.zeros(2, world * m, k, dtype=dtype)
    buf[0] = torch.randn(world * m, k).to(dtype)          # source half, random
    src, dst = buf[0], buf[1]
    memory = bytearray(buf.view(torch.uint8).numpy().tobytes())
    base = buf.data_ptr()
    problem = Problem(m=m, k=k, ns=(1,), dtype="float32", world=world, rank=0)
    for peer in range(world):
        rows = slice(peer * m, (peer + 1) * m)
        for c0, nc in problem.col_chunks():
            args = copy_2d_args(dst[rows, c0:c0 + nc], src[rows, c0:c0 + nc])
            if nc == 0:
                assert args is None
                continue
            assert (args.dpitch, args.spitch) == (k * itemsize, k * itemsize)
            assert (args.width, args.height) == (nc * itemsize, m)
            assert args.src == base + (peer * m * k + c0) * itemsize
            assert args.dst == base + (world * m * k + peer * m * k + c0) * itemsize
            replay_memcpy_2d(args, base, memory)
    replayed = torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(2, world * m, k)
    assert torch.equal(replayed[1], src)


def test_copy_2d_args_between_different_pitches():
    """A stage buffer (pitch = chunk width) filled from a column chunk of a wider buffer."""
    wide = torch.randn(6, 40)
    stage = torch.empty(6, 8)
    args = copy_2d_args(stage, wide[:, 16:24])
    assert (args.dpitch, args.spitch, args.width, args.height) == (32, 160, 32, 6)
    assert args.src == wide.data_ptr() + 16 * 4


def test_copy_2d_args_rejects_what_no_2d_copy_can_do():
    t = torch.randn(4, 6)
    with pytest.raises(InvalidArgumentError, match="same shape"):
        copy_2d_args(t[:, :2], t[:, :3])
    with pytest.raises(InvalidArgumentError, match="unit-stride, non-overlapping rows"):
        copy_2d_args(t.t()[:, :2], t.t()[:, 2:4])
    # stride-0 rows (an expanded tensor) would be read past their one row as if pitched
    with pytest.raises(InvalidArgumentError, match="non-overlapping rows.*strides \\(0, 1\\)"):
        copy_2d_args(t[:, :3], t[:1, :3].expand(4, 3))


class Recorder:
    """Stands in for a cuda.bindings module: records calls, returns success."""

    def __init__(self, real, result=(0,)):
        self._real, self.calls, self._result = real, [], result

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        def record(*args):
            self.calls.append((name, args))
            return self._result
        return record


def signature_params(fn) -> list[str]:
    """Parameter names from a cuda-python function's docstring signature line."""
    first = fn.__doc__.strip().splitlines()[0]
    inside = first[first.index("(") + 1: first.rindex(")")]
    names = []
    for param in filter(None, (p.strip() for p in inside.split(","))):
        # "size_t dpitch" (C style) or "kind: cudaMemcpyKind" (annotated)
        names.append(param.split(":")[0].strip() if ":" in param else param.split()[-1])
    return names


def test_cuda_vendor_calls_match_cuda_python_signatures():
    from cuda.bindings import driver, runtime

    rt, drv = Recorder(runtime), Recorder(driver)
    vendor = CudaVendor(runtime=rt, driver=drv)
    vendor.copy_1d(0x1000, 0x2000, 4096, 77)
    vendor.copy_2d(Copy2D(dst=0x1000, dpitch=256, src=0x8000, spitch=512, width=64, height=3), 77)
    vendor.write_value32(77, 0x3000, 5)
    vendor.wait_value32(77, 0x3004, 5, False)
    vendor.wait_value32(77, 0x3008, 6, True)
    calls = dict(rt.calls + drv.calls)
    for name, args in calls.items():
        real = getattr(runtime, name, None) or getattr(driver, name)
        assert len(args) == len(signature_params(real)), (name, args, real.__doc__.splitlines()[0])
    assert calls["cudaMemcpyAsync"] == (0x1000, 0x2000, 4096,
                                        runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice, 77)
    assert calls["cudaMemcpy2DAsync"] == (0x1000, 256, 0x8000, 512, 64, 3,
                                          runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice, 77)
    assert calls["cuStreamWriteValue32"] == (
        77, 0x3000, 5, driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
    waits = [args for name, args in drv.calls if name == "cuStreamWaitValue32"]
    assert waits == [(77, 0x3004, 5, driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
                     (77, 0x3008, 6, driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ)]


def test_cuda_ipc_handle_bytes_round_trip():
    """The 64 handle bytes that travel between ranks rebuild the same cudaIpcMemHandle_t."""
    import ctypes

    from cuda.bindings import runtime

    handle_bytes = bytes(range(64))
    seen = {}

    class FakeRuntime(Recorder):
        def cudaIpcOpenMemHandle(self, handle, flags):
            seen["bytes"] = ctypes.string_at(handle.getPtr(), 64)
            seen["flags"] = flags
            return (0, 0xABC000)

    vendor = CudaVendor(runtime=FakeRuntime(runtime), driver=Recorder(__import__(
        "cuda.bindings.driver", fromlist=["driver"])))
    assert vendor.ipc_open(handle_bytes) == 0xABC000
    assert seen == {"bytes": handle_bytes, "flags": runtime.cudaIpcMemLazyEnablePeerAccess}


def test_check_names_the_call_status_and_meaning():
    """A real cuda-python call with real arguments: on this GPU-less machine it returns an
    error status (never a TypeError), which check() turns into a named BackendCallError."""
    from cuda.bindings import runtime

    vendor = CudaVendor()
    status = runtime.cudaError_t.cudaErrorInvalidValue
    with pytest.raises(BackendCallError, match=r"cudaMemcpy2DAsync failed with status 1 "):
        vendor.check("cudaMemcpy2DAsync", (status,))
    assert vendor.check("cudaMalloc", (runtime.cudaError_t.cudaSuccess, 1234)) == 1234
    args = Copy2D(dst=0, dpitch=64, src=0, spitch=64, width=64, height=1)
    if not torch.cuda.is_available():
        with pytest.raises(BackendCallError, match="cudaMemcpy2DAsync failed with status"):
            vendor.copy_2d(args, 0)


def test_cuda_backend_reports_itself_unavailable_here():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    reason = CudaBackend.unavailable_reason()
    assert reason and ("CPU-only build" in reason or "no CUDA device" in reason)
    with pytest.raises(BackendUnavailableError, match="cuda backend cannot run here"):
        CudaBackend()


def test_cuda_says_unavailable_under_rocm_torch_and_rocm_under_cuda_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.41133-dd7f95766", raising=False)
    assert "ROCm build" in CudaBackend.unavailable_reason()
    assert "FICCO_BACKEND=rocm" in CudaBackend.unavailable_reason()
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0", raising=False)
    assert "not a ROCm build" in RocmBackend.unavailable_reason()


def public_methods(cls) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(getattr(cls, name)) for name in dir(Backend)
            if not name.startswith("_") and callable(getattr(Backend, name))}


def test_cuda_and_rocm_backends_expose_the_same_contract():
    for cls in (CudaBackend, RocmBackend):
        assert issubclass(cls, Backend)
        assert not getattr(cls, "__abstractmethods__", None), cls.__abstractmethods__
        assert list(inspect.signature(cls.__init__).parameters) == ["self", "device"]
    assert public_methods(CudaBackend) == public_methods(RocmBackend)
    for name, sig in public_methods(Backend).items():
        assert list(public_methods(CudaBackend)[name].parameters) == list(sig.parameters), name
    assert (CudaBackend.name, RocmBackend.name) == ("cuda", "rocm")


# -- The barrier program as driver calls (one cuStreamBatchMemOp per barrier) --------
class _PadHandle:
    """Slots of a pretend group: rank ``rank`` of ``world``, pads 4 KiB apart from 0x10000."""

    def __init__(self, rank, world):
        self.rank, self.world, self._programs = rank, world, {}

    def slot(self, owner, channel, writer):
        return 0x10000 + 0x1000 * owner + 4 * (channel * self.world + writer)


def test_flag_barrier_is_one_batch_mem_op_with_the_protocols_fields():
    from cuda.bindings import driver, runtime

    from ficco.symm_mem.barrier import flag_program

    drv = Recorder(driver)
    vendor = CudaVendor(runtime=Recorder(runtime), driver=drv)
    handle = _PadHandle(rank=2, world=4)
    flag = random.randrange(2, 1 << 31)      # a call flag (from the call's digest)
    program = flag_program(handle, 1, flag)
    vendor.mem_ops(77, program, capturing=False)
    assert [name for name, _ in drv.calls] == ["cuStreamBatchMemOp"]
    _name, args = drv.calls[0]
    assert len(args) == len(signature_params(driver.cuStreamBatchMemOp))
    stream, count, params, flags = args
    assert (stream, count, flags) == (77, 12, 0) and len(params) == 12
    write, wait = (driver.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_32,
                   driver.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_32)
    seen = []
    for p in params:
        if p.operation == write:
            seen.append(("w", int(p.writeValue.address), int(p.writeValue.value),
                         int(p.writeValue.flags)))
        else:
            assert p.operation == wait
            seen.append(("g", int(p.waitValue.address), int(p.waitValue.value),
                         int(p.waitValue.flags)))
    eq = int(driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ)
    want = ([("w", handle.slot(p, 1, 2), flag, 0) for p in range(4)]     # my flag at every peer
            + [("g", handle.slot(2, 1, p), flag, eq) for p in range(4)]  # each of mine: my flag
            + [("w", handle.slot(2, 1, p), 0, 0) for p in range(4)])    # then cleared
    assert seen == want
    # built once: the same parameter objects come back for the same (cached) program
    assert vendor.batch_params(flag_program(handle, 1, flag))[0][0] is params[0]
    # another call's flag is another program
    assert vendor.batch_params(flag_program(handle, 1, flag ^ 1))[0][0] is not params[0]


def test_single_signal_ops_are_plain_calls_and_leave_the_barrier_cache_alone():
    """A single flag write or wait (the gated schedules' arrival flags: GpuBackend's
    signal_write makes a fresh one-op tuple per call) went through the batch-parameter cache,
    keyed by the tuple's id: every call built new parameters and added an entry, and past
    4096 entries the cache was cleared, the barrier programs' parameters with it (rebuilt at
    their next barrier). A single op is one cuStreamWriteValue32 / cuStreamWaitValue32 call
    and the cache keeps what it had."""
    from cuda.bindings import driver, runtime

    from ficco.symm_mem.barrier import WAIT, WRITE, SignalOp, flag_program

    drv = Recorder(driver)
    vendor = CudaVendor(runtime=Recorder(runtime), driver=drv)
    handle = _PadHandle(rank=1, world=4)
    program = flag_program(handle, 0, 7)
    params = vendor.batch_params(program)[0][0]
    drv.calls.clear()
    for i in range(4200):
        vendor.mem_ops(3, (SignalOp(WRITE, 0x20000 + 4 * (i % 8), i, -1),), capturing=False)
    vendor.mem_ops(3, (SignalOp(WAIT, 0x20000, 5, -1, True),), capturing=False)
    names = [name for name, _ in drv.calls]
    assert names == ["cuStreamWriteValue32"] * 4200 + ["cuStreamWaitValue32"], set(names)
    assert vendor.batch_params(program)[0][0] is params
    assert len(vendor._batches) == 1


def test_large_groups_split_the_batch_and_capture_uses_single_calls():
    from cuda.bindings import driver, runtime

    from ficco.symm_mem.barrier import flag_program

    drv = Recorder(driver)
    vendor = CudaVendor(runtime=Recorder(runtime), driver=drv)
    program = flag_program(_PadHandle(rank=0, world=100), 0)       # 300 ops
    vendor.mem_ops(5, program, capturing=False)
    assert [args[1] for _, args in drv.calls] == [255, 45]
    drv.calls.clear()
    vendor.mem_ops(5, program, capturing=True)    # the capture path verified on H100
    names = [name for name, _ in drv.calls]
    assert names == ["cuStreamWriteValue32"] * 100 + ["cuStreamWaitValue32"] * 100 + \
        ["cuStreamWriteValue32"] * 100


# -- Peer views must be views, never copies ---------------------------------------
def test_tensor_at_refuses_a_copy_and_falls_back_to_a_real_view(monkeypatch):
    from ficco.symm_mem import device as dev

    memory = torch.arange(64, dtype=torch.uint8)
    address = memory.data_ptr()
    # A torch that infers the device from the pointer: as_tensor copies.
    monkeypatch.setattr(dev, "wrap_interface", lambda a, n, d: memory.clone())
    monkeypatch.setattr(dev, "wrap_storage", lambda a, n, d: memory)
    got = dev.tensor_at(address, 64, torch.device("cpu"))
    assert got.data_ptr() == address
    monkeypatch.setattr(dev, "wrap_storage", lambda a, n, d: memory.clone())
    with pytest.raises(BackendCallError, match="without a copy"):
        dev.tensor_at(address, 64, torch.device("cpu"))
    assert dev.is_view_of(memory, address, torch.device("cpu"))
    assert not dev.is_view_of(memory[1:], address, torch.device("cpu"))


# -- The watchdog's deadline counts from arrival; its death is surfaced --------
class _Event:
    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done

    def synchronize(self):
        pass


class _Port:
    """A WatchdogPort that records what the watchdog asks of it."""

    def __init__(self, fail_bind=False):
        self.released, self.errors, self.fail_bind = [], [], fail_bind

    def bind_thread(self):
        if self.fail_bind:
            raise RuntimeError("no device")

    def new_event(self):
        return _Event()

    def reader(self, deadline):
        return lambda slot: 0

    def release(self, deadline, ops):
        self.released.append(deadline)

    def died(self, error):
        self.errors.append(error)


def _dog(port):
    from ficco.backends.gpu.watchdog import Watchdog, WatchdogPort

    WatchdogPort.register(_Port)
    return Watchdog(port)


def test_watchdog_deadline_starts_when_the_stream_reaches_the_barrier():
    import time

    from ficco.backends.gpu.watchdog import PendingBarrier
    from ficco.symm_mem.barrier import Deadline

    port = _Port()
    dog = _dog(port)
    arrived, done = _Event(False), _Event(False)
    item = PendingBarrier(arrived, done, Deadline(0, 0, 3, 0.05, 1), None)
    dog.watch(item)
    time.sleep(0.3)               # long past 0.05 s since enqueue, but not yet arrived
    assert port.released == [] and item.deadline.started is None
    arrived.done = True
    for _ in range(200):
        if port.released:
            break
        time.sleep(0.01)
    assert port.released == [item.deadline] and item.how == "expired"
    dog.stop()


def test_a_dead_watchdog_thread_is_reported_not_swallowed():
    import time

    from ficco.backends.gpu.watchdog import PendingBarrier
    from ficco.symm_mem.barrier import Deadline

    port = _Port(fail_bind=True)
    dog = _dog(port)
    dog.watch(PendingBarrier(_Event(), _Event(), Deadline(0, 0, 0, 1.0, 1), None))
    for _ in range(200):
        if port.errors:
            break
        time.sleep(0.01)
    assert port.errors and "watchdog thread died" in str(port.errors[0])
    assert "no device" in str(port.errors[0])


def test_an_input_on_another_gpu_than_the_backends_is_a_clear_error():
    """Without torch.cuda.set_device(local_rank) every rank binds GPU 0."""
    from ficco.backends.gpu import GpuBackend

    class Bound:
        name, device_type, _device = "cuda", "cuda", torch.device("cuda", 0)


    class OnGpu1:     # only .device is read
        device = torch.device("cuda", 1)

    with pytest.raises(InvalidArgumentError, match=r"a_shard is on cuda:1 .* drives cuda:0.*"
                                                   r"torch.cuda.set_device\(local_rank\)"):
        GpuBackend.check_device(Bound(), OnGpu1(), "a_shard")

    class OnGpu0:
        device = torch.device("cuda", 0)

    GpuBackend.check_device(Bound(), OnGpu0(), "a_shard")


def test_a_captured_workspace_is_never_closed():
    """Growth after capture keeps the captured workspace mapped."""
    from ficco.symm_mem import workspace

    class Captured:
        captured, closed = True, False

        def close(self):
            self.closed = True

    handle = Captured()
    workspace.close(handle, drained=True)
    assert not handle.closed and workspace.kept(handle)


def test_host_pad_registration_calls_match_cuda_python_signatures():
    from cuda.bindings import driver, runtime

    class Runtime(Recorder):
        def cudaHostGetDevicePointer(self, host, flags):
            self.calls.append(("cudaHostGetDevicePointer", (host, flags)))
            return (runtime.cudaError_t.cudaSuccess, host + 0x1000)

    rt = Runtime(runtime)
    vendor = CudaVendor(runtime=rt, driver=Recorder(driver))
    vendor.host_register(0x5000, 4096)
    assert vendor.host_device_pointer(0x5000) == 0x6000
    vendor.host_unregister(0x5000)
    calls = dict(rt.calls)
    for name, args in calls.items():
        assert len(args) == len(signature_params(getattr(runtime, name))), name
    assert calls["cudaHostRegister"] == (0x5000, 4096, int(runtime.cudaHostRegisterMapped) |
                                         int(runtime.cudaHostRegisterPortable))
    assert calls["cudaHostGetDevicePointer"] == (0x5000, 0)
    assert calls["cudaHostUnregister"] == (0x5000,)


def test_a_host_barrier_does_not_block_on_a_dead_watchdog():
    import threading

    from ficco.backends.gpu.watchdog import PendingBarrier
    from ficco.symm_mem.barrier import Deadline

    port = _Port(fail_bind=True)
    dog = _dog(port)
    item = PendingBarrier(_Event(), _Event(), Deadline(0, 2, 0, 60.0, 1), None)
    dog.watch(item)
    waiter = threading.Thread(target=dog.wait_done, args=(item,), daemon=True)
    waiter.start()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and port.errors


def test_eager_barrier_records_arrival_then_program_then_done(monkeypatch):
    """GpuBackend's enqueue path without a GPU: arrived event, one vendor mem_ops call with the
    whole program, done event, one watched item carrying the deadline."""
    from ficco.backends.gpu import GpuBackend
    from ficco.symm_mem.barrier import Deadline, flag_program

    log = []

    class Ev:
        def __init__(self, name):
            self.name = name

        def record(self, queue):
            log.append(("record", self.name, queue.cuda_stream))

    class Dog:
        def __init__(self):
            self.names, self.watched = iter(["arrived", "done"]), []

        def event(self):
            return Ev(next(self.names))

        def watch(self, item):
            self.watched.append(item)

    class Vendor:
        def mem_ops(self, stream, ops, capturing):
            log.append(("mem_ops", len(ops), stream, capturing))

    class Fake:
        name, captures_signals = "cuda", True
        vendor, _watchdog = Vendor(), Dog()
        dm, native = torch.cuda, GpuBackend.native     # torch's device module, stream handle

    class Queue:
        cuda_stream = 0x77

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    handle = _PadHandle(rank=0, world=8)
    program = flag_program(handle, 0)
    deadline = Deadline(0, 0, 2, 5.0, 1, tuple(op for op in program if op.kind == "wait"))
    fake = Fake()
    GpuBackend.enqueue_signals(fake, Queue(), program, deadline)
    assert log == [("record", "arrived", 0x77), ("mem_ops", 24, 0x77, False),
                   ("record", "done", 0x77)]
    (item,) = fake._watchdog.watched
    assert item.deadline is deadline and item.deadline.started is None


def test_gpu_backend_refuses_a_torch_without_mm_out_dtype(monkeypatch):
    """The GPU GEMMs with float32 partial sums are torch.mm(..., out_dtype=)
    (torch >= 2.8 on CUDA); an older torch is refused when the backend starts, naming it, not
    at the first bf16 reduce-scatter."""
    from .. import fake_gpu

    class MmWithoutDtype:            # torch.ops.aten.mm before aten::mm.dtype existed
        default = torch.ops.aten.mm.default

    monkeypatch.setattr(torch.ops.aten, "mm", MmWithoutDtype())
    try:
        with pytest.raises(BackendUnavailableError, match=r"torch\.mm\(\.\.\., out_dtype=\)"):
            fake_gpu.install()
    finally:
        fake_gpu.uninstall()
