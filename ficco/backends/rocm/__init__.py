"""The ROCm backend: :class:`~ficco.backends.gpu.GpuBackend` (torch's ROCm build exposes HIP
streams, events and hipBLASLt GEMMs through ``torch.cuda``) plus the HIP calls torch does not
expose, made through hip-python (``from hip import hip``, imported only when used):

- 1-D copies: ``hipMemcpyAsync`` with ``hipMemcpyDeviceToDeviceNoCU`` so the copy runs on an
  SDMA engine and never takes compute units;
- 2-D copies: ``hipMemcpy2DAsync`` with ``hipMemcpyDeviceToDevice`` (it runs as a kernel on
  compute units whatever kind it is given, so asking for NoCU only pretended otherwise);
- signals: a whole barrier program in one ``hipStreamBatchMemOp`` call (one
  call per op would be 24 per barrier at W = 8), its parameter array built once per program in the
  C layout of ``hipStreamBatchMemOpParams`` with ctypes (hip-python 10.0's generated struct
  drops the ``value`` union, so its own setters would write ``flags`` where HIP reads the
  value); if this ROCm refuses the batch call or lacks it (before 6.4: hip-python raises
  AttributeError or a dlsym RuntimeError), one ``hipStreamWriteValue32`` /
  ``hipStreamWaitValue32`` per op from then on (``hipStreamWaitValueEq`` for plan flags,
  ``hipStreamWaitValueGte`` for host barriers' counts, an all-ones mask: the mask is ANDed
  with the slot before comparing, so 0 would never wait);
- signal pads in host-mapped memory (:mod:`ficco.symm_mem.host_pads`, the default) or, with
  ``FICCO_SIGNAL_PADS=device``, in uncached device memory (``hipExtMallocWithFlags(...,
  hipDeviceMallocUncached)``, the kind HIP documents for memory polled while peers write it);
  data spans in ``hipMalloc``;
- symmetric memory: ``hipIpcGetMemHandle`` / ``hipIpcOpenMemHandle``;
- no batched copy submission (``batches_copies`` stays False: one ``hipMemcpyAsync`` per copy,
  the plan's copy queues kept apart): HIP has ``hipMemcpyBatchAsync``, but hip-python 10.0's
  binding takes only ``srcs``, ``count``, ``attrs``, ``numAttrs`` and the stream and hands
  ``dsts``, ``sizes``, ``attrsIdxs`` and ``failIdx`` back as outputs, so the destinations and
  sizes cannot be passed through it.

Graph capture: HIP does not capture stream memory operations (CLR has no capture path for
them), so a captured multi-rank dma plan would replay without barriers and race; the backend
refuses such a capture with a clear error (``captures_signals = False``). 2-D copies run on
compute units on ROCm (``hipMemcpy2DAsync`` runs as a kernel): ``copy_2d_on_dma`` is False
so the selector prices ``*-2d`` schedules' copies as compute-unit copies. ROCm before 6.1 has no
``hipMemcpyDeviceToDeviceNoCU``: 1-D copies then use ``hipMemcpyDeviceToDevice`` (the runtime
picks the engine) and ``copy_1d_on_dma`` says so.

``hipMemcpyBatchAsync`` is not used: hip-python 10.0's generated binding drops its ``dsts``
and ``sizes`` arguments (``hipMemcpyBatchAsync(srcs, count, attrs, numAttrs, stream)``).

Nothing here has run on AMD hardware yet; see docs/gpu.md.

>>> from ficco.backends.rocm import RocmBackend
>>> RocmBackend.unavailable_reason() is None or "ROCm" in RocmBackend.unavailable_reason()
True
"""
from __future__ import annotations

import ctypes
import importlib

import torch

from ...errors import BackendUnavailableError
from ...symm_mem.barrier import WRITE
from ..gpu import GpuBackend
from ..gpu.vendor import Copy2D, Vendor, handle_bytes

IPC_HANDLE_BYTES = 64
#: hipStreamBatchMemOp takes fewer than 256 operations per call
BATCH_LIMIT = 255
#: hipStreamBatchMemOpType values (hip_runtime_api.h)
MEM_OP_WAIT_VALUE_32, MEM_OP_WRITE_VALUE_32 = 1, 2


class MemOp(ctypes.Structure):
    """``hipStreamBatchMemOpParams``' waitValue / writeValue member, as hip_runtime_api.h lays
    it out: operation, address, a 32/64-bit value union, flags, alias (40 bytes)."""

    _fields_ = [("operation", ctypes.c_uint32), ("address", ctypes.c_uint64),
                ("value64", ctypes.c_uint64), ("flags", ctypes.c_uint32),
                ("alias", ctypes.c_uint64)]


class MemOpParams(ctypes.Union):
    """``hipStreamBatchMemOpParams``: the union, padded to 6 uint64 (48 bytes)."""

    _fields_ = [("op", MemOp), ("pad", ctypes.c_uint64 * 6)]
ALL_BITS = 0xFFFFFFFF
#: hipDeviceMallocUncached from hip_runtime_api.h (hip-python 10.0 does not export it; its
#: hipExtMallocWithFlags docstring lists it among the accepted flags)
DEVICE_MALLOC_UNCACHED = 0x3


def address_of(value) -> int:
    """A hip-python pointer result (Pointer, DeviceArray) or an int, as an int address."""
    if isinstance(value, int):
        return value
    if hasattr(value, "as_c_void_p"):
        return value.as_c_void_p().value or 0
    return int(value)


class RocmVendor(Vendor):
    """hip-python calls. ``hip`` defaults to hip-python's module; tests pass a recorder."""

    name = "rocm"

    def __init__(self, hip=None) -> None:
        if hip is None:
            hip = importlib.import_module("hip.hip")
        self.hip = hip
        no_cu = getattr(hip.hipMemcpyKind, "hipMemcpyDeviceToDeviceNoCU", None)
        #: False on ROCm < 6.1 (no NoCU kind): the runtime then picks the engine itself
        self.copy_1d_on_dma = no_cu is not None
        self._copy_kind = no_cu if no_cu is not None else hip.hipMemcpyKind.hipMemcpyDeviceToDevice
        self._batches: dict[int, tuple] = {}   # id(program) -> (program, [params arrays])
        #: None until the first batch call; False once this ROCm refused hipStreamBatchMemOp
        self.batches_mem_ops: bool | None = None

    def _describe(self, status) -> str:
        try:
            name = self.hip.hipGetErrorName(status)[1]
            text = self.hip.hipGetErrorString(status)[1]
            decode = lambda v: v.decode() if isinstance(v, bytes) else str(v)
            return f"{decode(name)}: {decode(text)}"
        except Exception:  # noqa: BLE001 - describing an error must never hide it
            return getattr(status, "name", str(status))

    def bind_device(self, index):
        self.check("hipSetDevice", self.hip.hipSetDevice(index))

    def relax_capture_mode(self):
        # hip-python 10.0 binds hipThreadExchangeStreamCaptureMode(hipStreamCaptureMode* mode)
        # as a call without arguments (mode treated as output only), so the mode cannot be
        # set through it; the watchdog then runs in the default mode. See docs/gpu.md.
        return None

    def copy_1d(self, dst, src, nbytes, stream):
        self.check("hipMemcpyAsync",
                   self.hip.hipMemcpyAsync(dst, src, nbytes, self._copy_kind, stream))

    def copy_2d(self, args: Copy2D, stream):
        self.check("hipMemcpy2DAsync",
                   self.hip.hipMemcpy2DAsync(args.dst, args.dpitch, args.src, args.spitch,
                                             args.width, args.height,
                                             self.hip.hipMemcpyKind.hipMemcpyDeviceToDevice,
                                             stream))

    def write_value32(self, stream, address, value):
        self.check("hipStreamWriteValue32",
                   self.hip.hipStreamWriteValue32(stream, address, value, 0))

    def wait_value32(self, stream, address, value, exact):
        how = self.hip.hipStreamWaitValueEq if exact else self.hip.hipStreamWaitValueGte
        self.check("hipStreamWaitValue32",
                   self.hip.hipStreamWaitValue32(stream, address, value, how, ALL_BITS))

    def mem_ops(self, stream, ops, capturing):
        if self.batches_mem_ops is False or len(ops) == 1:
            # one op is one plain call (as on CUDA: its per-call tuple would fill the
            # parameter cache and clear the barrier programs' with it)
            super().mem_ops(stream, ops, capturing)
            return
        for chunk in self.batch_params(ops):
            try:
                result = self.hip.hipStreamBatchMemOp(stream, len(chunk),
                                                      ctypes.addressof(chunk), 0)
            except (AttributeError, RuntimeError):
                # ROCm < 6.4 has no such call: an older hip-python has no
                # binding (AttributeError), a newer one over an older library fails its dlsym
                # (RuntimeError). Nothing was enqueued.
                if self.batches_mem_ops is not None:
                    raise
                result = None
            if self.batches_mem_ops is None and (result is None or _status(result) !=
                                                 self.hip.hipError_t.hipSuccess):
                # Beta in HIP: a runtime without it answers before enqueuing anything.
                self.batches_mem_ops = False
                super().mem_ops(stream, ops, capturing)
                return
            self.check("hipStreamBatchMemOp", result)
            self.batches_mem_ops = True

    def batch_params(self, ops) -> list:
        """``hipStreamBatchMemOpParams`` arrays for a barrier program, built once per program
        (programs are cached per handle and channel: a dict hit per barrier)."""
        cached = self._batches.get(id(ops))
        if cached is not None and cached[0] is ops:
            return cached[1]
        eq, gte = int(self.hip.hipStreamWaitValueEq), int(self.hip.hipStreamWaitValueGte)
        chunks = []
        for start in range(0, len(ops), BATCH_LIMIT):
            part = ops[start: start + BATCH_LIMIT]
            array = (MemOpParams * len(part))()
            for entry, op in zip(array, part):
                write = op.kind == WRITE
                entry.op.operation = MEM_OP_WRITE_VALUE_32 if write else MEM_OP_WAIT_VALUE_32
                entry.op.address = op.slot
                entry.op.value64 = op.value & 0xFFFFFFFF
                entry.op.flags = 0 if write else (eq if op.exact else gte)
            chunks.append(array)
        if len(self._batches) > 4096:   # count-mode programs are per call: stay bounded
            self._batches.clear()
        self._batches[id(ops)] = (ops, chunks)
        return chunks

    def malloc(self, nbytes):
        return address_of(self.check("hipMalloc", self.hip.hipMalloc(max(nbytes, 1))))

    def malloc_signal(self, nbytes):
        flags = getattr(self.hip, "hipDeviceMallocUncached", DEVICE_MALLOC_UNCACHED)
        return address_of(self.check("hipExtMallocWithFlags",
                                     self.hip.hipExtMallocWithFlags(max(nbytes, 1), flags)))

    def free(self, address):
        self.check("hipFree", self.hip.hipFree(address))

    def ipc_export(self, address):
        handle = self.check("hipIpcGetMemHandle", self.hip.hipIpcGetMemHandle(address))
        return handle_bytes(address_of(handle), IPC_HANDLE_BYTES)

    def ipc_open(self, handle):
        wrapped = self.hip.hipIpcMemHandle_t.fromObj(bytearray(handle))
        opened = self.check("hipIpcOpenMemHandle",
                            self.hip.hipIpcOpenMemHandle(wrapped,
                                                         self.hip.hipIpcMemLazyEnablePeerAccess))
        return address_of(opened)

    def ipc_close(self, address):
        self.check("hipIpcCloseMemHandle", self.hip.hipIpcCloseMemHandle(address))

    def host_register(self, address, nbytes):
        flags = self.hip.hipHostRegisterMapped | self.hip.hipHostRegisterPortable
        self.check("hipHostRegister", self.hip.hipHostRegister(address, nbytes, flags))

    def host_device_pointer(self, address):
        return address_of(self.check("hipHostGetDevicePointer",
                                     self.hip.hipHostGetDevicePointer(address, 0)))

    def host_unregister(self, address):
        self.check("hipHostUnregister", self.hip.hipHostUnregister(address))


def _status(result):
    return result[0] if isinstance(result, tuple) else result


def duplicate_hip_runtimes(maps: str) -> str | None:
    r"""None when at most one HIP runtime (libamdhip64) is mapped in this process, else why
    that breaks ficco. ``maps`` is the text of /proc/self/maps. hip-python resolves its own
    libamdhip64 (its bundle, rocm_sdk, ROCM_PATH) and may load a second copy beside the one
    torch's pip wheel bundles: two runtimes share no streams, events or IPC handles.

    >>> duplicate_hip_runtimes("7f00-7f10 r-xp 0 0:0 1 /opt/rocm/lib/libamdhip64.so.6")
    >>> "two HIP runtimes" in duplicate_hip_runtimes(
    ...     "a-b r-xp 0 0:0 1 /x/torch/lib/libamdhip64.so\n"
    ...     "c-d r-xp 0 0:0 1 /opt/rocm-6.2/lib/libamdhip64.so.6")
    True
    """
    paths = sorted({line.split()[-1] for line in maps.splitlines()
                    if "libamdhip64" in line and line.split()[-1].startswith("/")})
    if len(paths) < 2:
        return None
    torch_copy = next((p for p in paths if "/torch/" in p), paths[0])
    return (f"two HIP runtimes are loaded in this process ({', '.join(paths)}); hip-python's "
            f"calls would not see torch's streams and memory. Make hip-python load torch's "
            f"copy: put {torch_copy.rsplit('/', 1)[0]} first on LD_LIBRARY_PATH (or install "
            f"torch and hip-python against one ROCm under ROCM_PATH)")


def hip_python_mismatch(rocm_version: str, hip_python_version: str) -> str | None:
    """None when hip-python's major.minor equals the installed ROCm's, else the fix.

    >>> hip_python_mismatch("6.2.41133-dd7f95766", "6.2.0.499")
    >>> hip_python_mismatch("6.2.41133", "10.0.0")[:27]
    'hip-python 10.0.0 does not '
    """
    want = ".".join(rocm_version.split(".")[:2])
    have = ".".join(hip_python_version.split(".")[:2])
    if want == have:
        return None
    return (f"hip-python {hip_python_version} does not match ROCm {rocm_version}; install the "
            f"matching one: pip install 'hip-python~={want}.0' (from the index in ROCm's "
            f"hip-python install guide)")


class RocmBackend(GpuBackend):
    """ficco on AMD Instinct GPUs. ``RocmBackend(device=None)`` uses the current device."""

    name = "rocm"
    priority = 20        # torch's ROCm build answers through torch.cuda too: asked first
    make_vendor = RocmVendor
    captures_signals = False
    #: hipMemcpy2DAsync ignores the NoCU kind: 2-D copies take compute units on ROCm
    copy_2d_on_dma = False

    @classmethod
    def unavailable_reason(cls):
        rocm = getattr(torch.version, "hip", None)
        if not rocm:
            return ("this torch is not a ROCm build (torch.version.hip is None); install torch "
                    "for ROCm, e.g. pip install torch --index-url "
                    "https://download.pytorch.org/whl/rocm6.4, or use the cuda/cpu backend")
        try:
            from importlib.metadata import PackageNotFoundError, version

            installed = version("hip-python")
        except PackageNotFoundError:
            want = ".".join(rocm.split(".")[:2])
            return (f"hip-python is not installed; install the one for ROCm {rocm}: "
                    f"pip install 'hip-python~={want}.0'")
        mismatch = hip_python_mismatch(rocm, installed)
        if mismatch:
            return mismatch
        try:
            from hip import hip  # noqa: F401
        except ImportError as exc:
            return f"hip-python {installed} is installed but does not import ({exc}); reinstall it"
        if not torch.get_device_module(cls.device_type).is_available():
            return ("no AMD GPU is visible (torch.cuda.is_available() is False); check rocm-smi "
                    "and HIP_VISIBLE_DEVICES")
        return None

    def __init__(self, device=None):
        super().__init__(device)   # binds the device: hip-python has loaded its runtime now
        try:
            with open("/proc/self/maps") as fh:
                problem = duplicate_hip_runtimes(fh.read())
        except OSError:
            problem = None
        if problem is not None:
            raise BackendUnavailableError(f"the rocm backend cannot run here: {problem}")

    def target(self):
        arch = getattr(self.device_module().get_device_properties(self._device), "gcnArchName",
                       "gfx")
        return f"rocm:{arch.split(':')[0]}"

    def fp8_forms(self) -> tuple[torch.dtype, ...]:
        """MI300X / MI325X (CDNA3, gfx94*) multiply only the fnuz forms; later AMD GPUs the
        OCP ones."""
        if self.target().startswith("rocm:gfx94"):
            return (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
        return super().fp8_forms()


__all__ = ["RocmBackend", "RocmVendor", "duplicate_hip_runtimes", "hip_python_mismatch"]
