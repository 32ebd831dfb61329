"""What a rank supplies on its own: fp8 scales drawn per rank, the all-reduce's fp8 partials,
a bias that differs across ranks, fp8 scales that require grad; every schedule of the op on
both transports, against float64 (rank-side functions: tests/per_rank_cases.py)."""
from __future__ import annotations

import random

import pytest

from ficco import schedules

from . import harness
from .per_rank_cases import ag_own_scales, ar_fp8_partials, scales_with_grad

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


def test_fp8_scales_that_require_grad_are_refused_before_any_output():
    for failures in harness.pool(2).run(scales_with_grad, random.randrange(1 << 30)):
        assert failures == []
