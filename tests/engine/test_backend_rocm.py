"""The ROCm backend without an AMD GPU: every hip-python call it makes is checked against
hip-python's real generated signatures and enums (hip-python imports here; only the calls
would need libamdhip64), plus availability messages and version matching."""
from __future__ import annotations

import pytest
import torch

from ficco.backends.gpu.vendor import Copy2D
from ficco.backends.rocm import ALL_BITS, RocmBackend, RocmVendor, address_of, hip_python_mismatch
from ficco.errors import BackendCallError, BackendUnavailableError

hip = pytest.importorskip("hip", reason="hip-python is not installed").hip


def c_params(fn) -> list[str]:
    """Parameter names of a hip-python function, from its generated signature line."""
    first = fn.__doc__.strip().splitlines()[0]
    inside = first[first.index("(") + 1: first.rindex(")")]
    return [p.strip().split()[-1] for p in inside.split(",") if p.strip()]


class HipRecorder:
    """Stands in for ``hip.hip``: records each call bound to the real parameter names and
    answers with ``results[name]`` (default: success)."""

    def __init__(self, results=None):
        self.calls: dict[str, dict] = {}
        self.order: list[str] = []
        self.results = results or {}

    def __getattr__(self, name):
        real = getattr(hip, name)
        if not callable(real) or isinstance(real, type):
            return real

        def record(*args):
            params = c_params(real)
            assert len(args) == len(params), f"{name}{tuple(params)} called with {args}"
            self.calls[name] = dict(zip(params, args))
            self.order.append(name)
            result = self.results.get(name, (hip.hipError_t.hipSuccess,))
            return result.pop(0) if isinstance(result, list) else result
        return record


def test_memcpy_1d_uses_device_to_device_no_cu():
    rec = HipRecorder()
    RocmVendor(hip=rec).copy_1d(0x1000, 0x2000, 12288, 0x77)
    assert rec.calls["hipMemcpyAsync"] == {
        "dst": 0x1000, "src": 0x2000, "sizeBytes": 12288,
        "kind": hip.hipMemcpyKind.hipMemcpyDeviceToDeviceNoCU, "stream": 0x77}


def test_memcpy_2d_arguments_ask_for_what_runs():
    """hipMemcpy2DAsync runs on compute units whatever kind it is given: it is asked for
    DeviceToDevice (the NoCU request and its fallback were dead code)."""
    args = Copy2D(dst=0x1000, dpitch=48, src=0x9000, spitch=48, width=10, height=13)
    rec = HipRecorder()
    RocmVendor(hip=rec).copy_2d(args, 0x55)
    assert rec.calls["hipMemcpy2DAsync"] == {
        "dst": 0x1000, "dpitch": 48, "src": 0x9000, "spitch": 48, "width": 10, "height": 13,
        "kind": hip.hipMemcpyKind.hipMemcpyDeviceToDevice, "stream": 0x55}


def test_stream_signals_flags_and_mask():
    rec = HipRecorder()
    vendor = RocmVendor(hip=rec)
    vendor.write_value32(0x10, 0x3000, 9)
    vendor.wait_value32(0x10, 0x3004, 9, False)
    assert rec.calls["hipStreamWriteValue32"] == {"stream": 0x10, "ptr": 0x3000, "value": 9,
                                                  "flags": 0}
    wait = rec.calls["hipStreamWaitValue32"]
    assert wait == {"stream": 0x10, "ptr": 0x3004, "value": 9,
                    "flags": hip.hipStreamWaitValueGte, "mask": 0xFFFFFFFF}
    vendor.wait_value32(0x10, 0x3008, 7, True)      # a plan flag: exactly this call's
    assert rec.calls["hipStreamWaitValue32"] == {"stream": 0x10, "ptr": 0x3008, "value": 7,
                                                 "flags": hip.hipStreamWaitValueEq,
                                                 "mask": 0xFFFFFFFF}
    # the mask is ANDed with the slot: anything short of all ones would ignore counter bits
    assert ALL_BITS == (1 << 32) - 1


def test_ipc_handles_round_trip_through_bytes():
    handle = hip.hipIpcMemHandle_t.fromObj(bytearray(range(64)))
    rec = HipRecorder({"hipIpcGetMemHandle": (hip.hipError_t.hipSuccess, handle),
                       "hipIpcOpenMemHandle": (hip.hipError_t.hipSuccess, 0xBEEF000)})
    vendor = RocmVendor(hip=rec)
    exported = vendor.ipc_export(0x4000)
    assert exported == bytes(range(64))
    assert rec.calls["hipIpcGetMemHandle"] == {"devPtr": 0x4000}
    assert vendor.ipc_open(exported) == 0xBEEF000
    opened = rec.calls["hipIpcOpenMemHandle"]
    assert bytes(opened["handle"].reserved) == bytes(range(64))
    assert opened["flags"] == hip.hipIpcMemLazyEnablePeerAccess


def test_malloc_free_and_pointer_results():
    from rocm.bindings.util.types import Pointer

    rec = HipRecorder({"hipMalloc": (hip.hipError_t.hipSuccess, Pointer.fromObj(0x7000))})
    vendor = RocmVendor(hip=rec)
    assert vendor.malloc(100) == 0x7000 and rec.calls["hipMalloc"] == {"size": 100}
    vendor.free(0x7000)
    assert rec.calls["hipFree"] == {"ptr": 0x7000}
    assert address_of(0x123) == 0x123


def test_check_names_the_call_and_status():
    vendor = RocmVendor(hip=HipRecorder())
    with pytest.raises(BackendCallError, match=r"hipStreamWaitValue32 failed with status 1\b"):
        vendor.check("hipStreamWaitValue32", (hip.hipError_t.hipErrorInvalidValue,))
    rec = HipRecorder({"hipMemcpyAsync": (hip.hipError_t.hipErrorInvalidValue,)})
    with pytest.raises(BackendCallError, match="hipMemcpyAsync failed"):
        RocmVendor(hip=rec).copy_1d(1, 2, 3, 4)


def test_batch_copy_binding_is_not_used():
    """hip-python's generated hipMemcpyBatchAsync lacks dsts and sizes; the vendor never
    calls it (so a fixed binding is a measured opt-in later, not a silent change)."""
    assert "dsts" not in c_params(hip.hipMemcpyBatchAsync)
    used = {name for fn in vars(RocmVendor).values() if hasattr(fn, "__code__")
            for name in fn.__code__.co_names}
    assert "hipMemcpyAsync" in used and "hipMemcpyBatchAsync" not in used


def test_rocm_backend_reports_itself_unavailable_here():
    if getattr(torch.version, "hip", None):
        pytest.skip("this torch is a ROCm build")
    reason = RocmBackend.unavailable_reason()
    assert "not a ROCm build" in reason and "torch.version.hip" in reason
    with pytest.raises(BackendUnavailableError, match="rocm backend cannot run here"):
        RocmBackend()


def test_mismatched_hip_python_says_what_to_install(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(torch.version, "hip", "6.2.41133-dd7f95766", raising=False)
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "10.0.0" if name == "hip-python" else "0")
    reason = RocmBackend.unavailable_reason()
    assert "hip-python 10.0.0 does not match ROCm 6.2" in reason
    assert "hip-python~=6.2.0" in reason
    assert hip_python_mismatch("6.4.1", "6.4.0.552") is None


# -- Signal pads in the memory HIP documents for polled flags -------------------
def test_signal_pads_come_from_uncached_device_memory():
    from rocm.bindings.util.types import Pointer

    from ficco.backends.rocm import DEVICE_MALLOC_UNCACHED

    rec = HipRecorder({"hipExtMallocWithFlags": (hip.hipError_t.hipSuccess,
                                                 Pointer.fromObj(0x9000))})
    vendor = RocmVendor(hip=rec)
    assert vendor.malloc_signal(256) == 0x9000
    assert rec.calls["hipExtMallocWithFlags"] == {"sizeBytes": 256,
                                                  "flags": DEVICE_MALLOC_UNCACHED}
    # the value HIP's header gives hipDeviceMallocUncached, beside the ones hip-python exports
    assert (hip.hipDeviceMallocDefault, hip.hipDeviceMallocFinegrained,
            hip.hipMallocSignalMemory, DEVICE_MALLOC_UNCACHED) == (0, 1, 2, 3)
    assert "hipDeviceMallocUncached" in hip.hipExtMallocWithFlags.__doc__
    vendor.free_signal(0x9000)
    assert rec.calls["hipFree"] == {"ptr": 0x9000}


# -- ROCm before 6.1 has no hipMemcpyDeviceToDeviceNoCU ---------------------------
class _Rocm60Recorder(HipRecorder):
    """hip-python for ROCm 6.0: hipMemcpyKind without the NoCU kind."""

    class hipMemcpyKind:
        hipMemcpyDeviceToDevice = hip.hipMemcpyKind.hipMemcpyDeviceToDevice


def test_rocm_without_no_cu_copies_device_to_device_and_says_so():
    rec = _Rocm60Recorder()
    vendor = RocmVendor(hip=rec)
    assert vendor.copy_1d_on_dma is False
    vendor.copy_1d(0x1000, 0x2000, 64, 0x77)
    assert rec.calls["hipMemcpyAsync"]["kind"] == hip.hipMemcpyKind.hipMemcpyDeviceToDevice
    assert RocmVendor(hip=HipRecorder()).copy_1d_on_dma is True
    assert RocmBackend.copy_2d_on_dma is False     # hipMemcpy2DAsync ignores NoCU


# -- Barriers: one batched call per program; never captured ----------------
class _Handle:
    rank, world, _programs = 1, 3, {}

    def slot(self, owner, channel, writer):
        return 0x5000 + 0x100 * owner + 4 * (channel * 3 + writer)


def _decode(address, count):
    """The hipStreamBatchMemOpParams array at ``address``, read back as HIP's C layout:
    (operation, address, 32-bit value, flags) per entry."""

    from ficco.backends.rocm import MemOpParams

    array = (MemOpParams * count).from_address(address)
    return [(e.op.operation, e.op.address, e.op.value64 & 0xFFFFFFFF, e.op.flags)
            for e in array]


def test_barrier_program_is_one_batched_call_in_hips_c_layout():
    from ficco.symm_mem.barrier import flag_program

    program = flag_program(_Handle(), 0, 0x1234)
    rec = HipRecorder()
    vendor = RocmVendor(hip=rec)
    vendor.mem_ops(0x33, program, capturing=False)
    assert rec.order == ["hipStreamBatchMemOp"]
    call = rec.calls["hipStreamBatchMemOp"]
    assert (call["stream"], call["count"], call["flags"]) == (0x33, 9, 0)
    write, wait = int(hip.hipStreamBatchMemOpType.hipStreamMemOpWriteValue32), \
        int(hip.hipStreamBatchMemOpType.hipStreamMemOpWaitValue32)
    eq = int(hip.hipStreamWaitValueEq)
    slot = _Handle().slot
    assert _decode(call["paramArray"], 9) == (
        [(write, slot(p, 0, 1), 0x1234, 0) for p in range(3)]          # my flag, every peer
        + [(wait, slot(1, 0, p), 0x1234, eq) for p in range(3)]       # == flag, my slots
        + [(write, slot(1, 0, p), 0, 0) for p in range(3)])           # cleared
    vendor.mem_ops(0x33, program, capturing=False)                    # parameters kept
    assert rec.calls["hipStreamBatchMemOp"]["paramArray"] == call["paramArray"]


def test_single_signal_ops_are_plain_calls_and_leave_the_barrier_cache_alone():
    """As on CUDA: a single flag write (a fresh one-op tuple per call) built batch parameters
    keyed by the tuple's id every time, and past 4096 entries the cache was cleared, the
    barrier programs' parameters with it."""
    from ficco.symm_mem.barrier import WRITE, SignalOp, flag_program

    rec = HipRecorder()
    vendor = RocmVendor(hip=rec)
    program = flag_program(_Handle(), 0, 0x77)
    vendor.mem_ops(0x33, program, capturing=False)
    kept = vendor.batch_params(program)
    for i in range(4200):
        vendor.mem_ops(0x33, (SignalOp(WRITE, 0x9000 + 4 * (i % 8), i, -1),), capturing=False)
    assert rec.order == ["hipStreamBatchMemOp"] + ["hipStreamWriteValue32"] * 4200
    assert vendor.batch_params(program) is kept and len(vendor._batches) == 1


def test_barrier_program_falls_back_to_one_call_per_op_where_the_batch_is_refused():
    from ficco.symm_mem.barrier import flag_program

    rec = HipRecorder({"hipStreamBatchMemOp": (hip.hipError_t.hipErrorNotSupported,)})
    vendor = RocmVendor(hip=rec)
    for _ in range(2):
        vendor.mem_ops(0x33, flag_program(_Handle(), 0), capturing=False)
    assert rec.order == ["hipStreamBatchMemOp"] + (["hipStreamWriteValue32"] * 3 + [
        "hipStreamWaitValue32"] * 3 + ["hipStreamWriteValue32"] * 3) * 2
    # the last op clears this rank's own slot of peer 2
    assert rec.calls["hipStreamWriteValue32"] == {"stream": 0x33, "ptr": 0x5000 + 0x100 + 8,
                                                  "value": 0, "flags": 0}


def test_rocm_refuses_to_capture_a_cross_rank_barrier(monkeypatch):
    """HIP does not capture stream memory operations: a graph would replay without barriers."""
    from ficco.errors import InvalidArgumentError
    from ficco.symm_mem.barrier import Deadline

    class Fake:
        name, captures_signals, dm = "rocm", False, torch.cuda
        capture_refusal = RocmBackend.capture_refusal

        def _raise_died(self):
            pass

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    # refused before the call allocates or enqueues anything ...
    with pytest.raises(InvalidArgumentError, match="cannot capture cross-rank barriers"):
        RocmBackend.before_dma(Fake(), None)
    # ... and, should a barrier still come under capture, refused there too
    with pytest.raises(InvalidArgumentError, match="cannot capture cross-rank barriers"):
        RocmBackend.enqueue_signals(Fake(), None, (), Deadline(0, 0, 0, 1.0, 1))


def test_host_pad_registration_calls():
    from rocm.bindings.util.types import Pointer

    rec = HipRecorder({"hipHostGetDevicePointer": (hip.hipError_t.hipSuccess,
                                                   Pointer.fromObj(0xA000))})
    vendor = RocmVendor(hip=rec)
    vendor.host_register(0x5000, 4096)
    assert vendor.host_device_pointer(0x5000) == 0xA000
    vendor.host_unregister(0x5000)
    assert rec.calls["hipHostRegister"] == {
        "hostPtr": 0x5000, "sizeBytes": 4096,
        "flags": hip.hipHostRegisterMapped | hip.hipHostRegisterPortable}
    assert rec.calls["hipHostGetDevicePointer"] == {"hstPtr": 0x5000, "flags": 0}
    assert rec.calls["hipHostUnregister"] == {"hostPtr": 0x5000}


def test_a_second_hip_runtime_beside_torchs_is_named():
    """Hip-python may load its own libamdhip64 beside torch's bundled one."""
    from ficco.backends.rocm import duplicate_hip_runtimes

    one = "7f0-7f1 r-xp 00000000 08:01 42 /venv/torch/lib/libamdhip64.so\n"
    assert duplicate_hip_runtimes(one + one) is None              # the same file, two mappings
    two = one + "7f2-7f3 r-xp 00000000 08:01 43 /opt/rocm-6.4.1/lib/libamdhip64.so.6.4.60401\n"
    problem = duplicate_hip_runtimes(two)
    assert "two HIP runtimes" in problem and "/opt/rocm-6.4.1/lib" in problem
    assert "LD_LIBRARY_PATH" in problem and "/venv/torch/lib" in problem
    assert duplicate_hip_runtimes("") is None


@pytest.mark.parametrize("missing", [
    AttributeError("module 'hip.hip' has no attribute 'hipStreamBatchMemOp'"),
    RuntimeError("dlsym: undefined symbol: hipStreamBatchMemOp")],
    ids=["binding-without-it", "library-without-it"])
def test_a_rocm_without_the_batch_call_falls_back_to_one_call_per_op(missing):
    """ROCm < 6.4 has no hipStreamBatchMemOp. hip-python then raises (no such
    attribute in an older binding; a dlsym RuntimeError in a newer binding over an older
    library) instead of returning a status: the per-op path runs, from then on."""
    from ficco.symm_mem.barrier import flag_program

    class Without(HipRecorder):
        def __getattr__(self, name):
            if name == "hipStreamBatchMemOp":
                if isinstance(missing, AttributeError):
                    raise missing

                def refuse(*args):
                    raise missing
                return refuse
            return super().__getattr__(name)

    rec = Without()
    vendor = RocmVendor(hip=rec)
    for _ in range(2):
        vendor.mem_ops(0x33, flag_program(_Handle(), 0), capturing=False)
    assert vendor.batches_mem_ops is False
    assert rec.order == (["hipStreamWriteValue32"] * 3 + ["hipStreamWaitValue32"] * 3
                         + ["hipStreamWriteValue32"] * 3) * 2
