"""The one-kernel all-reduce (``one-shot-kernel``, ``two-shot-kernel``) of matmul_all_reduce:
exact against float64 on CPU ranks through Triton's interpreter (W 2, 3, 4, 8; fp32, bf16; sum
and avg; bias; several b; the same bits on every rank), a late or dead peer raising within
FICCO_TIMEOUT (never data), a peer in another call, a call new to one rank, the plans'
barrier channels, and the schedules' gating."""
from __future__ import annotations

import random

import pytest
import torch

from ficco import kernels, schedules
from ficco.ops.matmul_all_reduce.schedules.kernel import ShotAllReduce
from ficco.plan import Barrier
from ficco.plan.problem import Problem

from ... import harness
from ...ar_cases import run_grid

pytestmark = pytest.mark.skipif(
    kernels.triton_reason() is not None or kernels.interpreter_reason() is not None,
    reason="needs Triton's interpreter")

OP = "matmul_all_reduce"
KERNELS = ("one-shot-kernel", "two-shot-kernel")


def _cases(world):
    """Each kernel at W = 2: two shapes x fp32/bf16, avg with a bias, several b (two
    launches: two-shot's channels); at W = 3, 4: one of bf16 and fp32 rows < W each, avg with
    a bias; at W = 8 (slow in the interpreter on 2 cores) one bf16 avg-with-bias case each."""
    bias = [{"schedule": s, "transport": "dma", "shape": 1, "reduce_op": "avg", "bias": True,
             "dtype": torch.bfloat16} for s in KERNELS]
    if world == 8:
        return bias
    grid = [{"schedule": "one-shot-kernel", "transport": "dma", "shape": 0,
             "dtype": torch.bfloat16},
            {"schedule": "two-shot-kernel", "transport": "dma", "shape": 2,
             "dtype": torch.float32}]
    if world == 2:
        grid += [{"schedule": s, "transport": "dma", "shape": sh, "dtype": d}
                 for s, sh, d in (("two-shot-kernel", 0, torch.bfloat16),
                                  ("one-shot-kernel", 2, torch.float32))]
        grid += [{"schedule": s, "transport": "dma", "shape": sh, "dtype": d}
                 for s in KERNELS for sh, d in ((0, torch.float32), (3, torch.float32))]
    return grid + bias


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_kernels_match_float64_and_are_the_same_on_every_rank(world):
    seed = random.randrange(1 << 30)
    failures = harness.pool(world).run(run_grid, seed, _cases(world), timeout_s=600)
    assert failures == [[]] * world, f"seed {seed}: {failures}"


# -- plans --------------------------------------------------------------------------------------
def _kernel_channels(plan) -> list[int]:
    """Every barrier channel of ``plan`` in order, the kernels' own included."""
    channels = []
    for op in plan.ops:
        if isinstance(op, Barrier):
            channels.append(op.channel)
        elif isinstance(op, ShotAllReduce):
            for i in range(op.barriers):
                channels.append((op.first_channel + i) % 2)
    return channels


@pytest.mark.parametrize("name", KERNELS)
def test_barrier_channels_alternate_and_end_on_one(name):
    for ns in ((5,), (5, 3), (4, 3, 2)):
        p = Problem(7, 6, ns, "float32", 3, 1, op=OP)
        channels = _kernel_channels(schedules.get(name, op=OP).plan(p, "dma"))
        assert channels == [i % 2 for i in range(len(channels))] and channels[-1] == 1, \
            (ns, channels)


def test_kernel_schedules_are_optional_and_dma_only():
    assert set(KERNELS) <= set(schedules.optional_names(op=OP))
    assert not set(KERNELS) & set(schedules.names(op=OP))
    assert set(KERNELS) <= set(schedules.unavailable("cpu", op=OP))   # interpreter only
    assert "interpreter" in schedules.unavailable("cpu", op=OP)["one-shot-kernel"]
    # not verified on a GPU yet: selectors leave them out there too, forcing runs them
    assert "not been verified" in schedules.unavailable("cuda:sm_90", op=OP)["two-shot-kernel"]
    assert schedules.why_not_here("one-shot-kernel", "cuda:sm_90", op=OP) is None
    assert "dma" in schedules.why_not_here("one-shot-kernel", "cuda:sm_90", "ccl", op=OP)
    p = Problem(4, 6, (5,), "float32", 2, 0, op=OP, bias=True)
    assert schedules.epilogue_reason("one-shot-kernel", p) is None   # a library GEMM's epilogue


# -- faults ------------------------------------------------------------------------------------
TIMEOUT_S = 3.0


@pytest.mark.parametrize("name", KERNELS)
def test_a_late_peer_makes_every_rank_raise_within_the_timeout(name):
    """The last rank arrives past FICCO_TIMEOUT: the others' kernels give up at the first
    barrier (to them it is a dead peer), the late one's at the closing one (a peer that gave
    up sends no more flags); nobody returns data, and after ficco.shutdown() the group is
    right again."""
    from ...ar_kernel_cases import late_peer

    seed = random.randrange(1 << 30)
    own = harness.pool(3, {**harness.DEFAULT_ENV, "FICCO_TIMEOUT": str(TIMEOUT_S)})
    results = own.run(late_peer, seed, name, 2 * TIMEOUT_S + 1, timeout_s=120)
    for outcome, took, after in results:
        assert outcome == "CommTimeoutError", results
        assert took < 4 * TIMEOUT_S, results      # bounded (loaded 2-core box: slack)
        assert after < 1e-5, results


def test_a_peer_in_another_call_is_a_mismatch_on_every_rank():
    """Both shapes agreed and cached, then rank 0 makes the other call: the kernel's first
    barrier finds the other call's flag in a peer's slot (a MismatchError on every rank; the
    wait is the same code in both kernels)."""
    from ...ar_cases import disagree_on_cached_shapes

    name = "one-shot-kernel"
    for small, large, mismatched, refused, again in harness.pool(3).run(
            disagree_on_cached_shapes, random.randrange(1 << 30), name):
        assert small < 1e-5 and large < 1e-5 and again < 1e-5, (name, small, large, again)
        assert mismatched == "mismatch", (name, mismatched)
        assert refused == "refused", (name, refused)


# -- torch's kernels as candidates -------------------------------------------------------------
TORCH = ("torch-one-shot", "torch-two-shot", "torch-multimem")


def test_torch_kernels_are_gated_where_they_cannot_run():
    from ficco.ops.matmul_all_reduce.schedules.torch_kernels import torch_reason

    assert set(TORCH) <= set(schedules.optional_names(op=OP))
    for name in TORCH:
        assert "CUDA" in schedules.why_not_here(name, "cpu", op=OP)
        assert "CUDA" in schedules.why_not_here(name, "rocm:gfx942", op=OP)
        assert "dma" in schedules.why_not_here(name, "cuda:sm_90", "ccl", op=OP)
        assert name in schedules.unavailable("cuda:sm_90", op=OP)    # never run on a GPU yet
    assert "NVLink SHARP" in torch_reason("multimem", "cuda:sm_80")
    assert torch_reason("one-shot", "cuda:sm_80") is None            # the op is in this torch


def test_torch_kernels_plumbing_with_stand_ins_on_cpu_ranks():
    """What runs around torch's kernels (nothing of torch's kernels runs on CPU)."""
    from ...ar_kernel_cases import torch_plumbing

    cases = [{"schedule": s, "transport": "dma", "shape": 3, "dtype": torch.bfloat16}
             for s in TORCH]
    cases += [{"schedule": "torch-one-shot", "transport": "dma", "shape": 0, "reduce_op": "avg",
               "bias": True}]
    seed = random.randrange(1 << 30)
    for failures, calls in harness.pool(2).run(torch_plumbing, seed, cases):
        assert failures == [], (seed, failures)
        assert calls == [("multimem_all_reduce_", "sum", True, False),
                         ("one_shot_all_reduce_out", "sum", True, True),
                         ("two_shot_all_reduce_out", "sum", True, True)], calls


# -- explain ------------------------------------------------------------------------------------
def test_explain_of_a_decode_shape_names_its_kernel_and_the_published_time():
    from ficco.heuristics.decision import Decision
    from ficco.heuristics.reductions import priced_against

    from ...ar_kernel_cases import explain_decode

    p = Problem(16, 512, (4096,), "bfloat16", 8, op=OP)     # 128 KB per rank
    for profile, schedule, transport, kernel, row in (
            ("h100", "serial", "ccl", "NCCL/RCCL", "W4"),
            ("mi355x", "two-shot-kernel", "dma", "two-shot", "W43"),
            ("h100", "torch-one-shot", "dma", "one_shot_all_reduce_out", "W25")):
        lines = priced_against(p, Decision(schedule, transport, "model", {"profile": profile}))
        assert kernel in lines[0] and "128 KB per rank on 8 ranks" in lines[0], lines
        assert f"(validate row {row}," in lines[1], lines
    text = harness.pool(2).run(explain_decode, "h100")[0]
    assert "priced    " in text and "2 ranks" in text, text
    assert "one-shot-kernel would run ficco's one-kernel all-reduce" in text, text


def test_the_decode_example_runs_on_the_one_kernel_all_reduce():
    """examples/tp_decode.py with its row-parallel projections forced to one-shot-kernel
    (2 ranks, through the interpreter), against the unsharded block."""
    from ...ar_cases import decode_example

    seed = random.randrange(1 << 30)
    for errors in harness.pool(2).run(decode_example, seed, "one-shot-kernel"):
        assert max(errors) <= 1e-5, (seed, errors)


def test_kernels_on_the_fake_gpu_match_float64():
    """The GPU path of the launch (device-address pads, the group's error word as halt, the
    error word checked behind the launch) on the fake GPU."""
    from ...ar_kernel_cases import on_fake_gpu

    seed = random.randrange(1 << 30)
    # the fake-GPU fault tests' kind of pool (their env): its ranks keep the fake device
    for errors in harness.pool(2, {"FICCO_TIMEOUT": "20"}).run(
            on_fake_gpu, seed, list(KERNELS), timeout_s=300):
        assert max(errors.values()) < 1e-5, (seed, errors)


@pytest.mark.parametrize("name", KERNELS)
def test_a_call_new_to_one_rank_while_its_peers_wait_in_the_kernel_is_a_fast_mismatch(name):
    """Rank 0's call is new to it (its first-call exchange) while its peers repeat an agreed
    one and wait in the kernel's first barrier (one-shot-kernel has no plan barrier before
    it): the waiting ranks answer rank 0's exchange, a MismatchError naming both shapes on
    every rank well before FICCO_TIMEOUT (20 s), never data; the next call is refused until
    every rank called ficco.shutdown(), then it is exact."""
    from ...ar_kernel_cases import new_to_one_rank

    seed = random.randrange(1 << 30)
    results = harness.pool(2).run(new_to_one_rank, seed, name, 20.0, timeout_s=120)
    for first, uneven, refused, after in results:
        assert first < 1e-5 and after < 1e-5, (seed, results)
        kind, message, seconds = uneven
        assert kind == "MismatchError", results
        assert "rows m=6" in message and "rows m=5" in message, results
        assert seconds < 10, results       # a bound far below FICCO_TIMEOUT, not a speed
        assert refused == "PoisonedGroupError", results


def test_on_the_fake_gpu_a_call_new_to_one_rank_while_its_peer_waits_in_the_kernel_is_a_mismatch():
    """The GPU path of the same case (the launch returns at once; the kernel waits on the
    device): a thread beside the launch answers rank 0's exchange, so rank 0 raises a
    MismatchError naming both shapes well before FICCO_TIMEOUT (15 s), and rank 1, whose
    kernel the answer halted, returns NaN (never data) and raises that MismatchError at its
    next call; after ficco.shutdown() the call is exact."""
    from ...ar_kernel_cases import new_to_one_rank_on_fake_gpu

    seed = random.randrange(1 << 30)
    (uneven0, following0, after0), (uneven1, following1, after1) = harness.pool(
        2, {"FICCO_TIMEOUT": "20"}).run(new_to_one_rank_on_fake_gpu, seed, "one-shot-kernel",
                                        15.0, timeout_s=300)
    results = (uneven0, following0, uneven1, following1)
    for kind, message, _, _ in (uneven0, following1):
        assert kind == "MismatchError", results
        assert "rows m=6" in message and "rows m=5" in message, results
    assert uneven1[0] == "ok" and uneven1[3] is True, results      # NaN, never data
    assert following0[0] == "PoisonedGroupError", results
    assert max(r[2] for r in results) < 10, results   # far below FICCO_TIMEOUT, not a speed
    assert after0 < 1e-5 and after1 < 1e-5, (seed, results)
