"""The ``tune`` selector and the gated schedules: which candidates it measures (offered ones by
default, FICCO_TUNE_CANDIDATES when set), that a gated winner is cached and read back, and end
to end on CPU with a forced list (the gated GEMM measured for real in Triton's interpreter)."""
from __future__ import annotations

import random

import pytest
import torch

import ficco
from ficco import config, kernels, schedules
from ficco.errors import ConfigError
from ficco.heuristics import choose, tune
from ficco.heuristics.cache import entries_in
from ficco.heuristics.measured import Scripted
from ficco.plan.problem import Problem

from ... import harness
from ...reference import ROW_TOL, max_row_rel_err

GATED = ["gated-1d", "gated-2d"]
PROBLEM = Problem(64, 32, (16,), "float32", 4)


def _fake_measure(measured, fastest):
    """A scripted live group whose ``fastest`` runs fastest; ``measured`` gets each name the
    first time it runs (tune runs every candidate several times, in turn)."""
    def seconds(name, via):
        if name not in measured:
            measured.append(name)
        return 1.0 if name == fastest else 2.0 + len(name) * 1e-3
    return Scripted(seconds)


def test_default_candidates_are_the_offered_schedules(tmp_path, monkeypatch):
    """CPU: the eleven (the interpreter is never timed by default). A GPU target where the
    gated GEMM runs: the eleven plus both gated schedules, and a gated winner is taken."""
    monkeypatch.setattr(kernels, "triton_reason", lambda: None)
    monkeypatch.setattr(kernels, "VERIFIED_TARGETS", ("cuda:sm_90",))
    with config.scope(cache_dir=str(tmp_path)):
        tune.clear_memory()
        measured = []
        choose(PROBLEM, target="cpu", selector="tune", live=_fake_measure(measured, "ring"))
        assert measured == schedules.names()
        measured = []
        d = choose(PROBLEM, target="cuda:sm_90", selector="tune",
                   live=_fake_measure(measured, "gated-2d"))
        assert measured == schedules.names() + GATED
        assert d.schedule == "gated-2d" and set(d.scores) == set(measured)
        measured = []   # not offered over ccl: the eleven again
        choose(PROBLEM, transport="ccl", target="cuda:sm_90", selector="tune",
               live=_fake_measure(measured, "ring"))
        assert measured == schedules.names()


def test_forced_candidates_include_gated_on_cpu_and_the_winner_survives_the_file(tmp_path):
    """FICCO_TUNE_CANDIDATES may name the gated schedules on CPU; only those are measured, the
    list is part of the cache key, and a gated winner read back from the file is used (a
    file check against names() alone would drop it and re-measure)."""
    with config.scope(cache_dir=str(tmp_path), tune_candidates=("serial", *GATED)):
        tune.clear_memory()
        measured = []
        d = choose(PROBLEM, target="cpu", selector="tune",
                   live=_fake_measure(measured, "gated-1d"))
        assert measured == ["serial", *GATED] and d.schedule == "gated-1d"
        tune.clear_memory()

        def fail(name, via):
            raise AssertionError(f"measured {name} again")

        again = choose(PROBLEM, target="cpu", selector="tune", live=Scripted(fail))
        assert again.schedule == "gated-1d" and "tuned earlier" in again.reason
    (key, entry), = entries_in(tmp_path / tune.CACHE_FILE).items()
    assert key.endswith("candidates=serial,gated-1d,gated-2d") and entry["schedule"] == "gated-1d"
    with config.scope(cache_dir=str(tmp_path)):   # the default list has its own key
        tune.clear_memory()
        measured = []
        assert choose(PROBLEM, target="cpu", selector="tune",
                      live=_fake_measure(measured, "ring")).schedule == "ring"
        assert measured == schedules.names()
    tune.clear_memory()


@pytest.mark.parametrize("names,transport,fake_no_triton,match", [
    ("serial,nope", "dma", False, "nope"),
    ("serial,gated-1d", "ccl", False, "gated-1d.*dma"),
    ("gated-2d", "dma", True, "gated-2d.*not installed"),
])
def test_forced_candidates_that_cannot_run_say_why_before_measuring(
        tmp_path, monkeypatch, names, transport, fake_no_triton, match):
    if fake_no_triton:
        monkeypatch.setattr(kernels, "triton_reason", lambda: "Triton is not installed: pip ...")
    monkeypatch.setenv("FICCO_TUNE_CANDIDATES", names)
    monkeypatch.setenv("FICCO_CACHE_DIR", str(tmp_path))
    tune.clear_memory()

    def fail(name, via):
        raise AssertionError("nothing may be measured")

    with pytest.raises(ConfigError, match=match):
        choose(PROBLEM, transport=transport, target="cpu", selector="tune", live=Scripted(fail))


@pytest.mark.parametrize("raw", ["ring,ring", " , "])
def test_tune_candidates_setting_is_validated(monkeypatch, raw):
    """A repeated name, or a list of no names (not unset: it must not measure nothing)."""
    monkeypatch.setenv("FICCO_TUNE_CANDIDATES", raw)
    with pytest.raises(ConfigError, match="FICCO_TUNE_CANDIDATES.*distinct"):
        config.tune_candidates()


def _tune_gated_live(rank, world, seed, root):
    """A real tune on the CPU backend over serial and gated-1d: both measured (the gated one
    through the interpreter), every rank picks the same, and the call is right."""
    from ...reference import make_inputs

    shards, bs, _, refs = make_inputs(seed, world, (5, 12), (7,), torch.float32)
    with ficco.config.scope(cache_dir=root, selector="tune",
                            tune_candidates=("serial", "gated-1d")):
        tune.clear_memory()
        out = ficco.all_gather_matmul(shards[rank], bs[0])
        ran = ficco.runtime.path.last_run()
        decision = ficco.explain(shards[rank], bs[0])
    tune.clear_memory()
    return decision.schedule, sorted(decision.scores), ran, max_row_rel_err(out, refs[0])


@pytest.mark.skipif(kernels.triton_reason() is not None, reason="Triton is not installed")
def test_tune_measures_a_forced_gated_candidate_on_the_cpu_backend(tmp_path):
    results = harness.pool(2).run(_tune_gated_live, random.randrange(1 << 30), str(tmp_path))
    assert results[0][0] == results[1][0]
    for schedule, scored, ran, err in results:
        assert scored == ["gated-1d", "serial"] and ran == (schedule, "dma")
        assert err <= ROW_TOL[torch.float32]
