"""Symmetric memory the runtime owns: each session's workspace (one per group and backend,
grown on demand, held by its :class:`ficco.runtime.session.Session`), and the allocations behind
``ficco.symm_mem.empty``.

Lifetime rule: a mapping is closed only after the queues that may touch it drained
(:func:`drained`), since a copy or GEMM still queued may read it; a mapping whose queues
cannot be drained in time is kept (the process exit frees it) rather than unmapped under a
running queue. Allocations made by ``ficco.symm_mem.empty`` stay mapped until the process
exits: their tensor, or any view of it, may be read after ``ficco.shutdown()``.

Ranks that disagree on a call are caught by the plans' barriers themselves: each carries
the call's flag (``handle.call_flag``, set by the runtime per call; see
:mod:`ficco.symm_mem.barrier`).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..group import rank_world, resolve
from .handle import aligned, register_local

_lock = threading.Lock()
# Mapped until the process exits: handles made by ficco.symm_mem.empty, and workspaces that
# could not be closed safely (queues still busy, a graph captured them, a barrier failed).
_kept: list = []


def get(session, nbytes: int, agree: Callable[[bool], bool] | None = None):
    """The workspace of ``session`` holding at least ``nbytes`` per rank. Collective when it
    (re)allocates: every rank grows at the same call because every rank agreed on the same
    problem first. The old one is closed once the session's queues drained. ``agree`` (the
    runtime's: True when the flag is True on every rank) makes closing the old one collective
    too: closing is a barrier and an exchange where peers map it (GPUs), so every rank closes
    it or every rank keeps it; a rank that closed alone would meet its peers' allocation with
    its release."""
    handle = session.workspace
    if handle is not None and handle.nbytes >= nbytes:
        return handle
    nbytes = aligned(nbytes)
    backend = session.backend
    if handle is not None:
        session.workspace = None
        closable = drained(backend, session.lane) and not must_keep(handle)
        if agree is not None:
            closable = agree(closable)
        close(handle, closable)
    group = session.group
    grown = max(nbytes, 2 * handle.nbytes if handle is not None else 0)
    handle = session.workspace = backend.symm_provider().allocate(grown, group,
                                                                  backend.device())
    return handle


def drained(backend, lane) -> bool:
    """True once ``lane``'s queues finished what they were given (bounded by FICCO_TIMEOUT);
    False when one is still busy."""
    try:
        backend.drain(lane)
    except BaseException:  # noqa: BLE001 - a queue that fails to drain keeps its memory mapped
        return False
    return True


def close(handle, drained: bool, failed: bool = False) -> None:
    """Close a workspace whose queues ``drained``; keep it mapped until exit otherwise.
    ``failed``: its session was poisoned by a failure: a GPU workspace (one with a group
    fault) is kept too, since closing it is a barrier with peers that may be gone."""
    if must_keep(handle, failed) or not drained:
        keep(handle)
        return
    handle.close()


def must_keep(handle, failed: bool = False) -> bool:
    """Whether ``handle`` stays mapped until exit whatever its queues did: a CUDA graph
    captured a barrier on it and may still replay it (never free what a graph references); its
    session failed and it has a group fault (closing is a barrier with peers that may be
    gone); or a barrier of its group was released (a peer may be dead, its close barrier
    would only time out, or late, still pulling from this memory)."""
    return bool(handle.captured or (failed and handle.fault is not None)
                or (handle.fault is not None and handle.fault.failed()))


def keep(handle) -> None:
    with _lock:
        _kept.append(handle)


def kept(handle) -> bool:
    """Whether ``handle`` is kept mapped until the process exits."""
    with _lock:
        return any(h is handle for h in _kept)


def allocate_symmetric(provider, shape, dtype, device, group):
    """Back end of ``ficco.symm_mem.empty``: a symmetric allocation of ``provider`` on
    ``device`` holding one tensor."""
    group = resolve(group)
    rank, _ = rank_world(group)
    nbytes = aligned(int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
    handle = provider.allocate(nbytes, group, torch.device(device))
    tensor = handle.get_buffer(rank, tuple(shape), dtype)
    register_local(handle, tensor)
    keep(handle)      # never unmapped before exit: views may outlive anything
    return handle, tensor
