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

from .. import harness
from ..reference import make_inputs, max_row_rel_err


def _shm_files():
    return sorted(glob.glob("/dev/shm/ficco-*"))


def _mismatched(rank, world, seed):
    rows = 8 if rank != 1 else 9
    a, b = torch.randn(rows, 16), torch.randn(16, 4)
    try:
        ficco.all_gather_matmul(a, b, schedule="serial")
    except MismatchError as exc:
        return str(exc)
    finally:
        ficco.shutdown()      # a MismatchError poisons the group until every rank resets
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
    results = harness.run_alone(3, _die_mid_call, 5, timeout_s=60, raw=True)
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
    during = harness.run_alone(2, _files_during_call, random.randrange(1000))
    assert during == [before, before]
    assert _shm_files() == before


def _group_lifetime(rank, world, seed):
    import gc

    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    shards, bs, _full, _refs = make_inputs(seed, world, (6, 8), (3,), torch.float32)
    with ficco.config.scope(transport="dma"):
        ficco.all_gather_matmul(shards[rank], bs[0], group, schedule="serial")
    session = ficco.session_of(group)        # (holds its group weakly)
    held = session.workspace is not None
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return held, session.workspace is not None


def test_destroying_a_group_releases_its_workspace():
    for held, still_held in harness.pool(2).run(_group_lifetime, random.randrange(1000)):
        assert held and not still_held


# -- Never a wrong result after a failure, a later disagreement or a second thread ----
def _outcome(fn):
    """("ok", value) or ("raised", "ErrorType: message")."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the test judges every kind
        return ("raised", f"{type(exc).__name__}: {exc}")


def _late_peer_on_ccl(rank, world, seed):
    shards, bs, _, refs = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    with ficco.config.scope(transport="ccl", timeout=1):
        first = _outcome(lambda: max_row_rel_err(
            ficco.all_gather_matmul(shards[rank], bs[0], schedule="serial"), refs[0]))
        if rank == 1:
            time.sleep(7.5)        # well past rank 0's deadline and liveness check, then healthy
        late = _outcome(lambda: ficco.all_gather_matmul(shards[rank], bs[0], schedule="serial"))
        later = []
        for call in range(3):
            shards, bs, _, refs = make_inputs(seed + 1 + call, world, (8, 16), (4,),
                                              torch.float32)
            later.append(_outcome(lambda: max_row_rel_err(
                ficco.all_gather_matmul(shards[rank], bs[0], schedule="serial"), refs[0])))
    return first, late, later


def test_late_peer_on_ccl_then_every_later_call_is_right_or_raises():
    results = harness.run_alone(2, _late_peer_on_ccl, random.randrange(1 << 30), timeout_s=120)
    for rank, (first, late, later) in enumerate(results):
        assert first[0] == "ok" and first[1] <= 1e-4, results
        for status, value in later:
            assert (status == "ok" and value <= 1e-4) or \
                (status == "raised" and value.split(":")[0] in ficco.errors.__dict__), results
    assert results[0][1][0] == "raised" and "CommTimeoutError" in results[0][1][1], results
    assert "[1]" in results[0][1][1], results      # the late peer is named
    assert results[0][2][0][0] == "raised" and "earlier" in results[0][2][0][1], results


def _disagree_on_cached_shapes(rank, world, seed, transport):
    small = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    large = make_inputs(seed + 1, world, (12, 16), (4,), torch.float32)
    out = []
    with ficco.config.scope(transport=transport, timeout=5):
        for shards, bs, _, refs in (small, large):      # both shapes agreed and cached
            out.append(_outcome(lambda: max_row_rel_err(
                ficco.all_gather_matmul(shards[rank], bs[0], schedule="ring"), refs[0])))
        shards, bs, _, refs = small if rank == 0 else large
        out.append(_outcome(lambda: ficco.all_gather_matmul(shards[rank], bs[0],
                                                            schedule="ring")))
        shards, bs, _, refs = small       # the same call again: refused, the group poisoned
        out.append(_outcome(lambda: ficco.all_gather_matmul(shards[rank], bs[0],
                                                            schedule="ring")))
        ficco.shutdown()                  # every rank resets: in step again, right again
        out.append(_outcome(lambda: max_row_rel_err(
            ficco.all_gather_matmul(shards[rank], bs[0], schedule="ring"), refs[0])))
    ficco.shutdown()
    return out


@pytest.mark.parametrize("transport", ["dma", "ccl"])
def test_disagreement_on_a_cached_shape_raises_on_every_rank(transport):
    results = harness.pool(2).run(_disagree_on_cached_shapes, random.randrange(1 << 30),
                                  transport)
    for agreed_small, agreed_large, mismatched, refused, again in results:
        assert agreed_small[0] == agreed_large[0] == "ok", results
        assert mismatched[0] == "raised" and mismatched[1].startswith("MismatchError"), results
        assert refused[0] == "raised" and refused[1].startswith("PoisonedGroupError"), results
        assert again[0] == "ok" and again[1] <= 1e-4, results


def _two_threads(rank, world, seed):
    """Calls on one group are serialised per group; which thread's call a peer pairs with is
    not defined, so both threads pass the same inputs (the documented contract)."""
    import threading

    outcomes = {0: [], 1: []}
    shards, bs, _, refs = make_inputs(seed, world, (64, 48), (40,), torch.float32)

    def worker(index):
        with ficco.config.scope(transport="dma", timeout=10):
            for call in range(15):
                outcomes[index].append(_outcome(lambda: max_row_rel_err(
                    ficco.all_gather_matmul(shards[rank], bs[0], schedule="uniform-unfused-1d"),
                    refs[0])))

    threads = [threading.Thread(target=worker, args=(i,), name=f"caller-{i}") for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ficco.shutdown()
    return outcomes[0] + outcomes[1]


def test_two_threads_on_one_group_never_get_a_wrong_result():
    results = harness.run_alone(2, _two_threads, random.randrange(1 << 30), timeout_s=180)
    for per_rank in results:
        assert per_rank and all(s == "ok" and err <= 1e-4 for s, err in per_rank), per_rank


_AFTER_SHUTDOWN = """
import ficco, torch
t = ficco.symm_mem.empty((256, 256))
t.fill_(1)
ficco.shutdown()
try:
    print(float(t.sum()))
except ficco.errors.FiccoError as exc:
    print("raised", exc)
"""


def test_symmetric_tensor_after_shutdown_does_not_crash():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _AFTER_SHUTDOWN], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() in ("65536.0",) or proc.stdout.startswith("raised"), proc.stdout


def test_ctrl_c_during_a_dma_call_then_exit_does_not_crash():
    import subprocess
    import sys

    for attempt in range(2):
        proc = subprocess.run([sys.executable, "-m", "tests.exit_after_error", "sigint"],
                              capture_output=True, text=True, timeout=240,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), check=False)
        codes = [int(c) for c in proc.stdout.split("exitcodes", 1)[-1].split()] \
            if "exitcodes" in proc.stdout else []
        assert proc.returncode == 0 and codes and all(c >= 0 for c in codes), \
            (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])


def _bf16_errors(rank, world, seed):
    """Fraction of bf16 outputs that differ from the correctly rounded float64 product."""
    out = {}
    shards, bs, _full, refs = make_inputs(seed, world, (24, 512), (64,), torch.bfloat16)
    want = refs[0].to(torch.bfloat16)
    with ficco.config.scope(transport="dma"):
        for name in ["ring", *[n for n in ficco.schedules.names() if n.endswith("-2d")]]:
            got = ficco.all_gather_matmul(shards[rank], bs[0], schedule=name)
            out[name] = float((got != want).double().mean())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_2d_schedules_round_bf16_once_like_ring(world):
    for per_rank in harness.pool(world).run(_bf16_errors, random.randrange(1 << 30)):
        ring = per_rank.pop("ring")
        for name, wrong in per_rank.items():
            assert wrong <= ring + 0.01, (name, wrong, ring)


# -- Failures that start on this rank name it; a slow GEMM is no failure ---
def _local_gemm_fails(rank, world, seed, schedule, transport, where):
    """Rank 1's next GEMM raises: in its queue's thread (the CPU backend runs GEMMs there) or
    while the executor enqueues it (as a GPU launch error would)."""
    from ficco.backends import cpu, get_backend

    from ..cases import fail_next_gemm

    real = cpu.gemm_into_view

    def broken(*args):
        cpu.gemm_into_view = real
        raise RuntimeError("injected GEMM failure")

    shards, bs, _, _ = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    with ficco.config.scope(transport=transport, timeout=5):
        ficco.all_gather_matmul(shards[rank], bs[0], schedule=schedule)   # agreed, warm
        restore = lambda: None
        if rank == 1 and where == "queue":
            cpu.gemm_into_view = broken
        elif rank == 1:
            restore = fail_next_gemm(get_backend())
        outcome = _outcome(lambda: ficco.all_gather_matmul(shards[rank], bs[0],
                                                           schedule=schedule))
        restore()
        cpu.gemm_into_view = real
    ficco.shutdown()
    return outcome


@pytest.mark.parametrize("schedule, transport, where", [
    ("uniform-unfused-1d", "dma", "queue"), ("ring", "ccl", "queue"),
    ("hetero-fused-2d", "dma", "enqueue")])
def test_a_local_gemm_failure_names_rank_op_schedule_and_step(schedule, transport, where):
    """Before: `FiccoError: queue compute failed: RuntimeError: injected GEMM failure`, naming
    neither rank, op, schedule nor step (the README promises all four); raised while
    enqueuing, a TransportError blaming a live peer."""
    results = harness.run_alone(2, _local_gemm_fails, random.randrange(1 << 30), schedule,
                                transport, where, timeout_s=120)
    status, message = results[1]
    assert status == "raised" and "injected GEMM failure" in message, results
    assert message.startswith("FiccoError") and "no longer answer" not in message, message
    for part in ("rank 1", "all_gather_matmul", schedule, transport, "plan step", "gemm",
                 "queue compute"):
        assert part in message, (part, message)


def _slow_gemms(rank, world, seed, transport):
    """Every GEMM of both ranks takes 1.5 s, with FICCO_TIMEOUT=0.5: no cross-rank wait waits
    for a GEMM of another rank longer than its own, so nothing may time out."""
    from ficco.backends import cpu

    real = cpu.gemm_into_view

    def slow(*args):
        time.sleep(1.5)
        return real(*args)

    shards, bs, _, refs = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    out = []
    with ficco.config.scope(transport=transport):
        ficco.all_gather_matmul(shards[rank], bs[0], schedule="hetero-fused-1d")   # agreed
        cpu.gemm_into_view = slow
        try:
            with ficco.config.scope(timeout=0.5):
                out.append(_outcome(lambda: max_row_rel_err(
                    ficco.all_gather_matmul(shards[rank], bs[0], schedule="hetero-fused-1d"),
                    refs[0])))
        finally:
            cpu.gemm_into_view = real
        out.append(_outcome(lambda: max_row_rel_err(
            ficco.all_gather_matmul(shards[rank], bs[0], schedule="hetero-fused-1d"), refs[0])))
    ficco.shutdown()
    return out


@pytest.mark.parametrize("transport", ["dma", "ccl"])
def test_a_local_gemm_longer_than_ficco_timeout_is_no_failure(transport):
    """Before: `CommTimeoutError: queue compute did not drain within FICCO_TIMEOUT` and a
    poisoned group, though FICCO_TIMEOUT bounds cross-rank waits only."""
    results = harness.run_alone(2, _slow_gemms, random.randrange(1 << 30), transport,
                                timeout_s=120)
    for slow, after in results:
        assert slow[0] == "ok" and slow[1] <= 1e-4, results
        assert after[0] == "ok" and after[1] <= 1e-4, results


# -- The ranks named as gone after a failure are the dead ones, only -------------
def _one_dies(rank, world, seed, dead, late, transport):
    """One normal call, then rank ``dead`` exits and the others call again (rank ``late``
    8 s later: alive, but busy while the first to fail looks for the dead)."""
    shards, bs, _, _ = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    with ficco.config.scope(transport=transport):
        ficco.all_gather_matmul(shards[rank], bs[0], schedule="ring")
        if rank == dead:
            os._exit(17)
        if rank == late:
            time.sleep(8)
        with ficco.config.scope(timeout=3):
            return _outcome(lambda: ficco.all_gather_matmul(shards[rank], bs[0],
                                                            schedule="ring"))


@pytest.mark.parametrize("dead, late, store", [(2, 1, "file"), (0, None, "tcp")])
def test_the_ranks_named_gone_after_a_failure_are_exactly_the_dead_ones(dead, late, store):
    """Before: the list of ranks that "no longer answer" came from a 3 s store exchange, so it
    named a live peer still inside its own collective, or every rank, the reporting one
    included, when rank 0 (the TCP store's host) had died, or an empty list."""
    world = 3
    results = harness.run_alone(world, _one_dies, random.randrange(1 << 30), dead, late, "ccl",
                                timeout_s=120, raw=True, store=store)
    assert results[dead][0] == "err", results
    for rank in sorted(set(range(world)) - {dead}):
        status, (kind, message) = results[rank]
        assert status == "ok" and kind == "raised", results[rank]
        assert f"rank {rank}:" in message, message
        assert f"rank(s) [{dead}] are gone" in message and "[]" not in message, message
        if late is not None and rank != late:      # alive, and said so
            assert f"rank(s) [{late}] are alive" in message, message
