"""Decide once: the Decision cached like the Plan and invalidated when a
setting that decides changes; the device profile frozen and fingerprinted once; the backend
chosen once per process; a warm call serialises nothing."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

import ficco
from ficco import backends, config, heuristics
from ficco.heuristics import profiles
from ficco.ops.all_gather_matmul.spec import SPEC as ALL_GATHER_MATMUL
from ficco.plan.problem import Problem
from ficco.runtime import agreement
from ficco.runtime import path as runtime

from .. import harness


def _call(m=16, k=32, n=24, world=2):
    """A canonical call as rank 0 of ``world`` (no group: decide() never communicates)."""
    call = ALL_GATHER_MATMUL.prepare(torch.randn(m, k), torch.randn(k, n))
    return dataclasses.replace(call, problem=dataclasses.replace(call.problem, world=world))


def _agreed(call, same_host=True):
    """What the ranks agreed for ``call`` when every rank passed its widths."""
    return agreement.Agreed(same_host, {}, ({"ns": list(call.ns)},) * call.world)


@pytest.fixture
def counted(monkeypatch):
    """Counts heuristics.choose calls (the decision made afresh); empties the cache first.
    The model decides (these calls have no live group for auto to measure on)."""
    monkeypatch.setenv("FICCO_SELECTOR", "model")
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
    first = runtime.decide(call, runtime.settings(call), _agreed(call))
    fresh = _call()                                  # fresh tensors, the same key
    assert runtime.decide(fresh, runtime.settings(call), _agreed(fresh)) is first
    assert len(counted) == 1
    # config.scope and the environment are part of the key, through the settings
    with config.scope(selector="paper"):
        paper = runtime.decide(call, runtime.settings(call), _agreed(call))
    assert paper.selector == "paper" and len(counted) == 2
    monkeypatch.setenv("FICCO_SCHEDULE", "hetero-fused-1d")
    forced = runtime.decide(call, runtime.settings(call), _agreed(call))
    assert (forced.schedule, forced.selector) == ("hetero-fused-1d", "forced")
    monkeypatch.delenv("FICCO_SCHEDULE")
    monkeypatch.setenv("FICCO_PROFILE", "mi300x")
    decision = runtime.decide(call, runtime.settings(call), _agreed(call))
    assert decision.inputs["profile"] == "mi300x"
    monkeypatch.delenv("FICCO_PROFILE")
    # transports offered (same host or not) and the problem key are part of it too
    apart = _agreed(call, same_host=False)
    assert runtime.decide(call, runtime.settings(call), apart).transport == "ccl"
    wider = _call(n=40)
    runtime.decide(wider, runtime.settings(call), _agreed(wider))
    assert len(counted) == 6
    # back to the first settings: still cached
    assert runtime.decide(call, runtime.settings(call), _agreed(call)) is first
    # timeouts and logging do not decide: no new decision
    with config.scope(timeout=7.0):
        assert runtime.decide(call, runtime.settings(call), _agreed(call)) is first
    assert len(counted) == 6


def test_the_decision_cache_is_bounded_lru(counted, monkeypatch):
    monkeypatch.setattr(ficco.runtime.session, "DECISIONS_KEPT", 3)
    s = runtime.settings(_call())
    calls = [_call(n=n) for n in (8, 16, 24, 32)]
    for call in calls[:3]:
        runtime.decide(call, s, _agreed(call))
    runtime.decide(calls[0], s, _agreed(calls[0]))   # the oldest, used again: now the newest
    runtime.decide(calls[3], s, _agreed(calls[3]))   # evicts n=16, the least recently used
    assert len(counted) == 4
    runtime.decide(calls[0], s, _agreed(calls[0]))
    assert len(counted) == 4
    runtime.decide(calls[1], s, _agreed(calls[1]))
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
    backends.auto_name.cache_clear()               # ask again, here
    monkeypatch.delenv("FICCO_BACKEND", raising=False)
    try:
        first = backends.get_backend()
        assert backends.get_backend() is first and first.name == "cpu"
        assert len(asked) == 1
        monkeypatch.setenv("FICCO_BACKEND", "cuda")   # read every call: honoured at once
        with pytest.raises(ficco.errors.BackendUnavailableError, match="FICCO_BACKEND=cuda"):
            backends.get_backend()
        monkeypatch.setenv("FICCO_BACKEND", "cpu")
        assert backends.get_backend() is first
        assert len(asked) == 1
    finally:
        backends.auto_name.cache_clear()           # (its answer here came from a fake)


def _warm_serialises(rank, world, seed):
    """JSON dumps and pickles during warm calls of both ops (after one cold call each)."""
    import pickle

    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(8, 16, generator=gen), torch.randn(16, 8, generator=gen)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one, bias = torch.tensor(1.0), torch.randn(8, generator=gen)
    ops = [lambda: ficco.all_gather_matmul(a, b),
           lambda: ficco.matmul_reduce_scatter(torch.cat([a] * world), b),
           # an fp8 call with a bias: its epilogue's signature is hashable too
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


def _fp8(t):
    return t.to(torch.float8_e4m3fn)


def test_a_warm_call_checks_nothing_again_and_computes_with_its_own_tensors(monkeypatch):
    """The canonical Call of a key (op, shapes, dtypes, devices, group,
    backend, the other arguments) is made once; a warm call of that key runs no check again
    but computes with its own operands, scales and bias (fresh values every call)."""
    from ficco.ops.all_gather_matmul import spec as ag
    from ficco.ops.matmul_reduce_scatter import spec as rs

    ficco.shutdown()
    checked = []
    for module in (ag, rs):
        real = module.check_arguments
        monkeypatch.setattr(module, "check_arguments",
                            lambda *x, real=real: checked.append(1) or real(*x))
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    for step in range(3):
        a, b = torch.randn(2, 3, 16, generator=gen), torch.randn(16, 8, generator=gen)
        a_scale = torch.rand(2, 3, 1, generator=gen) + 0.5        # row-wise
        b_scale, bias = torch.rand(1, 8, generator=gen) + 0.5, torch.randn(8, generator=gen)
        out = ficco.all_gather_matmul(_fp8(a), _fp8(b), gather_dim=1, a_scale=a_scale,
                                      b_scale=b_scale, bias=bias, out_dtype=torch.float32)
        want = (_fp8(a).double() * a_scale.double()) @ (_fp8(b).double() * b_scale.double()) \
            + bias.double()
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        c = torch.randn(5, 16, generator=gen)
        got = ficco.matmul_reduce_scatter(c, b, bias=bias)
        torch.testing.assert_close(got.double(), c.double() @ b.double() + bias.double(),
                                   rtol=1e-5, atol=1e-5)
        assert len(checked) == 2, (step, checked)    # the first call of each key only
    ficco.all_gather_matmul(torch.randn(3, 16), b)  # another shape: another key, checked
    assert len(checked) == 3
    for _ in range(2):                              # a call that fails its checks stays unknown
        with pytest.raises(ficco.errors.InvalidArgumentError, match="rows"):
            ficco.all_gather_matmul(torch.randn(3, 16), torch.randn(15, 8))
    assert len(checked) == 5


def _group_released(rank, world, seed):
    """A group used by warm calls, then destroyed: collected (ficco keeps no reference to
    it), and a new group's calls compute right."""
    import gc
    import weakref

    import torch.distributed as dist

    gen = torch.Generator().manual_seed(seed + rank)
    group = dist.new_group(list(range(world)))
    a, b = torch.randn(4, 8, generator=gen), torch.randn(8, 3, generator=torch.Generator())
    for _ in range(3):
        out = ficco.all_gather_matmul(a, b, group)
    whole = torch.empty(world * 4, 8)
    dist.all_gather_into_tensor(whole, a)
    good = torch.allclose(out, whole @ b, atol=1e-5)
    ref = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    again = dist.new_group(list(range(world)))
    out = ficco.all_gather_matmul(a, b, again)
    dist.destroy_process_group(again)
    return ref() is None, good and torch.allclose(out, whole @ b, atol=1e-5)


def test_a_known_call_keeps_no_destroyed_group_alive():
    for collected, right in harness.pool(2).run(_group_released, random.randrange(1 << 30)):
        assert collected and right


def test_a_calls_settings_and_prepared_form_are_frozen_and_typed():
    """Settings are read as fields of a frozen object (a 16-key dict was read by string
    before), every field of Settings and Prepared has a type of its own (none is ``Any``), and
    what the ranks agree on is every setting but the three that only change how long or how
    loudly a rank works."""
    from ficco.runtime.call import Prepared, Settings

    s = runtime.settings(_call())
    assert isinstance(s, Settings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.timeout_s = 1.0       # type: ignore[misc]
    for cls in (Settings, Prepared):
        fields = dataclasses.fields(cls)
        assert len(fields) >= 12 and all(str(f.type) != "Any" for f in fields), cls
    with config.scope(timeout=7.0, transport="ccl"):
        other = runtime.settings(_call())
    assert (other.timeout_s, other.transport) == (7.0, "ccl")
    assert set(s.agreed()) == {f.name for f in dataclasses.fields(Settings)} - \
        {"schedule_by", "timeout_s", "poison"}
    assert s.agreed()["transport"] != other.agreed()["transport"]
    assert s.deciding() == other.deciding()       # the transport decides through its candidates
