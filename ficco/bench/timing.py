"""Timing for ``characterize``: one victim op alone or beside back-to-back noise ops, on the
active backend's queues (streams on GPUs, worker threads on CPU), or on plain torch streams
where the backend cannot be created."""
from __future__ import annotations

import math
import os
from statistics import median

import torch

from ..errors import InvalidArgumentError


class Timer:
    """Times work enqueued on backend queues with the backend's own events."""

    def __init__(self, backend, copy_queues: int):
        self.backend = backend
        self.compute = backend.queue("compute")
        self.copies = [backend.queue(f"copy{i}") for i in range(copy_queues)]

    def _drain(self):
        self.backend.finish([self.compute, *self.copies])
        self.backend.synchronize()

    def alone(self, queue, enqueue, warmup: int, repeat: int) -> float:
        """Median seconds of ``enqueue(queue)`` with every other queue idle."""
        for _ in range(warmup):
            enqueue(queue)
        self._drain()
        marks = []
        for _ in range(repeat):
            start, end = self.backend.new_event(), self.backend.new_event()
            self.backend.record(start, queue)
            enqueue(queue)
            self.backend.record(end, queue)
            marks.append((start, end))
        self._drain()
        return median(self.backend.elapsed_s(s, e) for s, e in marks)

    def beside(self, queue, enqueue, noise_queues, noise, noise_count: int, repeat: int) -> float:
        """Median seconds of ``enqueue(queue)`` while ``noise(q)`` runs ``noise_count`` times
        back to back on each of ``noise_queues`` (queued first, so it covers the victim)."""
        times = []
        for _ in range(repeat):
            for q in noise_queues:
                for _ in range(noise_count):
                    noise(q)
            start, end = self.backend.new_event(), self.backend.new_event()
            self.backend.record(start, queue)
            enqueue(queue)
            self.backend.record(end, queue)
            self._drain()
            times.append(self.backend.elapsed_s(start, end))
        return median(times)


class TorchCudaQueues:
    """Stand-in for a GPU backend, on plain torch.cuda streams: for a GPU where no ficco GPU
    backend can be created, and to compare copy paths. Copies are ``Tensor.copy_``
    (cudaMemcpyAsync; 2D through cudaMemcpy2DAsync when cuda-python imports). With
    ``prefer_copy_engines`` they go through cudaMemcpyBatchAsync / cudaMemcpy3DBatchAsync with
    the prefer-overlap-with-compute hint, which asks the driver for a copy engine even for a
    copy inside one GPU (a plain one there runs on the SMs)."""

    def __init__(self, prefer_copy_engines: bool = False):
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._streams = {"compute": torch.cuda.current_stream()}
        self.prefer_copy_engines = prefer_copy_engines
        self.name = "torch-cuda" + ("-ce" if prefer_copy_engines else "")
        try:
            from cuda.bindings import runtime
        except ImportError:
            if prefer_copy_engines:
                raise InvalidArgumentError("--queues torch-ce needs cuda-python "
                                           "(pip install cuda-python)") from None
            runtime = None
        self._runtime = runtime

    def _check(self, call: str, result) -> None:
        err = result[0] if isinstance(result, tuple) else result
        if err != self._runtime.cudaError_t.cudaSuccess:
            raise RuntimeError(f"{call} failed: {err}")

    def target(self):
        major, minor = torch.cuda.get_device_capability()
        return f"{'rocm' if torch.version.hip else 'cuda'}:sm_{major}{minor}"

    def device(self):
        return self._device

    def queue(self, name):
        if name not in self._streams:
            self._streams[name] = torch.cuda.Stream()
        return self._streams[name]

    def new_event(self):
        return torch.cuda.Event(enable_timing=True)

    def record(self, event, queue):
        event.record(queue)

    def wait(self, event, queue):
        queue.wait_event(event)

    def copy(self, dst, src, queue):
        if self.prefer_copy_engines:
            rt = self._runtime
            attr = rt.cudaMemcpyAttributes()
            attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            attr.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
            nbytes = dst.numel() * dst.element_size()
            self._check("cudaMemcpyBatchAsync", rt.cudaMemcpyBatchAsync(
                [dst.data_ptr()], [src.data_ptr()], [nbytes], 1, [attr], [0], 1,
                queue.cuda_stream))
            return
        with torch.cuda.stream(queue):
            dst.copy_(src, non_blocking=True)

    def copy_2d(self, dst, src, queue):
        rt, size = self._runtime, dst.element_size()
        if rt is None:
            return self.copy(dst, src, queue)
        if self.prefer_copy_engines:
            op = rt.cudaMemcpy3DBatchOp()
            for operand, t in ((op.src, src), (op.dst, dst)):
                operand.type = rt.cudaMemcpy3DOperandType.cudaMemcpyOperandTypePointer
                operand.op.ptr.ptr = t.data_ptr()
                operand.op.ptr.rowLength = t.stride(0) * size   # pointer copies count bytes
            op.extent.width = dst.shape[1] * size
            op.extent.height, op.extent.depth = dst.shape[0], 1
            op.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            op.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
            self._check("cudaMemcpy3DBatchAsync",
                        rt.cudaMemcpy3DBatchAsync(1, [op], 0, queue.cuda_stream))
            return
        self._check("cudaMemcpy2DAsync", rt.cudaMemcpy2DAsync(
            dst.data_ptr(), dst.stride(0) * size, src.data_ptr(), src.stride(0) * size,
            dst.shape[1] * size, dst.shape[0], rt.cudaMemcpyKind.cudaMemcpyDefault,
            queue.cuda_stream))

    def gemm(self, a, b, out, accumulate, queue):
        with torch.cuda.stream(queue):
            if accumulate:
                out.addmm_(a, b)
            else:
                torch.mm(a, b, out=out)

    def finish(self, queues):
        for q in queues:
            self._streams["compute"].wait_stream(q)

    def synchronize(self):
        torch.cuda.synchronize()

    def elapsed_s(self, start, end):
        return start.elapsed_time(end) / 1e3


def _backend(queues: str = "auto"):
    """The active ficco backend (``queues="backend"``), :class:`TorchCudaQueues`
    (``"torch"``, ``"torch-ce"``), or for ``"auto"`` the backend unless a GPU is visible and
    no ficco GPU backend can be created here."""
    from ..backends import get_backend

    if queues in ("torch", "torch-ce"):
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"--queues {queues} needs a visible GPU (torch.cuda)")
        return TorchCudaQueues(prefer_copy_engines=queues == "torch-ce")
    try:
        backend = get_backend()
    except Exception as exc:  # noqa: BLE001 - any failure: fall back or re-raise below
        if queues == "backend" or not torch.cuda.is_available():
            raise
        print(f"ficco's GPU backend is unavailable ({type(exc).__name__}: {exc}); timing on "
              f"torch.cuda streams instead")
        return TorchCudaQueues()
    if queues == "auto" and backend.device().type == "cpu" and torch.cuda.is_available() \
            and os.environ.get("FICCO_BACKEND") != "cpu":
        return TorchCudaQueues()
    return backend


def _cover(victim_s: float, noise_s: float) -> int:
    """Noise repetitions that outlast the victim by half again (capped: a tiny noise op
    against a long victim would otherwise queue thousands)."""
    return max(2, min(256, math.ceil(1.5 * victim_s / max(noise_s, 1e-9)) + 1))
