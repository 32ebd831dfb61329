"""The state of a group between calls: what keeps a failure, a disagreement or a second
thread from turning into a wrong result.

- **Serialised calls.** One call per group at a time in a process; a second thread waits its
  turn (bounded by FICCO_TIMEOUT). Which thread's call a peer pairs with is not defined, so
  threads sharing a group must make interchangeable calls (or each use its own group).
- **Poisoned groups.** A call that fails after communication began may leave ranks out of
  step (a peer still in a barrier, a collective still pending). The group then refuses every
  call with :class:`~ficco.errors.PoisonedGroupError` until ``ficco.shutdown()`` ran on every
  rank; after a failed process-group collective (``ccl``) until the group is destroyed, since
  the collective itself may still be pending inside it.
- **A digest per call on ccl**: one all-gather of each rank's 8-byte digest before the
  collectives, so a difference names every rank's call (dma calls carry it as the flag value
  of their plan barriers instead, see ficco.symm_mem.barrier). While it waits, the check
  answers a peer's first-call agreement exchange (ficco.agreement.answer).
- **Named failures**: a transport error becomes a :class:`~ficco.errors.TransportError`
  naming rank, op, schedule, the step (agreement, call check or plan step) and which peers
  are gone (their process exited) or silent, the original as its cause; a failure of this
  rank's own work (a GEMM, a copy) names its plan step the same way.
"""
from __future__ import annotations

import os
import threading
import time
import weakref

import torch
import torch.distributed as dist

from . import agreement, config
from .call import Call
from .errors import (
    CommTimeoutError,
    FiccoError,
    InvalidArgumentError,
    MismatchError,
    PoisonedGroupError,
    TransportError,
)

_lock = threading.Lock()
_locks: dict = {}          # group id -> the lock serialising its calls
_poisoned: dict = {}       # group id -> (reason, survives shutdown)
_watched: set = set()      # group ids whose destruction we watch


def enter(call: Call, timeout_s: float) -> threading.Lock:
    """Start ``call``: wait (bounded by ``timeout_s``) until no other thread runs a call on
    its group, then refuse the group if an earlier call left it poisoned. Returns the held
    lock; the caller releases it when the call ends."""
    gid = call.group_key
    lock = _locks.get(gid)
    if lock is None:
        with _lock:
            lock = _locks.setdefault(gid, threading.Lock())
    if call.group is not None and gid not in _watched:
        _watch(call)
    if not lock.acquire(timeout=timeout_s):
        raise CommTimeoutError(
            f"rank {call.rank}: another thread's {call.op.name} call on group {gid} did not "
            f"finish within FICCO_TIMEOUT ({timeout_s:.1f}s); calls on one group run one at "
            f"a time")
    entry = _poisoned.get(gid)
    if entry is not None:
        lock.release()
        reason, sticky = entry
        fix = ("destroy this process group (dist.destroy_process_group(group)) and create a "
               "new one: a collective of the failed call may still be pending in it" if sticky
               else "call ficco.shutdown() on every rank, then call again")
        raise PoisonedGroupError(
            f"rank {call.rank}: an earlier call on group {gid} failed part-way ({reason}); "
            f"ranks may be out of step, so ficco refuses to run on this group: {fix}")
    return lock


def failed(call: Call, exc: BaseException, transport: str | None,
           schedule: str | None = None, step: str | None = None) -> BaseException:
    """Record a failure of ``call``; returns the exception to raise (``exc`` itself, or a
    TransportError / CommTimeoutError naming rank, op, schedule, step and the peers that do
    not answer, with ``exc`` as its cause). ``step`` is the runtime's stage (the call check,
    ...); a plan step the executor named on ``exc`` takes precedence."""
    if isinstance(exc, (InvalidArgumentError, PoisonedGroupError)) or \
            getattr(exc, "consistent", False):
        return exc      # raised alike on every rank, or before communicating: still in step
    summary = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    with _lock:
        _poisoned[call.group_key] = (summary, transport == "ccl")
    if isinstance(exc, CommTimeoutError) and transport == "ccl" and "rank(s)" not in str(exc):
        # A collective that timed out knows no peer: find out which are gone.
        peers, who = _gone(call)
        named = CommTimeoutError(
            f"rank {call.rank}: {_doing(call, 'ccl', schedule, exc, step)} passed "
            f"FICCO_TIMEOUT ({summary}); "
            + (who if peers else f"{who} (one is slow or made another call)"))
        named.missing = peers
        return named
    if getattr(exc, "ficco_local", False):
        # This rank's own work failed (a GEMM, a copy, a reduction): say where.
        return FiccoError(
            f"rank {call.rank}: {_doing(call, transport, schedule, exc, step)} failed on this "
            f"rank ({summary}); peers waiting for it raise at their deadline. The group is out "
            f"of step: see the error-handling section of the README")
    if isinstance(exc, (CommTimeoutError, MismatchError, KeyboardInterrupt, SystemExit)) or \
            not _from_transport(exc):
        return exc
    _, who = _gone(call)
    return TransportError(
        f"rank {call.rank}: {_doing(call, transport, schedule, exc, step)} failed "
        f"({summary}); {who}. The group is out of step: see the error-handling section of "
        f"the README")


def check_word_ccl(call: Call, word: int, signature: dict | None = None) -> None:
    """Every rank is about to run a call with digest ``word``: one all-gather of one int64.
    While it waits it answers a peer's agreement exchange with ``signature`` (a peer whose
    call is new to it: see ficco.agreement.answer), so that peer and this rank raise one
    MismatchError naming both calls rather than both waiting for FICCO_TIMEOUT."""
    words, work = _check_collective(call, word)
    what = f"{call.op.name} call check"
    if signature is not None and not _done_within(work, _ANSWER_AFTER_S):
        _wait_answering(call, work, signature, what)
    agreement.wait_bounded(work, rank=call.rank, what=what)
    seen = [int(w) for w in words.tolist()]
    if len(set(seen)) > 1:
        calls = "; ".join(f"rank {r}: " + ("this call" if w == word else agreement.describe(
            call.group, w)) for r, w in enumerate(seen))
        raise agreement.consistent(MismatchError(
            f"rank {call.rank}: the ranks of group {call.group_key} are making different "
            f"{call.op.name} calls ({calls}); each was agreed at an earlier call, nothing was "
            f"computed. Every rank must make the same calls in the same order: "
            f"{agreement.describe(call.group, word)} here"))


def flush_check(call: Call) -> None:
    """Complete the check collective of peers that answered this rank's agreement exchange
    from inside their own call check (``MismatchError.joined["ccl"]``): the same all-gather,
    so nothing stays in flight in the process group."""
    _, work = _check_collective(call, 0)
    agreement.wait_bounded(work, rank=call.rank, what=f"{call.op.name} call check (flush)")


# A check that has not completed after this long starts answering peers' agreement exchanges,
# then asks again at this period (the numbers of ficco.symm_mem.barrier's first barrier).
_ANSWER_AFTER_S, _ANSWER_EVERY_S = 0.1, 0.25


def _check_collective(call: Call, word: int):
    dev = call.backend.device()
    words = torch.empty(call.world, dtype=torch.int64, device=dev)
    mine = torch.tensor([word], dtype=torch.int64, device=dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return words, gather(words, mine, group=call.group, async_op=True)


def _done_within(work, seconds: float) -> bool:
    try:
        future = work.get_future()
    except RuntimeError:              # a process group without futures: poll
        deadline = time.monotonic() + seconds
        while not work.is_completed():
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-4)
        return True
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    return done.wait(seconds)


def _wait_answering(call: Call, work, signature: dict, what: str) -> None:
    """Wait for the check (bounded), answering peers' agreement exchanges now and then."""
    timeout_s = config.timeout_s()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            agreement.answer(call.group, call.rank, call.world, signature, "ccl")
        except MismatchError:
            # The peers complete this check's collective (flush_check): wait for it.
            agreement.wait_bounded(work, rank=call.rank, what=f"{what} (flush)")
            raise
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeoutError(f"rank {call.rank}: {what} did not finish within "
                                   f"FICCO_TIMEOUT ({timeout_s:.1f}s)")
        if _done_within(work, min(_ANSWER_EVERY_S, left)):
            return


def reset(keep_sticky: bool = True) -> None:
    """``ficco.shutdown()``: forget failures, except a failed collective's (see module doc)."""
    with _lock:
        for gid in [g for g, (_, sticky) in _poisoned.items() if not (sticky and keep_sticky)]:
            del _poisoned[gid]


def _doing(call: Call, transport, schedule, exc: BaseException, step) -> str:
    """``all_gather_matmul (schedule ring over ccl) in plan step 3 (all-gather s0, queue
    comm)``: what the call was doing when it failed."""
    named = getattr(exc, "ficco_step", None) or getattr(exc.__cause__, "ficco_step", None)
    how = f"schedule {schedule} over " if schedule else "over "
    where = named or step
    return (f"{call.op.name} ({how}{transport or 'the process group'})"
            + (f" in {where}" if where else ""))


def _from_transport(exc: BaseException) -> bool:
    """A failure of the process group's transport (gloo/nccl texts), not ficco's own."""
    text = f"{exc} {exc.__cause__ or ''}".lower()
    return isinstance(exc, RuntimeError) and not isinstance(exc, FiccoError) or any(
        word in text for word in ("connection", "gloo", "nccl", "peer", "socket", "closed"))


def _gone(call: Call) -> tuple[list[int], str]:
    """The peers that did not come after a failure, and a sentence that tells the dead from
    the live: a peer on this host (in this pid namespace) is gone when its process is; the
    others are asked to answer a short liveness exchange through the store, and one that does
    not is named as alive but silent (busy in its own wait, or slow) when its process runs,
    as silent when it runs elsewhere. Never this rank; never an empty list."""
    found = agreement.ranks_of(call.group)
    known = found is not None and len(found) == call.world
    # not known (no agreement yet, or of another size): no peer is local
    ranks = found if found is not None and known else ()
    here = agreement.Process.this()
    local = [r for r, p in enumerate(ranks) if r != call.rank and
             (p.host, p.pid_namespace) == (here.host, here.pid_namespace)]
    quiet = _unanswering(call)
    # After the exchange: a peer whose process was still exiting when this rank failed had
    # up to 3 s to be gone.
    dead = [r for r in local if not _alive(ranks[r].pid)]
    store_gone = quiet is None
    quiet = [r for r in quiet or () if r not in dead]
    live = [r for r in quiet if r in local]
    elsewhere = [r for r in quiet if r not in local]
    said = []
    if dead:
        said.append(f"rank(s) {dead} are gone (their processes exited)")
    if live:
        said.append(f"rank(s) {live} are alive but did not answer a liveness check (busy in "
                    f"another wait, or slow)")
    if elsewhere:
        said.append(f"rank(s) {elsewhere} did not answer a liveness check"
                    + (" (on other hosts: gone, busy or slow)" if known else ""))
    if store_gone:
        said.append("the group's store does not answer (the process hosting it, rank 0 with a "
                    "tcp:// or env:// rendezvous, is gone)")
    if said:
        return sorted(dead + quiet), "; ".join(said)
    return [], "every peer answers a liveness check"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (of this pid namespace) runs; a zombie does not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:                       # no /proc: signal 0 tells whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _unanswering(call: Call) -> list[int] | None:
    """Ranks that do not answer a short liveness exchange through the store (never this
    rank), or None when the store itself does not answer."""
    try:
        with config.scope(timeout=min(config.timeout_s(), 3.0)):
            agreement.exchange(call.group, call.rank, call.world, True,
                               what="liveness check after a failure")
    except CommTimeoutError as exc:
        return getattr(exc, "missing", [])
    except FiccoError:
        return []
    return []


def _watch(call: Call) -> None:
    """When the group is destroyed and dropped, its state goes with it: workspace (after its
    queues drained), agreements, poison, and the backend's queue threads once no watched
    group is left."""
    gid = call.group_key
    if call.group is None or gid in _watched:
        return
    with _lock:
        _watched.add(gid)
    try:
        weakref.finalize(call.group, _group_gone, gid, call.backend)
    except TypeError:      # a group object that takes no weak references: shutdown() only
        pass


def _group_gone(gid: str, backend) -> None:
    from .symm_mem import workspace

    workspace.release((gid, backend.name), backend)
    with _lock:
        _poisoned.pop(gid, None)
        _locks.pop(gid, None)
        _watched.discard(gid)
        last = not _watched
    agreement.forget_id(gid)
    if last and workspace.drain(backend):
        backend.close()
