"""The CPU backend: the reference for tests, CI and the demo.

A queue is a worker thread with a FIFO; an event is a flag; a copy queue is a thread doing
``Tensor.copy_`` (which releases the GIL), so copies really overlap GEMMs on a multi-core host.
If any queue fails during a call, every other queue of this rank is woken and skips the rest,
and ``finish`` raises the first error.

FICCO_TIMEOUT bounds waits on other ranks, never this rank's own work: ``finish`` gives up on a
queue only while it runs a collective (a host task not marked local) past the deadline, or when
no queue has moved for that long with none of them computing (every queue waiting on another).
A GEMM, copy or reduction takes as long as it takes; a barrier's wait has its own deadline.

Signals are plain stores and polls of int32 slots in /dev/shm (:mod:`ficco.symm_mem.cpu`),
run in queue order by the worker threads, so the CPU runs the barrier protocol of
:mod:`ficco.symm_mem.barrier` exactly as GPUs run it on their streams.
"""
from __future__ import annotations

import queue as queue_mod
import threading
import time

import torch
import torch.distributed as dist

from ...errors import CommTimeoutError, FiccoError, name_step
from ...host_tasks import LOCAL
from ...symm_mem.barrier import WRITE, run_on_host, wait_on_host
from ...symm_mem.cpu import CpuSymmProvider
from ..base import Backend

_GRACE_S = 0.5      # finish()'s slack past FICCO_TIMEOUT (see there)
# An idle queue thread ends after this long once no process group is left (the default group's
# destruction is not observable otherwise: torch keeps its Python object alive); a later call
# starts a new one.
_IDLE_S = 1.0


class _Aborted(Exception):
    """Raised inside a queue that is skipping work after another queue failed."""


class CpuEvent:
    __slots__ = ("flag", "time_s")

    def __init__(self):
        self.flag = threading.Event()
        self.time_s = None

    def set(self):
        self.time_s = time.perf_counter()
        self.flag.set()


# Each task in a worker's FIFO carries whether its caller was in inference mode (a worker thread
# starts with torch's default modes, not its caller's: H3, issue 12). The enqueueing methods
# put ``(task, _inference_mode())`` themselves: the executor enqueues one task per plan step,
# and a helper between would be one more Python call per step.
_inference_mode = torch.is_inference_mode_enabled

# What a queue's task is, for finish()'s deadline (``task.ficco_kind``; unmarked: BOUNDED).
#   LOCAL: this rank's own work (GEMM, copy, reduction): never timed out
WAITS = "waits"       # a wait that ends by another queue's progress or its own deadline
BOUNDED = "bounded"   # a collective: it may wait on a peer, so at most FICCO_TIMEOUT


def _kind(fn, kind: str):
    fn.ficco_kind = kind
    return fn


def _work(fn, tensors: tuple):
    """A GEMM or copy task: this rank's own work, holding its tensors (which name its plan
    step if it fails)."""
    fn.ficco_kind, fn.ficco_work = LOCAL, tensors
    return fn


class _Worker:
    def __init__(self, name: str, backend: CpuBackend):
        self.name = name
        self.backend = backend
        self.fifo: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
        self.step = None        # the plan step of the launched task now running, if named
        self.kind = None        # what the running task is (LOCAL, WAITS, BOUNDED; None: idle)
        self.since = self.moved = time.monotonic()   # task started / last task finished
        self.thread = threading.Thread(target=self._loop, name=f"ficco-{name}", daemon=True)
        self.thread.start()

    def _loop(self):
        torch.set_num_threads(1)
        # ficco's work sits below autograd (the ops' autograd is registered on the ops), as on
        # the caller's thread inside the op: recording here would refuse out= GEMMs on weights
        # that require grad.
        torch.set_grad_enabled(False)
        inference = None            # the entered inference_mode while tasks ask for it
        while True:
            try:
                task, in_inference = self.fifo.get(timeout=_IDLE_S)
            except queue_mod.Empty:
                if self.backend._retire(self):
                    return
                continue
            if in_inference != (inference is not None):
                if inference is not None:
                    inference.__exit__(None, None, None)
                    inference = None
                else:
                    inference = torch.inference_mode()
                    inference.__enter__()
            if task is None:
                return
            if isinstance(task, CpuEvent):  # finish() marker: always delivered
                task.set()
                continue
            if self.backend.abort.is_set():
                continue
            self.step = getattr(task, "ficco_step", None)
            self.since = time.monotonic()
            self.kind = getattr(task, "ficco_kind", BOUNDED)
            try:
                task()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by finish()
                self.backend._fail(self.name, exc, self.step, task)
            self.step = self.kind = None
            self.moved = time.monotonic()


def gemm_into(a, b, out, accumulate):
    """``out (+)= a @ b``; ``a`` and ``out`` may be 3-D batched views. A wider ``out`` (fp32
    for bf16/fp16 inputs) takes unrounded partial sums: the caller rounds once at the end."""
    if out.dtype != a.dtype:
        a, b = a.to(out.dtype), b.to(out.dtype)
    if a.dim() == 2:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif accumulate:
        out.baddbmm_(a, b.expand(a.shape[0], *b.shape))
    else:
        out.copy_(torch.matmul(a, b))


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, device=None) -> None:
        self.abort = threading.Event()
        self._errors: list[tuple] = []      # (queue name, exception, step, task)
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self._provider = CpuSymmProvider(self)

    @classmethod
    def unavailable_reason(cls):
        return None

    def target(self):
        return "cpu"

    def device(self):
        return torch.device("cpu")

    def queue(self, name):
        worker = self._workers.get(name)
        if worker is None:
            with self._lock:
                worker = self._workers.get(name)
                if worker is None:
                    worker = self._workers[name] = _Worker(name, self)
        return worker

    def _retire(self, worker: _Worker) -> bool:
        """Whether idle ``worker`` ends now: when no process group is left (after
        ``destroy_process_group()``), so ficco's threads do not outlive the group."""
        if not dist.is_available() or dist.is_initialized():
            return False
        with self._lock:
            if not worker.fifo.empty() or self._workers.get(worker.name) is not worker:
                return False
            del self._workers[worker.name]
            return True

    def new_event(self):
        return CpuEvent()

    def plan_events(self, compiled, count):
        return [CpuEvent() for _ in range(count)]   # fresh every call: an event fires once

    def record(self, event, queue):
        queue.fifo.put((event.set, _inference_mode()))      # instant: never held

    def wait(self, event, queue):
        def wait_for_event():
            # No deadline of its own: the event comes from another queue of this rank, which
            # computes (as long as it takes) or is bounded itself (finish()); a failure
            # anywhere aborts this wait.
            while not event.flag.wait(0.05):
                if self.abort.is_set():
                    raise _Aborted()
        queue.fifo.put((_kind(wait_for_event, WAITS), _inference_mode()))

    def copy(self, dst, src, queue):
        queue.fifo.put((_work(lambda: dst.copy_(src), (dst, src)), _inference_mode()))

    def copy_2d(self, dst, src, queue):
        queue.fifo.put((_work(lambda: dst.copy_(src), (dst, src)), _inference_mode()))

    def gemm(self, a, b, out, accumulate, queue):
        def run():
            gemm_into(a, b, out, accumulate)
        queue.fifo.put((_work(run, (a, b, out)), _inference_mode()))

    def launch(self, queue, fn):
        queue.fifo.put((fn, _inference_mode()))

    # -- signals (slots are (int32 array, index) pairs over /dev/shm, see symm_mem.cpu) ------
    def signal_write(self, queue, slot, value):
        pad, index = slot
        queue.fifo.put((lambda: pad.__setitem__(index, value), _inference_mode()))

    def signal_wait(self, queue, op, deadline):
        def wait():
            wait_on_host(op, deadline, _read, self.abort.is_set, _Aborted)
        queue.fifo.put((_kind(wait, WAITS), _inference_mode()))   # its own deadline bounds it

    def signal_batch(self, queue, ops, deadline):
        """A whole barrier program as one task of ``queue``: the primitives in order, as the
        GPU backends enqueue it in one driver call."""
        aborted = self.abort.is_set

        def program():
            for op in ops:
                if op.kind == WRITE:
                    _write(op.slot, op.value)
                else:
                    wait_on_host(op, deadline, _read, aborted, _Aborted)
        queue.fifo.put((_kind(program, WAITS), _inference_mode()))   # its own deadline

    def signal_now(self, ops, deadline):
        run_on_host(ops, deadline, _read, _write)

    def finish(self, queues):
        from ... import config

        timeout_s = config.timeout_s()
        stuck = self._drain([(q, _marker(q)) for q in queues], timeout_s)
        if stuck:
            self.abort.set()
            raise self._undrained(stuck, timeout_s)
        errors, self._errors = self._errors, []
        self.abort.clear()
        real = [(n, e, s, t) for n, e, s, t in errors if not isinstance(e, _Aborted)]
        if real:
            name, exc, step, task = real[0]
            if isinstance(exc, FiccoError):
                raise name_step(exc, step) if step else exc
            where = f" in {step}" if step else ""
            failure = FiccoError(f"queue {name} failed{where}: {type(exc).__name__}: {exc}")
            # This rank's own work (a GEMM, copy or reduction) or a collective: the executor
            # names a GEMM's or copy's plan step from the tensors the task held, the runtime
            # adds rank, op and schedule.
            failure.ficco_local = getattr(task, "ficco_kind", None) == LOCAL
            failure.ficco_work = getattr(task, "ficco_work", None)
            raise name_step(failure, step) from exc

    @staticmethod
    def _drain(markers, timeout_s: float) -> list:
        """Wait until every queue reached its marker; returns the queues held past the
        deadline instead (see the module docstring). The grace: a queue's own bounded waits
        (a dma barrier's poll) started their FICCO_TIMEOUT a moment before this one; they
        name the late peer, so they get a moment to report first."""
        limit = timeout_s + _GRACE_S
        for _, marker in markers:
            while not marker.flag.wait(0.05):
                busy = [w for w, m in markers if not m.flag.is_set()]
                now = time.monotonic()
                late = [w for w in busy if w.kind == BOUNDED and now - w.since > limit]
                if late:
                    return late
                computing = any(w.kind == LOCAL for w in busy)
                if not computing and now - max(w.moved for w, _ in markers) > limit:
                    return busy           # every queue waits on another: nothing will move
        return []

    @staticmethod
    def _undrained(stuck, timeout_s) -> CommTimeoutError:
        """The timeout of a call whose queues did not drain, naming the step that holds
        them: the first queue inside a named step (a collective), else the first stuck one
        (it waits on another queue of this rank)."""
        q = next((w for w in stuck if w.step), stuck[0])
        where = f": it is still in {q.step}" if q.step else " (waiting on another queue)"
        now = time.monotonic()
        states = "; ".join(
            f"{w.name}: {w.kind or 'between tasks'} for {now - (w.since if w.kind else w.moved):.1f}s"
            f", {w.fifo.qsize()} queued" for w in stuck)
        exc = CommTimeoutError(
            f"queue {q.name} did not drain within FICCO_TIMEOUT ({timeout_s:.1f}s){where} "
            f"[{states}]")
        return name_step(exc, q.step) if q.step else exc

    def _fail(self, name, exc, step=None, task=None):
        with self._lock:
            self._errors.append((name, exc, step, task))
        self.abort.set()

    def elapsed_s(self, start, end):
        return end.time_s - start.time_s

    def synchronize(self):
        """Block until every queue ran (or, after :meth:`cancel`, skipped) what it was given,
        bounded by FICCO_TIMEOUT; then the queues take new work normally again."""
        from ... import config

        with self._lock:
            workers = list(self._workers.values())
        stuck = self._drain([(w, _marker(w)) for w in workers], config.timeout_s())
        if stuck:
            raise CommTimeoutError(f"queue {stuck[0].name} is still busy after FICCO_TIMEOUT; "
                                   f"its memory stays mapped")
        with self._lock:
            self._errors = []
        self.abort.clear()

    def cancel(self):
        """Make every queue skip what is left (a failed or interrupted call)."""
        self.abort.set()

    def cancelled(self):
        return self.abort.is_set()

    def symm_provider(self):
        return self._provider

    def close(self):
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for worker in workers:
            worker.fifo.put((None, False))
        for worker in workers:
            worker.thread.join(timeout=5)


def _marker(worker) -> CpuEvent:
    marker = CpuEvent()
    worker.fifo.put((marker, _inference_mode()))
    return marker


def _read(slot) -> int:
    pad, index = slot
    return int(pad[index])


def _write(slot, value) -> None:
    pad, index = slot
    pad[index] = value


__all__ = ["CpuBackend"]
