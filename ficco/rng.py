"""A random stream per rank, for dropout in the sequence-parallel region.

Tensor-parallel ranks are usually seeded alike (the same weights at init), so every rank
draws the same random numbers. In the sequence-parallel region each rank holds a different
chunk of the sequence, so the same draws mean every chunk gets the same dropout mask: the
model trains with dropout correlated across sequence chunks, silently. :class:`ShardRNG` gives
each rank its own stream while it is entered and leaves the default generators as they were::

    rng = ShardRNG(seed=1234, group=tp_mesh)       # once
    for batch in data:
        with rng:                                  # dropout masks differ per sequence shard
            loss = model(batch)                    # eager or torch.compile'd
        loss.backward()

Enter it around the call of a compiled model, not inside it: a compiled graph reads its random
seed from the default generator when it runs, so the entered stream reaches it. The
backward needs no stream (dropout saves its mask); activation checkpointing restores the
stream it recorded at forward. DTensor random ops on GPU meshes (torch's styles) draw from
DTensor's own offset-based generator, which is already shard-aware; this stream reaches plain
tensors, e.g. the local outputs of ``RowwiseParallel`` and ``ficco.nn`` layers.
"""
from __future__ import annotations

import torch

from .errors import FiccoError
from .group import rank_world, resolve

# A large odd multiplier (the golden ratio's, 64-bit) spreads seeds so that (seed, rank) pairs
# of nearby seeds, e.g. seed + data-parallel rank, do not collide.
_SPREAD = 0x9E3779B97F4A7C15


class ShardRNG:
    """This rank's own random stream (CPU and the current CUDA/ROCm device), seeded from
    ``(seed, rank in group)``: entered, it replaces the default generators' states; on exit it
    keeps its advanced state for next time and puts theirs back.

    >>> rng = ShardRNG(seed=7)                  # no process group: rank 0 of 1
    >>> before = torch.get_rng_state()
    >>> with rng:
    ...     mask = torch.nn.functional.dropout(torch.ones(8), 0.5)
    >>> torch.equal(torch.get_rng_state(), before)
    True
    """

    def __init__(self, seed: int, group=None, *, devices=None):
        rank, _ = rank_world(resolve(group))
        self.rank_seed = (int(seed) * _SPREAD + rank + 1) % (1 << 63)
        if devices is None:   # the CPU and the current accelerator (cuda, xpu…), if any
            accelerator = torch.accelerator.current_accelerator(check_available=True)
            devices = ["cpu"] + ([torch.device(accelerator.type,
                                               torch.accelerator.current_device_index())]
                                 if accelerator is not None else [])
        self.devices = [torch.device(d) for d in devices]
        self._mine = {d: torch.Generator(device=d).manual_seed(self.rank_seed).get_state()
                      for d in self.devices}
        self._saved: dict[torch.device, torch.Tensor] | None = None   # the states entering replaced

    def __enter__(self) -> ShardRNG:  # noqa: PYI034 - typing.Self needs Python 3.11
        if self._saved is not None:
            raise FiccoError("this ShardRNG is already entered; enter it once at a time")
        self._saved = {d: _get(d) for d in self.devices}
        for d in self.devices:
            _set(d, self._mine[d])
        return self

    def __exit__(self, *exc) -> None:
        saved = self._saved
        assert saved is not None   # a with statement enters before it exits
        for d in self.devices:
            self._mine[d] = _get(d)
            _set(d, saved[d])
        self._saved = None


def _get(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


__all__ = ["ShardRNG"]
