"""A group's store as the agreement uses it: the epoch join (:func:`join`, see
:mod:`ficco.runtime.agreement`'s docstring), waits on its keys with an exact deadline, the
CommTimeoutError of a wait that did not complete, naming the ranks whose keys are missing,
and :class:`Bounded`, the store every exchange goes through, whose requests never outlast
their deadline (a frozen store host answers none). Nothing here knows what an exchange
carries: :mod:`ficco.runtime.agreement` writes and reads the parts; this module only waits
for them."""
from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from .. import config
from ..errors import CommTimeoutError, FiccoError, MismatchError, error_context
from ..group import key as group_key
from .session import Channel

#: how long past its deadline a caller waits for its request's answer from the helper thread
#: (the hand-off), before it gives up on it
GRACE_S = 0.2


class Stalled(TimeoutError):
    """The group's store did not answer a request within its deadline."""


class _Job:
    __slots__ = ("done", "error", "fn", "since", "value")

    def __init__(self, fn: Callable[[Any], Any]):
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.since = time.monotonic()


class _Helper:
    """A thread that makes one store client's requests, one job at a time. For a TCPStore
    (also under PrefixStores) the client is ficco's own, a clone of the group's (made by the
    thread, so a frozen host delays no caller), so a request given up on holds up none of
    torch's; other stores are used as they are. Idle, it ends when no process group is left
    (after ``destroy_process_group()``), as the CPU backend's queues do."""

    def __init__(self, store, name: str):
        self.store = store
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.current: _Job | None = None
        self.lock = threading.Lock()        # a leaf
        self.ended = False
        #: its caller gave up on its job: once that returns, the thread ends, and what is
        #: queued behind it is never made (those callers give up at their own deadlines)
        self.abandoned = False
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, job: _Job) -> bool:
        """Queue ``job``; False when the thread has ended (make a new helper)."""
        with self.lock:
            if self.ended:
                return False
            self.jobs.put(job)
            return True

    def _serve(self) -> None:
        client = None
        while True:
            try:
                job = self.jobs.get(timeout=_IDLE_S)
            except queue.Empty:
                with self.lock:
                    if self.jobs.empty() and not _groups_left():
                        self.ended = True
                        return
                continue
            if job is None:
                with self.lock:
                    self.ended = True
                return
            self.current = job
            try:
                if client is None:
                    client = _own_client(self.store)
                job.value = job.fn(client)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                job.error = exc
            self.current = None
            job.done.set()
            if self.abandoned:
                with self.lock:
                    self.ended = True
                return

    def stop(self, wait: bool) -> None:
        """End the thread once its job (if any) returned; ``wait``: join it (a second at most)."""
        self.jobs.put(None)
        if wait and self.thread is not threading.current_thread():
            self.thread.join(timeout=1.0)


_IDLE_S = 1.0        # an idle helper looks this often whether a process group is left


def _groups_left() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _own_client(store):
    inner = store
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    if hasattr(inner, "host") and hasattr(inner, "port"):
        try:
            return store.clone()
        except Exception:  # noqa: BLE001 - a store without clone: the group's own client
            return store
    return store


def where(store) -> str:
    """``the TCPStore at 10.0.0.1:29500``: what a message calls the group's store."""
    inner = store
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    if hasattr(inner, "host") and hasattr(inner, "port"):
        return f"the TCPStore at {inner.host}:{inner.port}"
    if hasattr(inner, "path"):
        return f"the FileStore at {inner.path}"
    return f"the {type(inner).__name__}"


class Bounded:
    """A group's store whose every request (or conversation of requests, :meth:`run`) is made
    on a helper thread while the caller waits at most until its deadline (plus
    :data:`GRACE_S`): a store whose host process is stopped (SIGSTOP, a debugger, a cgroup
    freezer, a swap storm) accepts a request and never answers, and torch's store clients wait
    for it, past any timeout. A request given up on is left to its helper (with its client);
    while it has no answer, every later request raises :class:`Stalled` at once, naming how
    long the store has been silent; once it returns, the next request gets a new helper."""

    def __init__(self, store, key: str):
        self.raw, self.key, self.where = store, key, where(store)
        self._lock = threading.Lock()       # a leaf
        self._helper: _Helper | None = None
        self._silent: _Helper | None = None  # the helper left waiting for an answer

    def run(self, fn: Callable[[Any], Any], within: float | None = None):
        """``fn(store)`` on the helper thread: its value, or what it raised; :class:`Stalled`
        when it did not return within ``within`` seconds (default FICCO_TIMEOUT)."""
        within = config.timeout_s() if within is None else max(within, 0.0)
        with self._lock:
            silent = self._silent
            if silent is not None:
                job = silent.current
                if job is not None and not job.done.is_set():
                    raise Stalled(self._silence(time.monotonic() - job.since))
                self._silent = None
            job = _Job(fn)
            helper = self._helper
            if helper is None or not helper.submit(job):
                helper = self._helper = _Helper(self.raw, f"ficco-store-{self.key}")
                helper.submit(job)
        if not job.done.wait(within + GRACE_S):
            with self._lock:
                if not job.done.is_set():
                    helper.abandoned = True     # it ends once its request returns
                    if self._helper is helper:
                        self._helper, self._silent = None, helper
                    raise Stalled(self._silence(time.monotonic() - job.since))
        if job.error is not None:
            raise job.error
        return job.value

    def _silence(self, seconds: float) -> str:
        return (f"{self.where} did not answer a request of ficco's for {seconds:.1f}s: the "
                f"process that hosts it (rank 0 under a tcp:// or env:// rendezvous, the agent "
                f"under torchrun) is stopped (SIGSTOP, a debugger, a cgroup freezer), swapping, "
                f"gone or unreachable")

    def close(self) -> None:
        """End the helper thread (waiting for it, a second at most, unless it waits for an
        answer); a later request starts a new one."""
        with self._lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            job = helper.current
            helper.stop(wait=job is None or job.done.is_set())


def join(channel: Channel, store: Bounded, rank: int, world: int, timeout_s: float) -> None:
    """Join a new epoch of ``channel`` (:func:`join_on`, made on ``store``'s helper thread and
    bounded by ``timeout_s`` even when the store never answers: then a CommTimeoutError naming
    it). Ranks that joined with different *generations* (how many times each reset the
    channel) are out of step (one shut down alone, or came late to a call its peers gave up on
    and reset after): a MismatchError on every rank, which also brings every rank to the
    highest generation, so the next ``ficco.shutdown()`` on every rank puts them in step. The
    channel changes here, on the caller's thread: a join given up on changes nothing."""
    with channel.lock:
        last, generation = channel.last, channel.generation
    try:
        epoch, generations = store.run(
            lambda raw: join_on(channel.key, last, generation, raw, rank, world, timeout_s),
            timeout_s)
    except Stalled as exc:
        raise unanswered(store, rank, "joining a new ficco session",
                         f"group {channel.key}", timeout_s, exc) from exc
    if len(set(generations)) > 1:
        with channel.lock:      # (never this epoch again: its keys stay what every rank read)
            channel.generation, channel.last = max(generations), epoch
        raise MismatchError(
            f"rank {rank}: the ranks of group {channel.key} have reset ficco a different number "
            f"of times since they made the group (rank: resets {dict(enumerate(generations))}): "
            f"a rank called ficco.shutdown() alone, or came to a call after its peers gave up "
            f"on it and reset. Nothing was computed; call ficco.shutdown() on every rank, "
            f"then call again")
    channel.joined(epoch)


def unanswered(store: Bounded, rank: int, what: str, where_: str, timeout_s: float,
               exc: Stalled) -> CommTimeoutError:
    """The error of a wait the group's store did not answer in time (:class:`Stalled`)."""
    return _missing(None, CommTimeoutError(
        f"rank {rank}: {what} ({where_}) got no answer from the group's store within "
        f"FICCO_TIMEOUT ({timeout_s:.1f}s): {exc}"))


def join_on(key: str, last: str | None, generation: int, store, rank: int, world: int,
            timeout_s: float) -> tuple[str, list[int]]:
    """The epoch of group ``key``'s channel every rank joined (see
    :mod:`ficco.runtime.agreement`'s docstring) and every rank's generation, this rank's being ``generation``: rank 0 proposes
    a fresh one; the others take the newest proposal other than ``last`` (the last epoch they
    joined), and move on to a newer one while they wait; every rank waits until all joined. A
    rank that gives up withdraws its part. Raises CommTimeoutError naming the ranks that did
    not join."""
    deadline = time.monotonic() + timeout_s
    epoch = None
    if rank == 0:
        epoch = uuid.uuid4().hex[:12]
        store.set("ficco/epoch", epoch)
    while True:
        if rank != 0:
            epoch = _newer_epoch(store, last, deadline)
            if epoch is None:
                raise CommTimeoutError(
                    f"rank {rank}: group {key}'s rank 0 proposed no new ficco session "
                    f"within FICCO_TIMEOUT ({timeout_s:.1f}s): it has not called "
                    f"ficco.shutdown() since this rank did (ficco.shutdown() runs on every "
                    f"rank, after any error), or it is dead, stuck, or skipped this call")
        assert epoch is not None
        keys = [f"ficco/{epoch}/joined/{r}" for r in range(world)]
        try:
            store.set(keys[rank], str(generation).encode())
            generations = _wait_joined(store, keys, epoch, rank, deadline)
        except Exception as exc:  # torch raises DistStoreError or RuntimeError
            late = late_error(store, keys, rank, "joining a new ficco session",
                         f"epoch {epoch} of group {key}", timeout_s, exc,
                         " (a rank that has not called ficco.shutdown() since the others did "
                         "is still in the old one)")
            _withdraw(store, keys[rank])
            raise late from exc
        if generations is not None:
            break
        _withdraw(store, keys[rank])     # rank 0 proposed a newer one meanwhile: take it
    return epoch, generations


_WITHDRAWN = b"x"      # a joined key's value once its rank gave up (keys are never deleted:
                      # a store's get of a missing key waits for the store's own timeout)


def _withdraw(store, key: str) -> None:
    try:
        store.set(key, _WITHDRAWN)
    except Exception:  # noqa: BLE001, S110 - a dead store: nobody completes the epoch anyway
        pass


def _wait_joined(store, keys: list, epoch: str, rank: int, deadline: float
                 ) -> list[int] | None:
    """Every rank's generation once every key holds one (a withdrawn part is waited out);
    None (ranks other than 0) when a newer epoch than ``epoch`` was proposed first;
    TimeoutError at ``deadline``."""
    pause = 0.0005
    while True:
        if store.check(keys):
            values = [store.get(k) for k in keys]
            if _WITHDRAWN not in values:
                return [int(v) for v in values]
        if rank != 0 and store.get("ficco/epoch").decode() != epoch:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("keys not set within the deadline")
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.02)


def _newer_epoch(store, last: str | None, deadline: float) -> str | None:
    pause = 0.0005
    while True:
        if has_key(store, "ficco/epoch"):
            epoch = store.get("ficco/epoch").decode()
            if epoch != last:
                return epoch
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.02)


def late_error(store, keys, rank: int, what: str, where: str, timeout_s: float, exc,
          hint: str = "") -> CommTimeoutError:
    """The error of a wait for ``keys`` that did not complete."""
    if not has_key(store, keys[rank]):
        # Not even this rank's own key: the store itself does not answer (missing None).
        return _missing(None, CommTimeoutError(
            f"rank {rank}: {what} ({where}) could not reach the group's store "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}): "
            f"the process that hosts it (rank 0 with a tcp:// or env:// rendezvous) is gone "
            f"or unreachable"))
    missing = [r for r, k in enumerate(keys) if r != rank and not has_key(store, k)]
    late = f"rank(s) {missing}; they are" if missing else \
        "the other ranks, who arrived only as it expired:"
    return _missing(missing, CommTimeoutError(
        f"rank {rank}: {what} ({where}) waited {timeout_s:.1f}s for {late} dead, stuck, or "
        f"skipped this call{hint}. Raise FICCO_TIMEOUT if they are only slow"))


def _missing(ranks: list[int] | None, exc: CommTimeoutError) -> CommTimeoutError:
    context = error_context(exc)
    context.asked, context.missing = True, ranks
    return exc


def store_of(group):
    """The process group's store (what every agreement exchange and join goes through)."""
    from torch.distributed.distributed_c10d import _get_process_group_store

    try:
        return _get_process_group_store(group)
    except Exception as exc:
        raise FiccoError(f"the process group {group_key(group)} has no store ficco can use to "
                         f"agree across ranks: {exc}") from exc


def wait_keys(store, keys: list, timeout_s: float) -> None:
    """``store.wait(keys)`` with an exact deadline: a FileStore's own wait overshoots its
    timeout by up to a second (0.3 s waits 1 s, 1 s waits 2 s on torch 2.x), which would put
    every named timeout a second late. Polls ``check`` with a backoff up to 20 ms."""
    if store.check(keys):
        return
    deadline = time.monotonic() + timeout_s
    pause = 0.0005
    while not store.check(keys):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"keys not set within {timeout_s:.1f}s")
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.02)


def has_key(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001 - a dead store: nobody arrived
        return False


def delete_key(store, key: str) -> None:
    try:
        store.delete_key(key)
    except Exception:  # noqa: BLE001, S110 - stores without delete keep a few bytes each
        pass
