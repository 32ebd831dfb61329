"""Cross-rank agreement: every rank of a group must call with the same shapes, dtypes and
settings, or every rank raises :class:`~ficco.errors.MismatchError` (never a hang, never
garbage). Every exchange here is bounded by ``FICCO_TIMEOUT`` and names the ranks that did
not arrive.

The first call of a new signature on a group runs a full exchange through the group's store
(what each rank called with, and its host). Later calls repeat only a 64-bit digest of the
signature, carried by the cheapest channel the call has (the flag of a dma plan's barriers,
one small collective on ccl).

A rank whose signature is new while a peer's is one they agreed before would otherwise wait in
the exchange while the peer waits in its per-call check. So a rank that waits in its per-call
check longer than a moment *answers* an agreement exchange a peer has opened at the same
position (:func:`answer`): the ranks then compare what they called with, and a difference is a
MismatchError on every rank that names it, within a second rather than at FICCO_TIMEOUT.

Fields under :data:`PER_RANK` (a rank's own shard width: ``n`` of all_gather_matmul, ``K`` of
matmul_reduce_scatter, which never travel) may differ across ranks: the digest leaves them out
and the agreement keeps every rank's value (:attr:`Agreed.per_rank`), so decisions that need
them use a value every rank knows alike.

"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import pickle
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from . import config
from .errors import CommTimeoutError, FiccoError, MismatchError
from .group import key as group_key

#: the signature key whose value may differ across ranks (see the module docstring)
PER_RANK = "per_rank"
_AGREED_LIMIT = 1024                     # distinct (group, signature) entries kept (LRU)
_agreed: OrderedDict[tuple, Agreed] = OrderedDict()
_ranks: dict = {}                        # group id -> (Process of every rank)
_sequence: dict = {}                     # group id -> number of exchanges in this epoch
_epoch = [0]                             # ficco.shutdown() calls: a reset every rank makes
_lock = threading.Lock()
_DIGESTS_KEPT = 1024
_digests: dict = {}                      # signature items -> digest: a warm call serialises nothing


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed for one signature: whether they share a host, the shared fields,
    and every rank's :data:`PER_RANK` fields (rank order)."""

    same_host: bool
    signature: dict
    per_rank: tuple


def shared(signature: dict) -> dict:
    """The fields every rank must pass alike (all but :data:`PER_RANK`)."""
    return {k: v for k, v in signature.items() if k != PER_RANK}


def digest(signature: dict) -> int:
    """A 63-bit digest of a signature's shared fields (key order does not matter; the
    :data:`PER_RANK` fields are left out), remembered per signature so a repeated call costs
    a dictionary lookup (no JSON).

    >>> digest({"m": 4, "k": 8}) == digest({"k": 8, "m": 4, PER_RANK: {"n": 3}})
    True
    """
    if PER_RANK in signature:
        signature = shared(signature)
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
                      word: int | None = None) -> Agreed:
    """Every rank of ``group`` called with ``signature`` (digest ``word``). The first sight of
    a signature exchanges it in full (bounded); later sights are a dictionary lookup here,
    and the runtime checks the digest of every call (in the flag every dma barrier carries,
    or one tiny collective on ccl). Raises MismatchError on every rank when they differ."""
    key = (group_key(group), digest(signature) if word is None else word)
    with _lock:
        if key in _agreed:
            _agreed.move_to_end(key)
            return _agreed[key]
    everyone = exchange(group, rank, world, _payload(signature), what=f"{op} agreement")
    return _settle(group, key[1], signature, everyone, op)


def answer(group, rank: int, world: int, signature: dict, via: str) -> None:
    """From a per-call check that waits (``via``: "ccl", a pending check collective, or "dma",
    a plan barrier that wrote its flags): when a peer opened an agreement exchange at this
    rank's next position, join it with this call's signature. A difference raises the
    MismatchError every participant raises (it says which checks joined, so the others can
    complete the pending collective or drop the workspace); no difference returns, and the
    check goes on waiting (that peer had only forgotten the signature). Cheap when nobody
    waits: one store lookup per peer."""
    if group is None or world == 1:
        return
    gid = group_key(group)
    store = _store(group)
    with _lock:
        prefix = f"ficco/{_epoch[0]}/{_sequence.get(gid, 0) + 1}/"
    for peer in range(world):
        if peer != rank and _has(store, f"{prefix}{peer}"):
            what, theirs = pickle.loads(store.get(f"{prefix}{peer}"))
            break
    else:
        return
    if isinstance(theirs, CallData):
        # A call's data exchange (expert routing counts): the peer makes a call this check's
        # call cannot be (that one carries no exchange), so the digests differ and the
        # exchange raises on every rank; equal digests would be a peer a call ahead: wait.
        word = digest(signature)
        if theirs.word != word:
            exchange_call_data(group, rank, world, word, None, summary(signature), what=what,
                               via=via)
        return
    if not what.endswith(" agreement"):
        return         # another kind of exchange: not this check's business
    everyone = exchange(group, rank, world, _payload(signature, via), what=what)
    _settle(group, digest(signature), signature, everyone, what.removesuffix(" agreement"))


@dataclass(frozen=True)
class CallData:
    """One rank's part of a call's data exchange (:func:`exchange_call_data`): the call's
    digest, its data, what the call is (for messages), and the per-call check it joined from
    (None: the rank makes this exchange itself)."""

    word: int
    data: object
    call: str
    via: str | None = None


def exchange_call_data(group, rank: int, world: int, word: int, data, call: str, *, what: str,
                       via: str | None = None) -> list:
    """Every rank's ``data`` for a call with digest ``word`` (described as ``call``), in rank
    order: one bounded exchange. Ranks whose digests differ raise one MismatchError on every
    rank naming each rank's call; a peer waiting in a per-call check joins it
    (:func:`answer`), so its ``joined`` says which checks to complete."""
    everyone = exchange(group, rank, world, CallData(word, data, call, via), what=what)
    if len({part.word for part in everyone}) > 1:
        calls = "; ".join(f"rank {r}: {part.call}" for r, part in enumerate(everyone))
        exc = consistent(MismatchError(
            f"rank {rank}: the ranks of group {group_key(group)} are making different calls "
            f"({calls}); nothing was computed. Every rank must make the same calls in the "
            f"same order (a rank that skipped a backward, or called with other shapes, "
            f"dtypes, settings or op)"))
        exc.joined = {v: [r for r, part in enumerate(everyone) if part.via == v]
                      for v in ("ccl", "dma")}
        raise exc
    return [part.data for part in everyone]


@dataclass(frozen=True)
class Process:
    """Where a rank runs: its host, its pid namespace (ranks on one host in different
    containers see other pids) and its pid."""

    host: str
    pid_namespace: str
    pid: int

    @classmethod
    def this(cls) -> Process:
        try:
            namespace = os.readlink("/proc/self/ns/pid")
        except OSError:                   # no /proc (not Linux): the host alone decides
            namespace = ""
        return cls(socket.gethostname(), namespace, os.getpid())


def _payload(signature: dict, via: str | None = None) -> dict:
    return {"signature": shared(signature), "per_rank": signature.get(PER_RANK),
            "host": socket.gethostname(), "process": Process.this(), "via": via}


def _settle(group, word: int, signature: dict, everyone: list, op: str) -> Agreed:
    gid = group_key(group)
    with _lock:
        _ranks[gid] = tuple(info["process"] for info in everyone)
    mine = shared(signature)
    sigs = [info["signature"] for info in everyone]
    differ = sorted({f for sig in sigs for f in set(sig) | set(mine) if sig.get(f) != mine.get(f)})
    if differ:
        detail = "; ".join(f"rank {r}: " + ", ".join(f"{f}={sig.get(f)}" for f in differ)
                           for r, sig in enumerate(sigs))
        exc = consistent(MismatchError(
            f"ranks of one group called {op} with different {', '.join(differ)} ({detail}); "
            f"every rank must pass the same shapes, dtypes and settings"))
        exc.joined = {via: [r for r, info in enumerate(everyone) if info["via"] == via]
                      for via in ("ccl", "dma")}
        raise exc
    agreed = Agreed(len({info["host"] for info in everyone}) == 1, mine,
                    tuple(info["per_rank"] for info in everyone))
    with _lock:
        _agreed[(gid, word)] = agreed
        while len(_agreed) > _AGREED_LIMIT:
            _agreed.popitem(last=False)
    return agreed


def known(group, signature: dict) -> Agreed | None:
    """What :func:`confirm_same_call` found for this signature before, or None: no communication."""
    with _lock:
        return _agreed.get((group_key(group), digest(signature)))


def describe(group, word: int | None = None, *, flag: int | None = None, flag_of=None) -> str:
    """The call an agreed digest ``word`` (or barrier call ``flag``, ``flag_of`` mapping a
    digest to its flag) stands for, as its op, role and shapes; "a call not agreed on this
    rank" when this rank never agreed it (error messages only: a linear scan for flags)."""
    gid = group_key(group)
    with _lock:
        entries = [(w, a) for (g, w), a in _agreed.items() if g == gid]
    for w, agreed in entries:
        if w == word or (flag is not None and flag_of(w) == flag):
            return summary(agreed.signature)
    return "a call not agreed on this rank (new shapes or settings)"


def summary(signature: dict) -> str:
    """``all_gather_matmul forward, shard (4, 16)``: a signature's op, role and input shape."""
    role = signature.get("role", "forward")
    if "shard_shape" in signature or "a_shape" in signature:
        shape = ("shard", signature["shard_shape"]) if "shard_shape" in signature else \
            ("a", signature.get("a_shape"))
        shape_text = f"{shape[0]} {shape[1]}"
    else:   # the expert ops: rows are data, the widths say which call
        shape_text = f"K {signature.get('k')}, n {signature.get('n')}"
    return f"{signature.get('op')} {role if role == 'forward' else 'in the ' + role}, {shape_text}"


def ranks_of(group) -> tuple | None:
    """The :class:`Process` of every rank of ``group``, as its last agreement found them."""
    with _lock:
        return _ranks.get(group_key(group))


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
    keys = [f"{prefix}{r}" for r in range(world)]
    timeout_s = config.timeout_s()
    try:
        store.set(keys[rank], pickle.dumps((what, payload)))
        _wait_keys(store, keys, timeout_s)
    except Exception as exc:  # torch raises DistStoreError or RuntimeError
        if not _has(store, keys[rank]):
            # Not even this rank's own key: the store itself does not answer (missing None).
            raise _missing(None, CommTimeoutError(
                f"rank {rank}: {what} (exchange {seq} on group {gid}) could not reach the "
                f"group's store ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}): the "
                f"process that hosts it (rank 0 with a tcp:// or env:// rendezvous) is gone "
                f"or unreachable")) from exc
        missing = [r for r, k in enumerate(keys) if r != rank and not _has(store, k)]
        late = f"rank(s) {missing}; they are" if missing else \
            "the other ranks, who arrived only as it expired:"
        raise _missing(missing, CommTimeoutError(
            f"rank {rank}: {what} (exchange {seq} on group {gid}) waited {timeout_s:.1f}s for "
            f"{late} dead, stuck, or skipped this call. Raise FICCO_TIMEOUT if they are only "
            f"slow")) from exc
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
            _ranks.clear()
            _sequence.clear()
            _epoch[0] += 1
            return
    forget_id(group_key(group))


def forget_id(gid: str) -> None:
    with _lock:
        for key in [k for k in _agreed if k[0] == gid]:
            del _agreed[key]


def _missing(ranks: list[int] | None, exc: CommTimeoutError) -> CommTimeoutError:
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
