"""The CUDA backend: :class:`~ficco.backends.gpu.GpuBackend` plus the few runtime and driver
calls torch does not expose, made through cuda-python (``cuda.bindings``):

- 1-D copies: ``cudaMemcpyAsync`` device-to-device on a copy stream (runs on a copy engine);
- 2-D copies: ``cudaMemcpy2DAsync`` (column chunks of the gathered buffer);
- a queue's copies of one step together: the 1-D ones in one ``cudaMemcpyBatchAsync``, the 2-D
  ones in one ``cudaMemcpy3DBatchAsync`` (pointer operands, element size 1: row length = the
  pitch in bytes, extent = width bytes x rows x 1), where driver and bindings are CUDA >= 12.8
  (the copies of one batch run in any order, concurrently); else one call each;
- signals: a whole barrier program in one ``cuStreamBatchMemOp`` call (eager), or
  ``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` (EQ for plan flags, GEQ for host
  barriers' counts) one by one under graph capture
  (the path verified on H100 with captured graphs);
- symmetric memory: ``cudaMalloc`` + ``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``.

>>> from ficco.backends.cuda import CudaBackend
>>> CudaBackend.unavailable_reason() is None or "CUDA" in CudaBackend.unavailable_reason()
True
"""
from __future__ import annotations

import ctypes

import torch

from ...symm_mem.barrier import WRITE
from ..gpu import GpuBackend
from ..gpu.vendor import Copy2D, Vendor, handle_bytes

IPC_HANDLE_BYTES = 64
#: cuStreamBatchMemOp takes fewer than 256 operations per call
BATCH_LIMIT = 255


class CudaVendor(Vendor):
    """cuda-python calls. ``runtime`` / ``driver`` default to ``cuda.bindings``' modules; tests
    pass recorders with the same function names."""

    name = "cuda"

    def __init__(self, runtime=None, driver=None) -> None:
        if runtime is None or driver is None:
            from cuda.bindings import driver as cuda_driver
            from cuda.bindings import runtime as cuda_runtime

            runtime, driver = runtime or cuda_runtime, driver or cuda_driver
        self.rt, self.drv = runtime, driver
        self._d2d = runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self._write_flags = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self._wait_geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self._wait_eq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
        self._batches: dict[int, tuple] = {}   # id(program) -> (program, [params chunks])
        self.batches_copies = self._copy_batch_support()
        if self.batches_copies:
            # One attribute set for every copy of a batch: sources read in stream order (they
            # are written by earlier work of the call), copies preferably beside compute.
            attrs = runtime.cudaMemcpyAttributes()
            attrs.srcAccessOrder = runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            attrs.flags = runtime.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
            self._batch_attrs = [attrs]
        self._ops_2d: dict[int, tuple] = {}   # id(copies) -> (copies, [cudaMemcpy3DBatchOp])

    def _copy_batch_support(self) -> bool:
        """Whether ``cudaMemcpyBatchAsync`` can be called: the bindings have it (12.8 or
        later) and so does the driver (``cudaDriverGetVersion`` >= 12080)."""
        if not hasattr(self.rt, "cudaMemcpyBatchAsync") or \
                not hasattr(self.rt, "cudaDriverGetVersion"):
            return False
        try:
            return int(self.check("cudaDriverGetVersion", self.rt.cudaDriverGetVersion())) \
                >= 12080
        except Exception:  # noqa: BLE001 - no answer: take the one-call-per-copy path
            return False

    def _describe(self, status) -> str:
        try:
            if isinstance(status, self.drv.CUresult):
                name = self.drv.cuGetErrorName(status)[1]
                text = self.drv.cuGetErrorString(status)[1]
            else:
                name = self.rt.cudaGetErrorName(status)[1]
                text = self.rt.cudaGetErrorString(status)[1]
            return f"{_text(name)}: {_text(text)}"
        except Exception:  # noqa: BLE001 - describing an error must never hide it
            return getattr(status, "name", str(status))

    def bind_device(self, index):
        self.check("cudaSetDevice", self.rt.cudaSetDevice(index))

    def relax_capture_mode(self):
        mode = self.rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed
        self.check("cudaThreadExchangeStreamCaptureMode",
                   self.rt.cudaThreadExchangeStreamCaptureMode(mode))

    def copy_1d(self, dst, src, nbytes, stream):
        self.check("cudaMemcpyAsync",
                   self.rt.cudaMemcpyAsync(dst, src, nbytes, self._d2d, stream))

    def copy_2d(self, args: Copy2D, stream):
        self.check("cudaMemcpy2DAsync",
                   self.rt.cudaMemcpy2DAsync(args.dst, args.dpitch, args.src, args.spitch,
                                             args.width, args.height, self._d2d, stream))

    def copy_batch(self, dsts, srcs, sizes, stream):
        if not self.batches_copies:
            super().copy_batch(dsts, srcs, sizes, stream)
            return
        # 12.8-12.9 bindings return (status, failIdx), 13.x the status alone: check() takes
        # either.
        self.check("cudaMemcpyBatchAsync",
                   self.rt.cudaMemcpyBatchAsync(dsts, srcs, sizes, len(sizes),
                                                self._batch_attrs, [0], 1, stream))

    def copy_batch_2d(self, copies, stream):
        if not self.batches_copies:
            super().copy_batch_2d(copies, stream)
            return
        ops = self.batch_ops_2d(copies)
        self.check("cudaMemcpy3DBatchAsync",
                   self.rt.cudaMemcpy3DBatchAsync(len(ops), ops, 0, stream))

    def batch_ops_2d(self, copies) -> list:
        """``cudaMemcpy3DBatchOp`` s of 2-D copies, built once per list (a bound plan passes
        the same list every call)."""
        cached = self._ops_2d.get(id(copies))
        if cached is not None and cached[0] is copies:
            return cached[1]
        rt = self.rt
        pointer = rt.cudaMemcpy3DOperandType.cudaMemcpyOperandTypePointer
        ops = []
        for args in copies:
            op = rt.cudaMemcpy3DBatchOp()
            for operand, address, pitch in ((op.src, args.src, args.spitch),
                                            (op.dst, args.dst, args.dpitch)):
                operand.type = pointer
                operand.op.ptr.ptr = address
                operand.op.ptr.rowLength = pitch      # elements of one byte
                operand.op.ptr.layerHeight = 0        # one layer
            op.extent.width, op.extent.height, op.extent.depth = args.width, args.height, 1
            op.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            op.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
            ops.append(op)
        if len(self._ops_2d) > 4096:
            self._ops_2d.clear()
        self._ops_2d[id(copies)] = (copies, ops)
        return ops

    def write_value32(self, stream, address, value):
        self.check("cuStreamWriteValue32",
                   self.drv.cuStreamWriteValue32(stream, address, value, self._write_flags))

    def wait_value32(self, stream, address, value, exact):
        flags = self._wait_eq if exact else self._wait_geq
        self.check("cuStreamWaitValue32",
                   self.drv.cuStreamWaitValue32(stream, address, value, flags))

    def mem_ops(self, stream, ops, capturing):
        if capturing or len(ops) == 1:
            # One op (a gated schedule's flag write, a single wait) is one plain call: its
            # tuple is made per call, so batch parameters cached by its id would be built
            # every time and fill the cache until it is cleared, barrier programs with it.
            super().mem_ops(stream, ops, capturing)
            return
        for chunk in self.batch_params(ops):
            self.check("cuStreamBatchMemOp",
                       self.drv.cuStreamBatchMemOp(stream, len(chunk), chunk, 0))

    def batch_params(self, ops) -> list[list]:
        """``CUstreamBatchMemOpParams`` for a barrier program, built once per program (the
        programs are cached per handle and channel, so this is a dict hit per barrier)."""
        cached = self._batches.get(id(ops))
        if cached is not None and cached[0] is ops:
            return cached[1]
        drv = self.drv
        params = []
        for op in ops:
            p = drv.CUstreamBatchMemOpParams()
            if op.kind == WRITE:
                p.writeValue.operation = drv.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_32
                p.writeValue.address = op.slot
                p.writeValue.value = op.value
                p.writeValue.flags = self._write_flags
            else:
                p.waitValue.operation = drv.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_32
                p.waitValue.address = op.slot
                p.waitValue.value = op.value
                p.waitValue.flags = self._wait_eq if op.exact else self._wait_geq
            params.append(p)
        chunks = [params[i: i + BATCH_LIMIT] for i in range(0, len(params), BATCH_LIMIT)]
        if len(self._batches) > 4096:   # count-mode programs are per call: stay bounded
            self._batches.clear()
        self._batches[id(ops)] = (ops, chunks)
        return chunks

    def malloc(self, nbytes):
        return int(self.check("cudaMalloc", self.rt.cudaMalloc(max(nbytes, 1))))

    def free(self, address):
        self.check("cudaFree", self.rt.cudaFree(address))

    def ipc_export(self, address):
        handle = self.check("cudaIpcGetMemHandle", self.rt.cudaIpcGetMemHandle(address))
        return handle_bytes(handle.getPtr(), IPC_HANDLE_BYTES)

    def ipc_open(self, handle):
        raw = ctypes.create_string_buffer(bytes(handle), IPC_HANDLE_BYTES)
        wrapped = self.rt.cudaIpcMemHandle_t(_ptr=ctypes.addressof(raw))
        address = self.check("cudaIpcOpenMemHandle",
                             self.rt.cudaIpcOpenMemHandle(wrapped,
                                                          self.rt.cudaIpcMemLazyEnablePeerAccess))
        return int(address)

    def ipc_close(self, address):
        self.check("cudaIpcCloseMemHandle", self.rt.cudaIpcCloseMemHandle(address))

    def host_register(self, address, nbytes):
        flags = int(self.rt.cudaHostRegisterMapped) | int(self.rt.cudaHostRegisterPortable)
        self.check("cudaHostRegister", self.rt.cudaHostRegister(address, nbytes, flags))

    def host_device_pointer(self, address):
        return int(self.check("cudaHostGetDevicePointer",
                              self.rt.cudaHostGetDevicePointer(address, 0)))

    def host_unregister(self, address):
        self.check("cudaHostUnregister", self.rt.cudaHostUnregister(address))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def installed_bindings_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("cuda-bindings", "cuda-python"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def cuda_python_mismatch(torch_cuda: str, bindings_version: str | None) -> str | None:
    """None when cuda-python's major equals torch's CUDA major (or is unknown), else the fix.

    >>> cuda_python_mismatch("13.0", "13.4.4")
    >>> cuda_python_mismatch("12.8", "13.4.4")[:44]
    'cuda-python 13.4.4 does not match torch buil'
    """
    want = torch_cuda.split(".")[0]
    if not bindings_version or bindings_version.split(".")[0] == want:
        return None
    return (f"cuda-python {bindings_version} does not match torch built for CUDA {torch_cuda}; "
            f"install the matching one: pip install 'ficco[cuda{want}]'")


class CudaBackend(GpuBackend):
    """ficco on NVIDIA GPUs. ``CudaBackend(device=None)`` uses the current CUDA device."""

    name = "cuda"
    priority = 10
    make_vendor = CudaVendor

    @classmethod
    def unavailable_reason(cls):
        if getattr(torch.version, "hip", None):
            return (f"this torch is a ROCm build (torch.version.hip={torch.version.hip}); use "
                    f"the rocm backend (FICCO_BACKEND=rocm)")
        if torch.version.cuda is None:
            return ("this torch is a CPU-only build (torch.version.cuda is None); install a CUDA "
                    "build of torch, e.g. pip install torch --index-url "
                    "https://download.pytorch.org/whl/cu130")
        try:
            import cuda.bindings.driver
            import cuda.bindings.runtime  # noqa: F401
        except ImportError as exc:
            major = torch.version.cuda.split(".")[0]
            return (f"cuda-python is missing ({exc}); install the one matching torch's CUDA "
                    f"{torch.version.cuda}: pip install 'ficco[cuda{major}]'")
        mismatch = cuda_python_mismatch(torch.version.cuda, installed_bindings_version())
        if mismatch:
            return mismatch
        if not torch.get_device_module(cls.device_type).is_available():
            return ("no CUDA device is visible (torch.cuda.is_available() is False); check the "
                    "driver with nvidia-smi and CUDA_VISIBLE_DEVICES")
        return None

    def target(self):
        major, minor = self.device_module().get_device_capability(self._device)
        return f"cuda:sm_{major}{minor}"


__all__ = ["CudaBackend", "CudaVendor"]
