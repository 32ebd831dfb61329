"""What a failure leaves behind: which failures poison a group's session, and the named
error the caller sees. The state itself lives on the group's :class:`~ficco.runtime.session.Session`.

- **Serialised calls.** One call per group at a time in a process (``Session.enter``); a
  second thread waits its turn (bounded by FICCO_TIMEOUT). Which thread's call a peer pairs
  with is not defined, so threads sharing a group must make interchangeable calls (or each
  use its own group: two groups share no lock, queue or store key).
- **Poisoned groups.** A call that fails after it could have communicated may leave ranks out
  of step (a peer still in a barrier, a collective still pending), and ranks that disagree
  (MismatchError) are out of step in their programs, whatever ficco could still pair: the
  group's session then refuses every call with :class:`~ficco.errors.PoisonedGroupError`
  until ``ficco.shutdown()`` ran on every rank; when a collective of the process group may
  still be pending in it (a failed ``ccl`` plan), until the group is destroyed. A call whose
  arguments or settings are refused on its rank (InvalidArgumentError, ConfigError: before
  it communicated, or after the agreement, e.g. a graph capture that would have to allocate)
  poisons nothing: nothing of it is in flight, and it took its number, so its peers' same
  call can never pair with this rank's next one.
- **Named failures**: a transport error becomes a :class:`~ficco.errors.TransportError`
  naming rank, op, schedule, the step (agreement, call check or plan step) and which peers
  are gone (their process exited) or silent, the original as its cause; a failure of this
  rank's own work (a GEMM, a copy, an allocation) names its plan step the same way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .. import config
from ..errors import (
    CommTimeoutError,
    ConfigError,
    FiccoError,
    InvalidArgumentError,
    MismatchError,
    PoisonedGroupError,
    TransportError,
    error_context,
    known_context,
)
from . import agreement
from .call import Call


@dataclass
class Stage:
    """Where a call is, for its failure: the transport and schedule chosen (None: not yet),
    the step (the runtime's; a plan step the executor names wins), whether a process-group
    collective of it may be pending, and whether the failure is this rank's own work (an
    allocation)."""

    transport: str | None = None
    schedule: str | None = None
    step: str | None = None
    pending: bool = False
    local: bool = False


def failed(call: Call, exc: BaseException, stage: Stage) -> BaseException:
    """Record a failure of ``call`` on its session (poisoning it, see the module docstring);
    returns the exception to raise (``exc`` itself, or a TransportError / CommTimeoutError /
    FiccoError naming rank, op, schedule, step and the peers that do not answer, with ``exc``
    as its cause)."""
    session = call.session
    if isinstance(exc, (PoisonedGroupError, InvalidArgumentError, ConfigError)):
        # Refused, or its arguments or settings refused on this rank (a capture that cannot
        # run, a schedule that cannot run this call): nothing of it is in flight, and it
        # took its number, so peers that went on cannot pair with this rank's next call.
        return exc
    first = str(exc).splitlines()[0] if str(exc) else ""
    summary = f"{type(exc).__name__}: {cut(first, SUMMARY_CHARS, 'in the error that call raised')}"
    session.poison(summary, stage.pending)
    summary = f"{type(exc).__name__}: {cut(first, SUMMARY_CHARS, 'in its __cause__ below')}"
    transport, schedule, step = stage.transport, stage.schedule, stage.step
    asked = known_context(exc)
    if isinstance(exc, CommTimeoutError) and (asked.asked or transport == "dma" or (
            transport == "ccl" and "rank(s)" not in str(exc))):
        # An exchange through the store names the ranks that did not come (None: the store
        # itself is gone); a collective that timed out knows no peer, and a dma barrier only
        # which peers' flags did not come: find out which are gone.
        heard = asked.missing if asked.asked else ...
        peers, who = _gone(call, heard)
        doing = _doing(call, transport or ("ccl" if heard is ... else None), schedule, exc, step)
        named = CommTimeoutError(
            f"rank {call.rank}: {doing} passed FICCO_TIMEOUT ({summary}); "
            + (who if peers else f"{who} (one is slow or made another call)")
            + ". The group is out of step: see the error-handling section of the README")
        context = error_context(named)
        context.asked, context.missing = True, peers
        return named
    if stage.local or known_context(exc).local:
        # This rank's own work failed (a GEMM, a copy, a reduction, an allocation): say where.
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


#: characters of a nested error's first line kept in a message that names it
SUMMARY_CHARS = 200


def cut(text: str, limit: int, rest: str) -> str:
    """``text``, or its first words within ``limit`` characters and where the rest is.

    >>> cut("a barrier waited 5.0s for rank(s) [1]", 24, "in its cause")
    'a barrier waited 5.0s … (cut; the whole text is in its cause)'
    """
    if len(text) <= limit:
        return text
    head = text[:limit + 1].rsplit(" ", 1)[0] if " " in text[:limit + 1] else text[:limit]
    return f"{head.rstrip(' ,;:')} … (cut; the whole text is {rest})"


def _doing(call: Call, transport, schedule, exc: BaseException, step) -> str:
    """``all_gather_matmul (schedule ring over ccl) in plan step 3 (all-gather s0, queue
    comm)``: what the call was doing when it failed."""
    named = known_context(exc).step or known_context(exc.__cause__).step
    how = f"schedule {schedule} over " if schedule else "over "
    where = named or step
    return (f"{call.op.name} ({how}{transport or 'the process group'})"
            + (f" in {where}" if where else ""))


def _from_transport(exc: BaseException) -> bool:
    """A failure of the process group's transport (gloo/nccl texts), not ficco's own."""
    text = f"{exc} {exc.__cause__ or ''}".lower()
    return isinstance(exc, RuntimeError) and not isinstance(exc, FiccoError) or any(
        word in text for word in ("connection", "gloo", "nccl", "peer", "socket", "closed"))


def _gone(call: Call, heard=...) -> tuple[list[int], str]:
    """The peers that did not come after a failure, and a sentence that tells the dead from
    the live: a peer on this host (in this pid namespace) is gone when its process is; the
    others are asked to answer a short liveness exchange through the store (unless ``heard``
    is the list of ranks an exchange already waited for in vain, or None when the store
    itself did not answer), and one that does not is named as alive but silent (busy in its
    own wait, or slow) when its process runs, as silent when it runs elsewhere. Never this
    rank; never an empty list."""
    found = agreement.ranks_of(call.group)
    known = found is not None and len(found) == call.world
    # not known (no agreement yet, or of another size): no peer is local
    ranks = found if found is not None and known else ()
    here = agreement.Process.this()
    local = [r for r, p in enumerate(ranks) if r != call.rank and
             (p.host, p.pid_namespace) == (here.host, here.pid_namespace)]
    quiet = _unanswering(call) if heard is ... else heard
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
        asked = known_context(exc)
        return asked.missing if asked.asked else []
    except FiccoError:
        return []
    return []
