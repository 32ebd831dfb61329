"""A group's store as the agreement uses it: the epoch join (:func:`join`, see
:mod:`ficco.runtime.agreement`'s docstring), waits on its keys with an exact deadline, and the
CommTimeoutError of a wait that did not complete, naming the ranks whose keys are missing.
Nothing here knows what an exchange carries: :mod:`ficco.runtime.agreement` writes and reads the
parts; this module only waits for them."""
from __future__ import annotations

import datetime
import time
import uuid

from ..errors import CommTimeoutError, FiccoError, MismatchError, error_context
from ..group import key as group_key
from .session import Channel


def join(channel: Channel, store, rank: int, world: int, timeout_s: float) -> None:
    """Join a new epoch of ``channel`` (see :mod:`ficco.runtime.agreement`'s docstring): rank 0 proposes
    a fresh one; the others take the newest proposal other than the last epoch they joined, and
    move on to a newer one while they wait; every rank waits until all joined, then compares the
    *generations* they joined with (how many times each rank reset the channel): ranks that
    reset a different number of times are out of step (one shut down alone, or came late to a
    call its peers gave up on and reset after), a MismatchError on every rank, which also brings
    every rank to the highest generation, so the next ``ficco.shutdown()`` on every rank puts
    them in step. A rank that gives up withdraws its part. Raises CommTimeoutError naming the
    ranks that did not join."""
    deadline = time.monotonic() + timeout_s
    epoch = None
    if rank == 0:
        epoch = uuid.uuid4().hex[:12]
        store.set("ficco/epoch", epoch)
    while True:
        if rank != 0:
            epoch = _newer_epoch(store, channel.last, deadline)
            if epoch is None:
                raise CommTimeoutError(
                    f"rank {rank}: group {channel.key}'s rank 0 proposed no new ficco session "
                    f"within FICCO_TIMEOUT ({timeout_s:.1f}s): it has not called "
                    f"ficco.shutdown() since this rank did (ficco.shutdown() runs on every "
                    f"rank, after any error), or it is dead, stuck, or skipped this call")
        assert epoch is not None
        keys = [f"ficco/{epoch}/joined/{r}" for r in range(world)]
        try:
            store.set(keys[rank], str(channel.generation).encode())
            generations = _wait_joined(store, keys, epoch, rank, deadline)
        except Exception as exc:  # torch raises DistStoreError or RuntimeError
            late = late_error(store, keys, rank, "joining a new ficco session",
                         f"epoch {epoch} of group {channel.key}", timeout_s, exc,
                         " (a rank that has not called ficco.shutdown() since the others did "
                         "is still in the old one)")
            _withdraw(store, keys[rank])
            raise late from exc
        if generations is not None:
            break
        _withdraw(store, keys[rank])     # rank 0 proposed a newer one meanwhile: take it
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
    """``store.wait(keys)`` with an exact deadline. A TCPStore (torchrun's, ``env://`` and
    ``tcp://``) waits on its server's notice, tens of microseconds after the last key lands; a
    FileStore's own wait overshoots by up to a second (0.3 s waits 1 s, 1 s waits 2 s on torch
    2.x) and sleeps 10 ms between its reads, so other stores are polled with ``check``, the
    pauses growing from 50 us by half each time up to 20 ms (the peers of one call arrive within
    a fraction of a millisecond of each other: a first pause of half a millisecond, what this
    waited before, was most of a new key's first call on CPU ranks)."""
    if store.check(keys):
        return
    if _waits_on_notice(store):
        try:
            store.wait(keys, datetime.timedelta(seconds=max(timeout_s, 1e-3)))
        except Exception as exc:  # torch raises DistStoreError on its timeout
            raise TimeoutError(f"keys not set within {timeout_s:.1f}s ({exc})") from exc
        return
    deadline = time.monotonic() + timeout_s
    pause = 5e-5
    while not store.check(keys):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"keys not set within {timeout_s:.1f}s")
        time.sleep(min(pause, left))
        pause = min(pause * 1.5, 0.02)


def _waits_on_notice(store) -> bool:
    """Whether ``store`` (under any PrefixStores) is a TCPStore, whose wait is a server notice."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return isinstance(store, dist.TCPStore)


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
