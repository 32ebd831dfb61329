"""ficco.moe: routing helpers, the MoE layer on one rank against a plain loop over experts,
and examples/moe_block.py's training parity on W ranks against its unsharded twin."""
from __future__ import annotations

import pathlib
import random
import sys

import pytest
import torch

from ficco.moe import ExpertParallelFFN, MoELayer, route, top_k, unroute

from . import harness
from .ep_cases import moe_parity

EXAMPLES = str(pathlib.Path(__file__).resolve().parents[1] / "examples")


def test_route_then_unroute_is_the_identity_and_sorts_by_expert():
    torch.manual_seed(random.randrange(1 << 30))
    tokens, experts = torch.randn(7, 3), torch.randint(0, 5, (7, 2))
    rows, counts, order = route(tokens, experts, 5)
    assert counts.tolist() == torch.bincount(experts.flatten(), minlength=5).tolist()
    sorted_experts = experts.flatten()[order]
    assert torch.equal(sorted_experts, sorted_experts.sort().values)
    back = unroute(rows, order)
    assert torch.equal(back, tokens.repeat_interleave(2, 0))
    gates = torch.rand(7, 2)
    assert torch.allclose(unroute(rows, order, gates),
                          (tokens.unsqueeze(1) * gates.unsqueeze(-1)).sum(1))


def test_top_k_renormalises_the_chosen_weights():
    gates, experts = top_k(torch.tensor([[0.0, 1.0, 2.0, 0.5]]), 2)
    assert experts.tolist() == [[2, 1]] and abs(float(gates.sum()) - 1) < 1e-6


def test_layer_on_one_rank_matches_its_unsharded_twin():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from moe_block import MoEBlock, sharded_from

    torch.manual_seed(random.randrange(1 << 30))
    reference = MoEBlock(8, 16, 4)
    layer = sharded_from(reference)
    x = torch.randn(9, 8, dtype=torch.float32)
    assert torch.allclose(layer(x), reference(x), atol=1e-5)


def test_experts_must_split_evenly():
    from unittest import mock

    with mock.patch("ficco.moe.rank_world", return_value=(0, 2)), \
            pytest.raises(ValueError, match="multiple of the group size"):
        ExpertParallelFFN(4, 8, num_experts=3)


@pytest.mark.parametrize("world,experts_per_rank", [(2, 2), (3, 1), (4, 3)])
def test_example_trains_like_its_unsharded_twin(world, experts_per_rank):
    seed = random.randrange(1 << 30)
    results = harness.pool(world).run(moe_parity, seed, experts_per_rank)
    for loss_diff, weight_diff in results:
        assert loss_diff < 1e-4 and weight_diff < 1e-4, (seed, results)


def test_layer_shape_of_a_batch():
    layer = MoELayer(8, 16, num_experts=4, k=2)
    assert layer(torch.randn(2, 3, 8)).shape == (2, 3, 8)
