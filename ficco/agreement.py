"""Cross-rank agreement: every rank of a group must call with the same shapes, dtypes and
settings, or every rank raises :class:`~ficco.errors.MismatchError` (never a hang, never
garbage). Every exchange here is bounded by ``FICCO_TIMEOUT`` and names the ranks that did
not arrive.

The first call of a new signature on a group runs a full exchange through the group's store
(what each rank called with, and its host). Later calls repeat only a 64-bit digest of the
signature, carried by the cheapest channel the call has (see :func:`check_digest`).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import pickle
import socket
import threading
import time
from collections import OrderedDict

from . import config
from .errors import CommTimeoutError, FiccoError, MismatchError
from .group import key as group_key

_AGREED_LIMIT = 1024                     # distinct (group, signature) entries kept (LRU)
_agreed: OrderedDict[tuple, bool] = OrderedDict()   # -> whether all ranks share a host
_sequence: dict = {}                     # group id -> number of exchanges in this epoch
_epoch = [0]                             # ficco.shutdown() calls: a reset every rank makes
_lock = threading.Lock()
_DIGESTS_KEPT = 1024
_digests: dict = {}                      # signature items -> digest: a warm call serialises nothing


def digest(signature: dict) -> int:
    """A 63-bit digest of a signature dict (key order does not matter), remembered per
    signature so a repeated call costs a dictionary lookup (no JSON).

    >>> digest({"m": 4, "k": 8}) == digest({"k": 8, "m": 4})
    True
    """
    key: frozenset | None
    try:
        # Values of one field keep their type from call to call (an int field never holds a
        # bool), so equal item sets mean equal JSON.
        key = frozenset(signature.items())
        word = _digests.get(key)
    except TypeError:   # an unhashable value (a list): digest it every time
        key = word = None
    if word is None:
        text = json.dumps(signature, sort_keys=True, default=str)
        word = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(),
                              "little") >> 1
        if key is not None:
            if len(_digests) >= _DIGESTS_KEPT:
                _digests.clear()
            _digests[key] = word
    return word


def confirm_same_call(group, rank: int, world: int, signature: dict, op: str,
                      word: int | None = None) -> bool:
    """Every rank of ``group`` called with ``signature`` (digest ``word``): returns whether
    all ranks share this host. The first sight of a signature exchanges it in full (bounded);
    later sights are a dictionary lookup here, and the runtime checks the digest of every
    call (in the flag every dma barrier carries, or one tiny collective on ccl)."""
    key = (group_key(group), digest(signature) if word is None else word)
    with _lock:
        if key in _agreed:
            _agreed.move_to_end(key)
            return _agreed[key]
    everyone = exchange(group, rank, world, (signature, socket.gethostname()),
                        what=f"{op} agreement")
    differ = sorted({f for info, _ in everyone for f in set(info) | set(signature)
                     if info.get(f) != signature.get(f)})
    if differ:
        detail = "; ".join(f"rank {r}: " + ", ".join(f"{f}={info.get(f)}" for f in differ)
                           for r, (info, _) in enumerate(everyone))
        raise consistent(MismatchError(
            f"ranks of one group called {op} with different {', '.join(differ)} ({detail}); "
            f"every rank must pass the same shapes, dtypes and settings"))
    same_host = len({host for _, host in everyone}) == 1
    with _lock:
        _agreed[key] = same_host
        while len(_agreed) > _AGREED_LIMIT:
            _agreed.popitem(last=False)
    return same_host


def known(group, signature: dict) -> bool | None:
    """What :func:`confirm_same_call` found for this signature before (same host?), or None: no
    communication."""
    with _lock:
        return _agreed.get((group_key(group), digest(signature)))


def exchange(group, rank: int, world: int, payload, *, what: str) -> list:
    """Every rank's ``payload`` in rank order, through the group's store, bounded by
    FICCO_TIMEOUT: ranks that do not arrive in time are named in a CommTimeoutError."""
    if group is None or world == 1:
        return [payload]
    store = _store(group)
    gid = group_key(group)
    with _lock:
        seq = _sequence[gid] = _sequence.get(gid, 0) + 1
    prefix = f"ficco/{_epoch[0]}/{seq}/"
    store.set(f"{prefix}{rank}", pickle.dumps((what, payload)))
    keys = [f"{prefix}{r}" for r in range(world)]
    timeout_s = config.timeout_s()
    try:
        _wait_keys(store, keys, timeout_s)
    except Exception as exc:
        missing = [r for r, k in enumerate(keys) if not _has(store, k)]
        raise _missing(missing, CommTimeoutError(
            f"rank {rank}: {what} (exchange {seq} on group {gid}) waited {timeout_s:.1f}s for "
            f"rank(s) {missing}; they are dead, stuck, or skipped this call. Raise "
            f"FICCO_TIMEOUT if they are only slow")) from exc
    tagged = [pickle.loads(store.get(k)) for k in keys]
    if seq > 2:
        # Every rank finished reading exchange seq-2 before it could write exchange seq-1.
        _delete(store, f"ficco/{_epoch[0]}/{seq - 2}/{rank}")
    doing = {r: tag for r, (tag, _) in enumerate(tagged) if tag != what}
    if doing:
        raise MismatchError(f"rank {rank} was in {what} while rank(s) {sorted(doing)} were in "
                            f"{sorted(set(doing.values()))}: the ranks of group {gid} are out "
                            f"of step (one skipped or added a call)")
    return [payload for _, payload in tagged]


def all_ranks(group, rank: int, world: int, flag: bool, *, what: str) -> bool:
    """True when ``flag`` is True on every rank (bounded)."""
    return all(exchange(group, rank, world, bool(flag), what=what))


def max_over_ranks(group, rank: int, world: int, value: float, *, what: str) -> float:
    """The largest ``value`` over the ranks (bounded)."""
    return max(exchange(group, rank, world, float(value), what=what))


def wait_bounded(work, *, rank: int, what: str) -> None:
    """Wait for an async collective's ``work`` at most FICCO_TIMEOUT."""
    timeout_s = config.timeout_s()
    try:
        ok = work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            raise      # a broken transport: the caller names the peers (guard.failed)
        raise CommTimeoutError(f"rank {rank}: {what} passed FICCO_TIMEOUT "
                               f"({timeout_s:.1f}s): {exc}") from exc
    if ok is False:
        raise CommTimeoutError(f"rank {rank}: {what} did not finish within FICCO_TIMEOUT "
                               f"({timeout_s:.1f}s)")


def forget(group=None) -> None:
    """Drop what was agreed (all groups, or one): ``ficco.shutdown`` and group destruction.
    A full reset starts a new epoch of exchanges, so ranks that fell out of step (one timed
    out in an exchange the others never entered) are in step again once every rank reset."""
    with _lock:
        if group is None:
            _agreed.clear()
            _sequence.clear()
            _epoch[0] += 1
            return
    forget_id(group_key(group))


def forget_id(gid: str) -> None:
    with _lock:
        for key in [k for k in _agreed if k[0] == gid]:
            del _agreed[key]


def _missing(ranks: list[int], exc: CommTimeoutError) -> CommTimeoutError:
    exc.missing = ranks
    return exc


def consistent(exc: MismatchError) -> MismatchError:
    """Mark a MismatchError that every rank raises from the same data: the ranks stay in step
    and the group stays usable."""
    exc.consistent = True
    return exc


def _store(group):
    from torch.distributed.distributed_c10d import _get_process_group_store

    try:
        return _get_process_group_store(group)
    except Exception as exc:
        raise FiccoError(f"the process group {group_key(group)} has no store ficco can use to "
                         f"agree across ranks: {exc}") from exc


def _wait_keys(store, keys: list, timeout_s: float) -> None:
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


def _has(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001 - a dead store: nobody arrived
        return False


def _delete(store, key: str) -> None:
    try:
        store.delete_key(key)
    except Exception:  # noqa: BLE001, S110 - stores without delete keep a few bytes each
        pass
