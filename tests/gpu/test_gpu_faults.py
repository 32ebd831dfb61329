"""The fault tests on a real GPU: the rank functions of tests/engine/test_gpu_faults.py
(tests/fault_cases.py), unchanged, on several processes sharing one GPU, with
CUDA_DEVICE_MAX_CONNECTIONS 1 and 8 set before CUDA starts, host-mapped (default) and device
signal pads. ``bash bench/gpu_lease.sh`` runs them (its GPU suite part)."""
from __future__ import annotations

import random

import pytest

from .. import fault_cases as cases
from .. import harness
from .conftest import gpu_backend_name

pytestmark = pytest.mark.gpu

T = 1.0


def _pool(connections=8, world=3):
    return harness.pool(world, {"FICCO_TEST_REAL_GPU": "1", "FICCO_TIMEOUT": "30",
                                "CUDA_DEVICE_MAX_CONNECTIONS": str(connections)})


def _tag():
    return random.randrange(1 << 40)


@pytest.mark.parametrize("connections,env", [(8, {}), (1, {}), (8, {"FICCO_SIGNAL_PADS": "device"})],
                         ids=["connections-8-host-pads", "connections-1-host-pads",
                              "connections-8-device-pads"])
def test_a_stalled_rank_is_released_and_named_on_gpu(connections, env):
    results = _pool(connections).run(cases.stalled_peer, _tag(), gpu_backend_name(), 8, env,
                                     "ring", 1, T, timeout_s=150)
    for seconds, poisoned, nxt, _, _ in results[:-1]:
        assert seconds != "hung" and seconds < 2.5 * T + 3, results
        assert poisoned and nxt.startswith("CommTimeoutError") and "[2]" in nxt, results


@pytest.mark.parametrize("schedule,calls", [("ring", 4), ("gated-1d", 2)])
def test_barriers_queued_behind_a_dead_peer_are_released_at_once_on_gpu(schedule, calls):
    results = _pool().run(cases.stalled_peer, _tag(), gpu_backend_name(), 8, {}, schedule,
                          calls, T, timeout_s=150)
    for seconds, poisoned, nxt, _, outcomes in results[:-1]:
        assert seconds != "hung" and seconds < 2.5 * T + 3, results
        assert poisoned and "[2]" in nxt and outcomes["expired"] <= 1, results


def test_a_timeout_on_one_group_leaves_another_group_alone_on_gpu():
    results = _pool().run(cases.two_groups, _tag(), T, timeout_s=150)
    for rank, (b_errors, b_next, a_next) in enumerate(results):
        assert all(e <= 1e-4 for e in b_errors), (rank, results)
        assert isinstance(b_next, float) and b_next <= 1e-4, (rank, results)
        if rank < 2:
            assert a_next.startswith("CommTimeoutError") and "[2]" in a_next, (rank, results)


def test_a_captured_graph_replays_right_after_shutdown_on_gpu():
    if gpu_backend_name() == "rocm":
        pytest.skip("HIP cannot capture stream memory operations: refused before capture")
    for errors in _pool().run(cases.replay_after_shutdown, random.randrange(1 << 20),
                              timeout_s=150):
        assert all(isinstance(e, float) and e <= 1e-4 for e in errors), errors


def test_a_late_peer_never_pulls_rows_of_the_next_call_on_gpu():
    results = _pool().run(cases.late_peer, _tag(), T, timeout_s=150)
    assert results[:-1] == ["ok"] * 2, results
    assert results[-1] == "NaN" or "gave up" in results[-1], results


def test_gated_gemm_runs_with_one_hardware_queue_on_gpu():
    names = ["gated-1d", "gated-2d"]
    for errors in _pool(connections=1).run(cases.gated_with_one_hardware_queue, names, 5.0,
                                           timeout_s=200):
        assert all(isinstance(errors[n], float) and errors[n] <= 1e-4 for n in names), errors
