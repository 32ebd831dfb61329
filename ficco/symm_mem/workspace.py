"""Symmetric memory the runtime owns: one workspace per (group, backend), grown on demand, and
the allocations behind ``ficco.symm_mem.empty``.

Lifetime rule: a mapping is closed only after the backend's queues drained (``drain``), since
a copy or GEMM still queued may read it; a mapping whose queues cannot be drained in time is
kept (the process exit frees it) rather than unmapped under a running queue.
"""
from __future__ import annotations

import threading
import weakref

import torch

from ..call import group_id, group_rank_world, resolve_group
from . import aligned, register_local

_lock = threading.Lock()
_workspaces: dict = {}          # (group id, backend name) -> handle
_allocations: list = []         # handles made by ficco.symm_mem.empty
_kept: list = []                # handles that could not be closed safely (queues busy)


def key_of(group, backend) -> tuple:
    return (group_id(group), backend.name)


def get(group, backend, nbytes: int):
    """The workspace of (``group``, ``backend``) holding at least ``nbytes`` per rank.
    Collective when it (re)allocates: every rank grows at the same call because every rank
    agreed on the same problem first."""
    key = key_of(group, backend)
    with _lock:
        handle = _workspaces.get(key)
        if handle is not None and handle.nbytes >= nbytes:
            return handle
    if handle is not None:
        release(key, backend)
    grown = max(nbytes, 2 * handle.nbytes if handle is not None else 0)
    handle = backend.symm_provider().allocate(grown, group, backend.device())
    with _lock:
        _workspaces[key] = handle
    if handle is not None and group is not None:
        # Destroying the group (and dropping it) releases its workspace, not only shutdown().
        weakref.finalize(group, release, key, backend)
    return handle


def held(group, backend) -> bool:
    return key_of(group, backend) in _workspaces


def release(key, backend=None) -> None:
    """Close the workspace ``key`` once the backend's queues drained."""
    with _lock:
        handle = _workspaces.pop(key, None)
    if handle is not None:
        _close(handle, backend)


def drop(group, backend) -> None:
    release(key_of(group, backend), backend)


def _close(handle, backend) -> None:
    if backend is not None and not drain(backend):
        _kept.append(handle)
        return
    handle.close()


def drain(backend) -> bool:
    """True once every queue of ``backend`` finished what it was given (bounded by
    FICCO_TIMEOUT); False when a queue is still busy."""
    try:
        backend.synchronize()
    except Exception:  # noqa: BLE001 - a queue that fails to drain keeps its memory mapped
        return False
    return True


def allocate_symmetric(shape, dtype, device, group):
    """Back end of ``ficco.symm_mem.empty``: a symmetric allocation holding one tensor."""
    from ..backends import get_backend

    backend = get_backend()
    group = resolve_group(group)
    rank, _ = group_rank_world(group)
    nbytes = aligned(int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
    handle = backend.symm_provider().allocate(nbytes, group,
                                              torch.device(device or backend.device()))
    tensor = handle.get_buffer(rank, tuple(shape), dtype)
    register_local(handle, tensor)
    with _lock:
        _allocations.append(handle)
    return handle, tensor


def release_all(backend=None) -> None:
    """Close every workspace and symmetric allocation (``ficco.shutdown``)."""
    with _lock:
        handles = list(_workspaces.values()) + _allocations
        _workspaces.clear()
        _allocations.clear()
    if not handles:
        return
    if backend is not None and not drain(backend):
        _kept.extend(handles)
        return
    for handle in handles:
        handle.close()
