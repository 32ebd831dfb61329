"""ficco.compat's fp8 twins against torch's own fallbacks (the oracles), on torch's own test
cases, and the bad scales every op refuses before any communication."""
from __future__ import annotations

import random

from .. import harness
from ..fp8_cases import bad_scales, compat_ag_cases, compat_rs_cases


def test_fused_all_gather_scaled_matmul_matches_torch():
    assert harness.pool(2).run(compat_ag_cases, random.randrange(1 << 30)) == [[], []]


def test_fused_scaled_matmul_reduce_scatter_matches_torch():
    assert harness.pool(2).run(compat_rs_cases, random.randrange(1 << 30)) == [[], []]


def test_compat_twins_on_four_ranks():
    seed = random.randrange(1 << 30)
    assert harness.pool(4).run(compat_ag_cases, seed) == [[]] * 4
    assert harness.pool(4).run(compat_rs_cases, seed) == [[]] * 4


def test_bad_scales_raise_before_any_communication():
    seen, other = harness.pool(2).run(bad_scales, timeout_s=60)
    assert other == []
    assert seen and all(s.endswith("refused") for s in seen), seen


def test_an_activation_on_the_reduce_scatter_is_an_invalid_argument():
    """docs/fp8.md promises InvalidArgumentError for it (it was a TypeError): from the op and
    from explain, naming why."""
    import pytest
    import torch

    import ficco
    from ficco.errors import InvalidArgumentError

    a, w = torch.randn(4, 8), torch.randn(8, 3)
    with pytest.raises(InvalidArgumentError, match="reduce-scatter's output is a sum"):
        ficco.matmul_reduce_scatter(a, w, activation="gelu")
    with pytest.raises(InvalidArgumentError, match="reduce-scatter's output is a sum"):
        ficco.explain(a, w, op="matmul_reduce_scatter", activation="gelu")
    assert torch.allclose(ficco.matmul_reduce_scatter(a, w, activation=None), a @ w)
