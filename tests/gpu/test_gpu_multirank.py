"""Several ranks sharing ONE GPU (separate processes, gloo process group, IPC symmetric memory):
raw pulls, the barrier deadline, and every schedule x transport x W x dtype through
``ficco.all_gather_matmul`` against float64. Correctness only: timings here mean nothing."""
from __future__ import annotations

import pytest

from ficco import schedules

from .. import harness
from . import gpu_cases

pytestmark = pytest.mark.gpu

WORLDS = (1, 2, 4)
GPU_ENV = {"FICCO_TIMEOUT": "30"}


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("m,k", [(8, 32), (13, 10)])
def test_ipc_pull_rows_and_columns(world, m, k):
    wrong = harness.pool(world, GPU_ENV).run(gpu_cases.ipc_pull, m, k, timeout_s=120)
    assert wrong == [0] * world


def test_stalled_peer_raises_instead_of_hanging():
    results = harness.pool(2, GPU_ENV).run(gpu_cases.stalled_peer, 1.0, timeout_s=120)
    assert "rank(s) [1]" in results[0] and "step 5" in results[0], results


@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
@pytest.mark.parametrize("transport", ("dma", "ccl"))
@pytest.mark.parametrize("schedule", schedules.names())
@pytest.mark.parametrize("world", WORLDS)
def test_schedule_on_gpu(world, schedule, transport, dtype):
    if world == 1 and transport == "ccl":
        pytest.skip("world size 1 is a plain matmul: no transport")
    seed = hash((world, schedule, transport, dtype)) % 10_000
    failures = harness.pool(world, GPU_ENV).run(gpu_cases.schedule_case, schedule, transport,
                                                dtype, seed, timeout_s=120)
    assert failures == [[]] * world


@pytest.mark.parametrize("schedule", ("serial", "ring", "uniform-fused-1d", "hetero-fused-2d"))
@pytest.mark.parametrize("world", (2, 4))
def test_graph_captured_call_replays_correctly(world, schedule):
    seed = hash((world, schedule)) % 10_000
    failures = harness.pool(world, GPU_ENV).run(gpu_cases.capture_replay, schedule, seed,
                                                timeout_s=180)
    assert failures == [[]] * world


# -- The GPU backends' multi-rank cases --------------------------------------------------------------------------------------
from . import gpu_fault_cases


def test_peer_views_are_views_not_copies():
    for bad, seen in harness.pool(2, GPU_ENV).run(gpu_fault_cases.peer_views_are_views):
        assert bad == [] and seen


def test_a_captured_graph_survives_workspace_growth():
    failures = harness.pool(2, GPU_ENV).run(gpu_fault_cases.capture_then_grow_then_replay, 7,
                                            timeout_s=180)
    assert failures == [[]] * 2


def test_disagreement_on_a_cached_shape_raises_on_every_rank_on_gpu_dma():
    """The barrier's call flag catches ranks making different calls on GPU dma."""
    results = harness.pool(2, GPU_ENV).run(gpu_fault_cases.disagreement_on_a_cached_shape, 5,
                                           timeout_s=180)
    for small, large, (outcome, poisoned), *after in results:
        assert small <= 1e-4 and large <= 1e-4, results
        assert outcome.startswith("MismatchError") and poisoned, results
        assert float(outcome.split("after ")[1].split("s:")[0]) < 10, results   # a peek
        assert isinstance(after[-1], float) and after[-1] <= 1e-4, results


def test_a_failing_rank_makes_every_rank_raise():
    results = harness.pool(2, GPU_ENV).run(gpu_fault_cases.failing_rank_makes_everyone_raise, 11,
                                           timeout_s=120)
    for failed, err in results:
        assert failed != "returned" and err <= 1e-4, results
    assert "injected GEMM failure" in results[1][0]


def test_an_input_on_another_gpu_is_refused():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two visible GPUs")
    for message in harness.pool(1, GPU_ENV).run(gpu_fault_cases.wrong_device_is_refused):
        assert "torch.cuda.set_device" in message, message


@pytest.mark.parametrize("schedule", ("serial", "ring", "uniform-fused-1d", "hetero-unfused-2d"))
def test_schedules_with_host_signal_pads(schedule):
    """FICCO_SIGNAL_PADS=host: barrier flags in host-mapped memory, results against float64."""
    env = {**GPU_ENV, "FICCO_SIGNAL_PADS": "host"}
    failures = harness.pool(2, env).run(gpu_cases.schedule_case, schedule, "dma", "bfloat16",
                                        5, timeout_s=120)
    assert failures == [[]] * 2
