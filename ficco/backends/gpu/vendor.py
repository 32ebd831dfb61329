"""The vendor layer of the GPU backends: the handful of runtime calls torch does not expose
(:class:`Vendor`; :mod:`ficco.backends.cuda` and :mod:`ficco.backends.rocm` implement it), and
the pure functions that turn tensor views into those calls' integer arguments (tested without
a GPU; :class:`ficco.backends.gpu.GpuBackend` computes them once per bound plan).
"""
from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from ...errors import BackendCallError, InvalidArgumentError
from ...symm_mem.barrier import WRITE


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
    def copy_2d(self, args: Copy2D, stream: int) -> None: ...

    #: :meth:`copy_batch` is one runtime call whose copies run concurrently (set per instance
    #: by vendors that have one: CUDA >= 12.8's ``cudaMemcpyBatchAsync``)
    batches_copies: bool = False

    def copy_batch(self, dsts: list[int], srcs: list[int], sizes: list[int],
                   stream: int) -> None:
        """1-D copies ``dsts[i] <- srcs[i]`` of ``sizes[i]`` bytes, independent of each other,
        in stream order as a whole. Vendors with a batch call override it; this one makes one
        call per copy."""
        for dst, src, nbytes in zip(dsts, srcs, sizes):
            self.copy_1d(dst, src, nbytes, stream)

    def copy_batch_2d(self, copies: list[Copy2D], stream: int) -> None:
        """2-D copies, independent of each other, in stream order as a whole (one call where
        :attr:`batches_copies`: CUDA's ``cudaMemcpy3DBatchAsync``; here one call each).
        ``copies`` is the same list object every call of a bound plan (vendors may keep what
        they built from it)."""
        for args in copies:
            self.copy_2d(args, stream)

    @abstractmethod
    def write_value32(self, stream: int, address: int, value: int) -> None:
        """Stream-ordered store of ``value`` at ``address``, fenced after earlier work."""

    @abstractmethod
    def wait_value32(self, stream: int, address: int, value: int, exact: bool) -> None:
        """Later work on ``stream`` waits until the int32 at ``address`` is >= ``value`` (==
        ``value`` when ``exact``: flag-mode barriers, where a peer's flag names its call)."""

    def mem_ops(self, stream: int, ops: tuple, capturing: bool) -> None:
        """Enqueue a barrier program (:class:`~ficco.symm_mem.barrier.SignalOp` s, in order).
        Vendors with a batch call override it; this one makes one call per op."""
        for op in ops:
            if op.kind == WRITE:
                self.write_value32(stream, op.slot, op.value)
            else:
                self.wait_value32(stream, op.slot, op.value, op.exact)

    @abstractmethod
    def malloc(self, nbytes: int) -> int: ...

    def malloc_signal(self, nbytes: int) -> int:
        """Memory for signal pads, polled by stream waits (plain device memory unless the
        vendor documents a better kind)."""
        return self.malloc(nbytes)

    def free_signal(self, address: int) -> None:
        self.free(address)

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

    @abstractmethod
    def host_register(self, address: int, nbytes: int) -> None:
        """Page-lock host memory as mapped and portable (every context sees it)."""

    @abstractmethod
    def host_device_pointer(self, address: int) -> int:
        """The device address of registered host memory at ``address``."""

    @abstractmethod
    def host_unregister(self, address: int) -> None: ...


def handle_bytes(address: int, size: int = 64) -> bytes:
    """The ``size`` bytes of a C handle struct at ``address`` (IPC handles are 64 bytes)."""
    return ctypes.string_at(address, size)


# -- argument construction, pure so it is tested without a GPU ----------------------------------
class Copy2D(NamedTuple):
    """cudaMemcpy2DAsync / hipMemcpy2DAsync arguments, all in bytes: ``height`` rows of
    ``width`` bytes from ``src`` (rows ``spitch`` apart) to ``dst`` (rows ``dpitch`` apart)."""

    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int


def pitched(t: torch.Tensor) -> bool:
    """Whether a copy engine can read or write ``t`` (2-D): rows of unit-stride columns that
    do not overlap. A transposed or expanded (stride-0) view is not; torch copies it.

    >>> g = torch.empty(4, 6)
    >>> pitched(g[:, 1:3]), pitched(g.t()), pitched(g[:1].expand(4, 6))
    (True, False, False)
    """
    if t.dim() != 2:
        return False
    rows, cols = t.shape
    row_stride, col_stride = t.stride()
    return (cols <= 1 or col_stride == 1) and (rows <= 1 or row_stride >= cols)


def _row_pitch_bytes(t: torch.Tensor, name: str) -> int:
    if not pitched(t):
        raise InvalidArgumentError(
            f"copy_2d needs 2-D {name} views of unit-stride, non-overlapping rows; got shape "
            f"{tuple(t.shape)} strides {t.stride()}")
    return max(t.stride(0), t.shape[1]) * t.element_size()


def copy_2d_args(dst: torch.Tensor, src: torch.Tensor) -> Copy2D | None:
    """The 2-D copy that moves ``src`` into ``dst`` (same shape), or None when it is empty.

    >>> g = torch.empty(8, 10, dtype=torch.bfloat16)        # gathered buffer, K = 10
    >>> a = copy_2d_args(g[0:4, 3:6], g[4:8, 3:6])          # a 4 x 3 column chunk
    >>> (a.dpitch, a.spitch, a.width, a.height)
    (20, 20, 6, 4)
    """
    shape = dst.shape
    if shape != src.shape or dst.dtype != src.dtype:
        raise InvalidArgumentError(
            f"copy_2d: dst {tuple(dst.shape)} {dst.dtype} and src {tuple(src.shape)} "
            f"{src.dtype} must have the same shape and dtype")
    if dst.numel() == 0:
        return None
    # Each tensor attribute read costs host time (a re-bound plan makes this call per copy):
    # shape, strides and item size are read once; the helper only words the error.
    ds, ss = dst.stride(), src.stride()
    if len(shape) != 2 or (shape[1] > 1 and (ds[1] != 1 or ss[1] != 1)) or \
            (shape[0] > 1 and (ds[0] < shape[1] or ss[0] < shape[1])):
        _row_pitch_bytes(dst, "dst")
        _row_pitch_bytes(src, "src")
    rows, cols = shape
    size = dst.element_size()
    return Copy2D(dst.data_ptr(), max(ds[0], cols) * size, src.data_ptr(),
                  max(ss[0], cols) * size, cols * size, rows)


def copy_call_args(dst: torch.Tensor, src: torch.Tensor, two_d: bool = False):
    """What one plan copy of ``src`` into ``dst`` asks of the vendor, from the views alone:
    None (nothing to copy), ``(dst, src, nbytes)`` for a 1-D copy, or a :class:`Copy2D`. A 1-D
    copy of views that are not both contiguous becomes a 2-D one. Pure integers, so the
    executor can compute them once per bound plan (:meth:`GpuBackend.prepare_copy`).

    >>> g = torch.empty(8, 10, dtype=torch.bfloat16)
    >>> d, s, n = copy_call_args(g[0:4], g[4:8])           # whole rows: one 1-D copy
    >>> (s - d, n)
    (80, 80)
    >>> copy_call_args(g[0:4, 3:6], g[4:8, 3:6]).height    # a column chunk: 2-D
    4
    """
    if two_d:
        return copy_2d_args(dst, src)
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise InvalidArgumentError(f"copy: dst {tuple(dst.shape)} {dst.dtype} and src "
                                   f"{tuple(src.shape)} {src.dtype} differ")
    if dst.numel() == 0:
        return None
    if not (dst.is_contiguous() and src.is_contiguous()):
        return copy_2d_args(dst, src)
    return (dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())


def copy_nothing(queue) -> None:
    """A prepared copy of an empty block."""
