"""The errors (and the one warning) ficco raises. Each message says what failed, the values
seen and the fix."""
from __future__ import annotations

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
    until ``ficco.shutdown()`` ran on every rank (ficco.guard)."""

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


_E = TypeVar("_E", bound=BaseException)


def name_step(exc: _E, step: str) -> _E:
    """Remember on ``exc`` the plan step it came from (``ficco.guard.failed`` puts it in the
    message); the first step named wins. Returns ``exc``.

    >>> name_step(name_step(ValueError("x"), "plan step 3"), "plan step 5").ficco_step
    'plan step 3'
    """
    if getattr(exc, "ficco_step", None) is None:
        try:
            setattr(exc, "ficco_step", step)  # noqa: B010 - any exception type
        except AttributeError:      # an exception type without a __dict__
            pass
    return exc
