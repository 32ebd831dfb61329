"""Backend selection: exactly one backend is active per process.

A backend is a package of this folder (``ficco/backends/<name>/``) that defines a
:class:`Backend` subclass whose ``name`` is the package's: found by that name, nothing listed
elsewhere (:func:`names`). ``FICCO_BACKEND`` forces one; otherwise the usable backend of the
highest ``priority`` its class declares (rocm, a ROCm build of torch, before cuda before cpu:
a GPU build with a visible device wins over the CPU). The automatic choice is made once per
process (asking the GPU runtimes costs far more than a call's own host work); a changed
``FICCO_BACKEND`` is honoured at the next call, since it is read each time like every
setting. Each backend instance registers its symmetric-memory provider for its device type
with :mod:`ficco.symm_mem` when it is made (symmetric memory sits below the backends).
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
import threading

from .. import config
from ..errors import BackendUnavailableError
from ..symm_mem.handle import register_provider
from .base import Backend

_active: dict[str, Backend] = {}
_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _found() -> dict[str, type[Backend] | str]:
    """name -> the Backend subclass of every backend package of this folder's path (or why
    its package cannot be imported); a package of shared code (``gpu``) defines none of its
    own name."""
    found: dict[str, type[Backend] | str] = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.ispkg:
            continue
        module = f"{__name__}.{info.name}"
        try:
            package = importlib.import_module(module)
        except ImportError as exc:
            found[info.name] = f"the {info.name} backend cannot be imported: {exc}"
            continue
        classes = [c for c in vars(package).values() if isinstance(c, type) and
                   issubclass(c, Backend) and c.__dict__.get("name") == info.name]
        if classes:
            found[info.name] = classes[0]
    return found


def names() -> tuple[str, ...]:
    """Every backend package's name, sorted.

    >>> names()
    ('cpu', 'cuda', 'rocm')
    """
    return tuple(sorted(_found()))


def refresh() -> None:
    """Look for backend packages again (one added to this folder's path at run time, as a
    test does) and make the next automatic choice anew."""
    _found.cache_clear()
    config.backend_names.cache_clear()
    auto_name.cache_clear()


def backend_class(name: str) -> type[Backend]:
    """The :class:`Backend` subclass of backend package ``name``."""
    found = _found().get(name)
    if found is None:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; valid backends: {', '.join(names())}")
    if isinstance(found, str):
        raise BackendUnavailableError(found)
    return found


def by_priority() -> list[str]:
    """Every backend's name, the highest ``priority`` first (the automatic choice's order)."""
    return sorted(names(), key=lambda n: -_priority(n))


def _priority(name: str) -> int:
    try:
        return backend_class(name).priority
    except BackendUnavailableError:
        return -1


def gpu_reasons() -> dict[str, str]:
    """Why each device backend (every one but cpu) cannot run here (empty for one that can),
    so an error about a tensor on a GPU under the cpu backend can say what is missing (a
    binding, a device)."""
    reasons = {}
    for name in by_priority():
        if name == "cpu":
            continue
        try:
            reason = backend_class(name).unavailable_reason()
        except BackendUnavailableError as exc:
            reason = str(exc)
        if reason is not None:
            reasons[name] = reason
    return reasons


def unavailable_note() -> str:
    """One sentence naming why each device backend is unavailable ("" when one is available).

    >>> "cuda:" in unavailable_note() or unavailable_note() == ""
    True
    """
    reasons = gpu_reasons()
    if len(reasons) < len(names()) - 1:
        return ""
    return "no GPU backend can run here (" + "; ".join(f"{n}: {r}" for n, r in reasons.items()) \
        + ")"


@functools.lru_cache(maxsize=1)
def auto_name() -> str:
    """The backend chosen when ``FICCO_BACKEND`` names none: the usable one of the highest
    priority, asked once per process (``auto_name.cache_clear()`` asks again)."""
    reasons = gpu_reasons()
    return next((name for name in by_priority() if name != "cpu" and name not in reasons),
                "cpu")


def get_backend(name: str | None = None) -> Backend:
    """The active backend instance (created on first use): ``name``, else ``FICCO_BACKEND``,
    else the automatic choice.

    >>> get_backend("cpu") is get_backend("cpu")
    True
    """
    name = name or config.backend() or auto_name()
    backend = _active.get(name)
    if backend is not None:
        return backend
    with _lock:
        if name not in _active:
            cls = backend_class(name)
            reason = cls.unavailable_reason()
            if reason is not None:
                raise BackendUnavailableError(f"FICCO_BACKEND={name} cannot run here: {reason}")
            _active[name] = _registered(cls())
        return _active[name]


def _registered(backend: Backend) -> Backend:
    """``backend``, its symmetric-memory provider registered for its device type."""
    register_provider(backend.device_type, backend.symm_provider, backend.device)
    return backend


# Symmetric memory named by no device: the active backend's (made on first use).
register_provider(None, lambda: get_backend().symm_provider(), lambda: get_backend().device())


def install(name: str, backend: Backend | None) -> Backend | None:
    """Make ``backend`` the instance of backend ``name`` (None: forget it, so the next use
    makes one); returns the one it replaces. For test doubles of a device (tests/fake_gpu.py)."""
    with _lock:
        old = _active.pop(name, None)
        if backend is not None:
            _active[name] = _registered(backend)
    return old


def installed(name: str) -> bool:
    """Whether an instance of backend ``name`` exists in this process."""
    return name in _active


def close_all() -> None:
    with _lock:
        for backend in _active.values():
            backend.close()
        _active.clear()


__all__ = [
    "Backend",
    "auto_name",
    "backend_class",
    "by_priority",
    "close_all",
    "get_backend",
    "gpu_reasons",
    "install",
    "installed",
    "names",
    "refresh",
    "unavailable_note",
]
