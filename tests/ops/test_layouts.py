"""Every operand of every op in every memory layout, over every schedule and transport, against
float64 (a column-major ``a`` gave wrong results under the fused 1d schedules
of the reduce-scatter, and a wrong ``x.grad`` through the all-gather's backward)."""
from __future__ import annotations

import random

import pytest
import torch

from .. import harness
from ..layout_cases import DENSE_OPS, LAYOUTS, campaign, gpu_gather_layouts, laid_out
from ..reference import ROW_TOL


def test_layouts_are_what_they_say():
    gen = torch.Generator().manual_seed(0)
    strides = {kind: laid_out((4, 5), kind, gen, torch.float32).stride() for kind in LAYOUTS}
    assert strides == {"row": (5, 1), "transposed": (1, 4), "sliced": (16, 1),
                       "expanded": (0, 1), "strided-3d": (15, 1)}
    assert laid_out((2, 3, 4), "strided-3d", gen, torch.float32).stride() == (4, 8, 1)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("ops", [DENSE_OPS, ("all_to_all_grouped_mm",)], ids=["dense", "expert"])
def test_every_layout_every_schedule_matches_float64(world, ops):
    seed = random.randrange(1 << 30)
    failures = harness.pool(world).run(campaign, ops, seed, timeout_s=300)
    assert failures == [[]] * world, f"seed {seed}: {failures}"


def test_gpu_copy_engines_take_every_shard_layout():
    """GPU dma (fake GPU): a copy engine reads rows of unit-stride columns. A transposed shard
    was refused on its rank mid-call (its peers then timed out), and an expanded one (stride-0
    rows) was read past its one row: values up to 1e31."""
    for errors in harness.pool(3, {"FICCO_TIMEOUT": "20"}).run(
            gpu_gather_layouts, "cuda", random.randrange(1 << 30), timeout_s=300):
        assert set(errors) == set(LAYOUTS)
        assert max(errors.values()) <= ROW_TOL[torch.float32], errors
