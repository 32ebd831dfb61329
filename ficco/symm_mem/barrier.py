"""The one cross-rank barrier protocol of ficco, for every backend (CPU included), and its one
timeout message.

A barrier is a short program of two stream-ordered primitives every backend provides::

    signal_write(queue, slot, value)       # store value into a pad slot, after earlier work
    signal_wait(queue, op, deadline)       # later work waits until op's slot meets op
                                           # (>= op.value, or == op.value when op.exact)

Slot ``[channel, writer]`` of rank ``owner``'s signal pad is where ``writer`` signals
``owner``. Two modes share the program shape (set every peer's slot, wait for all of mine):

- **flag** (plan channels 0 and 1, capture-safe): every value is a constant of the call, so a
  CUDA graph holding the barrier replays correctly. Each rank writes its *call flag* into its
  slot of every peer's pad, waits until each of its own slots holds exactly that flag, then
  clears its own slots to 0. The call flag is a nonzero 31-bit value of the call's digest
  (shapes, dtypes, op, settings) and its number in the group's sequence of calls
  (:func:`call_flag` of ``ficco.runtime.agreement.mixed``): ranks making different calls, or one
  call at different places in their sequences, never pass
  each other's barrier, and a slot holding a nonzero flag other than this rank's names a peer
  in another call, a :class:`~ficco.errors.MismatchError` raised alike on every rank (each
  rank sees the other's flag). That is the per-call agreement check of every dma call, on
  every backend, at no cost beyond the barrier the plan runs anyway. Clearing cannot
  erase a peer's *next* flag because plans alternate channels 0 and 1 with a dependency
  between them (pulls wait on barrier 0, barrier 1 waits on the pulls, and the next call's
  barrier 0 comes after this call's barrier 1 on every queue of the rank): a peer can only
  set a slot again after this rank has passed the other channel's barrier.
- **count** (host barriers, channels 2 and up): a rank may reach the same channel again at
  once, so the value is a per-channel generation that only grows and nothing is cleared.

Programs are built once per (handle, channel, mode) and cached on the handle: the slot
addresses never change while the handle lives (a barrier costs no per-call lookups). A flag
program is a *template* whose flag writes and waits hold no value (None): the call's flag is
the barrier's ``Deadline.target``. Backends that take templates (``Backend.signal_templates``:
the CPU's) read it there; for the others :func:`plan_barrier` fills it in (cached per flag).

The deadline counts from when the queue *reaches* the wait, not from when the host enqueued
it: work queued before the barrier may legitimately take longer than FICCO_TIMEOUT.

The first plan barrier of a call also *answers* (``Deadline.answer``, set by the runtime per
call through ``handle.first_wait``): a host thread that has waited there a moment asks whether
a peer is in a first-call agreement exchange instead (its call is new to it, this rank's was
agreed before) and joins it, so the two raise a MismatchError naming both calls at once rather
than both waiting for FICCO_TIMEOUT (:func:`ficco.runtime.agreement.answer`). Only the first barrier:
until it passed, no peer can have finished this call, so a peer's exchange is this call's.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CommTimeoutError, InvalidArgumentError, MismatchError, error_context

#: int32 counters per rank and peer in every signal pad: (SIGNAL_CHANNELS, world)
SIGNAL_CHANNELS = 8
#: channels of the plans' stream-ordered barriers (flag mode, safe to capture in graphs)
PLAN_CHANNELS = (0, 1)
#: the call flag of a plan run without a call digest (benchmarks, tests): the same on every rank
FLAG = 1
WRITE, WAIT = "write", "wait"
_FLAG_PROGRAMS_KEPT = 64          # flag programs per handle (one per channel and call flag)
# A first barrier that waits this long starts answering peers' agreement exchanges, then asks
# again at this period: a store lookup per peer, never on a call whose peers are on time.
ANSWER_AFTER_S, ANSWER_EVERY_S = 0.1, 0.25


def call_flag(word: int | None) -> int:
    """The flag value of a call with digest ``word``: nonzero, below 2**31 (an int32 slot).

    >>> call_flag(None), 0 < call_flag(2**62 + 12345) < 2**31
    (1, True)
    """
    return FLAG if word is None else word % 0x7FFFFFFF + 1


@dataclass(frozen=True)
class SignalOp:
    """One primitive of a barrier program: ``kind`` is WRITE or WAIT (until the slot is >=
    ``value``, or == ``value`` when ``exact``); ``peer`` is the rank the slot belongs to
    (WRITE) or signals from (WAIT), for error messages."""

    kind: str
    slot: Any
    value: int | None        # None in a template: the call's flag (the deadline's target)
    peer: int
    exact: bool = False

    def met(self, seen: int, target: int | None = None) -> bool:
        value = self.value if self.value is not None else target
        return seen == value if self.exact else seen >= value  # type: ignore[operator]

    def foreign(self, seen: int | None, target: int | None = None) -> bool:
        """A flag-mode slot holding another call's flag: a peer making another call (None:
        the slot could not be read)."""
        value = self.value if self.value is not None else target
        return self.exact and seen is not None and seen != 0 and seen != value


class Deadline:
    """When a barrier's waits give up, and what to say then. ``waits`` are the program's WAIT
    ops; ``started`` is set by the backend when its queue reaches the first wait. (A plain
    class with slots: one is made per barrier per call, on the enqueue hot path.)"""

    __slots__ = (
        "answer",
        "channel",
        "fired",
        "handle",
        "rank",
        "started",
        "step",
        "target",
        "timeout_s",
        "waits",
    )

    def __init__(self, rank: int, channel: int, step: int, timeout_s: float, target: int,
                 waits: tuple = (), handle: Any = None, answer: Callable[[], None] | None = None):
        self.rank, self.channel, self.step = rank, channel, step
        self.timeout_s, self.target, self.waits = timeout_s, target, waits
        self.started: float | None = None
        self.fired = False
        self.handle = handle   # the SymmHandle (GPU: marked when captured into a graph)
        self.answer = answer   # the call's first barrier: answers a peer's agreement exchange

    def start(self, now: float | None = None) -> float:
        """Start the clock (first caller wins); returns the monotonic expiry time."""
        if self.started is None:
            self.started = time.monotonic() if now is None else now
        return self.started + self.timeout_s

    def expired(self, now: float | None = None) -> bool:
        return self.started is not None and \
            (time.monotonic() if now is None else now) > self.started + self.timeout_s

    def late(self, read: Callable[[Any], int]) -> list[tuple[int, int]]:
        """(peer, value seen) for each wait whose slot does not hold its value yet."""
        seen = [(op.peer, int(read(op.slot))) for op in self.waits]
        return [(peer, value) for (peer, value), op in zip(seen, self.waits)
                if not op.met(value, self.target)]

    def foreign(self, late: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Those of ``late`` whose slot holds another call's flag (flag mode)."""
        exact = {op.peer: op for op in self.waits}
        return [(p, v) for p, v in late if p in exact and exact[p].foreign(v, self.target)]

    def error(self, late: list[tuple[int, int]]) -> CommTimeoutError | MismatchError:
        """The one error of every backend's barriers: a MismatchError when a peer's slot holds
        another call's flag, else the one timeout message."""
        where = f" at step {self.step}" if self.step is not None and self.step >= 0 else ""
        foreign = self.foreign(late)
        if foreign:
            mismatch = MismatchError(
                f"rank {self.rank}{where}: rank(s) {[p for p, _ in foreign]} reached this "
                f"call's barrier (channel {self.channel}) from a different call (call flags "
                f"{[v for _, v in foreign]}, this rank's {self.target}): other shapes, dtypes, "
                f"settings or op, each agreed at an earlier call. Nothing this call computed "
                f"is returned; every rank must make the same calls in the same order")
            # the runtime names the calls they stand for
            error_context(mismatch).flags = dict(foreign)
            return mismatch
        peers = [p for p, _ in late]
        values = [v for _, v in late]
        held = "whose signal slots could not be read" if None in values else \
            f"whose signal slots held {values}"
        return CommTimeoutError(
            f"rank {self.rank}{where}: barrier channel {self.channel} (waiting for value "
            f"{self.target}) waited {self.timeout_s:.1f}s for rank(s) {peers or '?'} {held}; "
            f"they are dead, stuck, or called with other arguments. "
            f"Raise FICCO_TIMEOUT if they are only slow")


    def given_up(self, by: int | None, late: list[tuple[int, int | None]]) -> CommTimeoutError:
        """The error of a barrier released before its deadline because its group had already
        failed on this rank: ``by`` the rank that gave up first (None: this rank, at an
        earlier barrier), ``late`` the peers not arrived here either."""
        where = f" at step {self.step}" if self.step is not None and self.step >= 0 else ""
        who = "an earlier barrier of this rank" if by is None else f"rank {by}"
        peers = [p for p, _ in late]
        return CommTimeoutError(
            f"rank {self.rank}{where}: barrier channel {self.channel} was released without "
            f"waiting: {who} gave up on this group (a barrier passed FICCO_TIMEOUT)"
            + (f"; rank(s) {peers} had not reached this barrier either" if peers else "")
            + ". Nothing this rank computed since is returned: call ficco.shutdown() on every "
              "rank, then call again")


def _check_channel(handle, channel: int) -> None:
    if not 0 <= channel < SIGNAL_CHANNELS:
        raise InvalidArgumentError(f"barrier channel {channel} is outside [0, {SIGNAL_CHANNELS})")


def flag_program(handle, channel: int, flag: int = FLAG) -> tuple[SignalOp, ...]:
    """Set my call flag in every peer's pad, wait until each of my slots holds exactly that
    flag, clear my slots (cached per channel and flag)."""
    return _flag_program(handle, channel, flag)[0]


def _flag_template(handle, channel: int) -> tuple[tuple, tuple]:
    """(program, waits) of a flag barrier on ``channel`` with the flag left to the deadline
    (cached per channel)."""
    cached = handle._programs.get(channel)
    if cached is None:
        _check_channel(handle, channel)
        r, w = handle.rank, handle.world
        waits = tuple(SignalOp(WAIT, handle.slot(r, channel, p), None, p, True)
                      for p in range(w))
        program = (tuple(SignalOp(WRITE, handle.slot(p, channel, r), None, p) for p in range(w))
                   + waits
                   + tuple(SignalOp(WRITE, handle.slot(r, channel, p), 0, p) for p in range(w)))
        cached = handle._programs[channel] = (program, waits)
    return cached


def _flag_program(handle, channel: int, flag: int) -> tuple[tuple, tuple]:
    """The template of ``channel`` with ``flag`` filled in (cached per channel and flag)."""
    key = (channel, flag)
    cached = handle._programs.get(key)
    if cached is None:
        if not 0 < flag < 2 ** 31:
            raise InvalidArgumentError(f"a call flag is in [1, 2**31); got {flag}")
        template, _ = _flag_template(handle, channel)
        program = tuple(SignalOp(op.kind, op.slot, flag if op.value is None else op.value,
                                 op.peer, op.exact) for op in template)
        waits = tuple(op for op in program if op.kind == WAIT)
        flags = [k for k in handle._programs if isinstance(k, tuple) and isinstance(k[0], int)]
        if len(flags) >= _FLAG_PROGRAMS_KEPT:     # many distinct calls: stay bounded
            for k in flags:
                del handle._programs[k]
        cached = handle._programs[key] = (program, waits)
    return cached


def count_program(handle, channel: int, generation: int) -> tuple[SignalOp, ...]:
    """Write ``generation`` into my slot of every peer's pad, wait for all my slots >= it."""
    key = ("count", channel)
    slots = handle._programs.get(key)
    if slots is None:
        _check_channel(handle, channel)
        r, w = handle.rank, handle.world
        slots = handle._programs[key] = ([(handle.slot(p, channel, r), p) for p in range(w)],
                                         [(handle.slot(r, channel, p), p) for p in range(w)])
    writes, waits = slots
    return (tuple(SignalOp(WRITE, s, generation, p) for s, p in writes)
            + tuple(SignalOp(WAIT, s, generation, p) for s, p in waits))


def _deadline(handle, channel, step, timeout_s, target, program) -> Deadline:
    return Deadline(handle.rank, channel, -1 if step is None else step, timeout_s, target,
                    tuple(op for op in program if op.kind == WAIT), handle=handle)


def plan_barrier(backend, handle, channel: int, queue, timeout_s: float, step: int) -> None:
    """A plan's barrier (flag mode), ordered on ``queue``: the executor calls it for a plan's
    barrier step, and it enqueues the program through ``backend.signal_batch``.

    >>> from ficco.backends.cpu import CpuBackend
    >>> backend = CpuBackend()
    >>> h = backend.symm_provider().allocate(64, None, backend.device())    # world 1
    >>> q = backend.queue("copy0")
    >>> plan_barrier(backend, h, 0, q, timeout_s=5.0, step=0); backend.finish([q])
    >>> int(h.signal_pad(0)[0, 0])      # flag set, awaited, then cleared
    0
    """
    if channel not in PLAN_CHANNELS:
        raise InvalidArgumentError(f"plan barriers use channels {PLAN_CHANNELS}; got {channel}")
    flag = getattr(handle, "call_flag", FLAG)
    if backend.signal_templates:    # the flag is the deadline's target: one program per channel
        program, waits = handle._programs.get(channel) or _flag_template(handle, channel)
    else:
        program, waits = handle._programs.get((channel, flag)) or \
            _flag_program(handle, channel, flag)
    answer = getattr(handle, "first_wait", None)
    if answer is not None:
        handle.first_wait = None            # the call's first barrier only
    backend.signal_batch(queue, program, Deadline(handle.rank, channel, step, timeout_s, flag,
                                                  waits, handle, answer))


def host_barrier(backend, handle, channel: int, timeout_s: float, step=None) -> None:
    """Block the host until every rank reached this barrier as often as this rank (count
    mode); raises the one CommTimeoutError naming the late peers."""
    if channel in PLAN_CHANNELS:
        raise InvalidArgumentError(
            f"barrier channels {PLAN_CHANNELS} belong to ficco's plans (flag mode); use a "
            f"channel in [2, {_signal_channels()}) for host barriers")
    _check_channel(handle, channel)
    generation = handle._generation[channel] + 1
    handle._generation[channel] = generation
    program = count_program(handle, channel, generation)
    backend.signal_now(program, _deadline(handle, channel, step, timeout_s, generation,
                                          program))


def _signal_channels() -> int:
    return SIGNAL_CHANNELS


def wait_on_host(op: SignalOp, deadline: Deadline, read: Callable[[Any], int],
                 abandoned: Callable[[], bool] | None = None,
                 abandon_error: type[BaseException] | None = None) -> None:
    """Poll ``read(op.slot)`` from a host thread until ``op`` is met (growing nap), raising
    the deadline's error once it passes (its clock starts at the first wait reached), or at
    once a MismatchError when the slot holds another call's flag."""
    expiry = deadline.start()
    assert deadline.started is not None     # start() set it
    answer_at = deadline.started + ANSWER_AFTER_S
    nap = 2e-5
    target = deadline.target
    while not op.met(seen := read(op.slot), target):
        if op.foreign(seen, target):
            deadline.fired = True
            raise deadline.error(deadline.late(read))
        if abandoned is not None and abandoned():
            raise (abandon_error or CommTimeoutError)(f"rank {deadline.rank}: barrier abandoned")
        now = time.monotonic()
        if now > expiry:
            deadline.fired = True
            raise deadline.error(deadline.late(read))
        if deadline.answer is not None and now >= answer_at:
            answer_at = now + ANSWER_EVERY_S
            deadline.answer()      # raises the MismatchError of a peer's differing call
        time.sleep(nap)
        nap = min(nap * 2, 1e-3)


def run_on_host(program, deadline: Deadline, read: Callable[[Any], int],
                write: Callable[[Any, int], None]) -> None:
    """Execute a barrier program from the calling host thread (CPU host barriers)."""
    for op in program:
        if op.kind == WRITE:
            write(op.slot, op.value)
        else:
            wait_on_host(op, deadline, read)
