"""What a rank supplies on its own: fp8 scales drawn per rank, the all-reduce's fp8 partials,
a bias that differs across ranks, fp8 scales that require grad; every schedule of the op on
both transports, against float64 (rank-side functions: tests/per_rank_cases.py)."""
from __future__ import annotations

import random

import pytest
import torch

from ficco import schedules

from .. import harness
from ..per_rank_cases import ag_own_scales, ar_bias_per_rank, ar_fp8_partials, scales_with_grad

TRANSPORTS = ("dma", "ccl")


def _cases(op: str, **extra) -> list[dict]:
    return [{"schedule": name, "transport": t, **extra}
            for name in schedules.names(op=op) for t in TRANSPORTS]


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_wise_scales_of_each_rank_travel_with_its_shard(world):
    cases = [dict(c, m=(3, 5)[i % 2]) for i, c in enumerate(_cases("all_gather_matmul"))]
    for failures in harness.pool(world).run(ag_own_scales, random.randrange(1 << 30), cases):
        assert failures == []


def test_all_reduce_fp8_partials_travel_in_float32_and_round_once():
    cases = _cases("matmul_all_reduce")
    for failures in harness.pool(3).run(ar_fp8_partials, random.randrange(1 << 30), cases):
        assert failures == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bias_that_differs_across_ranks_is_refused_on_every_rank(dtype):
    cases = _cases("matmul_all_reduce", dtype=dtype)
    for failures in harness.pool(2).run(ar_bias_per_rank, random.randrange(1 << 30), cases):
        assert failures == []


def test_fp8_scales_that_require_grad_are_refused_before_any_output():
    for failures in harness.pool(2).run(scales_with_grad, random.randrange(1 << 30)):
        assert failures == []


def test_a_dma_barrier_timeout_names_op_schedule_transport_and_the_gone_peer():
    from ..per_rank_cases import warm_dma_call_then_peer_dies

    text = harness.dead_peer_error(warm_dma_call_then_peer_dies)
    for rank in (0, 2):
        mine = text.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        assert "all_gather_matmul (schedule ring over dma" in mine, mine
        assert "rank(s) [1] are gone (their processes exited)" in mine, mine
        assert "passed FICCO_TIMEOUT" in mine, mine


def test_a_nested_error_text_is_cut_at_a_word_and_says_where_the_rest_is():
    from ficco.runtime.guard import SUMMARY_CHARS, cut

    words = [f"word{i}" for i in range(100)]
    text = " ".join(words)
    short = cut(text, SUMMARY_CHARS, "in its __cause__ below")
    head = short.split(" … ")[0]
    assert len(head) <= SUMMARY_CHARS and head.split() == words[:len(head.split())]
    assert short.endswith("(cut; the whole text is in its __cause__ below)")
    assert cut("short enough", SUMMARY_CHARS, "anywhere") == "short enough"
