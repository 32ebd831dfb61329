"""Cross-rank agreement: every rank of a group must call with the same shapes, dtypes and
settings, at the same place in its sequence of calls, or every rank raises
:class:`~ficco.errors.MismatchError` (never a hang, never garbage). Every exchange here is
bounded by ``FICCO_TIMEOUT`` and names the ranks that did not arrive.

Exchanges go through the group's store, under the group's :class:`~ficco.runtime.session.Channel`:
keys ``ficco/<epoch>/<n>/<rank>`` for its n-th exchange. A channel's first exchange *joins* an
epoch (:func:`~ficco.runtime.store.join`): the group's rank 0 proposes a fresh one, the
others take the first proposal newer than the last they used, and all wait until every rank
joined. So after ``ficco.shutdown()`` on every rank (at any times, in any order, even one
rank more often than the others) the ranks meet again in a new epoch, with no key of an older
one in their way.

Calls pair by *number*: the n-th call that enters ficco on a rank for a group (a call that
fails on its own rank before communicating included) pairs only with the n-th call of its
peers. The number travels with the call's digest in every check: the first call of a new
signature runs a full exchange (what each rank called with, its host), later calls only a
digest and the number, through the cheapest channel the call has (the flag of a dma plan's
barriers; on ccl, one small exchange through the store, which leaves nothing pending in the
process group when a peer never comes).

A rank whose signature is new while a peer's is one they agreed before would otherwise wait in
the exchange while the peer waits in its dma barrier. So a barrier that waits longer than a
moment *answers* an agreement exchange a peer has opened at the same position (:func:`answer`):
the ranks then compare what they called with, and a difference is a MismatchError on every
rank that names it, within a second rather than at FICCO_TIMEOUT. (A ccl check and an
agreement exchange meet by themselves: both are exchanges at the same position.)

Fields under :data:`PER_RANK` (a rank's own shard width: ``n`` of all_gather_matmul, ``K`` of
matmul_reduce_scatter, which never travel) may differ across ranks: the digest leaves them out
and the agreement keeps every rank's value (:attr:`Agreed.per_rank`), so decisions that need
them use a value every rank knows alike.

"""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import pickle
import socket
import struct
from dataclasses import dataclass

from .. import config
from ..errors import CommTimeoutError, MismatchError
from ..group import key as group_key
from ..symm_mem import agree as symm_agree
from .session import AGREED_KEPT, Channel, channel_of
from .store import delete_key, has_key, join, late_error, store_of, wait_keys

#: the signature key whose value may differ across ranks (see the module docstring)
PER_RANK = "per_rank"
#: the wire form of a call check's part: a zero byte (never the start of a pickle), then the
#: call's digest and number
_CHECK = struct.Struct("<xqq")
CHECK = "call check"


MIX, MASK = 0x9E3779B97F4A7C15, 0x7FFFFFFFFFFFFFFF


def mixed(word: int, number: int) -> int:
    """A call's digest ``word`` with its number folded in: 63 bits that differ for the same
    call at another place in the sequence (the dma barriers' flag is made from it).

    >>> mixed(5, 1) != mixed(5, 2) and 0 <= mixed(2**62, 3) < 2**63
    True
    """
    return (word ^ (number * MIX)) & MASK


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
    try:
        # Values of one field keep their type from call to call (an int field never holds a
        # bool), so equal item sets mean equal JSON.
        return _digest_of(frozenset(signature.items()))
    except TypeError:   # an unhashable value (a list): digest it every time
        return _digest_text(signature)


def _digest_text(signature: dict) -> int:
    text = json.dumps(signature, sort_keys=True, default=str)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


@functools.lru_cache(maxsize=1024)
def _digest_of(items: frozenset) -> int:
    """The digest of a signature's items (a pure function: remembered, so a repeated call
    serialises nothing)."""
    return _digest_text(dict(items))


def confirm_same_call(group, rank: int, world: int, signature: dict, op: str,
                      word: int | None = None, number: int = 0) -> Agreed:
    """Every rank of ``group`` called with ``signature`` (digest ``word``) as its call number
    ``number`` (0: a check outside the numbered calls, ficco.compat's). The first sight of a
    signature exchanges it in full (bounded); later sights are a dictionary lookup here, and
    the runtime checks the digest and number of every call. Raises MismatchError on every
    rank when they differ."""
    word = digest(signature) if word is None else word
    channel = channel_of(group)
    agreed = None if channel is None else channel.agreed.get(word)
    if agreed is not None or channel is None:
        return agreed or Agreed(True, shared(signature), (signature.get(PER_RANK),))
    everyone = exchange(group, rank, world, _payload(signature, number),
                        what=f"{op} agreement")
    return _settle(channel, word, signature, everyone, op, number)


def answer(group, rank: int, world: int, signature: dict, number: int) -> None:
    """From a dma plan barrier that waits: when a peer opened an agreement exchange at this
    rank's next position, join it with this call's signature and number. A difference raises
    the MismatchError every participant raises; no difference returns, and the barrier goes
    on waiting (that peer had only forgotten the signature). Cheap when nobody waits: one
    store lookup per peer."""
    channel = channel_of(group)
    if channel is None or world == 1 or channel.epoch is None:
        return
    store = store_of(group)
    with channel.lock:
        prefix = f"ficco/{channel.epoch}/{channel.sequence + 1}/"
    for peer in range(world):
        if peer != rank and has_key(store, f"{prefix}{peer}"):
            what, theirs = _load(store.get(f"{prefix}{peer}"))
            break
    else:
        return
    if isinstance(theirs, CallData):
        # A call's data exchange (expert routing counts): the peer makes a call this barrier's
        # call cannot be (that one carries no exchange), so the digests differ and the
        # exchange raises on every rank; equal digests would be a peer a call ahead: wait.
        word = mixed(digest(signature), number)
        if theirs.word != word:
            exchange_call_data(group, rank, world, word, None, summary(signature), what=what,
                               via="dma")
        return
    if what.endswith(CHECK):
        # A peer's ccl call check at this position: its call was agreed with another
        # transport (a dma call waits here): the same exchange, and both raise at once.
        check(channel, group, rank, world, digest(signature), number,
              str(signature.get("op")))
        return
    if not what.endswith(" agreement"):
        return         # another kind of exchange: not this barrier's business
    everyone = exchange(group, rank, world, _payload(signature, number, "dma"), what=what)
    _settle(channel, digest(signature), signature, everyone, what.removesuffix(" agreement"),
            number)


def check(channel: Channel, group, rank: int, world: int, word: int, number: int,
          op: str) -> None:
    """Every rank is about to run call number ``number`` with digest ``word`` (a warm ccl
    call, agreed before): one exchange of 17 bytes per rank through the store (the generic
    :func:`exchange`, written out for the warm path: no pickle, no helper per rank). Ranks
    making different calls, or calls at different places in their sequence, raise one
    MismatchError on every rank naming each rank's call; a peer opening its first-call
    agreement at this position is such a difference too (its call is new to it, this rank's
    is not)."""
    what = f"{op} {CHECK}"
    store, epoch = channel.store, channel.epoch
    if store is None or epoch is None:     # not joined yet (after a reset): the long way
        everyone = exchange(group, rank, world, (word, number), what=what)
        if any(part != (word, number) for part in everyone):
            raise _out_of_step(group, rank, word, number, [(what, p) for p in everyone])
        return
    seq = channel.next_exchange()
    prefix = f"ficco/{epoch}/{seq}/"
    keys = [f"{prefix}{r}" for r in range(world)]
    mine = _CHECK.pack(word, number)
    try:
        store.set(keys[rank], mine)
        if not store.check(keys):
            wait_keys(store, keys, config.timeout_s())
        parts = [store.get(k) for k in keys]
    except Exception as exc:  # torch raises DistStoreError or RuntimeError
        raise late_error(store, keys, rank, what, f"exchange {seq} on group {channel.key}",
                    config.timeout_s(), exc) from exc
    if seq > 2:
        try:      # every rank read exchange seq-2 before it could write seq-1
            store.delete_key(f"ficco/{epoch}/{seq - 2}/{rank}")
        except Exception:  # noqa: BLE001, S110 - stores without delete keep a few bytes each
            pass
    if parts.count(mine) != world:
        raise _out_of_step(group, rank, word, number, [_load(raw, what) for raw in parts])


@dataclass(frozen=True)
class CallData:
    """One rank's part of a call's data exchange (:func:`exchange_call_data`): the call's
    digest (its number folded in), its data, what the call is (for messages), and the check
    it joined from (None: the rank makes this exchange itself)."""

    word: int
    data: object
    call: str
    via: str | None = None


def exchange_call_data(group, rank: int, world: int, word: int, data, call: str, *, what: str,
                       via: str | None = None) -> list:
    """Every rank's ``data`` for a call with digest ``word`` (its number folded in: see
    :func:`mixed`; described as ``call``), in rank order: one bounded exchange. Ranks whose
    words differ raise one MismatchError on every rank naming each rank's call; a peer
    waiting in a dma barrier joins it (:func:`answer`)."""
    everyone = exchange(group, rank, world, CallData(word, data, call, via), what=what)
    if len({part.word for part in everyone}) > 1:
        calls = "; ".join(f"rank {r}: {part.call}" for r, part in enumerate(everyone))
        raise MismatchError(
            f"rank {rank}: the ranks of group {group_key(group)} are making different calls "
            f"({calls}), or the same call at different places in their sequence of calls; "
            f"nothing was computed. Every rank must make the same calls in the same order (a "
            f"rank that skipped a backward, whose earlier call failed on its own, or that "
            f"called with other shapes, dtypes, settings or op)")
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


def _payload(signature: dict, number: int, via: str | None = None) -> dict:
    return {"signature": shared(signature), "per_rank": signature.get(PER_RANK),
            "host": socket.gethostname(), "process": Process.this(), "via": via,
            "number": number}


def _settle(channel: Channel, word: int, signature: dict, everyone: list, op: str,
            number: int) -> Agreed:
    with channel.lock:
        channel.processes = tuple(info["process"] for info in everyone)
    mine = shared(signature)
    sigs = [info["signature"] for info in everyone]
    differ = sorted({f for sig in sigs for f in set(sig) | set(mine) if sig.get(f) != mine.get(f)})
    if differ:
        detail = "; ".join(f"rank {r}: " + ", ".join(f"{f}={sig.get(f)}" for f in differ)
                           for r, sig in enumerate(sigs))
        raise MismatchError(
            f"ranks of one group called {op} with different {', '.join(differ)} ({detail}); "
            f"every rank must pass the same shapes, dtypes and settings")
    numbers = [info["number"] for info in everyone]
    if len(set(numbers)) > 1:
        raise MismatchError(
            f"ranks of group {channel.key} made the same {op} call at different places in "
            f"their sequence of calls (rank: call number {dict(enumerate(numbers))}): a rank "
            f"whose earlier call failed on its own (bad input, an interrupt) or that skipped a "
            f"call is out of step; nothing was computed")
    agreed = Agreed(len({info["host"] for info in everyone}) == 1, mine,
                    tuple(info["per_rank"] for info in everyone))
    with channel.lock:
        if len(channel.agreed) >= AGREED_KEPT:
            channel.agreed.clear()    # at the same exchange on every rank: still in step
        channel.agreed[word] = agreed
    return agreed


def known(group, signature: dict) -> Agreed | None:
    """What :func:`confirm_same_call` found for this signature before, or None: no communication."""
    channel = channel_of(group)
    return None if channel is None else channel.agreed.get(digest(signature))


def describe(group, word: int | None = None, *, flag: int | None = None, flag_of=None,
             near: int = 0) -> str:
    """The call an agreed digest ``word`` (or barrier call ``flag``: ``flag_of(digest,
    number)`` makes one, tried at the call numbers around ``near``) stands for, as its op, role
    and shapes; "a call not agreed on this rank" when this rank never agreed it (error
    messages only: a linear scan)."""
    channel = channel_of(group)
    entries = [] if channel is None else list(channel.agreed.items())
    for w, agreed in entries:
        if w == word:
            return summary(agreed.signature)
        for number in range(max(near - 3, 0), near + 4) if flag is not None else ():
            if flag_of(w, number) == flag:
                return f"{summary(agreed.signature)}, as its call {number}"
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
    channel = channel_of(group)
    return None if channel is None else channel.processes


def exchange(group, rank: int, world: int, payload, *, what: str) -> list:
    """Every rank's ``payload`` in rank order, through the group's store, bounded by
    FICCO_TIMEOUT: ranks that do not arrive in time are named in a CommTimeoutError; ranks in
    another kind of exchange at this position (``what`` differs) raise MismatchError."""
    if group is None or world == 1:
        return [payload]
    channel = channel_of(group)
    assert channel is not None
    store = channel.store or store_of(group)
    channel.store = store
    timeout_s = config.timeout_s()
    if channel.epoch is None:
        join(channel, store, rank, world, timeout_s)
    with channel.lock:
        seq = channel.next_exchange()
        epoch = channel.epoch
    prefix = f"ficco/{epoch}/{seq}/"
    keys = [f"{prefix}{r}" for r in range(world)]
    gid = channel.key
    check_part = what.endswith(CHECK)
    try:
        store.set(keys[rank], _CHECK.pack(*payload) if check_part else
                  pickle.dumps((what, payload)))
        wait_keys(store, keys, timeout_s)
    except Exception as exc:  # torch raises DistStoreError or RuntimeError
        raise late_error(store, keys, rank, what, f"exchange {seq} on group {gid}", timeout_s,
                    exc) from exc
    tagged = [_load(store.get(k), what if check_part else None) for k in keys]
    if seq > 2:
        # Every rank finished reading exchange seq-2 before it could write exchange seq-1.
        delete_key(store, f"ficco/{epoch}/{seq - 2}/{rank}")
    if any(tag != what for tag, _ in tagged):
        raise _out_of_step(group, rank, None, None, tagged)
    return [part for _, part in tagged]


def _load(raw: bytes, check_what: str | None = None) -> tuple:
    """``(what, payload)`` of an exchange part: a call check's compact form or a pickle."""
    if raw[:1] == b"\0":
        return (check_what or CHECK), _CHECK.unpack(raw)
    return pickle.loads(raw)


def _out_of_step(group, rank: int, word: int | None, number: int | None,
                 tagged: list) -> MismatchError:
    """The MismatchError of an exchange whose ranks are in different calls: each rank's
    call, from what it wrote."""
    def call_of(what: str, part) -> str:
        if what.endswith(CHECK):
            return f"{describe(group, part[0])} (its call {part[1]})"
        if what.endswith(" agreement") and isinstance(part, dict):
            return f"{summary(part['signature'])}, new to it (its call {part.get('number')})"
        if isinstance(part, CallData):
            return part.call
        return what

    calls = "; ".join(f"rank {r}: {call_of(what, part)}" for r, (what, part) in enumerate(tagged))
    return MismatchError(
        f"rank {rank}: the ranks of group {group_key(group)} are making different calls, or "
        f"the same call at different places in their sequence of calls ({calls}); nothing was "
        f"computed. Every rank must make the same calls in the same order (a rank that "
        f"skipped a backward, whose earlier call failed on its own, or that called with other "
        f"shapes, dtypes, settings or op)")


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


# Symmetric memory's allocation steps end in this exchange (it sits below the runtime).
symm_agree.use_exchange(exchange)
