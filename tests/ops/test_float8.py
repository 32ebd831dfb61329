"""Gradients of the epilogues (bias, activation, out_dtype) and ficco.float8's training
contract: fp8 forward, straight-through backward in the output dtype, training parity with an
unsharded twin that quantizes alike (tests/float8_cases.py)."""
from __future__ import annotations

import random

import pytest
import torch

from .. import harness
from ..float8_cases import bias_gradcheck, float8_gradients, float8_training_parity


@pytest.mark.parametrize("world", [2, 3])
def test_bias_gradients_pass_gradcheck(world):
    for failures in harness.pool(world).run(bias_gradcheck, random.randrange(1 << 30)):
        assert failures == []


@pytest.mark.parametrize("recipe,hp,world,tol", [("rowwise", torch.float32, 2, 1e-5),
                                                 ("tensorwise", torch.float32, 3, 1e-5),
                                                 ("rowwise", torch.bfloat16, 2, 2e-2)])
def test_float8_gradients_are_the_dequantized_operands(recipe, hp, world, tol):
    for errs in harness.pool(world).run(float8_gradients, random.randrange(1 << 30), recipe, hp):
        assert all(e <= tol for e in errs.values()), errs


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_training_matches_its_unsharded_twin(recipe):
    for diffs in harness.pool(2).run(float8_training_parity, random.randrange(1 << 30), recipe):
        assert max(diffs) <= 1e-5, diffs


def test_fp8_operands_that_require_grad_are_refused_before_communicating():
    import ficco
    from ficco.errors import InvalidArgumentError

    a = torch.randn(4, 32).to(torch.float8_e4m3fn).requires_grad_()
    b = torch.randn(32, 16).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    for op in (ficco.all_gather_matmul, ficco.matmul_reduce_scatter):
        with pytest.raises(InvalidArgumentError, match="ficco.float8"):
            op(a, b, a_scale=one, b_scale=one)
