"""ficco.nn's traps: no silent wrong model from an unset sequence dimension,
a warning where from_linear unties tied weights, and ficco.rng.ShardRNG for dropout masks that
differ per sequence shard (eager and compiled)."""
from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ficco.nn as fnn
from ficco.errors import InvalidArgumentError

from .. import harness


@pytest.mark.parametrize("make", [
    lambda: fnn.ColumnParallelLinear(8, 6),
    lambda: fnn.RowParallelLinear(8, 6),
    lambda: fnn.ColumnParallelLinear.from_linear(nn.Linear(8, 6)),
    lambda: fnn.RowParallelLinear.from_linear(nn.Linear(8, 6)),
])
def test_unset_seq_dim_is_refused_for_batched_inputs(make):
    """Before: seq_dim defaulted to 0, so a batch-first (batch, seq, hidden) input gathered
    the batch and attention ran within each rank's chunk of the sequence."""
    layer = make()
    with pytest.raises(InvalidArgumentError, match=r"seq_dim=1 for batch-first"):
        layer(torch.randn(2, 5, 8))
    x = torch.randn(5, 8, dtype=torch.float64)      # 2-D: only one row dimension
    torch.testing.assert_close(layer.double()(x), nn.functional.linear(
        x, *_full(layer)))


def _full(layer):
    if isinstance(layer, fnn.ColumnParallelLinear):
        return layer.weights[0], layer.biases[0]
    return layer.weight, layer.bias


def test_from_linear_warns_when_it_unties_weights():
    """Before: a head tied to its embedding silently got its own copy."""
    emb, head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    for layer in (fnn.ColumnParallelLinear, fnn.RowParallelLinear):
        with pytest.warns(UserWarning, match=r"also a parameter of Embedding \(tied weights"):
            layer.from_linear(head)
    loose = nn.Linear(8, 10)
    keep = loose.weight          # a plain reference is not a tie
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fnn.ColumnParallelLinear.from_linear(loose)
        fnn.RowParallelLinear.from_linear(loose)
    assert keep is loose.weight


# -- dropout in the sequence-parallel region -----------------------------------------------------
def _masks(rank, world, seed):
    """Dropout masks on every rank (the same default seed everywhere): plain, inside a
    ShardRNG twice, from a fresh ShardRNG, compiled in and out of it; and whether the
    default generator was left as it was."""
    import torch.distributed as dist

    from ficco.rng import ShardRNG

    torch.manual_seed(seed)
    x = torch.ones(2, 4, 16)
    drop = lambda t: F.dropout(t, 0.5, training=True)
    compiled = torch.compile(drop, fullgraph=True)
    out = {"plain": drop(x)}
    rng = ShardRNG(seed, group=None)
    state = torch.get_rng_state()
    with rng:
        out["shard"] = drop(x)
    with rng:
        out["shard, next"] = drop(x)
        out["shard, compiled"] = compiled(x)
    untouched = torch.equal(torch.get_rng_state(), state)
    with ShardRNG(seed):
        out["shard, again"] = drop(x)
    torch.manual_seed(seed + 1)
    out["compiled"] = compiled(x)
    gathered = {}
    for name, t in out.items():
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        gathered[name] = parts
    return gathered, untouched


def test_shard_rng_gives_each_sequence_shard_its_own_dropout_mask():
    """Before: dropout in the SP region drew the same mask on every rank (and the docs said
    nothing). Eager and compiled, the stream advances across uses and is reproducible."""
    seed = random.randrange(1 << 30)
    gathered, untouched = harness.pool(2).run(_masks, seed, timeout_s=300)[0]
    same = lambda a, b: torch.equal(a, b)
    assert untouched
    for name in ("plain", "compiled"):             # the trap, shown
        assert same(*gathered[name]), name
    for name in ("shard", "shard, next", "shard, compiled"):
        assert not same(*gathered[name]), name
        assert 0.3 < float((gathered[name][0] == 0).float().mean()) < 0.7, name
    assert not same(gathered["shard"][0], gathered["shard, next"][0])
    assert same(gathered["shard"][0], gathered["shard, again"][0])


def _draws_after_layers(rank, world, seed):
    """Layers of uneven widths (7 features over the ranks) must leave the
    global RNG where every rank finds the same next numbers: ``from_linear`` draws nothing,
    the constructors the same amount on every rank."""
    import torch.distributed as dist

    outcomes = []
    for make in (lambda: fnn.ColumnParallelLinear.from_linear(nn.Linear(4, 7)),
                 lambda: fnn.ColumnParallelLinear.from_linear([nn.Linear(4, 7), nn.Linear(4, 5)]),
                 lambda: fnn.RowParallelLinear.from_linear(nn.Linear(7, 4)),
                 lambda: fnn.ColumnParallelLinear(4, [7, 5]),
                 lambda: fnn.RowParallelLinear(7, 4)):
        torch.manual_seed(seed)
        linear = nn.Linear(4, 7)   # drawn before, on every rank alike
        layer = make()
        mine = torch.rand(3)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        outcomes.append(all(torch.equal(t, everyone[0]) for t in everyone))
        # nn.Linear's bound, 1/sqrt(in_features) of the whole layer, on every shard
        bound = 1 / layer.in_features ** 0.5
        outcomes.append(all(float(p.abs().max()) <= bound for p in layer.parameters()))
        del linear
    return outcomes


def test_building_layers_leaves_the_global_rng_in_step_across_ranks():
    for outcomes in harness.pool(3).run(_draws_after_layers, random.randrange(1 << 20)):
        assert outcomes == [True] * 10, outcomes
