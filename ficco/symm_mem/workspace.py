"""Symmetric memory the runtime owns: one workspace per (group, backend), grown on demand, and
the allocations behind ``ficco.symm_mem.empty``.

Lifetime rule: a mapping is closed only after the backend's queues drained (``drain``), since
a copy or GEMM still queued may read it; a mapping whose queues cannot be drained in time is
kept (the process exit frees it) rather than unmapped under a running queue. Allocations made
by ``ficco.symm_mem.empty`` stay mapped until the process exits: their tensor, or any view of
it, may be read after ``ficco.shutdown()``.

Ranks that disagree on a call are caught by the plans' barriers themselves: each carries
the call's flag (``handle.call_flag``, set by the runtime per call; see
:mod:`ficco.symm_mem.barrier`).
"""
from __future__ import annotations

import threading

import torch

from ..group import key as group_key
from ..group import rank_world, resolve
from . import aligned, register_local

_lock = threading.Lock()
_workspaces: dict = {}          # (group id, backend name) -> handle
_allocations: list = []         # handles made by ficco.symm_mem.empty (mapped until exit)
_kept: list = []                # handles that could not be closed safely (queues busy)


def key_of(group, backend) -> tuple:
    return (group_key(group), backend.name)


def get(group, backend, nbytes: int):
    """The workspace of (``group``, ``backend``) holding at least ``nbytes`` per rank.
    Collective when it (re)allocates: every rank grows at the
    same call because every rank agreed on the same problem first."""
    nbytes = aligned(nbytes)
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
    return handle


def current(group, backend):
    """The workspace of (``group``, ``backend``) as it is now, or None (never allocates)."""
    with _lock:
        return _workspaces.get(key_of(group, backend))


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
    if handle.captured:
        # A CUDA graph captured a barrier on this workspace and may still replay it: its
        # memory stays mapped until exit (issue 15 item 2: never free what a graph references;
        # issue 25 item 6: ficco.shutdown() included).
        _kept.append(handle)
        return
    if handle.fault is not None and handle.fault.failed():
        # A barrier of this group was released: a peer may be dead (its close barrier would
        # only time out) or late (still pulling from this memory). Kept until exit.
        _kept.append(handle)
        return
    if backend is not None and not drain(backend):
        _kept.append(handle)
        return
    handle.close()


def drain(backend, cancel: bool = False) -> bool:
    """True once every queue of ``backend`` finished what it was given (bounded by
    FICCO_TIMEOUT); False when a queue is still busy. ``cancel`` first tells the queues to
    skip what is left (after a failure or an interrupt)."""
    if cancel:
        backend.cancel()
    try:
        backend.synchronize()
    except BaseException:  # noqa: BLE001 - a queue that fails to drain keeps its memory mapped
        return False
    return True


_settling: dict = {}            # id(backend) -> (thread, [drained]): a drain after a failure


def drain_in_background(backend) -> None:
    """After a failed ``ccl`` call: make the queues skip what is left now, and drain them on
    a helper thread, so the error reaches the caller at its deadline rather than one more
    FICCO_TIMEOUT later (a collective waiting on a late peer cannot be cancelled: it ends
    when the peer comes or the transport gives up). The next call waits for it first
    (:func:`settle`), so no call ever runs on queues that still skip work."""
    backend.cancel()
    result: list = []
    thread = threading.Thread(target=lambda: result.append(drain(backend)), daemon=True,
                              name="ficco-drain")
    with _lock:
        _settling[id(backend)] = (thread, result)
    thread.start()


def settle(backend) -> None:
    """Before a call (no communication yet): wait, bounded by FICCO_TIMEOUT, for the drain
    :func:`drain_in_background` started; raise CommTimeoutError if the queues are still
    busy (the next call tries again)."""
    if not _settling:
        return
    with _lock:
        entry = _settling.pop(id(backend), None)
    if entry is None:
        return
    from .. import config
    from ..errors import CommTimeoutError

    thread, result = entry
    thread.join(config.timeout_s())
    if not thread.is_alive() and result and result[0]:
        return
    if drain(backend):    # one more bounded try on this thread
        return
    with _lock:
        _settling.setdefault(id(backend), (thread, [False]))
    raise CommTimeoutError(
        f"this process's {backend.name} queues are still busy with a collective of an earlier "
        f"failed call (a peer never came) after FICCO_TIMEOUT; nothing was sent. Destroy the "
        f"process group of that call, or wait for its transport to give up, then call again")


def allocate_symmetric(shape, dtype, device, group):
    """Back end of ``ficco.symm_mem.empty``: a symmetric allocation holding one tensor."""
    from ..backends import get_backend

    backend = get_backend()
    group = resolve(group)
    rank, _ = rank_world(group)
    nbytes = aligned(int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
    handle = backend.symm_provider().allocate(nbytes, group,
                                              torch.device(device or backend.device()))
    tensor = handle.get_buffer(rank, tuple(shape), dtype)
    register_local(handle, tensor)
    with _lock:
        _allocations.append(handle)   # never unmapped before exit: views may outlive anything
    return handle, tensor


def release_all(backend=None) -> None:
    """Close every workspace once the queues drained (``ficco.shutdown``). Allocations made
    by ``ficco.symm_mem.empty`` close when their tensor is gone."""
    with _lock:
        handles = list(_workspaces.values())
        _workspaces.clear()
    if not handles:
        return
    if backend is not None and not drain(backend):
        _kept.extend(handles)
        return
    for handle in handles:
        _close(handle, None)     # captured or failed workspaces are kept (see _close)
