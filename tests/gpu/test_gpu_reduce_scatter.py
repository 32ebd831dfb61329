"""matmul_reduce_scatter with several ranks sharing ONE GPU (IPC symmetric memory, gloo):
every schedule x transport x W x dtype against float64, avg, and CUDA-graph replay.
Correctness only: timings here mean nothing."""
from __future__ import annotations

import pytest

from ficco import schedules

from .. import harness
from . import gpu_rs_cases

pytestmark = pytest.mark.gpu

GPU_ENV = {"FICCO_TIMEOUT": "30"}
NAMES = schedules.names(op="matmul_reduce_scatter")


@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
@pytest.mark.parametrize("transport", ("dma", "ccl"))
@pytest.mark.parametrize("schedule", NAMES)
@pytest.mark.parametrize("world", (1, 2, 4))
def test_schedule_on_gpu(world, schedule, transport, dtype):
    if world == 1 and transport == "ccl":
        pytest.skip("world size 1 is a plain matmul: no transport")
    seed = hash((world, schedule, transport, dtype)) % 10_000
    failures = harness.pool(world, GPU_ENV).run(gpu_rs_cases.schedule_case, schedule,
                                                transport, dtype, seed, timeout_s=120)
    assert failures == [[]] * world


@pytest.mark.parametrize("schedule", ("serial", "ring", "hetero-fused-1d", "uniform-fused-2d"))
def test_avg_on_gpu(schedule):
    failures = harness.pool(2, GPU_ENV).run(gpu_rs_cases.schedule_case, schedule, "dma",
                                            "float32", 7, "avg", timeout_s=120)
    assert failures == [[]] * 2


@pytest.mark.parametrize("schedule", ("serial", "ring", "uniform-fused-1d", "hetero-fused-2d"))
@pytest.mark.parametrize("world", (2, 4))
def test_graph_captured_call_replays_correctly(world, schedule):
    seed = hash((world, schedule)) % 10_000
    failures = harness.pool(world, GPU_ENV).run(gpu_rs_cases.capture_replay, schedule, seed,
                                                timeout_s=180)
    assert failures == [[]] * world
