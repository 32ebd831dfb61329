"""ficco.moe: routing helpers, the MoE layer on one rank against a plain loop over experts,
and examples/moe_block.py's training parity on W ranks against its unsharded twin."""
from __future__ import annotations

import pathlib
import random
import sys

import pytest
import torch

from ficco.moe import ExpertParallelFFN, MoELayer, route, top_k, unroute

from ... import harness
from ...ep_cases import moe_parity

EXAMPLES = str(pathlib.Path(__file__).resolve().parents[3] / "examples")
# The pool test_training compiles in (same env: the same ranks): a rank that finished compiling
# waits in its first collective for the slowest rank's compile.
COMPILE_ENV = {"FICCO_TIMEOUT": "300"}


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


def test_compiled_fullgraph_layer_trains_like_its_unsharded_twin():
    """The whole MoE layer (router, top-k, route, dispatch, experts, combine, unroute) forward
    and backward under torch.compile(fullgraph=True) at W=2: one graph, no break, and the
    training matches the unsharded twin. Dispatch's and combine's output rows are unbacked
    sizes of the fake kernels; routing changes every step without a recompile."""
    seed = random.randrange(1 << 30)
    results = harness.pool(2, COMPILE_ENV).run(moe_parity, seed, 2, True, timeout_s=900)
    for loss_diff, weight_diff, graph_breaks, graphs in results:
        assert loss_diff < 1e-4 and weight_diff < 1e-4, (seed, results)
        assert graph_breaks == 0 and graphs == 1, results


def test_compiled_graphs_are_the_same_on_every_rank_and_match_eager():
    """Before: combine's backward read this rank's number while being traced, so rank 0 could
    load rank 1's cached backward (same forward graph, same cache key) and fail. Now both
    graphs are identical on every rank, and the compiled FFN matches eager."""
    from ...ep_cases import compiled_graphs

    results = harness.pool(2, COMPILE_ENV).run(compiled_graphs, random.randrange(1 << 30),
                                             timeout_s=900)
    assert len(results[0][0]) == 2 and results[0][0] == results[1][0]
    assert all(diff < 1e-5 for _, diff in results), [diff for _, diff in results]


def test_layer_shape_of_a_batch():
    layer = MoELayer(8, 16, num_experts=4, k=2)
    assert layer(torch.randn(2, 3, 8)).shape == (2, 3, 8)


@pytest.mark.parametrize("transport", ["dma", "ccl"])
def test_a_rank_that_skips_a_backward_of_an_moe_layer_makes_every_rank_raise_mismatch(
        transport):
    """The skipped-backward case for the expert-parallel ops. Before: rank 0's backward (a dispatch and
    a combine handed the forward's routing: no counts exchange, straight to the call check)
    waited in its check while rank 1's next forward waited in its counts exchange: both timed
    out at FICCO_TIMEOUT and the group was poisoned. Now the backward's calls carry their
    role, and a waiting check answers the peer's counts exchange: MismatchError on every rank
    naming both calls, and the next step is right."""
    from ...ep_cases import moe_skip_one_backward

    results = harness.pool(2).run(moe_skip_one_backward, random.randrange(1 << 30), transport)
    harness.check_skipped_backward(results)
