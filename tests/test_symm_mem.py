"""ficco.symm_mem on the CPU backend: every rank sees every peer's allocation."""
from __future__ import annotations

import random

import pytest
import torch

import ficco
from ficco.errors import InvalidArgumentError

from . import harness


def _exchange(rank, world, seed):
    t = ficco.symm_mem.empty((5, 7), dtype=torch.float32)
    handle = ficco.symm_mem.rendezvous(t)
    values = torch.randn(world, 5, 7, generator=torch.Generator().manual_seed(seed))
    t.copy_(values[rank])
    handle.barrier(channel=3, timeout_s=20)
    seen = [torch.equal(handle.get_buffer(p, (5, 7), torch.float32), values[p])
            for p in range(world)]
    handle.barrier(channel=3, timeout=20)      # DESIGN's keyword; timeout_s is the same
    pads = [tuple(handle.signal_pad(p).shape) for p in range(world)]
    try:
        handle.get_buffer(0, (100, 100), torch.float32)
        too_big = "no error"
    except InvalidArgumentError as exc:
        too_big = str(exc)
    return all(seen), pads, too_big


def test_empty_rendezvous_get_buffer_barrier():
    world = 3
    for ok, pads, too_big in harness.pool(world).run(_exchange, random.randrange(1 << 20)):
        assert ok
        assert pads == [(ficco.symm_mem.SIGNAL_CHANNELS, world)] * world
        assert "needs 40000 bytes" in too_big


def test_rendezvous_rejects_ordinary_tensors():
    with pytest.raises(InvalidArgumentError, match="ficco.symm_mem.empty"):
        ficco.symm_mem.rendezvous(torch.zeros(3))
