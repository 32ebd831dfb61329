"""Deadlines for stream-ordered barrier waits. A stream wait cannot time out, so a host thread
watches every barrier still pending:

- the clock starts when the stream *reaches* the barrier (an ``arrived`` event recorded just
  before its program completes), not when the host enqueued it: work queued earlier may take
  longer than FICCO_TIMEOUT without being a timeout;
- past the deadline it names the peers whose slots are short, reports the error to the
  barrier's group (:class:`~ficco.symm_mem.fault.GroupFault`: error slot and error word, raised
  before anything is released), gives up on the group (raises the peers' words), and releases
  the stream;
- once a group has failed on this rank (its word raised by this rank or by a peer that gave
  up), every later barrier of that group is released as soon as its stream reaches it, with no
  deadline of its own: a dead peer costs one FICCO_TIMEOUT, not one per queued barrier;
  gated GEMMs of the group stop too (they poll the same word); a word a
  gated GEMM of this rank raised (it waited its own deadline) expires the barrier instead, so
  the peers' words are raised as at any deadline;
- a flag-mode barrier still waiting is *peeked* now and then (5 ms after the stream reached
  it, then at doubling gaps up to 0.5 s): a slot holding another call's flag means a peer is
  making a different call, which no wait will ever fix, so the barrier is expired at once
  with the MismatchError of :mod:`ficco.symm_mem.barrier` instead of at its deadline;
- the thread never blocks on a stream: it reads slots and writes them through a
  :class:`WatchdogPort` that promises as much (host loads and stores on host-mapped pads), so
  a stream stuck in front of a shared hardware queue cannot stop it;
- if the thread itself dies, that error is surfaced, never swallowed.

The watchdog knows the GPU backend only through :class:`WatchdogPort` (no import of
:mod:`ficco.backends.gpu`). Events are plain (no timing) and recycled once their barrier
completed.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import BackendCallError, FiccoError


@dataclass(eq=False)
class PendingBarrier:
    arrived: Any          # event recorded before the program
    done: Any             # event recorded after the program
    deadline: Any         # ficco.symm_mem.barrier.Deadline (its handle carries the group fault)
    queue: Any            # the stream the program runs on
    peek_gap: float = 0.0  # seconds to the next look for a foreign flag (0: not yet looked)
    peek_at: float = 0.0
    how: str = ""          # "" while pending; then "done", "expired" or "released"


class WatchdogPort(ABC):
    """What the watchdog needs from a GPU backend, and may call from its own thread. None of
    these may block on a stream."""

    @abstractmethod
    def bind_thread(self) -> None:
        """Make the calling thread use the backend's device (and relaxed capture mode)."""

    @abstractmethod
    def new_event(self) -> Any:
        """A plain event (no timing)."""

    @abstractmethod
    def reader(self, deadline) -> Callable[[Any], int] | None:
        """A function reading the int32 at a slot of ``deadline``'s barrier now, or None when
        the slots cannot be read yet without waiting (device pads: an asynchronous read is
        still in flight)."""

    @abstractmethod
    def release(self, deadline, ops) -> None:
        """Write each WAIT ``op``'s awaited value into its slot, so the stream moves on."""

    @abstractmethod
    def died(self, error: FiccoError) -> None:
        """The watchdog thread died with ``error``: every later call must raise it."""


class Watchdog:
    POLL_S = 0.002
    FIRST_PEEK_S, MAX_PEEK_GAP_S = 0.005, 0.5

    def __init__(self, port: WatchdogPort):
        self.port = port
        self._pending: list[PendingBarrier] = []
        self._free_events: list = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        #: how each barrier ended, counted: "done", "expired" (its deadline or a foreign
        #: flag), "released" (its group had already failed)
        self.outcomes = {"done": 0, "expired": 0, "released": 0}

    def event(self):
        """A plain event from the recycled pool (creating one costs a driver call)."""
        with self._cv:
            if self._free_events:
                return self._free_events.pop()
        return self.port.new_event()

    def watch(self, item: PendingBarrier) -> None:
        with self._cv:
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ficco-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self):
        try:
            self.port.bind_thread()
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - surfaced by the backend's next call
            with self._cv:
                self._thread = None      # the next watch() starts a fresh one
                orphans, self._pending = self._pending, []
            error = BackendCallError(
                f"ficco's barrier watchdog thread died: {type(exc).__name__}: {exc}; barriers "
                f"pending at that moment had no deadline")
            for item in orphans:         # their calls' outputs must not pass as good
                fault = item.deadline.handle.fault if item.deadline.handle is not None else None
                if fault is not None:
                    fault.report(error)
            self.port.died(error)

    def _loop(self):
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                items = list(self._pending)
            now = time.monotonic()
            finished, recycle = [], []
            for item in items:
                if item.done.query():
                    item.how = "done"
                    finished.append(item)
                    recycle += [item.arrived, item.done]
                elif item.arrived.query():
                    self._check(item, now)
                    if item.how:
                        finished.append(item)   # its events may still be pending: not reused
            if finished:
                with self._cv:
                    self._pending = [i for i in self._pending if i not in finished]
                    self._free_events += recycle
                    for item in finished:
                        self.outcomes[item.how] += 1
            time.sleep(self.POLL_S)

    def _check(self, item: PendingBarrier, now: float) -> None:
        """A barrier whose stream is waiting in it: release it when its group failed, expire
        it past its deadline or on a foreign flag, else leave it."""
        deadline = item.deadline
        deadline.start(now)
        fault = deadline.handle.fault if deadline.handle is not None else None
        if fault is not None and fault.kernel_gave_up():
            # A gated GEMM of this rank waited its deadline for a peer's rows:
            # the peers this barrier waits for are late; give up on them as at a deadline.
            item.how = "expired"
            self._expire(item, fault)
            return
        if fault is not None and fault.failed():
            item.how = "released"
            deadline.fired = True
            if fault.error is None:     # a peer gave up: say so, and who is missing here
                read = self.port.reader(deadline)
                late = deadline.late(read) if read is not None else []
                fault.report(deadline.given_up(fault.given_up_by(), late))
            self.port.release(deadline, deadline.waits)
            return
        if deadline.expired(now) or self._foreign(item, now):
            item.how = "expired"
            self._expire(item, fault)

    def _expire(self, item: PendingBarrier, fault) -> None:
        """Name the late peers, report to the group (error and word, before any release), give
        up on the group, then release the stream."""
        deadline = item.deadline
        read = self.port.reader(deadline)
        if read is not None:
            late = deadline.late(read)
        else:     # device pads whose read has not come back: every wait counts as late
            late = [(op.peer, None) for op in deadline.waits]
        deadline.fired = True
        if fault is not None:
            fault.report(deadline.error(late))
            fault.give_up()
        peers = {peer for peer, _ in late}
        self.port.release(deadline, tuple(op for op in deadline.waits if op.peer in peers))

    def _foreign(self, item: PendingBarrier, now: float) -> bool:
        """Whether a peer's slot of this (flag-mode) barrier holds another call's flag; looks
        only at the peek times, and only where the slots can be read without waiting."""
        deadline = item.deadline
        if not any(op.exact for op in deadline.waits):
            return False
        if item.peek_gap == 0.0:
            item.peek_gap, item.peek_at = self.FIRST_PEEK_S, deadline.started + self.FIRST_PEEK_S
        if now < item.peek_at:
            return False
        read = self.port.reader(deadline)
        if read is None:
            return False     # not readable yet: look again at the next poll
        item.peek_gap = min(2 * item.peek_gap, self.MAX_PEEK_GAP_S)
        item.peek_at = now + item.peek_gap
        return bool(deadline.foreign(deadline.late(read)))

    def ended(self, item: PendingBarrier) -> bool:
        """Whether ``item`` left the watch: completed, expired or released."""
        with self._cv:
            return item not in self._pending

    def wait_done(self, item: PendingBarrier) -> None:
        """Block the host until ``item`` completed or the watchdog expired or released it
        (not called by the watchdog thread)."""
        while not item.done.query():
            with self._cv:
                if item not in self._pending:
                    break           # expired: the stream was released, done will complete
                if self._thread is None:
                    return          # the watchdog died: its error is pending, do not block
            time.sleep(0.0005)
        item.done.synchronize()

    def stop(self):
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
