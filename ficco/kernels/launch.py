"""What the executor calls for the gated schedules' two plan ops: raising an arrival flag on a
copy queue (``Signal``) and launching the gated GEMM on the compute queue (``GatedGemm``).

Flags are one int32 word per (peer, chunk) of this call, zeroed on the compute queue before
any side queue starts (the executor allocates them), so a call never sees the previous call's
flags. A flag is raised *stream-ordered* after its copy: on GPUs with a stream memory write
(``cuStreamWriteValue32`` / ``hipStreamWriteValue32``, no compute unit involved), on CPU by the
copy queue's worker thread right after the copy.

Errors: on CPU the kernel runs synchronously on the compute worker, so a timed-out wait raises
:class:`~ficco.errors.CommTimeoutError` at once and the call fails. On GPUs the launch is
asynchronous: the error word is copied to pinned host memory behind the kernel and checked
when the next gated call starts (or :func:`raise_pending` is called), as GPU barrier timeouts
are; the kernel itself never spins past its budget.
"""
from __future__ import annotations

import threading
import time

import torch

from ..schedules.gated import describe_flag


def raise_flag(backend, queue, flags: torch.Tensor, index: int) -> None:
    """Enqueue ``flags[index] = 1`` on ``queue`` after the work already there, through the
    backend's ``signal_write`` (the barrier protocol's primitive: slots are (array, index)
    pairs on CPU, device addresses on GPUs)."""
    slot = (flags, index) if flags.device.type == "cpu" else flags.data_ptr() + 4 * index
    backend.signal_write(queue, slot, 1)


class TileTrace:
    """Per-tile timestamps of the gated GEMM launches made inside a ``with`` block on this
    thread (``bench timeline`` uses it; off otherwise, and then the kernel has no trace
    code). After the call finished, :meth:`tiles` gives one list of
    :func:`~ficco.kernels.trace.read_trace` dicts per launch, each with the launch's
    ``b``::

        with TileTrace() as tiles:
            out, plan, rows = ficco.api.traced_all_gather_matmul(a, b, schedule="gated-1d")
        for launch in tiles.tiles(): ...
    """

    _local = threading.local()

    def __init__(self):
        self.launches: list = []   # dicts: b, segments, n, trace, mode, device, origin

    def __enter__(self):
        self._saved = getattr(TileTrace._local, "sink", None)
        TileTrace._local.sink = self
        return self

    def __exit__(self, *exc):
        TileTrace._local.sink = self._saved

    @staticmethod
    def active():
        return getattr(TileTrace._local, "sink", None)

    def tiles(self) -> list[list[dict]]:
        from .trace import read_trace, ticks_per_s

        out = []
        for launch in self.launches:
            tiles = read_trace(launch["trace"], launch["segments"], launch["n"], launch["mode"],
                               ticks_per_s(launch["mode"], launch["device"]),
                               origin=launch["origin"])
            for t in tiles:
                t["b"] = launch["b"]
            out.append(tiles)
        return out


_pending: list = []
_pending_lock = threading.Lock()


def raise_pending() -> None:
    """Raise the first recorded timeout of an earlier asynchronous (GPU) gated launch; the
    executor calls it before it enqueues anything of a gated plan, so a half-enqueued call
    never leaves peers waiting at a barrier this rank will not reach."""
    with _pending_lock:
        done = [item for item in _pending if item[0].query()]
        for item in done:
            _pending.remove(item)
    for _, word, describe, timeout_s in done:
        from .gated_gemm import check_error

        check_error(word, describe, timeout_s)


def gated_task(backend, problem, op, a_local, gathered, b, out, flags, timeout_s: float):
    """The host function that launches ``op`` (a :class:`~ficco.plan.GatedGemm`) when the
    compute queue runs it: at once on GPUs (the launch is stream-ordered), in order on the CPU
    worker (which then runs the interpreter)."""
    from . import configs
    from .gated_gemm import Segment, check_error, gated_gemm
    from .trace import clock_mode, trace_buffer, trace_supported

    segments = tuple(Segment(*s) for s in op.segments)
    local_row0 = problem.shard_row0(problem.rank)
    family = configs.family(backend.target())
    traced = {}
    sink = TileTrace.active()   # read here, on the caller's thread (run() may run elsewhere)
    if sink is not None and out.numel() and trace_supported():   # else: no marks drawn
        mode = clock_mode(backend.target())
        trace = trace_buffer(segments, out.shape[1], family, out.device)
        traced = {"trace": trace, "trace_mode": mode}
        traced_launch = {"b": op.b, "segments": segments, "n": out.shape[1], "trace": trace,
                         "mode": mode, "device": out.device.index or 0, "origin": None}
        sink.launches.append(traced_launch)

    def describe(flag: int) -> str:
        return describe_flag(problem, flag)

    def run() -> None:
        if out.numel() == 0:
            return
        a = a_local if a_local.stride(-1) == 1 else a_local.contiguous()
        if out.device.type == "cpu":
            if traced:   # the host clock the tiles read: times count from this launch
                traced_launch["origin"] = time.perf_counter_ns()
            halt = torch.zeros(1, dtype=torch.int32)
            with _Watch(halt, backend.cancelled, timeout_s):
                err = gated_gemm(a, gathered, b, out, segments, flags,
                                 local_row0=local_row0, halt=halt, timeout_s=timeout_s,
                                 family=family, **traced)
            check_error(err, describe, timeout_s)
            return
        err = gated_gemm(a, gathered, b, out, segments, flags, local_row0=local_row0,
                         timeout_s=timeout_s, family=family, **traced)
        word = torch.empty(1, dtype=torch.int32, pin_memory=True)
        word.copy_(err, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        with _pending_lock:
            _pending.append((done, word, describe, timeout_s))
    return run


class _Watch:
    """CPU only: while the interpreted kernel runs, a thread raises its ``halt`` word at the
    call's deadline or when another queue of this rank failed (``backend.cancelled()``), so
    a wait ends on time and never outlives a failed call; the poll budget stays as backstop."""

    def __init__(self, halt: torch.Tensor, cancelled, timeout_s: float):
        self.halt, self.cancelled, self.timeout_s = halt, cancelled, timeout_s
        self.done = threading.Event()

    def _loop(self, deadline: float) -> None:
        while not self.done.wait(0.01):
            if time.monotonic() > deadline or self.cancelled():
                self.halt.fill_(1)
                return

    def __enter__(self):
        self.thread = threading.Thread(target=self._loop, name="ficco-gated-watch",
                                       args=(time.monotonic() + self.timeout_s,), daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
