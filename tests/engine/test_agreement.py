"""Every wait ficco starts is bounded by FICCO_TIMEOUT and names who did not come;
every setting that changes what a rank does is agreed; bad settings fail before any
communication; failures name the rank and peers; nothing crashes the exit after an error."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest
import torch

import ficco

from .. import harness
from ..reference import make_inputs, max_row_rel_err


def _outcome(fn):
    start = time.monotonic()
    try:
        value = fn()
        return ("ok", value if isinstance(value, float) else None, time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 - the test judges every kind
        return (type(exc).__name__, str(exc), time.monotonic() - start)


def _skip_first_call(rank, world, seed):
    warm, w, _, _ = make_inputs(seed + 1, world, (3, 8), (3,), torch.float32)
    ficco.all_gather_matmul(warm[rank], w[0])     # the group's session exists on every rank
    shards, bs, _, refs = make_inputs(seed, world, (5, 8), (3,), torch.float32)
    result = ("skipped", None, 0.0)
    if rank != world - 1:            # the last rank never makes this first call
        with ficco.config.scope(timeout=2):
            result = _outcome(lambda: ficco.all_gather_matmul(shards[rank], bs[0]))
    ficco.shutdown()                 # every rank resets: the group is usable again
    again = _outcome(lambda: max_row_rel_err(ficco.all_gather_matmul(shards[rank], bs[0]),
                                             refs[0]))
    ficco.shutdown()
    return result, again


def test_a_peer_that_skips_the_first_call_is_named_within_the_deadline():
    results = harness.pool(3).run(_skip_first_call, random.randrange(1 << 30))
    for rank, (first, again) in enumerate(results[:-1]):
        kind, message, seconds = first
        assert kind == "CommTimeoutError" and "[2]" in message and f"rank {rank}" in message, first
        assert seconds < 10, first
    for _, again in results:
        assert again[0] == "ok" and again[1] <= 1e-4, results


def _bad_env_on_one_rank(rank, world, seed):
    shards, bs, _, _ = make_inputs(seed, world, (4, 8), (3,), torch.float32)
    name, value = ("FICCO_COPY_ENGINES", "-2") if rank == 1 else (None, None)
    if name:
        os.environ[name] = value
    try:
        with ficco.config.scope(timeout=2):
            result = _outcome(lambda: ficco.all_gather_matmul(shards[rank], bs[0]))
    finally:
        if name:
            del os.environ[name]
    ficco.shutdown()
    return result


def test_a_bad_env_value_fails_on_its_rank_before_communicating_and_is_named_elsewhere():
    results = harness.pool(2).run(_bad_env_on_one_rank, random.randrange(1 << 30))
    assert results[1][0] == "ConfigError" and "FICCO_COPY_ENGINES" in results[1][1], results
    assert results[1][2] < 1.0, results          # before any communication
    assert results[0][0] == "CommTimeoutError" and "[1]" in results[0][1], results


def _settings_differ(rank, world, seed, setting, values):
    shards, bs, _, _refs = make_inputs(seed, world, (6, 8), (3,), torch.float32)
    with ficco.config.scope(**{setting: values[rank]}, timeout=5):
        result = _outcome(lambda: ficco.all_gather_matmul(shards[rank], bs[0]))
    ficco.shutdown()
    return result


@pytest.mark.parametrize("setting, values", [("disable", (True, False)),
                                             ("selector", ("tune", "model")),
                                             ("profile", ("h100", "mi300x")),
                                             ("transport", ("dma", "ccl"))])
def test_ranks_with_different_settings_all_raise_mismatch(setting, values):
    results = harness.pool(2).run(_settings_differ, random.randrange(1 << 30), setting, values)
    for kind, message, _ in results:
        assert kind == "MismatchError" and setting in message, results


def _killed_on_ccl(rank, world, seed):
    shards, bs, _, _ = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    with ficco.config.scope(transport="ccl"):
        ficco.all_gather_matmul(shards[rank], bs[0], schedule="ring")
        if rank == 1:
            os._exit(17)
        with ficco.config.scope(timeout=3):
            return _outcome(lambda: ficco.all_gather_matmul(shards[rank], bs[0], schedule="ring"))


def test_a_killed_peer_on_ccl_is_named_in_a_ficco_error():
    results = harness.run_alone(3, _killed_on_ccl, 7, timeout_s=90, raw=True)
    for rank in (0, 2):
        status, (kind, message, elapsed) = results[rank]
        assert status == "ok" and kind in ficco.errors.__dict__, results[rank]
        assert "[1]" in message and f"rank {rank}" in message, results[rank]
        # ... and the op, schedule and step it was in (the call check before the plan).
        assert "all_gather_matmul" in message and "ring" in message, results[rank]
        assert "step" in message and "call check" in message, results[rank]
        # A bound, not a speed: the deadline, the liveness check that names the peer, a grace.
        assert elapsed < 3 + 3 + _GRACE_S, results[rank]


_GRACE_S = 1.5     # scheduling slack on a loaded 2-core host, far below the old 5 s drain


def _late_in_the_plan_on_ccl(rank, world, seed):
    from ficco.backends.cpu import CpuBackend

    shards, bs, _, refs = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    real = CpuBackend.launch      # on serial over ccl: only the all-gather is launched
    with ficco.config.scope(transport="ccl"):     # (a fresh rank's first call: the default deadline)
        first = max_row_rel_err(ficco.all_gather_matmul(shards[rank], bs[0],
                                                        schedule="serial"), refs[0])
    with ficco.config.scope(transport="ccl", timeout=1):
        if rank == 1:
            # Passes the call check, then its host is late (8 s) enqueuing the plan's
            # all-gather: rank 0's comm queue waits in the collective past the deadline.
            def late(self, queue, fn):
                time.sleep(8)
                return real(self, queue, fn)
            CpuBackend.launch = late
        try:
            return first, _outcome(lambda: ficco.all_gather_matmul(shards[rank], bs[0],
                                                                  schedule="serial"))
        finally:
            CpuBackend.launch = real


def test_a_peer_late_inside_the_plan_on_ccl_is_named_with_the_step_at_the_deadline():
    results = harness.run_alone(2, _late_in_the_plan_on_ccl, random.randrange(1 << 30),
                                timeout_s=120)
    first, (kind, message, elapsed) = results[0]
    assert first <= 1e-4, results
    assert kind == "CommTimeoutError", results
    assert "rank 0" in message and "[1]" in message, results          # who: this rank, the peer
    assert "all_gather_matmul" in message and "serial" in message, results   # op, schedule
    assert "all-gather s0" in message and "queue comm" in message, results   # the plan step
    # At the deadline (1 s), plus the liveness check naming the peer (1 s), plus a grace.
    assert elapsed < 1 + 1 + _GRACE_S, results


def _explain_alone(rank, world, seed):
    shards, bs, _, _ = make_inputs(seed, world, (7, 8), (3,), torch.float32)
    if rank == 0:
        with ficco.config.scope(timeout=30):
            return _outcome(lambda: str(ficco.explain(shards[rank], bs[0])))
    return ("idle", None, 0.0)


def test_explain_on_one_rank_alone_does_not_communicate():
    results = harness.pool(2).run(_explain_alone, random.randrange(1 << 30), timeout_s=60)
    assert results[0][0] == "ok" and results[0][2] < 10, results


def _destroyed_group_threads(rank, world, seed):
    import gc
    import threading

    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    shards, bs, _, refs = make_inputs(seed, world, (6, 8), (3,), torch.float32)
    with ficco.config.scope(transport="dma"):
        err = max_row_rel_err(ficco.all_gather_matmul(shards[rank], bs[0], group,
                                                      schedule="ring"), refs[0])
    before = sorted(t.name for t in threading.enumerate() if t.name.startswith("ficco-"))
    dist.destroy_process_group(group)
    del group
    gc.collect()
    after = sorted(t.name for t in threading.enumerate() if t.name.startswith("ficco-"))
    return err, before, after


def test_queue_threads_end_with_their_group():
    results = harness.run_alone(2, _destroyed_group_threads, random.randrange(1 << 30))
    for err, before, after in results:
        assert err <= 1e-4 and before and after == [], results


def test_exit_right_after_a_caught_error_never_crashes():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "tests.exit_after_error", "skip", "6"],
                          capture_output=True, text=True, timeout=400, cwd=root, check=False)
    codes = proc.stdout.split("exitcodes", 1)[-1].split()
    assert proc.returncode == 0 and len(codes) == 12 and set(codes) == {"0"}, \
        (proc.stdout[-1000:], proc.stderr[-3000:])


# -- A rank that skips a backward never pairs its peers' backward with its
# own next forward -------------------------------------------------------------------------------
def _sp_mlp(seed, world, rank):
    """The SP MLP: a ColumnParallelLinear then a RowParallelLinear (16 -> 32 -> 16),
    their unsharded twins, and one batch (sequence 8)."""
    from torch import nn

    from ficco.nn import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(seed)
    up, down = nn.Linear(16, 32), nn.Linear(32, 16)
    col = ColumnParallelLinear.from_linear(up)
    row = RowParallelLinear.from_linear(down)
    return col, row, up, down


def _mlp_step(col, row, up, down, x, rank, world, backward=True):
    """One step of the sharded MLP on this rank's rows of ``x``: "wrong output", "wrong
    gradient" or "ok" against the unsharded twins (raises what ficco raises)."""
    loss = row(torch.relu(col(x.chunk(world)[rank]))).square().sum()
    ref = down(torch.relu(up(x))).chunk(world)[rank].square().sum()
    if abs(float(loss.detach()) - float(ref.detach())) > 1e-4 * abs(float(ref.detach())):
        return "wrong output"
    if not backward:
        return "ok"
    for p in (*col.parameters(), *row.parameters(), *up.parameters(), *down.parameters()):
        p.grad = None
    loss.backward()
    down(torch.relu(up(x))).square().sum().backward()
    pairs = [(col.weights[0].grad, up.weight.grad.chunk(world)[rank]),
             (col.biases[0].grad, up.bias.grad.chunk(world)[rank]),
             (row.weight.grad, down.weight.grad.chunk(world, dim=1)[rank]),
             (row.bias.grad, down.bias.grad)]        # all-reduced over the group
    for mine, want in pairs:
        if not torch.allclose(mine, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
            return "wrong gradient"
    return "ok"


def _skip_one_backward(rank, world, seed, transport, skip_step, backward_gather):
    col, row, up, down = _sp_mlp(seed, world, rank)
    outcomes = []
    with ficco.config.scope(transport=transport, timeout=20, backward_gather=backward_gather):
        for step in range(4):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed + step))
            skip = rank == 1 and step == skip_step    # e.g. `if torch.isfinite(loss):`
            try:
                outcome = _mlp_step(col, row, up, down, x, rank, world, backward=not skip)
            except Exception as exc:  # noqa: BLE001 - the test judges every kind
                outcome = f"{type(exc).__name__}: {exc}"     # caught: the loop goes on
            outcomes.append((step, "skipped backward" if skip else outcome))
        ficco.shutdown()       # every rank resets: the group is in step again
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed + 99))
        outcomes.append(("after", _mlp_step(col, row, up, down, x, rank, world)))
    ficco.shutdown()
    return outcomes


@pytest.mark.parametrize("transport, backward_gather", [("dma", "save"), ("ccl", "save"),
                                                        ("dma", "regather")])
def test_a_rank_that_skips_a_backward_makes_every_rank_raise_mismatch(transport,
                                                                      backward_gather):
    """Before: in the SP MLP the Row layer's backward (an all_gather_matmul) has the Column
    layer's forward signature, so rank 0's backward paired with rank 1's next forward: wrong
    gradients and outputs, nothing raised. Now the call's role is part of what ranks agree on:
    rank 0 raises in its backward of step 1, rank 1 in its forward of step 2, both
    MismatchError naming the roles. Both ranks catch it and go on, a step
    apart; before, the weight gradients of the next steps were wrong (rank 0's step 2 ran with
    rank 1's step 3). Now the MismatchError poisons the group: every later step raises
    PoisonedGroupError until ficco.shutdown() on every rank, then the next step is right."""
    results = harness.pool(2).run(_skip_one_backward, random.randrange(1 << 30), transport, 1,
                                  backward_gather)
    harness.check_skipped_backward(results)


# -- A call new to one rank while its peers repeat an agreed one -----------------
def _uneven_sequence_after_a_normal_step(rank, world, seed, transport):
    """seq 8 (4 rows each), then seq 9: rank 0's 5 rows are new to it, rank 1's 4 rows were
    agreed at the first call."""
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))
    outcomes = []
    with ficco.config.scope(transport=transport, timeout=20):
        for seq in (8, 9):
            x = torch.randn(seq, 16, generator=torch.Generator().manual_seed(seed + seq))
            outcomes.append(_outcome(lambda: max_row_rel_err(
                ficco.all_gather_matmul(x.tensor_split(world)[rank], w), x.double() @ w.double())))
        x = torch.randn(8, 16)
        outcomes.append(_outcome(lambda: ficco.all_gather_matmul(x.chunk(world)[rank], w)))
        ficco.shutdown()             # every rank resets: in step again
        outcomes.append(_outcome(lambda: ficco.all_gather_matmul(x.chunk(world)[rank], w)))
    ficco.shutdown()
    return outcomes


@pytest.mark.parametrize("transport", ["dma", "ccl"])
def test_a_call_new_to_one_rank_while_its_peer_repeats_an_agreed_one_is_a_fast_mismatch(
        transport):
    """Before: rank 0 (new shape) waited in the first-call exchange while rank 1 (agreed
    shape) waited in its call check: both timed out at FICCO_TIMEOUT (20 s here), without
    shapes. Now rank 1's waiting check answers rank 0's exchange: MismatchError on both,
    naming both shard shapes, well before the deadline; the next call is refused until every
    rank called ficco.shutdown(), then runs."""
    results = harness.pool(2).run(_uneven_sequence_after_a_normal_step,
                                  random.randrange(1 << 30), transport)
    for first, uneven, refused, after in results:
        assert first[0] == "ok" and first[1] <= 1e-4, results
        kind, message, seconds = uneven
        assert kind == "MismatchError" and "(5, 16)" in message and "(4, 16)" in message, \
            results
        assert seconds < 10, results      # a bound far below FICCO_TIMEOUT, not a speed
        assert refused[0] == "PoisonedGroupError", results   
        assert after[0] == "ok", results


# -- Queue threads end with the default group too ---------------------------------
def _destroyed_default_group_threads(rank, world, seed):
    import gc
    import threading

    import torch.distributed as dist

    shards, bs, _, refs = make_inputs(seed, world, (6, 8), (3,), torch.float32)
    with ficco.config.scope(transport="dma"):
        err = max_row_rel_err(ficco.all_gather_matmul(shards[rank], bs[0], schedule="ring"),
                              refs[0])
    before = sorted(t.name for t in threading.enumerate() if t.name.startswith("ficco-"))
    dist.destroy_process_group()
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = sorted(t.name for t in threading.enumerate() if t.name.startswith("ficco-"))
        if not after:
            break
        time.sleep(0.1)
    return err, before, after


def test_queue_threads_end_with_the_default_group():
    """Before: they outlived `dist.destroy_process_group()` (only groups made by new_group
    took them along)."""
    results = harness.run_alone(2, _destroyed_default_group_threads, random.randrange(1 << 30))
    for err, before, after in results:
        assert err <= 1e-4 and before and after == [], results
