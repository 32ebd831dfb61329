"""The GPU backend's failure handling, multi-rank on the CPU. ``GpuBackend`` itself
(queues, events, barriers, watchdog, error words, fence) runs over the fake GPU of
``tests/fake_gpu.py``: streams on host-thread hardware queues with head-of-line blocking,
stream memory operations over host memory, IPC memory in /dev/shm."""
from __future__ import annotations

import random
import threading

import pytest

from .. import fault_cases as cases
from .. import harness

T = 1.0     # FICCO_TIMEOUT of the failing calls, seconds


def _pool(world=3):
    return harness.pool(world, {"FICCO_TIMEOUT": "20"})


def _tag():
    return random.randrange(1 << 40)


# -- finding 2: the rescue of a stuck stream must not go through a stream ------------------------
@pytest.mark.parametrize("vendor,hw_queues,env", [
    ("rocm", 2, {}),                                          # ROCm: few hardware queues
    ("cuda", 1, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),       # Megatron's setting
    ("cuda", 8, {}),
    ("cuda", 8, {"FICCO_SIGNAL_PADS": "device"}),          # asked for: reads are async
], ids=["rocm-2-queues", "cuda-connections-1", "cuda-connections-8", "cuda-8-device-pads"])
def test_a_dead_peer_is_released_without_a_stream_and_the_watchdog_never_blocks(
        vendor, hw_queues, env):
    results = _pool().run(cases.stalled_peer, _tag(), vendor, hw_queues, env, "ring", 1, T,
                          timeout_s=90)
    for seconds, poisoned, nxt, blocked, _ in results[:-1]:
        assert seconds != "hung", results           # the device drained: the stream was freed
        assert poisoned, results                     # the released call's outputs are NaN
        assert nxt.startswith("CommTimeoutError") and "[2]" in nxt, results
        assert blocked == [], results                # no Stream/Event/device synchronize
    assert results[-1] == "stalled"


# -- finding 3: one FICCO_TIMEOUT per dead peer, not one per queued barrier -------------------
@pytest.mark.parametrize("schedule,calls", [("ring", 4), ("gated-1d", 2)])
def test_barriers_queued_behind_a_dead_peer_are_released_at_once(schedule, calls):
    """``calls`` calls queued behind a dead peer (2 barriers each): the device drains about
    one FICCO_TIMEOUT after the first barrier, not 2 * calls of them (as it did)."""
    results = _pool().run(cases.stalled_peer, _tag(), "cuda", 8, {}, schedule, calls, T,
                          timeout_s=120)
    for seconds, poisoned, nxt, blocked, outcomes in results[:-1]:
        assert seconds != "hung" and seconds < 2.5 * T + 1.0, results
        assert poisoned and "[2]" in nxt, results
        assert outcomes["expired"] <= 1, results          # one deadline, the rest released
        assert outcomes["expired"] + outcomes["released"] >= 2 * calls - 1, results


# -- finding 5: failures stay in their group ---------------------------------------------------
def test_a_timeout_on_one_group_leaves_another_groups_results_and_calls_alone():
    results = _pool().run(cases.two_groups, _tag(), T, timeout_s=120)
    for rank, (b_errors, b_next, a_next) in enumerate(results):
        assert all(e <= 1e-4 for e in b_errors), (rank, results)    # not NaN, not raised
        assert isinstance(b_next, float) and b_next <= 1e-4, (rank, results)
        if rank < 2:
            assert a_next.startswith("CommTimeoutError") and "[2]" in a_next, (rank, results)


# -- finding 6: no read of freed memory, no stale pull ---------------------------------------------
def test_a_captured_graph_replays_right_after_shutdown():
    results = _pool().run(cases.replay_after_shutdown, random.randrange(1 << 20), timeout_s=120)
    for errors in results:
        assert all(isinstance(e, float) and e <= 1e-4 for e in errors), results


@pytest.mark.parametrize("env", [{}, {"FICCO_SIGNAL_PADS": "device"}],
                         ids=["host-pads", "device-pads"])
def test_a_late_peer_never_pulls_rows_of_the_next_call(env):
    """Device pads too: their error words live in host memory as well, so the
    rank that gives up raises the late peer's word."""
    results = _pool().run(cases.late_peer, _tag(), T, env, timeout_s=120)
    for drained in results[:-1]:
        assert drained == "ok", results
    late = results[-1]
    assert late == "NaN" or late.startswith("CommTimeoutError"), results
    assert "gave up" in late or late == "NaN", results


# -- finding 7: HIP capture refused before anything is captured -------------------------------------
def test_hip_capture_is_refused_before_it_begins():
    for outcome, nodes, invalidated, err in _pool().run(
            cases.hip_capture_is_refused_before_it_begins, timeout_s=120):
        assert "cannot capture cross-rank barriers" in outcome, outcome
        assert nodes == 0 and invalidated is None, (nodes, invalidated)
        assert err <= 1e-4


# -- finding 1: the gated GEMM is launched after the copies it waits for ------------------------
def test_gated_gemm_never_waits_in_front_of_its_own_copies():
    names = ["gated-1d", "gated-2d"]
    for errors in _pool().run(cases.gated_with_one_hardware_queue, names, 3.0, timeout_s=180):
        assert all(isinstance(errors[n], float) and errors[n] <= 1e-4 for n in names), errors


# -- The gated GEMM's wait is timed, not counted -----------------------------------
def test_gated_gemm_waits_for_a_peer_late_inside_the_timeout():
    """A peer 1.5 s late under FICCO_TIMEOUT = 6 s: both gated schedules give exact results on
    every rank, and the next call is clean (the tiles used to give up after a guessed number
    of polls and leave C holding stale values, with nothing raised)."""
    names = ["gated-1d", "gated-2d"]
    for errors in _pool().run(cases.late_within_timeout, names, 1.5, 6.0, timeout_s=240):
        for n in names:
            assert isinstance(errors[n], float) and errors[n] <= 1e-4, errors
            assert errors[n + " next"] == "ok", errors


@pytest.mark.parametrize("name", ["gated-1d", "gated-2d"])
def test_a_gated_gemm_that_gives_up_poisons_its_own_call(name):
    """Rank 0's kernel waits its deadline for a flag that never comes: that call's outputs
    are all NaN (the kernel raised the group's word, the fence saw it) and the next call
    raises, naming the gated GEMM; the other ranks' calls are right."""
    results = _pool().run(cases.gated_kernel_gives_up, name, 1.0, timeout_s=180)
    drained, all_nan, nxt = results[0]
    assert drained == "ok" and all_nan, results
    assert nxt.startswith("CommTimeoutError") and "gated GEMM" in nxt, results


def test_a_capture_that_must_allocate_is_refused_before_it_begins():
    """The capture used to die with an opaque error (a synchronize and an
    allocation inside it); now a clear refusal, nothing captured, the capture intact."""
    outcomes, error = zip(*_pool().run(cases.capture_that_must_allocate, timeout_s=120))
    for rank_outcomes in outcomes:
        for outcome, nodes, invalidated in rank_outcomes:
            assert "graph capture" in outcome and "eagerly" in outcome, rank_outcomes
            assert nodes == 0 and invalidated is None, rank_outcomes
    assert all(e <= 1e-4 for e in error), error


def test_ranks_sharing_a_gpu_share_the_gated_grids_reserve():
    """W ranks on one GPU each launched a persistent grid of all but 1/32 of its
    compute units: together they filled every unit, so the kernels that raise flags could not
    run. The units left to the gated GEMMs are now split between the ranks on the device."""
    from ficco.kernels import configs

    results = _pool().run(cases.gated_grid_of_shared_gpu, "gated-1d", timeout_s=180)
    grids = [g for rank_grids, _ in results for g in rank_grids]
    assert len(grids) == 3 and all(g is not None and g >= 1 for g in grids), results
    assert sum(grids) <= configs.resident_programs(16), results     # the fake GPU's 16 SMs
    assert all(err <= 1e-4 for _, err in results), results


@pytest.mark.parametrize("env", [{}, {"FICCO_SIGNAL_PADS": "device"}],
                         ids=["host-pads", "device-pads"])
def test_the_gpu_suites_peer_view_check_holds_for_either_pads(env):
    """The GPU suite's check took every pad for GPU memory at its slot address,
    so host pads (the default) failed it on every GPU; it runs here first."""
    for bad, seen in _pool(2).run(cases.peer_views, env, timeout_s=120):
        assert bad == [] and seen, bad


def test_host_pads_of_a_gpu_handle_are_views_and_a_copy_is_caught():
    """What a real GPU shows and the fake cannot (its device is the CPU): host pads beside
    data spans on ``cuda:0`` are views; a pad that is a copy is named."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from ficco.symm_mem.device import GpuSymmHandle, is_view_of

    arrays = [np.zeros(9, np.int32) for _ in range(2)]
    pads = [torch.from_numpy(a[:8]).view(4, 2) for a in arrays]
    handle = SimpleNamespace(
        world=2, backend=SimpleNamespace(device=lambda: torch.device("cuda", 0)),
        _spans=[SimpleNamespace(data_ptr=lambda: 0x1000, device=torch.device("cuda", 0))] * 2,
        _pads=pads, host_pads=SimpleNamespace(arrays=arrays,
                                              device=[a.ctypes.data for a in arrays]),
        slot=lambda owner, channel, writer: arrays[owner].ctypes.data + 4 * (channel * 2 + writer))
    # the old check (a GPU view at the slot address) calls every host pad a copy
    assert not any(is_view_of(pads[p], handle.slot(p, 0, 0), torch.device("cuda", 0))
                   for p in range(2))
    assert GpuSymmHandle.view_problems(handle) == []
    handle._pads = [pads[0], pads[1].clone()]
    assert GpuSymmHandle.view_problems(handle) == ["rank 1's host pad is not a view of its mapping"]


def test_the_fake_device_frees_a_host_tasks_tensors_only_when_every_queue_is_idle():
    """The fake GPU models a caching allocator: a tensor a host task closed over is not handed
    back while another queue may still read it by address (a prepared copy). With the CPU
    allocator's immediate reuse, rs-ag over ccl read another allocation's bytes under load
    (selftest FAIL, error 0.1 - 1e32 on the fake GPU only)."""
    import gc
    import weakref

    import torch

    from .. import fake_gpu

    device = fake_gpu.install("cuda", 8)
    try:
        a, b = fake_gpu.FakeStream(device), fake_gpu.FakeStream(device)
        gate = threading.Event()
        t = torch.randn(64)
        alive = weakref.ref(t)
        a.enqueue(lambda held=t: held.sum())             # a host task holding t
        b.enqueue(lambda: gate.wait(10))                # another queue, still busy
        del t
        a.synchronize()
        gc.collect()
        assert alive() is not None, "freed while queue b may still read it"
        gate.set()
        device.synchronize()
        gc.collect()
        assert alive() is None, "kept after every queue went idle"
    finally:
        fake_gpu.uninstall()


def test_a_workspace_one_rank_cannot_close_is_kept_by_every_rank():
    """Closing a GPU workspace is collective (its release is an exchange): when one rank must
    keep its old workspace at a growth, every rank keeps it, and the grown calls are right.
    Before, rank 0 allocated while rank 1 ran the release: both timed out."""
    for errors in harness.pool(2, {"FICCO_TIMEOUT": "20"}).run(
            cases.one_rank_cannot_close_its_workspace, random.randrange(1 << 20), timeout_s=120):
        assert max(errors) <= 1e-5, errors
