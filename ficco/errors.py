"""The errors (and the one warning) ficco raises. Each message says what failed, the values
seen and the fix."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TypeVar


class FiccoError(RuntimeError):
    """Base of every ficco error."""


class InvalidArgumentError(FiccoError, ValueError):
    """A call's arguments are wrong; raised before any communication."""


class ConfigError(FiccoError, ValueError):
    """A FICCO_* environment variable or knob holds a value ficco does not accept."""


class MismatchError(FiccoError):
    """Ranks of one group called with different shapes, dtypes or schedules, or made their
    calls in another order: their programs are out of step, so the group's session is poisoned
    until ``ficco.shutdown()`` ran on every rank (ficco.runtime.guard)."""

    #: a plan barrier's mismatch: peer rank -> the call flag its slot held, which the runtime
    #: turns into the calls they stand for (ficco.symm_mem.barrier)
    flags: dict[int, int] | None = None


class CommTimeoutError(FiccoError, TimeoutError):
    """A cross-rank wait passed its deadline (FICCO_TIMEOUT): a peer is dead or stuck."""

    #: the ranks that did not arrive, where the wait could tell (None: the store itself did
    #: not answer, so no rank could be asked)
    missing: list[int] | None = []   # noqa: RUF012 - read-only default; instances set their own


class BackendUnavailableError(FiccoError):
    """The requested backend cannot run here (no device, missing package, wrong version)."""


class BackendCallError(FiccoError):
    """A vendor runtime call (CUDA driver/runtime, HIP) returned an error status."""


class PoisonedGroupError(FiccoError):
    """An earlier call on this group failed part-way, so ranks may be out of step; ficco
    refuses to run on the group (rather than compute on leftovers) until it is reset."""


class TransportError(FiccoError):
    """Moving bytes between ranks failed (a collective, a peer's connection); the message
    names the rank, op, schedule and peers, and the original error is the cause."""


class FiccoWarning(UserWarning):
    """Something runs, but not on ficco: e.g. a TP plan none of whose GEMMs reach ficco's ops
    (``ficco.torchtitan``, ``ficco.compat.install_symm_mem_override``)."""


_warned: set = set()
_warned_lock = threading.Lock()


def first_time(key) -> bool:
    """True the first time this process asks about ``key`` (a hashable naming one warning),
    False after: the one memo behind every warn-once of ficco (an unknown setting, a cache
    file's fault, a torchtitan module ficco cannot reach)."""
    with _warned_lock:
        if key in _warned:
            return False
        _warned.add(key)
        return True


@dataclass
class ErrorContext:
    """What ficco learnt about an exception on its way up, kept on it as one record
    (:func:`error_context`) for the layer that words the final error (``ficco.runtime.guard``)."""

    #: the plan step it came from (the first one named wins)
    step: str | None = None
    #: the executor step being enqueued when a backend raised at once
    at: tuple | None = None
    #: this rank's own work failed (a GEMM, a copy, a reduction), not a peer or a transport
    local: bool = False
    #: the tensors the failed queue task held: find its plan step
    work: tuple | None = None
    #: an exchange asked the peers: ``missing`` is its answer
    asked: bool = False
    #: the ranks that never came (None: the store itself did not answer)
    missing: list[int] | None = None
    #: a barrier's mismatch: each peer's call flag, which the runtime turns into its call
    flags: dict[int, int] | None = None


_CONTEXT = "ficco_context"


def error_context(exc: BaseException) -> ErrorContext:
    """The :class:`ErrorContext` of ``exc``, attached empty at first use (a throwaway record
    for an exception type that takes no attributes).

    >>> error_context(ValueError("x")).step is None
    True
    """
    found = known_context(exc)
    if _CONTEXT not in getattr(exc, "__dict__", ()):
        try:
            setattr(exc, _CONTEXT, found)
        except AttributeError:      # an exception type without a __dict__
            pass
    return found


def known_context(exc: BaseException | None) -> ErrorContext:
    """What is known of ``exc`` (an empty record when nothing, or for None); attaches nothing."""
    found = getattr(exc, "__dict__", {}).get(_CONTEXT)
    return found if isinstance(found, ErrorContext) else ErrorContext()


_E = TypeVar("_E", bound=BaseException)


def name_step(exc: _E, step: str) -> _E:
    """Remember on ``exc`` the plan step it came from (``ficco.runtime.guard.failed`` puts it in the
    message); the first step named wins. Returns ``exc``.

    >>> error_context(name_step(name_step(ValueError("x"), "plan step 3"), "plan step 5")).step
    'plan step 3'
    """
    context = error_context(exc)
    if context.step is None:
        context.step = step
    return exc
