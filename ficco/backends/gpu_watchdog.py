"""Deadlines for stream-ordered barrier waits. A stream wait cannot time out, so a host thread
watches every barrier still pending:

- the clock starts when the stream *reaches* the barrier (an ``arrived`` event recorded just
  before its waits completes), not when the host enqueued it: work queued earlier may take
  longer than FICCO_TIMEOUT without being a timeout;
- past the deadline it names the peers whose slots are short, releases the stream (so the
  process can go on and exit) and leaves the one timeout error of
  :mod:`ficco.symm_mem.barrier` for the backend to raise at its next call;
- a flag-mode barrier still waiting is *peeked* now and then (5 ms after the stream reached
  it, then at doubling gaps up to 0.5 s): a slot holding another call's flag means a peer is
  making a different call, which no wait will ever fix, so the barrier is expired at once
  with the MismatchError of :mod:`ficco.symm_mem.barrier` instead of at its deadline;
- if the thread itself dies, that error is surfaced the same way, never swallowed.

Events are plain (no timing) and recycled once their barrier completed.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import BackendCallError

if TYPE_CHECKING:
    from .gpu import GpuBackend


@dataclass(eq=False)
class PendingBarrier:
    arrived: Any          # torch.cuda.Event recorded before the waits
    done: Any             # torch.cuda.Event recorded after the program
    deadline: Any         # ficco.symm_mem.barrier.Deadline
    queue: Any            # the stream the program runs on
    peek_gap: float = 0.0  # seconds to the next look for a foreign flag (0: not yet looked)
    peek_at: float = 0.0


class Watchdog:
    POLL_S = 0.002
    FIRST_PEEK_S, MAX_PEEK_GAP_S = 0.005, 0.5

    def __init__(self, backend: GpuBackend):
        self.backend = backend
        self._pending: list[PendingBarrier] = []
        self._free_events: list = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    def event(self):
        """A plain event from the recycled pool (creating one costs a driver call)."""
        with self._cv:
            if self._free_events:
                return self._free_events.pop()
        return torch.cuda.Event()

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
            self.backend.bind_thread()
            self.backend.vendor.relax_capture_mode()
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - surfaced by the backend's next call
            with self._cv:
                self._thread = None      # the next watch() starts a fresh one
            self.backend.set_error(BackendCallError(
                f"ficco's barrier watchdog thread died: {type(exc).__name__}: {exc}; barriers "
                f"pending at that moment had no deadline"))

    def _loop(self):
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                items = list(self._pending)
            now = time.monotonic()
            done, recycle = [], []
            for item in items:
                if item.done.query():
                    done.append(item)
                    recycle += [item.arrived, item.done]
                elif item.arrived.query():
                    item.deadline.start(now)
                    if item.deadline.expired(now) or self._foreign(item, now):
                        self.backend.expire(item)
                        done.append(item)   # its events may still be pending: not reused
            if done:
                with self._cv:
                    self._pending = [i for i in self._pending if i not in done]
                    self._free_events += recycle
            time.sleep(self.POLL_S)

    def _foreign(self, item: PendingBarrier, now: float) -> bool:
        """Whether a peer's slot of this (flag-mode) barrier holds another call's flag; looks
        only at the peek times (a look at device pads is a small device-to-host read)."""
        deadline = item.deadline
        if not any(op.exact for op in deadline.waits):
            return False
        if item.peek_gap == 0.0:
            item.peek_gap, item.peek_at = self.FIRST_PEEK_S, deadline.started + self.FIRST_PEEK_S
        if now < item.peek_at:
            return False
        item.peek_gap = min(2 * item.peek_gap, self.MAX_PEEK_GAP_S)
        item.peek_at = now + item.peek_gap
        return bool(deadline.foreign(deadline.late(self.backend.slot_reader(deadline))))

    def wait_done(self, item: PendingBarrier) -> None:
        """Block the host until ``item`` completed or the watchdog expired it."""
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
