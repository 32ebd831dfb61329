"""The CPU backend: the reference for tests, CI and the demo.

A queue is a worker thread with a FIFO; an event is a flag; a copy queue is a thread doing
``Tensor.copy_`` (which releases the GIL), so copies really overlap GEMMs on a multi-core host.
If any queue fails during a call, every other queue of its lane is woken and skips the rest,
and ``finish`` raises the first error.

A *lane* is one session's set of queues (:meth:`CpuBackend.lane`): worker threads of its own,
its own abort switch and its own errors. Calls on two groups (two sessions) never share a
queue, so one group's barrier never holds the other's work, and one group's failure never
makes the other's queues skip work. Work queued without a lane (benchmarks,
doctests) runs on the backend's default lane.

FICCO_TIMEOUT bounds waits on other ranks, never this rank's own work: ``finish`` gives up on a
queue only while it runs a collective (a host task not marked local) past the deadline, or when
no queue has moved for that long with none of them computing (every queue waiting on another).
A GEMM, copy or reduction takes as long as it takes; a barrier's wait has its own deadline.

Signals are plain stores and polls of int32 slots in /dev/shm (:mod:`ficco.symm_mem.cpu`),
run in queue order by the worker threads, so the CPU runs the barrier protocol of
:mod:`ficco.symm_mem.barrier` exactly as GPUs run it on their streams.
"""
from __future__ import annotations

import itertools
import queue as queue_mod
import threading
import time
import weakref

import torch
import torch.distributed as dist

from ...errors import CommTimeoutError, FiccoError, error_context, name_step
from ...plan.epilogue import gemm_into_view
from ...plan.tasks import LOCAL
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


class CpuEvent(threading.Event):
    """An event of a plan (or a queue's marker): a thread-safe flag, and when it was set."""

    time_s: float | None = None

    def set(self):
        self.time_s = time.perf_counter()
        super().set()


# Each task in a worker's FIFO carries whether its caller was in inference mode (a worker thread
# starts with torch's default modes, not its caller's). The enqueueing methods
# put ``(task, _inference_mode())`` themselves: the executor enqueues one task per plan step,
# and a helper between would be one more Python call per step.
_inference_mode = torch.is_inference_mode_enabled

# What a queue's task is, for finish()'s deadline (``task.ficco_kind``; unmarked: BOUNDED).
#   LOCAL: this rank's own work (GEMM, copy, reduction): never timed out
WAITS = "waits"       # a wait that ends by another queue's progress or its own deadline
BOUNDED = "bounded"   # a collective: it may wait on a peer, so at most FICCO_TIMEOUT


# The enqueueing methods mark their tasks in place (``task.ficco_kind``; a GEMM's or copy's
# ``task.ficco_work``, the tensors that name its plan step if it fails): one Python call per
# plan step, no helper between.


class _Worker:
    def __init__(self, name: str, lane: Lane):
        self.name = name
        self.lane = lane
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
                if self.lane.retire(self):
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
            if self.lane.abort.is_set():
                self.lane.skipped = True
                continue
            self.step = getattr(task, "ficco_step", None)
            self.since = time.monotonic()
            self.kind = getattr(task, "ficco_kind", BOUNDED)
            try:
                task()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by finish()
                self.lane.fail(self.name, exc, self.step, task)
            self.step = self.kind = None
            self.moved = time.monotonic()


class Lane:
    """One session's queues (see the module docstring): worker threads made on first use, an
    abort switch that makes them skip what is left, and the errors they hit."""

    def __init__(self, backend: CpuBackend):
        self.backend = backend
        self.abort = threading.Event()
        self.skipped = False                # a task was skipped since the last finish
        self.errors: list[tuple] = []       # (queue name, exception, step, task)
        self.lock = threading.Lock()
        self.workers: dict[str, _Worker] = {}
        #: the workers of each list of queue names asked for (:meth:`CpuBackend.queues`),
        #: forgotten whenever a worker ends
        self.lists: dict[tuple[str, ...], list[_Worker]] = {}
        self.closed = False

    def queue(self, name: str) -> _Worker:
        worker = self.workers.get(name)
        if worker is None:
            with self.lock:
                worker = self.workers.get(name)
                if worker is None:
                    worker = self.workers[name] = _Worker(name, self)
        return worker

    def retire(self, worker: _Worker) -> bool:
        """Whether idle ``worker`` ends now: when its lane was closed (its session dropped), or
        when no process group is left (after ``destroy_process_group()``), so ficco's threads
        do not outlive the group; a later call starts a new one."""
        if not self.closed and (not dist.is_available() or dist.is_initialized()):
            return False
        with self.lock:
            if not worker.fifo.empty() or self.workers.get(worker.name) is not worker:
                return False
            del self.workers[worker.name]
            self.lists.clear()
            return True

    def fail(self, name, exc, step=None, task=None) -> None:
        with self.lock:
            self.errors.append((name, exc, step, task))
        self.abort.set()

    def close(self) -> None:
        """End the worker threads once they ran what they hold (never waits)."""
        self.closed = True
        with self.lock:
            workers = list(self.workers.values())
            self.workers.clear()
            self.lists.clear()
        for worker in workers:
            worker.fifo.put((None, False))


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    signal_templates = True     # signal_batch reads a template's flag from the deadline

    def __init__(self, device=None) -> None:
        self._lock = threading.Lock()
        self._default = Lane(self)          # work queued without a session's lane
        self._lanes: weakref.WeakSet[Lane] = weakref.WeakSet()
        self._provider = CpuSymmProvider(self)

    @classmethod
    def unavailable_reason(cls):
        return None

    def target(self):
        return "cpu"

    def device(self):
        return torch.device("cpu")

    def lane(self) -> Lane:
        """A set of queues of its own for one session (see the module docstring)."""
        lane = Lane(self)
        with self._lock:
            self._lanes.add(lane)
        return lane

    def queue(self, name, lane=None):
        return (lane or self._default).queue(name)

    def queues(self, names, lane=None):
        lane = lane or self._default
        found = lane.lists.get(names)    # a plan's names: the same workers every call
        if found is None:
            found = [lane.queue(name) for name in names]
            with lane.lock:
                if all(lane.workers.get(w.name) is w for w in found):   # none ended since
                    lane.lists[tuple(names)] = found
        return found

    def _every_lane(self) -> list[Lane]:
        with self._lock:
            return [self._default, *self._lanes]

    def new_event(self):
        return CpuEvent()

    def plan_events(self, compiled, count):
        # fresh every call (an event fires once), made without a Python frame of ficco's
        return list(itertools.starmap(CpuEvent, itertools.repeat((), count)))

    def record(self, event, queue):
        queue.fifo.put((event.set, _inference_mode()))      # instant: never held

    def wait(self, event, queue):
        aborted = queue.lane.abort.is_set

        def wait_for_event():
            # No deadline of its own: the event comes from another queue of this lane, which
            # computes (as long as it takes) or is bounded itself (finish()); a failure
            # anywhere in the lane aborts this wait.
            while not event.wait(0.05):
                if aborted():
                    raise _Aborted()
        wait_for_event.ficco_kind = WAITS    # type: ignore[attr-defined]
        queue.fifo.put((wait_for_event, _inference_mode()))

    def copy(self, dst, src, queue):
        def task():
            dst.copy_(src)
        task.ficco_kind, task.ficco_work = LOCAL, (dst, src)    # type: ignore[attr-defined]
        queue.fifo.put((task, _inference_mode()))

    copy_2d = copy     # rows of any pitch: Tensor.copy_ takes strided views

    def gemm(self, a, b, out, accumulate, queue):
        def task():
            gemm_into_view(a, b, out, accumulate)
        task.ficco_kind, task.ficco_work = LOCAL, (a, b, out)    # type: ignore[attr-defined]
        queue.fifo.put((task, _inference_mode()))

    def launch(self, queue, fn):
        queue.fifo.put((fn, _inference_mode()))

    # -- signals (slots are (int32 array, index) pairs over /dev/shm, see symm_mem.cpu) ------
    def signal_write(self, queue, slot, value):
        pad, index = slot
        queue.fifo.put((lambda: pad.__setitem__(index, value), _inference_mode()))

    def signal_wait(self, queue, op, deadline):
        aborted = queue.lane.abort.is_set

        def wait():
            wait_on_host(op, deadline, _read, aborted, _Aborted)
        wait.ficco_kind = WAITS             # type: ignore[attr-defined]  # its own deadline
        queue.fifo.put((wait, _inference_mode()))

    def signal_batch(self, queue, ops, deadline):
        """A whole barrier program as one task of ``queue``: the primitives in order, as the
        GPU backends enqueue it in one driver call."""
        aborted = queue.lane.abort.is_set
        flag = deadline.target if deadline is not None else None

        def program():
            for op in ops:
                if op.kind == WRITE:
                    _write(op.slot, flag if op.value is None else op.value)
                else:
                    wait_on_host(op, deadline, _read, aborted, _Aborted)
        program.ficco_kind = WAITS          # type: ignore[attr-defined]  # its own deadline
        queue.fifo.put((program, _inference_mode()))

    def signal_now(self, ops, deadline):
        run_on_host(ops, deadline, _read, _write)

    def finish(self, queues, timeout_s=None):
        lane = queues[0].lane if queues else self._default
        if timeout_s is None:
            from ... import config

            timeout_s = config.timeout_s()
        markers = []
        inference = _inference_mode()
        for q in queues:
            marker = CpuEvent()
            q.fifo.put((marker, inference))
            markers.append((q, marker))
        stuck = self._drain(markers, timeout_s)
        if stuck:
            lane.abort.set()
            raise self._undrained(stuck, timeout_s)
        errors = lane.errors
        if errors:
            # A worker records its error before it reaches its marker, so every error of this
            # call is in by now; the lock only orders the swap against a concurrent fail().
            # A warm call without errors takes no lock here: the session's is its one lock.
            with lane.lock:
                errors, lane.errors = lane.errors, []
        skipped, lane.skipped = lane.skipped, False
        lane.abort.clear()
        real = [(n, e, s, t) for n, e, s, t in errors if not isinstance(e, _Aborted)] \
            if errors else errors
        if real:
            name, exc, step, task = real[0]
            if isinstance(exc, FiccoError):
                raise name_step(exc, step) if step else exc
            where = f" in {step}" if step else ""
            failure = FiccoError(f"queue {name} failed{where}: {type(exc).__name__}: {exc}")
            # This rank's own work (a GEMM, copy or reduction) or a collective: the executor
            # names a GEMM's or copy's plan step from the tensors the task held, the runtime
            # adds rank, op and schedule.
            context = error_context(failure)
            context.local = getattr(task, "ficco_kind", None) == LOCAL
            context.work = getattr(task, "ficco_work", None)
            raise name_step(failure, step) from exc
        if skipped or errors:
            # Cancelled from outside the call (ficco.shutdown(), or this session dropped while
            # the call ran): work was skipped, so the outputs are not what they should be.
            raise FiccoError("the call was cancelled while it ran (ficco.shutdown() or its "
                             "group's session was dropped); nothing it computed is returned")

    @staticmethod
    def _drain(markers, timeout_s: float) -> list:
        """Wait until every queue reached its marker; returns the queues held past the
        deadline instead (see the module docstring). The grace: a queue's own bounded waits
        (a dma barrier's poll) started their FICCO_TIMEOUT a moment before this one; they
        name the late peer, so they get a moment to report first."""
        limit = timeout_s + _GRACE_S
        for _, marker in markers:
            while not marker.wait(0.05):
                busy = [w for w, m in markers if not m.is_set()]
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

    def elapsed_s(self, start, end):
        return end.time_s - start.time_s

    def synchronize(self):
        """Block until every queue of every lane ran (or, after :meth:`cancel`, skipped) what
        it was given, bounded by FICCO_TIMEOUT; then the queues take new work normally."""
        for lane in self._every_lane():
            self.drain(lane)

    def drain(self, lane=None):
        """:meth:`synchronize` for one lane's queues (the default lane's for None)."""
        from ... import config

        lane = lane or self._default
        with lane.lock:
            workers = list(lane.workers.values())
        stuck = self._drain([(w, _marker(w)) for w in workers], config.timeout_s())
        if stuck:
            raise CommTimeoutError(f"queue {stuck[0].name} is still busy after FICCO_TIMEOUT; "
                                   f"its memory stays mapped")
        with lane.lock:
            lane.errors = []
        lane.skipped = False
        lane.abort.clear()

    def cancel(self, lane=None):
        """Make the queues of ``lane`` (every lane for None) skip what is left (a failed or
        interrupted call)."""
        for each in ([lane] if lane is not None else self._every_lane()):
            each.abort.set()

    def cancelled(self, lane=None):
        return (lane or self._default).abort.is_set()

    def close_lane(self, lane):
        lane.close()

    def symm_provider(self):
        return self._provider

    def close(self):
        lanes = self._every_lane()
        workers = [w for lane in lanes for w in lane.workers.values()]
        for lane in lanes:
            lane.close()
        for worker in workers:
            if worker.thread is not threading.current_thread():
                worker.thread.join(timeout=5)
        self._default = Lane(self)


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
