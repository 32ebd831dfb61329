"""Decide once (issue 24 item 5): the Decision cached like the Plan and invalidated when a
setting that decides changes; the device profile frozen and fingerprinted once; the backend
chosen once per process; a warm call serialises nothing."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

import ficco
from ficco import backends, config, heuristics, runtime
from ficco.heuristics import profiles
from ficco.ops.all_gather_matmul import SPEC as ALL_GATHER_MATMUL
from ficco.problem import Problem

from . import harness


def _call(m=16, k=32, n=24, world=2):
    """A canonical call as rank 0 of ``world`` (no group: decide() never communicates)."""
    call = ALL_GATHER_MATMUL.prepare(torch.randn(m, k), torch.randn(k, n))
    return dataclasses.replace(call, problem=dataclasses.replace(call.problem, world=world))


@pytest.fixture
def counted(monkeypatch):
    """Counts heuristics.choose calls (the decision made afresh); empties the cache first."""
    made = []
    real = heuristics.choose

    def choose(problem, **kwargs):
        made.append(kwargs.get("selector"))
        return real(problem, **kwargs)

    monkeypatch.setattr(heuristics, "choose", choose)
    runtime.shutdown()
    yield made
    runtime.shutdown()


def test_a_decision_is_made_once_per_key_and_again_when_a_deciding_setting_changes(counted,
                                                                                   monkeypatch):
    call = _call()
    first = runtime.decide(call, runtime.settings(call), True)
    assert runtime.decide(_call(), runtime.settings(call), True) is first   # fresh tensors
    assert len(counted) == 1
    # config.scope and the environment are part of the key, through the settings
    with config.scope(selector="paper"):
        paper = runtime.decide(call, runtime.settings(call), True)
    assert paper.selector == "paper" and len(counted) == 2
    monkeypatch.setenv("FICCO_SCHEDULE", "hetero-fused-1d")
    forced = runtime.decide(call, runtime.settings(call), True)
    assert (forced.schedule, forced.selector) == ("hetero-fused-1d", "forced")
    monkeypatch.delenv("FICCO_SCHEDULE")
    monkeypatch.setenv("FICCO_PROFILE", "mi300x")
    assert runtime.decide(call, runtime.settings(call), True).inputs["profile"] == "mi300x"
    monkeypatch.delenv("FICCO_PROFILE")
    # transports offered (same host or not) and the problem key are part of it too
    assert runtime.decide(call, runtime.settings(call), False).transport == "ccl"
    runtime.decide(_call(n=40), runtime.settings(call), True)
    assert len(counted) == 6
    # back to the first settings: still cached
    assert runtime.decide(call, runtime.settings(call), True) is first
    # timeouts and logging do not decide: no new decision
    with config.scope(timeout=7.0):
        assert runtime.decide(call, runtime.settings(call), True) is first
    assert len(counted) == 6


def test_the_decision_cache_is_bounded_lru(counted, monkeypatch):
    monkeypatch.setattr(runtime, "_DECISION_LIMIT", 3)
    s = runtime.settings(_call())
    calls = [_call(n=n) for n in (8, 16, 24, 32)]
    for call in calls[:3]:
        runtime.decide(call, s, True)
    runtime.decide(calls[0], s, True)          # the oldest, used again: now the newest
    runtime.decide(calls[3], s, True)          # evicts n=16, the least recently used
    assert len(counted) == 4
    runtime.decide(calls[0], s, True)
    assert len(counted) == 4
    runtime.decide(calls[1], s, True)
    assert len(counted) == 5


def test_a_profile_is_frozen_and_fingerprinted_once(monkeypatch):
    prof = dataclasses.replace(profiles.load("h100"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        prof.host_op_s = 1.0
    dumps = []
    real = json.dumps
    monkeypatch.setattr(profiles.json, "dumps", lambda *a, **k: dumps.append(1) or real(*a, **k))
    assert prof.fingerprint() is prof.fingerprint()
    assert hash(prof) == hash(dataclasses.replace(prof)) and prof == dataclasses.replace(prof)
    assert len(dumps) == 2        # this profile once, its fresh copy once
    other = dataclasses.replace(prof, host_op_s=prof.host_op_s * 2)
    assert other.fingerprint() != prof.fingerprint()


def test_the_backend_is_chosen_once_per_process_unless_ficco_backend_changes(monkeypatch):
    asked = []
    monkeypatch.setattr(backends, "gpu_reasons",
                        lambda: asked.append(1) or {"rocm": "no", "cuda": "no"})
    monkeypatch.setattr(backends, "_detected", [])
    monkeypatch.delenv("FICCO_BACKEND", raising=False)
    first = backends.get_backend()
    assert backends.get_backend() is first and first.name == "cpu"
    assert len(asked) == 1
    monkeypatch.setenv("FICCO_BACKEND", "cuda")   # read every call: honoured at once
    with pytest.raises(ficco.errors.BackendUnavailableError, match="FICCO_BACKEND=cuda"):
        backends.get_backend()
    monkeypatch.setenv("FICCO_BACKEND", "cpu")
    assert backends.get_backend() is first
    assert len(asked) == 1


def _warm_serialises(rank, world, seed):
    """JSON dumps and pickles during warm calls of both ops (after one cold call each)."""
    import pickle

    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(8, 16, generator=gen), torch.randn(16, 8, generator=gen)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one, bias = torch.tensor(1.0), torch.randn(8, generator=gen)
    ops = [lambda: ficco.all_gather_matmul(a, b),
           lambda: ficco.matmul_reduce_scatter(torch.cat([a] * world), b),
           # an fp8 call with a bias (issue 27): its epilogue's signature is hashable too
           lambda: ficco.all_gather_matmul(a8, b8, a_scale=one, b_scale=one, bias=bias,
                                           out_dtype=torch.bfloat16)]
    for op in ops:
        op()
    seen = []
    real_json, real_pickle = json.dumps, pickle.dumps
    json.dumps = lambda *x, **k: seen.append("json") or real_json(*x, **k)
    pickle.dumps = lambda *x, **k: seen.append("pickle") or real_pickle(*x, **k)
    try:
        for op in ops * 3:
            op()
    finally:
        json.dumps, pickle.dumps = real_json, real_pickle
    return seen, runtime.last_run()


def test_a_warm_call_serialises_nothing():
    for seen, ran in harness.pool(2).run(_warm_serialises, random.randrange(1 << 30)):
        assert ran is not None and seen == []


def test_a_warm_decision_is_not_recomputed_on_a_live_group():
    for made in harness.pool(2).run(_decisions_made, random.randrange(1 << 30)):
        assert made == [1, 1], made


def _decisions_made(rank, world, seed):
    """Decisions made afresh by a cold call and by three warm calls of the same shape."""
    ficco.shutdown()         # every rank: no decision kept from earlier tests of the pool
    made = []
    real = heuristics.choose
    heuristics.choose = lambda problem, **k: made.append(1) or real(problem, **k)
    try:
        a = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
        b = torch.randn(8, 5)
        counts = []
        for _ in range(4):
            ficco.all_gather_matmul(a, b)
            counts.append(len(made))
    finally:
        heuristics.choose = real
    return [counts[0], counts[-1]]


def test_problem_properties_read_per_call_are_computed_once():
    p = Problem(m=10, k=4, ns=(3, 5), dtype="float32", world=4, op="matmul_reduce_scatter")
    assert (p.reduces, p.big_m, p.n_total, p.itemsize, p.block_rows) == (True, 10, 8, 4, 3)
    assert {"reduces", "big_m", "n_total", "itemsize", "block_rows"} <= set(vars(p))
    assert dataclasses.replace(p, rank=3).block_rows == 2      # a copy computes its own
