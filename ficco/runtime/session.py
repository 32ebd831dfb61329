"""A group's state in this process: one :class:`Session` per (process group, backend), found
from the group *object*, never from its name.

Everything ficco keeps about a group between calls lives here: the lock that serialises its
calls, whether an earlier call left it poisoned, its symmetric workspace, its queues (a
backend *lane*: threads or streams of its own), the calls it agreed with its peers, the
:class:`~ficco.runtime.call.Prepared` form of each call it made, its plans and decisions,
which measured decisions (``auto``, ``tune``) every rank of it holds, and the last decision
it ran. The
conversation with the peers through the group's store (which epoch of it the ranks joined,
how many exchanges it holds, where every rank runs, the number of this rank's next call) is
the group's :class:`Channel`, shared by its sessions.

The life cycle (docs/design.md §10):

- **create**: at the group's first call in this process (or the first after a drop);
- **agree**: the first exchange of a channel joins an epoch every rank proposes alike
  (:func:`ficco.runtime.store.join`); each call takes the next *number* of the channel,
  and calls pair by number (the n-th call that enters ficco on a rank runs with the n-th of
  its peers);
- **poison**: a call that fails after it could have communicated, or whose ranks disagree,
  leaves its session refusing calls (sticky, surviving ``ficco.shutdown()``, when a collective
  of the process group may still be pending in it: then only the group's destruction ends it);
- **drop**: ``ficco.shutdown()`` drops every session whole (workspaces released after their
  queues drained, lanes closed) and resets every channel; the group's destruction drops its
  sessions through a finalizer that holds the group's entry, never its name, so a new group
  of the same name starts clean and an old group's finalizer never touches a new one.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from typing import Any

from ..errors import CommTimeoutError, PoisonedGroupError
from ..group import key as group_key
from ..group import rank_world
from ..symm_mem import workspace

#: calls (call keys) whose checked form a session keeps, plans and decisions (LRU each)
CALLS_KEPT = PLANS_KEPT = DECISIONS_KEPT = 256
#: digests agreed per channel (cleared when full: every rank clears at the same exchange)
AGREED_KEPT = 1024
#: dispatch routings per session that a combine may reuse (``send_counts=``)
ROUTINGS_KEPT = 512


class Channel:
    """A group's conversation with its peers through the group's store (see the module
    docstring and :func:`ficco.runtime.store.join`). ``last`` is the last epoch this process
    joined and ``generation`` the number of resets; both survive :meth:`reset`, so a rank
    never joins an epoch it left, nor one its peers joined from another generation."""

    def __init__(self, key: str):
        self.key = key
        self.lock = threading.Lock()
        self.last: str | None = None
        #: how many times this process reset the channel (ranks join an epoch only at equal
        #: generations: ficco.runtime.store.join)
        self.generation = 0
        self._start()

    def reset(self) -> None:
        """Forget the conversation (``ficco.shutdown()``): the next exchange joins a new epoch
        at the next generation, the next call is number 1 again."""
        with self.lock:
            self.generation += 1
        self._start()

    def _start(self) -> None:
        self.epoch: str | None = None
        #: the numbers of this rank's exchanges in this epoch (``next`` on a count: thread-safe,
        #: so the warm ccl check takes no lock); ``sequence``, the last one taken
        self.exchanges = itertools.count(1)
        self.sequence = 0
        self.agreed: dict = {}              # digest -> ficco.runtime.agreement.Agreed
        self.processes: tuple | None = None  # every rank's Process, as the last agreement saw
        #: the numbers of this rank's calls (``next`` on a count: thread-safe); ``number``,
        #: the last one taken (the runtime takes them itself on its warm path)
        self.numbers = itertools.count(1)
        self.number = 0
        self.store: Any = None              # the group's store, once an exchange found it

    def take(self) -> int:
        """The number of the call this rank starts now."""
        self.number = number = next(self.numbers)
        return number

    def next_exchange(self) -> int:
        """The number of the exchange this rank makes now in this epoch (a session's calls
        run one at a time, so ``sequence`` is never set back by an earlier taker)."""
        self.sequence = sequence = next(self.exchanges)
        return sequence

    def joined(self, epoch: str) -> None:
        """This rank joined ``epoch``: its exchanges count from 1 again."""
        with self.lock:
            self.epoch = self.last = epoch
            self.exchanges = itertools.count(1)
            self.sequence = 0


class Known:
    """What a session knows of one call key: the checked call (without group and tensors) a
    warm call clones, and its :class:`ficco.runtime.call.Prepared` forms by (settings snapshot,
    role, overrides)."""

    __slots__ = ("prepared", "template")

    def __init__(self, template: Any):
        self.template = template
        self.prepared: dict[tuple, Any] = {}     # run key -> ficco.runtime.call.Prepared


class Session:
    """One group's (and backend's) state in this process; see the module docstring."""

    def __init__(self, group, backend, channel: Channel | None):
        self.group_ref = None if group is None else weakref.ref(group)
        self.key = group_key(group)
        self.backend = backend
        self.rank, self.world = rank_world(group)
        self.channel = channel
        self.lock = threading.Lock()
        #: (reason, sticky) of the failure that left the group out of step, or None
        self.poisoned: tuple[str, bool] | None = None
        self.workspace: Any = None          # the symmetric workspace handle (dma)
        self.lane: Any = None               # the backend's queues of this session
        self.calls: OrderedDict[Any, Known] = OrderedDict()
        self.plans: OrderedDict[tuple, tuple] = OrderedDict()      # key -> (plan, compiled)
        self.decisions: OrderedDict[tuple, Any] = OrderedDict()
        #: ficco.runtime.call.Settings by (snapshot, op, overrides)
        self.settings: dict[tuple, Any] = {}
        self.routings: OrderedDict[tuple, tuple] = OrderedDict()   # dispatch matrices (expert)
        #: the measuring selectors' (auto, tune) cache entries ``(cache file, key)`` every rank
        #: of this group holds: found in this process's memory without asking the ranks again
        #: (ficco.heuristics.measured.Cache); an entry another group agreed on is asked about
        self.measured: set[tuple[str, str]] = set()
        #: ``auto``'s explorations in flight on this group, by cache key
        #: (ficco.heuristics.explore): every rank of it holds the same
        self.exploring: dict[str, Any] = {}
        #: the Decision of the last multi-rank call run on this group in this process
        self.last: Any = None

    @property
    def group(self):
        """The process group (None once it is gone, or for a world of one)."""
        return None if self.group_ref is None else self.group_ref()

    # -- calls ----------------------------------------------------------------------------------
    def enter(self, op: str, timeout_s: float) -> threading.Lock:
        """Start a call: wait (bounded) until no other thread runs one on this group, then
        refuse if an earlier call left the group poisoned. Returns the held lock. (The
        runtime's warm path does the same, written out.)"""
        lock = self.lock
        if not lock.acquire(timeout=timeout_s):
            raise self.busy(op, timeout_s)
        if self.poisoned is not None:
            lock.release()
            raise self.refusal()
        return lock

    def busy(self, op: str, timeout_s: float) -> CommTimeoutError:
        return CommTimeoutError(
            f"rank {self.rank}: another thread's {op} call on group {self.key} did not finish "
            f"within FICCO_TIMEOUT ({timeout_s:.1f}s); calls on one group run one at a time")

    def refusal(self) -> PoisonedGroupError:
        assert self.poisoned is not None
        reason, sticky = self.poisoned
        fix = ("destroy this process group (dist.destroy_process_group(group)) and create a "
               "new one: a collective of the failed call may still be pending in it" if sticky
               else "call ficco.shutdown() on every rank, then call again")
        return PoisonedGroupError(
            f"rank {self.rank}: an earlier call on group {self.key} failed part-way ({reason});"
            f" ranks may be out of step, so ficco refuses to run on this group: {fix}")

    def known(self, key) -> Known | None:
        try:
            return self.calls.get(key)
        except TypeError:   # an argument that does not hash (an activation given as a list)
            return None

    def remember(self, key, template) -> Known:
        known = self.calls.get(key)
        if known is None:
            known = self.calls[key] = Known(template)
            while len(self.calls) > CALLS_KEPT:
                self.calls.popitem(last=False)
        return known

    def poison(self, reason: str, sticky: bool) -> None:
        """Refuse every later call (see the module docstring) and release what the session
        holds: nothing it decided is used again."""
        if self.poisoned is None or sticky:
            self.poisoned = (reason, sticky)
        self.release(wait=not sticky, failed=True)

    # -- resources ------------------------------------------------------------------------------
    def queues_lane(self):
        """This session's lane of the backend's queues, made on first use."""
        lane = self.lane
        if lane is None:
            lane = self.lane = self.backend.lane()
        return lane

    def release(self, wait: bool = True, failed: bool = False) -> None:
        """Drop the session's caches; stop its queues (what is queued is skipped), then close
        its workspace once they drained (bounded; kept mapped until exit when they did not)
        and its lane. ``wait``: False skips the drain (a failed collective that cannot be
        cancelled: the workspace stays mapped until exit); ``failed``: after a failure
        (:func:`ficco.symm_mem.workspace.close`)."""
        self.calls.clear()
        self.plans.clear()
        self.decisions.clear()
        self.settings.clear()
        self.routings.clear()
        self.measured.clear()
        self.exploring.clear()
        lane, handle = self.lane, self.workspace
        self.lane = self.workspace = None
        backend = self.backend
        if lane is not None:
            backend.cancel(lane)
        drained = wait and workspace.drained(backend, lane)
        if handle is not None:
            workspace.close(handle, drained, failed)
        if lane is not None:
            backend.close_lane(lane)


class _Entry:
    """What the registry holds for one group (or, for calls without a group, one backend):
    its channel and its sessions by backend name."""

    __slots__ = ("__weakref__", "channel", "sessions")

    def __init__(self, channel: Channel | None):
        self.channel = channel
        self.sessions: dict[str, Session] = {}


# group (or backend, for a world of one) -> _Entry; weak: a destroyed group's entry goes with it
_registry: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()     # a leaf: nothing is acquired while it is held


def of(group, backend) -> Session:
    """The session of ``group`` (a resolved ProcessGroup, or None for a world of one) with
    ``backend``, made at first use. A session poisoned stickily stays (until the group is
    destroyed), even across ``ficco.shutdown()`` and a new backend object."""
    entry = _registry.get(backend if group is None else group)
    if entry is not None:
        session = entry.sessions.get(backend.name)
        if session is not None and (session.backend is backend or session.poisoned):
            return session
    return _create(group, backend)


def _create(group, backend) -> Session:
    owner = backend if group is None else group
    with _lock:
        entry = _registry.get(owner)
        if entry is None:
            entry = _registry[owner] = _Entry(None if group is None else Channel(group_key(group)))
            weakref.finalize(owner, _gone, entry)
        session = entry.sessions.get(backend.name)
        if session is None or (session.backend is not backend and not session.poisoned):
            session = entry.sessions[backend.name] = Session(group, backend, entry.channel)
    return session


def channel_of(group) -> Channel | None:
    """The channel of ``group`` (made at first use), or None for no group."""
    if group is None:
        return None
    entry = _registry.get(group)
    if entry is None:
        with _lock:
            entry = _registry.get(group)
            if entry is None:
                entry = _registry[group] = _Entry(Channel(group_key(group)))
                weakref.finalize(group, _gone, entry)
    return entry.channel


def peek(group, backend) -> Session | None:
    """The session of ``group`` if it exists (never makes one)."""
    entry = _registry.get(backend if group is None else group)
    return None if entry is None else entry.sessions.get(backend.name)


def every() -> list[Session]:
    """Every session of this process."""
    with _lock:
        return [s for entry in list(_registry.values()) for s in entry.sessions.values()]


def drop_all() -> None:
    """``ficco.shutdown()``: drop every session whole and reset every channel; a session
    poisoned stickily stays (released) until its group is destroyed."""
    with _lock:
        entries = list(_registry.values())
    for entry in entries:
        for name, session in list(entry.sessions.items()):
            session.release()
            if session.poisoned is None or not session.poisoned[1]:
                entry.sessions.pop(name, None)
        if entry.channel is not None:
            entry.channel.reset()


def _gone(entry: _Entry) -> None:
    """The group (or backend) died: release its sessions. Runs wherever the collector runs."""
    for session in list(entry.sessions.values()):
        session.release()
    entry.sessions.clear()
