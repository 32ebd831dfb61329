"""Backend selection: exactly one backend is active per process.

``FICCO_BACKEND`` forces one (cpu, cuda, rocm); otherwise the first usable of rocm (torch's
ROCm build), cuda, cpu — a GPU build with a visible device wins over the CPU. The automatic
choice is made once per process (asking the GPU runtimes costs far more than a call's own
host work); a changed ``FICCO_BACKEND`` is honoured at the next call, since it is read each
time like every setting.
"""
from __future__ import annotations

import functools
import importlib
import threading

from .. import config
from ..errors import BackendUnavailableError
from .base import Backend

_CLASSES = {"cuda": ("ficco.backends.cuda", "CudaBackend"),
            "rocm": ("ficco.backends.rocm", "RocmBackend"),
            "cpu": ("ficco.backends.cpu", "CpuBackend")}
_active: dict[str, Backend] = {}
_lock = threading.Lock()


def backend_class(name: str) -> type[Backend]:
    if name not in _CLASSES:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; valid backends: {', '.join(_CLASSES)}")
    module, cls = _CLASSES[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(f"the {name} backend cannot be imported: {exc}") from exc


def gpu_reasons() -> dict[str, str]:
    """Why each GPU backend cannot run here (empty for one that can), so an error about a
    tensor on a GPU under the cpu backend can say what is missing (a binding, a device)."""
    reasons = {}
    for name in ("rocm", "cuda"):
        try:
            reason = backend_class(name).unavailable_reason()
        except BackendUnavailableError as exc:
            reason = str(exc)
        if reason is not None:
            reasons[name] = reason
    return reasons


def unavailable_note() -> str:
    """One sentence naming why each GPU backend is unavailable ("" when one is available).

    >>> "cuda:" in unavailable_note() or unavailable_note() == ""
    True
    """
    reasons = gpu_reasons()
    if len(reasons) < 2:
        return ""
    return "no GPU backend can run here (" + "; ".join(f"{n}: {r}" for n, r in reasons.items()) \
        + ")"


@functools.lru_cache(maxsize=1)
def auto_name() -> str:
    """The backend chosen when ``FICCO_BACKEND`` names none: the first usable of rocm, cuda,
    cpu, asked once per process (``auto_name.cache_clear()`` asks again)."""
    reasons = gpu_reasons()
    return next((name for name in ("rocm", "cuda") if name not in reasons), "cpu")


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
            _active[name] = cls()
        return _active[name]


def install(name: str, backend: Backend | None) -> Backend | None:
    """Make ``backend`` the instance of backend ``name`` (None: forget it, so the next use
    makes one); returns the one it replaces. For test doubles of a device (tests/fake_gpu.py)."""
    with _lock:
        old = _active.pop(name, None)
        if backend is not None:
            _active[name] = backend
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
    "close_all",
    "get_backend",
    "gpu_reasons",
    "install",
    "installed",
    "unavailable_note",
]
