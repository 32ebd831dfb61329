"""Symmetric memory: every rank of a group allocates the same number of bytes and can address
every peer's allocation directly (CPU: shared files in /dev/shm; GPUs: IPC handles or torch's
``_symmetric_memory``).

The API mirrors torch's::

    t = ficco.symm_mem.empty((m, k), dtype=torch.bfloat16)   # this rank's part
    h = ficco.symm_mem.rendezvous(t, group)                   # collective
    peer = h.get_buffer(1, (m, k), torch.bfloat16)            # rank 1's part, as a tensor
    h.barrier(channel=2, timeout_s=60)

Each handle also carries one signal pad per rank: ``SIGNAL_CHANNELS x world`` int32 counters
used for cross-rank barriers (rank r writes generation g into slot ``[channel, r]`` of every
peer's pad, then waits until its own pad holds >= g in every slot of that channel). Channels 0
and 1 belong to ficco's plans (on GPUs they hold constant flags so graphs can replay them);
host barriers use channels 2 and up. The barrier protocol itself lives in
:mod:`ficco.symm_mem.barrier`, once for every backend.

Modules: ``barrier`` (the protocol), ``cpu`` (/dev/shm files), ``device`` (GPU handles over raw
device memory), ``ipc`` (our GPU provider over IPC handles), ``torch_symm`` (torch's provider
and the ``FICCO_SYMM`` choice between the two).
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgumentError
from .barrier import SIGNAL_CHANNELS
from .handle import (
    Provider,
    SymmHandle,
    aligned,
    owner_of,
    provider_for,
    register_local,
    register_provider,
)

__all__ = ["SIGNAL_CHANNELS", "Provider", "SymmHandle", "aligned", "empty", "provider_for",
           "register_local", "register_provider", "rendezvous"]


def empty(shape, dtype: torch.dtype = torch.float32, device=None, group=None) -> torch.Tensor:
    """Allocate a tensor in symmetric memory (collective over ``group``) and return this
    rank's part; ``rendezvous(t, group)`` returns its handle."""
    from .workspace import allocate_symmetric

    # The provider the backend of ``device``'s type registered (none named: the active
    # backend's): the backends sit above symmetric memory and hand theirs in.
    provider, default = provider_for(None if device is None else torch.device(device).type)
    _handle, tensor = allocate_symmetric(provider, shape, dtype, device or default, group)
    return tensor


def rendezvous(tensor: torch.Tensor, group=None) -> SymmHandle:
    """The handle of a tensor made by :func:`empty`."""
    handle = owner_of(tensor)
    if handle is None:
        raise InvalidArgumentError(
            "rendezvous() takes a tensor allocated by ficco.symm_mem.empty(); this tensor lives "
            "in ordinary memory")
    return handle
