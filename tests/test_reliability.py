"""Ranks that disagree get an error on every rank; a dead or stuck peer makes the others
raise within FICCO_TIMEOUT naming it; no shared-memory file is ever left behind."""
from __future__ import annotations

import glob
import os
import random
import time

import pytest
import torch

import ficco
from ficco.errors import CommTimeoutError, MismatchError

from . import harness
from .reference import make_inputs


def _shm_files():
    return sorted(glob.glob("/dev/shm/ficco-*"))


def _mismatched(rank, world, seed):
    rows = 8 if rank != 1 else 9
    a, b = torch.randn(rows, 16), torch.randn(16, 4)
    try:
        ficco.all_gather_matmul(a, b, schedule="serial")
    except MismatchError as exc:
        return str(exc)
    return "no error"


def test_ranks_with_different_shapes_all_raise():
    messages = harness.pool(3).run(_mismatched, 0)
    for msg in messages:
        assert "different" in msg and "m" in msg and "rank 1" in msg, msg


def _stuck_peer(rank, world, schedule):
    shards, bs, _, _ = make_inputs(3, world, (8, 16), (4,), torch.float32)
    ficco.all_gather_matmul(shards[rank], bs[0], schedule=schedule)  # agree on the shape
    outcome = "returned"
    if rank != world - 1:  # the last rank never comes to the second call
        start = time.monotonic()
        try:
            with ficco.config.scope(timeout=2):
                ficco.all_gather_matmul(shards[rank], bs[0], schedule=schedule)
        except CommTimeoutError as exc:
            outcome = f"{time.monotonic() - start:.1f}s {exc}"
    ficco.shutdown()  # every rank drops its workspace so the pool stays usable
    return outcome


@pytest.mark.parametrize("schedule", ["serial", "uniform-fused-1d"])
def test_stuck_peer_raises_within_the_deadline_naming_it(schedule):
    world = 3
    results = harness.pool(world).run(_stuck_peer, schedule)
    for rank, msg in enumerate(results[:-1]):
        seconds = float(msg.split("s ", 1)[0])
        assert seconds < 10, msg
        assert f"rank {rank}" in msg and f"[{world - 1}]" in msg and "barrier" in msg, msg
    assert results[-1] == "returned"


def _die_mid_call(rank, world, seed):
    shards, bs, _, _ = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    ficco.all_gather_matmul(shards[rank], bs[0], schedule="ring")
    if rank == 1:
        os._exit(17)
    try:
        with ficco.config.scope(timeout=2):
            ficco.all_gather_matmul(shards[rank], bs[0], schedule="ring")
    except CommTimeoutError as exc:
        return str(exc)
    return "no error"


def test_dead_peer_makes_others_fail_not_hang_and_leaks_nothing():
    before = _shm_files()
    pool = harness.RankPool(3)
    try:
        for conn in pool.conns:
            conn.send((_die_mid_call.__module__, _die_mid_call.__name__, (5,)))
        results = pool._collect(60)
    finally:
        pool.close()
    assert results[1][0] == "err" and "died" in results[1][1]
    for rank in (0, 2):
        status, msg = results[rank]
        assert status == "ok" and "[1]" in msg and f"rank {rank}" in msg, results[rank]
    assert _shm_files() == before


def _files_during_call(rank, world, seed):
    shards, bs, _, _ = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    ficco.all_gather_matmul(shards[rank], bs[0], schedule="serial")
    return _shm_files()


def test_no_shared_memory_file_exists_even_while_ranks_hold_workspaces():
    before = _shm_files()
    pool = harness.RankPool(2)
    try:
        during = pool.run(_files_during_call, random.randrange(1000))
    finally:
        pool.close()
    assert during == [before, before]
    assert _shm_files() == before


def _group_lifetime(rank, world, seed):
    import gc

    import torch.distributed as dist

    from ficco.backends import get_backend
    from ficco.symm_mem import workspace

    group = dist.new_group(list(range(world)))
    shards, bs, full, refs = make_inputs(seed, world, (6, 8), (3,), torch.float32)
    with ficco.config.scope(transport="dma"):
        ficco.all_gather_matmul(shards[rank], bs[0], group, schedule="serial")
    key = workspace.key_of(group, get_backend())
    held = key in workspace._workspaces
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return held, key in workspace._workspaces


def test_destroying_a_group_releases_its_workspace():
    for held, still_held in harness.pool(2).run(_group_lifetime, random.randrange(1000)):
        assert held and not still_held
