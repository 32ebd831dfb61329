"""Every FICCO_* setting, in one place, read when used (never at import).

Each knob reads its environment variable on every access unless set from Python::

    from ficco import config
    config.timeout_s()                      # FICCO_TIMEOUT or 300
    with config.scope(schedule="ring"):     # temporary override, e.g. in tests
        ...

A bad value raises :class:`~ficco.errors.ConfigError` listing what is accepted.
Precedence for a decision: call argument > env/scope > selector.

One case rule for every setting: a value that names something ficco knows (a backend, a
schedule, a selector, a transport, a built-in profile, a log level) is read in any case;
a path (FICCO_PROFILE's file, FICCO_CACHE_DIR) is taken as written. A ``FICCO_*`` variable
that names no setting (a misspelt ``FICCO_SCHEDUEL``) is warned about once per process
(:func:`warn_unknown`), where a call first reads the settings.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class Knob:
    env: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    #: the values it takes (a function of none: asked when a value is checked, its answer
    #: cached by the function itself)
    choices: tuple | Callable[[], tuple] | None = None
    #: ``parse`` also checks values set from Python (numbers), not only env strings
    checks_values: bool = False

    def read(self) -> Any:
        # One Python call per read (ficco reads several settings per call): no helpers here.
        stack = getattr(_local, "stack", None)
        override = stack[-1].get(self.env, _UNSET) if stack else _UNSET
        if override is not _UNSET:
            return override
        raw = os.environ.get(self.env)
        if raw is None or raw.strip() == "":
            return self.default
        try:
            value = self.parse(raw.strip())
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.env}={raw!r} is not valid: {exc}; {self.doc}") from None
        choices = self.choices() if callable(self.choices) else self.choices
        if choices is not None and value not in choices:
            named = ", ".join(str(c) for c in choices if c is not None)
            unset = f", or leave {self.env} unset" if None in choices else ""
            raise ConfigError(f"{self.env}={raw!r} is not valid; use one of: {named}{unset}")
        return value


#: How bytes may cross ranks (DESIGN §2), and what FICCO_TRANSPORT accepts.
TRANSPORTS = ("dma", "ccl")
TRANSPORT_SETTINGS = ("auto", *TRANSPORTS)

_UNSET = object()
_local = threading.local()


def _overrides() -> dict:
    if not hasattr(_local, "stack"):
        _local.stack = [{}]
    return _local.stack[-1]


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be a positive number")
    return value


def _seconds(raw) -> float:
    value = float(raw)
    if math.isinf(value) and value > 0:
        # No call may wait forever (a dead peer must make the others fail); a day is "never"
        # for any healthy wait and still ends.
        raise ValueError("ficco never waits forever; give a large finite number of seconds "
                         "instead, e.g. 86400 (a day)")
    if not value > 0:
        raise ValueError("must be a positive, finite number of seconds")
    if value > threading.TIMEOUT_MAX:
        # every wait goes through a lock or an event, which refuse longer timeouts
        raise ValueError(f"must be at most {threading.TIMEOUT_MAX:.4g} s (the longest wait "
                         f"Python's threading takes, threading.TIMEOUT_MAX)")
    return value


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _flag(raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be 0 or 1")


def _names(raw: str) -> tuple[str, ...]:
    names = tuple(n.strip().lower() for n in raw.split(",") if n.strip())
    if not names or len(set(names)) != len(names):
        raise ValueError("must be distinct comma-separated schedule names")
    return names


@functools.lru_cache(maxsize=1)
def backend_names() -> tuple[str | None, ...]:
    """What FICCO_BACKEND takes: the name of a backend package of ficco/backends, or nothing
    (``ficco.backends.names``, asked by name: the backends sit above the settings;
    ``ficco.backends.refresh`` asks again)."""
    return (None, *importlib.import_module("ficco.backends").names())


KNOBS: dict[str, Knob] = {k.env: k for k in [
    Knob("FICCO_BACKEND", None, str.lower, "a backend of ficco/backends: cpu, cuda, rocm",
         choices=backend_names),
    # Checked against the op's schedules when a call reads it (names depend on the op): it
    # forces the ops that have a schedule of that name; the others choose as if unset.
    Knob("FICCO_SCHEDULE", None, str.lower,
         "a schedule name of any op (ficco.schedules.names(op=...)); it forces the ops that "
         "have it"),
    Knob("FICCO_SELECTOR", "auto", str.lower,
         "which selector picks a schedule: auto (the model's shortlist, measured on the live "
         "group at a key's first sight), model, paper or tune (every schedule, measured)",
         choices=("auto", "paper", "model", "tune")),
    Knob("FICCO_AUTO", "explore", str.lower,
         "how the auto selector measures a new key: explore (its first call runs serial, its "
         "next calls run the shortlisted schedules as the real calls, timed, until one "
         "exchange settles the decision) or upfront (the shortlist is timed in front of the "
         "first call, which then runs the winner)",
         choices=("explore", "upfront")),
    Knob("FICCO_TRANSPORT", "auto", str.lower, "how bytes cross ranks",
         choices=TRANSPORT_SETTINGS),
    Knob("FICCO_DISABLE", False, _flag, "1 runs plain all_gather + matmul"),
    Knob("FICCO_PROFILE", None, str, "a built-in profile name or a JSON file path"),
    Knob("FICCO_TOPOLOGY", None, str.lower, "mesh, switch or pcie",
         choices=(None, "mesh", "switch", "pcie")),
    Knob("FICCO_CACHE_DIR", None, str,
         "a directory for what ficco measures on this machine (the auto and tune selectors' "
         "JSON caches, calibrated profiles)"),
    Knob("FICCO_TUNE_CANDIDATES", None, _names,
         "the schedules the tune selector measures, e.g. serial,ring,gated-1d (default: every "
         "schedule offered on this backend; gated-* only where Triton runs, never on CPU)"),
    Knob("FICCO_TIMEOUT", 300.0, _seconds, "seconds before a cross-rank wait fails (finite)",
         checks_values=True),
    Knob("FICCO_LOG", "warning", str.lower, "log level of ficco's decisions",
         choices=("debug", "info", "warning", "error")),
    Knob("FICCO_LOG_RANKS", "0", str.lower,
         "which ranks log: 0 (the default group's rank 0) or all", choices=("0", "all")),
    Knob("FICCO_COPY_ENGINES", None, _positive_int, "copy queues per rank (default: one per peer)"),
    Knob("FICCO_SYMM", "ipc", str.lower, "GPU symmetric memory provider",
         choices=("ipc", "auto", "torch")),
    Knob("FICCO_SIGNAL_PADS", "auto", str.lower,
         "where GPU barrier flags and error words live: host-mapped memory, which the "
         "barrier watchdog reads and releases without a stream (auto and host), or device "
         "memory (device: no rescue if a stream shares the stuck one's hardware queue; "
         "refused with one hardware queue)",
         choices=("auto", "device", "host")),
    Knob("FICCO_POISON", False, _flag,
         "1 fills outputs and workspaces with NaN before each call (debugging, tests)"),
    Knob("FICCO_PAPER_LOW", 1.0, _positive_float,
         "paper selector: below this multiple of the machine's OTB*MT pick uniform-fused-1d"),
    Knob("FICCO_PAPER_HIGH", 5.0, _positive_float,
         "paper selector: above this multiple of the machine's OTB*MT pick hetero-unfused-1d"),
    Knob("FICCO_BACKWARD_GATHER", "save", str.lower,
         "how all_gather_matmul's backward gets the gathered input for the weight gradient: "
         "save (keep it from the forward: W x more activation memory, no extra communication) "
         "or regather (gather it again in the backward, overlapped with the input-gradient "
         "reduce-scatter)", choices=("save", "regather")),
]}

_NAMES = {env.removeprefix("FICCO_").lower(): env for env in KNOBS}


#: FICCO_* variables that are no setting of the library: the test harness's and the GPU lease
#: scripts' own (tests/, bench/), read there
TOOL_ENV = ("FICCO_FAKE_GPU", "FICCO_LEASE_SCALE", "FICCO_LEASE_QUICK")
TOOL_PREFIXES = ("FICCO_TEST_",)


def unknown_env() -> list[str]:
    """The ``FICCO_*`` environment variables that name no setting, sorted.

    >>> os.environ["FICCO_SCHEDUEL"] = "ring"; unknown_env(); del os.environ["FICCO_SCHEDUEL"]
    ['FICCO_SCHEDUEL']
    """
    return sorted(k for k in os.environ if k.startswith("FICCO_") and k not in KNOBS
                  and k not in TOOL_ENV and not k.startswith(TOOL_PREFIXES))


def warn_unknown() -> None:
    """Warn once per process and name for each ``FICCO_*`` variable that names no setting,
    with the closest known names: a misspelt setting is otherwise silently ignored."""
    import difflib
    import warnings

    from .errors import FiccoWarning, first_time

    for name in unknown_env():
        if not first_time(("unknown setting", name)):
            continue
        close = difflib.get_close_matches(name, list(KNOBS), n=2)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        warnings.warn(f"{name} is set but is no ficco setting, so it changes nothing; {hint}"
                      f"known: {', '.join(sorted(KNOBS))}", FiccoWarning, stacklevel=3)


def get(name: str) -> Any:
    """Read a knob by short name (``"timeout"``) or env name (``"FICCO_TIMEOUT"``)."""
    env = _NAMES.get(name, name)
    if env not in KNOBS:
        raise ConfigError(f"unknown ficco setting {name!r}; known: {', '.join(sorted(_NAMES))}")
    return KNOBS[env].read()


@contextlib.contextmanager
def scope(**settings):
    """Temporarily set knobs by short name (this thread only): ``scope(timeout=5)``."""
    new = dict(_overrides())
    for name, value in settings.items():
        env = _NAMES.get(name)
        if env is None:
            raise ConfigError(f"unknown ficco setting {name!r}; known: {', '.join(sorted(_NAMES))}")
        knob = KNOBS[env]
        if isinstance(value, str) or knob.checks_values:
            try:
                value = knob.parse(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{name}={value!r} is not valid: {exc}; {knob.doc}") from None
        choices = knob.choices() if callable(knob.choices) else knob.choices
        if choices is not None and value not in choices:
            raise ConfigError(f"{name}={value!r} is not valid; use one of: "
                              f"{', '.join(map(str, choices))}")
        new[env] = value
    _overrides_stack().append(new)
    try:
        yield
    finally:
        _overrides_stack().pop()


def _overrides_stack() -> list:
    _overrides()
    return _local.stack


#: what a snapshot reads: every knob, and the vendors' hardware-queue settings the call's
#: settings include (:func:`hardware_queues`)
_SNAPSHOT_ENV = (*KNOBS, "CUDA_DEVICE_MAX_CONNECTIONS", "GPU_MAX_HW_QUEUES")


def snapshot() -> tuple:
    """The raw FICCO_* environment and this thread's overrides, as a hashable key: equal
    snapshots read to equal settings (callers memoise validated settings by it)."""
    stack = getattr(_local, "stack", None)   # (one Python call per call: no helpers)
    overrides = stack[-1] if stack else None
    return (tuple(map(os.environ.get, _SNAPSHOT_ENV)),
            tuple(sorted(zip(overrides, map(repr, overrides.values())))) if overrides else ())


# Typed accessors: the names the rest of ficco uses. Each is its knob's bound ``read``, one
# Python call, since the call path reads a few per call.
backend: Callable[[], str | None] = KNOBS["FICCO_BACKEND"].read
schedule: Callable[[], str | None] = KNOBS["FICCO_SCHEDULE"].read
selector: Callable[[], str] = KNOBS["FICCO_SELECTOR"].read
auto_mode: Callable[[], str] = KNOBS["FICCO_AUTO"].read
transport: Callable[[], str] = KNOBS["FICCO_TRANSPORT"].read
disabled: Callable[[], bool] = KNOBS["FICCO_DISABLE"].read
profile: Callable[[], str | None] = KNOBS["FICCO_PROFILE"].read
topology: Callable[[], str | None] = KNOBS["FICCO_TOPOLOGY"].read
cache_dir: Callable[[], str | None] = KNOBS["FICCO_CACHE_DIR"].read
tune_candidates: Callable[[], tuple[str, ...] | None] = KNOBS["FICCO_TUNE_CANDIDATES"].read
timeout_s: Callable[[], float] = KNOBS["FICCO_TIMEOUT"].read
log_level: Callable[[], str] = KNOBS["FICCO_LOG"].read
log_ranks: Callable[[], str] = KNOBS["FICCO_LOG_RANKS"].read
copy_engines: Callable[[], int | None] = KNOBS["FICCO_COPY_ENGINES"].read
poison: Callable[[], bool] = KNOBS["FICCO_POISON"].read
backward_gather: Callable[[], str] = KNOBS["FICCO_BACKWARD_GATHER"].read


def paper_thresholds() -> tuple[float, float]:
    return get("FICCO_PAPER_LOW"), get("FICCO_PAPER_HIGH")


def hardware_queues(vendor: str) -> int | None:
    """How many hardware queues this process's GPU streams share, from the vendor's own
    setting: ``CUDA_DEVICE_MAX_CONNECTIONS`` (CUDA; Megatron's sequence parallelism sets 1),
    ``GPU_MAX_HW_QUEUES`` (ROCm). None where unset (the driver's default) or not a GPU.

    >>> import os; os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = " 1 "
    >>> hardware_queues("cuda"), hardware_queues("rocm"), hardware_queues("cpu")
    (1, None, None)
    >>> del os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]
    """
    knob = {"cuda": "CUDA_DEVICE_MAX_CONNECTIONS", "rocm": "GPU_MAX_HW_QUEUES"}.get(vendor)
    value = os.environ.get(knob, "").strip() if knob else ""
    try:
        return int(value) if value else None
    except ValueError:
        raise ConfigError(f"{knob}={value!r} is not a whole number of hardware queues") from None
