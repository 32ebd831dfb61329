"""all_gather_matmul end to end: every schedule x transport x world size against float64."""
from __future__ import annotations

import random

import pytest
import torch

import ficco
from ficco import ops
from ficco.runtime import path as runtime

from ... import harness
from ...cases import DTYPES, SHAPES, run_matrix
from ...reference import ROW_TOL, make_inputs, max_row_rel_err

WORLDS = (1, 2, 3, 4, 8)


@pytest.mark.parametrize("transport", ["dma", "ccl"])
@pytest.mark.parametrize("schedule", ficco.schedules.names())
@pytest.mark.parametrize("world", WORLDS)
def test_schedule_matches_reference(world, schedule, transport):
    seed = random.randrange(1 << 30)
    failures = harness.pool(world).run(run_matrix, schedule, transport, seed)
    assert failures == [[]] * world, f"seed {seed}: {failures}"


@pytest.mark.parametrize("schedule", ficco.schedules.names())
def test_world_size_one_is_a_plain_matmul(schedule):
    """No process group at all: ficco degrades to a matmul for every shape and dtype."""
    seed = random.randrange(1 << 30)
    for case, (label, shape, ns, gdim, ret) in enumerate(SHAPES):
        for dtype in DTYPES:
            shards, bs, full, refs = make_inputs(seed + case, 1, shape, ns, dtype, gdim)
            result = ficco.all_gather_matmul(shards[0], bs, gather_dim=gdim, schedule=schedule,
                                             return_gathered=True)
            gathered, outs = result
            assert torch.equal(gathered, full), label
            for out, ref in zip(outs, refs):
                assert max_row_rel_err(out, ref) <= ROW_TOL[dtype], (label, dtype, seed)


def _selector_picks(rank, world, seed):
    """With no schedule forced, the selector's pick runs, agrees on every rank, and is right."""
    shards, bs, _full, refs = make_inputs(seed, world, (24, 32), (40,), torch.float32)
    decision = ficco.explain(shards[rank], bs[0])
    out = ficco.all_gather_matmul(shards[rank], bs[0])
    return decision.schedule, decision.transport, runtime.last_run(), max_row_rel_err(out, refs[0])


def test_selector_choice_runs_and_agrees():
    results = harness.pool(4).run(_selector_picks, random.randrange(1 << 30))
    assert len({r[:3] for r in results}) == 1, results
    schedule, transport, ran, err = results[0]
    assert ran == (schedule, transport)
    assert err <= ROW_TOL[torch.float32]


def _disabled(rank, world, seed):
    shards, bs, full, refs = make_inputs(seed, world, (6, 8), (5,), torch.float32)
    with ficco.config.scope(disable=True):
        gathered, out = ficco.all_gather_matmul(shards[rank], bs[0], return_gathered=True)
    return torch.equal(gathered, full), max_row_rel_err(out, refs[0])


def test_ficco_disable_runs_plain_all_gather_then_matmul():
    for same, err in harness.pool(2).run(_disabled, random.randrange(1 << 30)):
        assert same and err <= ROW_TOL[torch.float32]


def _tune_with_uneven_caches(rank, world, seed, root):
    """Rank 0 finds a (planted) winner in its cache file, rank 1 has none: instead of one rank
    measuring while the other skips (a deadlock), both measure and agree."""
    import os

    from ficco.heuristics import tune
    from ficco.heuristics.profiles import resolve

    cache = os.path.join(root, f"rank{rank}")
    os.makedirs(cache, exist_ok=True)
    shards, bs, _full, refs = make_inputs(seed, world, (8, 16), (6,), torch.float32)
    with ficco.config.scope(cache_dir=cache, selector="tune"):
        if rank == 0:
            problem = ops.get("all_gather_matmul").prepare(shards[rank], bs[0]).problem
            profile = resolve("cpu")
            key = tune.cache_key(problem, "dma", "cpu", profile.topology)
            tune.CACHE.write(key, {"schedule": "ring-bidir", "scores": {"ring-bidir": 1e-9}})
        decision = ficco.explain(shards[rank], bs[0])
        out = ficco.all_gather_matmul(shards[rank], bs[0])
    tune.clear_memory()
    return decision.schedule, decision.reason, len(decision.scores), max_row_rel_err(out, refs[0])


def test_tune_agrees_when_only_some_ranks_have_a_cache_file(tmp_path):
    results = harness.pool(2).run(_tune_with_uneven_caches, random.randrange(1 << 30),
                                  str(tmp_path))
    assert results[0][0] == results[1][0], results
    for schedule, reason, n_scores, err in results:
        assert "tuned earlier" not in reason and n_scores == len(ficco.schedules.names())
        assert err <= ROW_TOL[torch.float32]


def _auto_transport(rank, world, seed):
    """With FICCO_TRANSPORT=auto the model weighs both transports and the call runs the one
    it predicts faster (here across a tiny and a larger GEMM)."""
    from ficco.heuristics import choose

    out = []
    for case, (m, k, n) in enumerate([(2, 8, 8), (96, 192, 160)]):
        shards, bs, _full, refs = make_inputs(seed + case, world, (m, k), (n,), torch.float32)
        with ficco.config.scope(transport="auto", selector="model"):
            decision = ficco.explain(shards[rank], bs[0])
            result = ficco.all_gather_matmul(shards[rank], bs[0])
            problem = ops.get("all_gather_matmul").prepare(shards[rank], bs[0]).problem
            best = {via: min(choose(problem, transport=via, target="cpu").scores.values())
                    for via in ("dma", "ccl")}
        out.append((decision.transport, min(best, key=best.get), runtime.last_run(),
                    (decision.schedule, decision.transport), max_row_rel_err(result, refs[0])))
    return out


def test_auto_transport_runs_the_transport_the_model_predicts_faster():
    for per_rank in harness.pool(3).run(_auto_transport, random.randrange(1 << 30)):
        for chosen, predicted_best, ran, decided, err in per_rank:
            assert chosen == predicted_best and ran == decided, per_rank
            assert err <= ROW_TOL[torch.float32]


# -- Bad input gets ficco's errors ------------------------------------------
@pytest.mark.parametrize("value", ["inf", "Infinity", "nan", "-1", "0"])
def test_ficco_timeout_must_be_a_finite_number_of_seconds(monkeypatch, value):
    """Before: FICCO_TIMEOUT=inf passed validation and the first wait raised OverflowError
    (no call may wait forever: a large finite value is the way to wait long)."""
    from ficco.errors import ConfigError

    monkeypatch.setenv("FICCO_TIMEOUT", value)
    with pytest.raises(ConfigError, match="FICCO_TIMEOUT") as caught:
        ficco.config.timeout_s()
    if value.lower().startswith("inf"):
        assert "86400" in str(caught.value), caught.value     # says what to use instead
    monkeypatch.delenv("FICCO_TIMEOUT")
    with pytest.raises(ConfigError, match="timeout"), ficco.config.scope(timeout=float(value)):
        pass


def test_from_linear_takes_only_linears():
    """Before: `TypeError` (nn.Conv1d has no in_features)."""
    from torch import nn

    from ficco.errors import InvalidArgumentError
    from ficco.nn import ColumnParallelLinear, RowParallelLinear

    conv = nn.Conv1d(4, 4, 1)
    for make in (lambda: ColumnParallelLinear.from_linear(conv),
                 lambda: ColumnParallelLinear.from_linear([nn.Linear(4, 4), conv]),
                 lambda: RowParallelLinear.from_linear(conv)):
        with pytest.raises(InvalidArgumentError, match="Conv1d"):
            make()


@pytest.mark.parametrize("value", ["yes", 1, None, torch.tensor(True)])
def test_return_gathered_must_be_a_bool(value):
    """Before: `return_gathered="yes"` was taken as True."""
    from ficco.errors import InvalidArgumentError

    for w in (torch.randn(8, 3), torch.randn(8, 3, requires_grad=True)):   # eager, the op
        with pytest.raises(InvalidArgumentError, match="return_gathered"):
            ficco.all_gather_matmul(torch.randn(4, 8), w, return_gathered=value)
