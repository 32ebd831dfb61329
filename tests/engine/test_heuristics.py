"""Profiles, the paper rule, choose() with every selector, the tune cache, logging."""
from __future__ import annotations

import json
import logging
import random

import pytest
import torch

import ficco
from ficco import config, schedules
from ficco.errors import ConfigError, InvalidArgumentError
from ficco.heuristics import Decision, choose, model, profiles, tune
from ficco.heuristics.cache import entries_in
from ficco.heuristics.measured import Scripted
from ficco.heuristics.paper import combined_score, paper_choice
from ficco.heuristics.scenarios import PAPER_TABLE_I, table_i_problem
from ficco.plan.problem import Problem

from .. import harness
from ..reference import ROW_TOL, make_inputs, max_row_rel_err

REQUIRED_PROFILES = ("mi300x", "mi325x", "mi355x", "h100", "h200", "b200", "a100", "cpu")


# -- profiles -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", REQUIRED_PROFILES)
def test_builtin_profile_loads_and_cites_every_number(name):
    prof = profiles.load(name)
    raw = json.loads((profiles.PROFILE_DIR / f"{name}.json").read_text())
    missing = [k for k in raw if k not in ("name", "sources") and not raw["sources"].get(k)]
    assert not missing, f"{name}: no source for {missing}"
    assert prof.flops("bfloat16") > 0 and prof.hbm_bytes_per_s > 0


@pytest.mark.parametrize("name", REQUIRED_PROFILES)
def test_every_profile_states_its_host_cost_per_op_measured_or_labelled_estimate(name):
    """Host_op_s is recorded with each profile, with where it was measured
    or, until a GPU measures it, a source that says ESTIMATE."""
    raw = json.loads((profiles.PROFILE_DIR / f"{name}.json").read_text())
    assert raw["host_op_s"] > 0
    source = raw["sources"]["host_op_s"]
    assert source.startswith(("measured: `python -m ficco.bench characterize --parts enqueue", "ESTIMATE")), source
    assert ("characterize --parts enqueue" in source), source


#: Built-in profiles of one die and interconnect: (profile, the profile it shares them with,
#: the fields that differ because the hardware does). H200 SXM is the H100 SXM5's GH100 die
#: (132 SMs, the same cuBLAS kernels) with NVLink 4 and NVSwitch; only its HBM3e differs.
SAME_HARDWARE = [("h200", "h100", {"name", "hbm_bytes_per_s", "hbm_capacity_bytes"})]


@pytest.mark.parametrize("name,like,differs", SAME_HARDWARE, ids=[r[0] for r in SAME_HARDWARE])
def test_profiles_of_the_same_hardware_keep_its_fields_equal(name, like, differs):
    """A number fitted or measured on one part holds for every profile of the same silicon
    and links: h200 had drifted from h100 (partial_wave_speedup 1.3 against 1.05, the ccl
    latency 20 us against 8 us, no all-gather / reduce-scatter / all-to-all bus-bandwidth
    curves), so the model picked differently on H200 for no H200 reason. Every field but
    those the hardware changes (and the sources' wording) must stay equal, nested ones
    (dil, cil, ccl and its curves) in full."""
    import dataclasses

    mine = dataclasses.asdict(profiles.load(name))
    theirs = dataclasses.asdict(profiles.load(like))
    apart = {k for k in mine if k not in differs | {"sources"} and mine[k] != theirs[k]}
    assert not apart, {k: (mine[k], theirs[k]) for k in sorted(apart)}
    assert all(mine[k] != theirs[k] for k in differs - {"name"}), differs


def test_mi300x_matches_the_paper_platform():
    prof = profiles.load("mi300x")
    assert (prof.topology, prof.gpus_per_node, prof.link_bytes_per_s) == ("mesh", 8, 64e9)


def test_profile_json_round_trip(tmp_path):
    prof = profiles.load("h100")
    path = tmp_path / "mine.json"
    prof.to_json(path)
    again = profiles.load(str(path))
    assert again.fingerprint() == prof.fingerprint()


def test_partial_profile_gets_defaults_and_bad_ones_fail(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"name": "tiny", "peak_flops": {"float32": 1e12},
                                "hbm_bytes_per_s": 1e11, "compute_units": 4,
                                "topology": "pcie", "link_bytes_per_s": 1e10,
                                "cil": {"dma_gemm": 0.5}}))
    prof = profiles.load(str(path))
    assert prof.cil["dma_gemm"] == 0.5 and "mt_half_bytes" in prof.cil
    with pytest.raises(ConfigError, match="mi300x"):
        profiles.load("no-such-gpu")
    path.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ConfigError, match="missing required"):
        profiles.Profile.from_dict(json.loads(path.read_text()))


def test_noisy_measured_copy_curve_is_clamped():
    prof = profiles.Profile.from_dict({
        "name": "noisy", "peak_flops": {"float32": 1e12}, "hbm_bytes_per_s": 1e11,
        "compute_units": 4, "topology": "switch", "link_bytes_per_s": 1e10,
        "copy_efficiency": {"4096": 0.6, "16384": -0.26, "65536": 1.7}})
    assert all(0 < prof.copy_fraction(size) <= 1 for size in (1e3, 4096, 16384, 3e4, 1e6))

def test_detect_maps_targets_to_profiles():
    assert profiles.detect("cpu") == "cpu"
    assert profiles.detect("rocm:gfx942", "AMD Instinct MI300X") == "mi300x"
    assert profiles.detect("rocm:gfx942", "AMD Instinct MI325X") == "mi325x"
    assert profiles.detect("cuda:sm_90", "NVIDIA H100 80GB HBM3") == "h100"
    assert profiles.detect("cuda:sm_90", "NVIDIA H200") == "h200"
    assert profiles.detect("cuda:sm_100", "NVIDIA B200") == "b200"
    assert profiles.detect("cuda:sm_120", "future") == "h100"
    with pytest.raises(ConfigError):
        profiles.detect("tpu:v5")


# -- paper ----------------------------------------------------------------------------------
def test_paper_rule_worked_example_and_branches():
    mi300x = profiles.load("mi300x")
    g6 = table_i_problem("g6")
    assert combined_score(g6, mi300x) == pytest.approx(
        2 * 262144 * 1024 * 8192 / (1.3074e15 * 1e-3))
    assert paper_choice(g6, mi300x)[0] == "hetero-fused-1d"
    assert paper_choice(table_i_problem("g1"), mi300x)[0] == "uniform-fused-2d"  # M <= K
    assert paper_choice(table_i_problem("g13"), mi300x)[0] == "hetero-unfused-1d"
    assert paper_choice(g6, mi300x, low=4.0, high=8.0)[0] == "uniform-fused-1d"
    assert paper_choice(Problem(4, 4, (4,), "float32", 1), mi300x)[0] == "serial"


def test_paper_thresholds_come_from_the_knobs():
    g6 = table_i_problem("g6")
    with config.scope(paper_low=4.0, paper_high=8.0):
        assert choose(g6, target="rocm:gfx942", selector="paper").schedule == "uniform-fused-1d"
    with config.scope(paper_low=1.0, paper_high=2.0):
        assert choose(g6, target="rocm:gfx942", selector="paper").schedule == "hetero-unfused-1d"
    with config.scope(paper_low=5.0, paper_high=2.0), pytest.raises(ConfigError):
        choose(g6, target="rocm:gfx942", selector="paper")


# -- choose ---------------------------------------------------------------------------------
def test_forced_schedule_wins_and_is_reported():
    d = choose(table_i_problem("g6"), target="cpu", forced="ring", forced_by="FICCO_SCHEDULE")
    assert (d.schedule, d.selector) == ("ring", "forced") and d.scores["ring"] > 0
    assert "FICCO_SCHEDULE" in d.reason and d.inputs["M"] == 262144
    with pytest.raises(InvalidArgumentError, match="valid schedules"):
        choose(table_i_problem("g6"), forced="fastest")


@pytest.mark.parametrize("selector", ["paper", "model"])
def test_selectors_are_deterministic_and_rank_independent(selector):
    for name in ("g2", "g6", "g14"):
        base = table_i_problem(name)
        decisions = []
        for rank in range(8):
            model.clear_cache()   # each rank computes its own, as separate processes would
            decisions.append(choose(Problem(base.m, base.k, base.ns, base.dtype, 8, rank),
                                    target="rocm:gfx942", selector=selector))
        assert len({(d.schedule, tuple(sorted(d.scores.items()))) for d in decisions}) == 1


def test_model_picks_the_fastest_candidate_of_all_schedules():
    d = choose(table_i_problem("g11"), target="rocm:gfx942", selector="model")
    # every schedule, plus the optional gated-* ones where Triton runs on the target
    assert set(d.scores) == set(schedules.offered("rocm:gfx942"))
    assert d.scores[d.schedule] == min(d.scores.values())
    assert d.inputs["profile"] == "mi300x" and d.inputs["topology"] == "mesh"
    text = str(d)
    assert d.schedule in text and "ms" in text and "reason" in text


def test_env_selects_selector_profile_and_topology(tmp_path):
    g6 = table_i_problem("g6")
    with config.scope(selector="paper", profile="h100", topology="mesh"):
        d = choose(g6, target="rocm:gfx942")
    assert (d.selector, d.inputs["profile"], d.inputs["topology"]) == ("paper", "h100", "mesh")
    path = tmp_path / "p.json"
    profiles.load("a100").to_json(path)
    with config.scope(profile=str(path), selector="model"):
        assert choose(g6, target="cpu").inputs["profile"] == "a100"


def test_tune_measures_once_breaks_ties_by_name_and_caches_to_disk(tmp_path):
    problem = Problem(64, 32, (16,), "float32", 4)
    live = Scripted(lambda name, via: 1.0 if name in ("ring-bidir", "ring")
                    else 2.0 + len(name) * 1e-3)
    with config.scope(cache_dir=str(tmp_path)):
        tune.clear_memory()
        d = choose(problem, target="cpu", selector="tune", live=live)
        assert d.schedule == "ring" and d.selector == "tune" and d.final
        names = schedules.names()
        # two warm-up rounds in order, then five timed ones, each in its own shuffled order
        assert live.runs[:2 * len(names)] == [(name, "dma") for name in names] * 2
        rounds = [live.runs[i:i + len(names)] for i in range(2 * len(names), len(live.runs),
                                                             len(names))]
        assert len(rounds) == 5 and all(sorted(r) == sorted(rounds[0]) for r in rounds)
        assert len({tuple(r) for r in rounds}) > 1
        d2 = choose(problem, target="cpu", selector="tune", live=live)
        assert d2.schedule == "ring" and len(live.runs) == 7 * len(names)
        tune.clear_memory()   # a fresh process: the file answers, nothing is measured

        def fail(name, via):
            raise AssertionError("must not measure again")

        assert choose(problem, target="cpu", selector="tune",
                      live=Scripted(fail)).schedule == "ring"
    data = entries_in(tmp_path / tune.CACHE_FILE)
    (key, entry), = data.items()
    assert entry["schedule"] == "ring" and "W=4" in key and "cpu" in key
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_tune_without_a_live_group_says_the_model_decided(tmp_path):
    """Offline (no live group) and before measuring, tune decides by the model and says so;
    the runtime does not keep such a decision (final False)."""
    with config.scope(cache_dir=str(tmp_path)):
        tune.clear_memory()
        d = choose(Problem(64, 32, (16,), "float32", 4), target="cpu", selector="tune")
    model = choose(Problem(64, 32, (16,), "float32", 4), target="cpu", selector="model")
    assert (d.selector, d.schedule, d.final) == ("tune", model.schedule, False)
    assert "not tuned yet (no live group" in d.reason and d.decided_by.startswith("model")


def test_info_logging_once_per_problem_key(caplog):
    problem = Problem(1000, 64, (48,), "float32", 3)
    with config.scope(log="info"), caplog.at_level(logging.INFO, logger="ficco"):
        for _ in range(3):
            choose(problem, target="cpu", selector="paper")
    lines = [r for r in caplog.records if "ficco decision" in r.getMessage()]
    assert len(lines) == 1 and "M=3000" in lines[0].getMessage()


def test_decision_is_frozen_and_prints_a_table():
    d = choose(table_i_problem("g5"), target="rocm:gfx942", selector="paper")
    assert isinstance(d, Decision)
    with pytest.raises(AttributeError):
        d.schedule = "serial"
    assert str(d).splitlines()[0].startswith("schedule  uniform-fused-2d")


def test_table_i_is_the_papers():
    assert len(PAPER_TABLE_I) == 16 and PAPER_TABLE_I["g13"] == (1607680, 57344, 8192)
    assert table_i_problem("g2").key() == (16384, 16384, (2048,), "bfloat16", 8)


# -- explain on a live group -------------------------------------------------------------------
def _explain_live(rank, world, seed, cache_dir):
    from ficco.runtime import path as runtime

    shards, bs, _, refs = make_inputs(seed, world, (12, 16), (20,), torch.float32)
    with ficco.config.scope(selector="tune", cache_dir=cache_dir):
        tune.clear_memory()
        before = ficco.explain(shards[rank], bs[0])     # local: nothing measured yet
        out = ficco.all_gather_matmul(shards[rank], bs[0])   # measures every candidate
        ran = runtime.last_run()
        after = ficco.explain(shards[rank], bs[0])      # local: the measured winner
    picked_by = []
    for sel in ("paper", "model"):
        with ficco.config.scope(selector=sel):
            picked_by.append(ficco.explain(shards[rank], bs[0]).selector)
    return (before.selector, "not tuned yet" in before.reason, after.schedule, after.reason,
            tuple(sorted(after.scores)), ran[0], max_row_rel_err(out, refs[0]), tuple(picked_by))


def test_explain_is_local_and_reports_what_the_call_tuned(tmp_path):
    results = harness.pool(3).run(_explain_live, random.randrange(1 << 30), str(tmp_path))
    assert len({r[2] for r in results}) == 1, results
    for selector, untuned, schedule, reason, scored, ran, err, picked in results:
        assert selector == "tune" and untuned, results
        assert schedule == ran and "tuned earlier" in reason, results
        assert scored == tuple(sorted(schedules.names())), results
        assert err <= ROW_TOL[torch.float32] and picked == ("paper", "model"), results
    entries = entries_in(tmp_path / tune.CACHE_FILE)
    assert [e["schedule"] for e in entries.values()] == [results[0][2]]


# -- The model knows its error ------------------------------------------------
def _with_band(monkeypatch, width):
    """Every shape class gets the band ``width``."""
    from ficco.heuristics import bands

    data = {"all": {"band": width, "rows": []}, "classes": {}}
    monkeypatch.setattr(bands, "load", lambda path=bands.BANDS_FILE: data)


BAND_CASES = [("g6", "rocm:gfx942", 1), ("g14", "rocm:gfx942", 8), ("g2", "cuda:sm_90", 8),
              ("rs-70b-down", "cuda:sm_90", 1), ("rs-small", "cuda:sm_90", 1)]


def _band_problem(name, scale):
    if name == "rs-70b-down":   # llama-70B down projection at TP 8, seq 8192
        return Problem(8192, 3584, (8192,), "bfloat16", 8, op="matmul_reduce_scatter")
    if name == "rs-small":
        return Problem(1024, 3584, (8192,), "bfloat16", 8, op="matmul_reduce_scatter")
    return table_i_problem(name, scale=scale)


def _gain(decision):
    """The predicted gain of the fastest candidate over serial on the better transport."""
    fastest = min(decision.scores.values())
    return decision.scores["serial"] / fastest - 1


@pytest.mark.parametrize("name, target, scale", BAND_CASES)
def test_model_never_keeps_an_overlap_whose_predicted_gain_is_inside_its_band(
        monkeypatch, name, target, scale):
    """Invariants of the band rule: with band 0 the model picks the fastest candidate; with any
    band an overlapped pick's predicted gain over the best serial exceeds the band, and a pick
    of serial means no candidate's gain does; widening the band never turns serial into an
    overlapped schedule; the reason says which case it is."""
    problem = _band_problem(name, scale)
    transports = ("dma", "ccl")
    picks = []
    for width in (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 5.0):
        _with_band(monkeypatch, width)
        d = choose(problem, transport=transports, target=target, selector="model")
        per_via = {via: model.predict_all(problem, profiles.resolve(target), None, via, None,
                                          schedules.offered(target, via, problem.op))
                   for via in transports}
        base = min(per_via[via]["serial"] for via in transports)
        fastest = min(t for times in per_via.values() for t in times.values())
        gain = base / fastest - 1
        assert d.band == width and d.band_class.startswith(problem.op)
        if d.schedule == "serial":
            assert d.scores["serial"] == base
            assert gain <= width or all(t >= base for times in per_via.values()
                                        for t in times.values())
            if gain > 0 and min(min(t.values()) for t in per_via.values()) < base:
                assert f"inside the model's \u00b1{width:.0%}" in d.reason, d.reason
        else:
            assert base / d.scores[d.schedule] - 1 > width, (width, d)
            assert f"exceeds the model's \u00b1{width:.0%}" in d.reason
        if width == 0.0 and gain > 0:
            assert d.scores[d.schedule] == fastest
        picks.append(d.schedule != "serial")
        assert "band      \u00b1" in str(d)
    # a wider band never keeps more overlap than a narrower one
    assert picks == sorted(picks, reverse=True), picks
    assert picks[-1] is False


def test_the_band_never_touches_forced_paper_or_tune_decisions(monkeypatch, tmp_path):
    _with_band(monkeypatch, 5.0)
    g2 = table_i_problem("g2")
    forced = choose(g2, target="rocm:gfx942", forced="hetero-unfused-1d", forced_by="argument")
    assert (forced.schedule, forced.band) == ("hetero-unfused-1d", None)
    paper = choose(g2, target="rocm:gfx942", selector="paper")
    assert (paper.schedule, paper.band) == ("hetero-unfused-1d", None)
    with config.scope(cache_dir=str(tmp_path)):
        tuned = choose(g2, target="cpu", selector="tune",
                       live=Scripted(lambda name, via: 1.0 if name == "ring" else 2.0))
    assert (tuned.schedule, tuned.band) == ("ring", None)


def test_bands_come_from_validated_residuals_by_shape_class():
    from ficco.heuristics import bands

    rows = [dict(id=f"r{i}", op="matmul_reduce_scatter", role="tune", kind="point",
                 rel_error=f"{e:+.3f}", **{"class": "matmul_reduce_scatter/balanced"})
            for i, e in enumerate((0.01, -0.02, 0.03, -0.04, 0.20))]
    rows += [dict(id="a", op="all_gather_matmul", role="holdout", kind="point", rel_error="+0.3",
                  **{"class": "all_gather_matmul/comm-bound"}),
             dict(id="fit", op="all_gather_matmul", role="fit", kind="point", rel_error="+0.9",
                  **{"class": "all_gather_matmul/comm-bound"}),
             dict(id="agg", op="all_gather_matmul", role="tune", kind="aggregate",
                  rel_error="+0.9", **{"class": ""})]
    data = bands.from_rows(rows)
    # the 80th percentile by nearest rank of the class's five residuals
    assert data["classes"]["matmul_reduce_scatter/balanced"]["band"] == 0.04
    # a class with fewer rows than MIN_ROWS takes its op's band; fits and aggregates are left out
    assert "all_gather_matmul/comm-bound" not in data["classes"]
    assert data["classes"]["all_gather_matmul"] == {"band": 0.3, "rows": ["a"], "median": 0.3}
    prof = profiles.load("h100")
    ag = Problem(4096, 8192, (1024,), "bfloat16", 8)
    assert bands.band(ag, prof, data=data)[0] == 0.3
    assert bands.band(Problem(8, 8, (8,), "bfloat16", 8, op="matmul_reduce_scatter"), prof,
                      data={"all": {"band": 0.5}, "classes": {}})[0] == 0.5
    # an overlapped implementation the model does not price (no prediction), measured 25%
    # slower than its publication's serial row: that row's class keeps serial below 25%
    rs = Problem(4096, 8192, (8192,), "bfloat16", 8, op="matmul_reduce_scatter")
    cls = bands.shape_class(rs, prof)
    serial = dict(id="s", op="matmul_reduce_scatter", role="tune", kind="point", published="100",
                  rel_error="+0.01", prediction="101", **{"class": cls})
    lost = dict(id="l", op="matmul_reduce_scatter", role="tune", kind="point", published="125",
                rel_error="", prediction="", versus="s", **{"class": ""})
    won = dict(lost, id="w", published="90")
    data = bands.from_rows(rows + [serial, lost, won])
    assert data["floors"] == {cls: {"loss": 0.25, "rows": ["l"]}}
    assert bands.band(rs, prof, data=data) == (0.25, cls)
    # the shipped bands cover both ops, from the command that regenerates them
    shipped = bands.load()
    assert shipped["generated_by"] == bands.COMMAND
    assert {"all_gather_matmul", "matmul_reduce_scatter"} <= set(shipped["classes"])


def test_explain_lines_up_its_columns_and_says_what_otb_and_mt_are():
    """The explain header was misaligned and OTB/MT were never defined."""
    d = choose(table_i_problem("g6"), target="rocm:gfx942", selector="model")
    lines = str(d).splitlines()
    key = next(line for line in lines if line.startswith("key "))
    assert "otb = op-to-byte" in key and "mt = " in key and "MK + KN + MN" in key
    head = next(line for line in lines if line.startswith("scores "))
    rows = [line for line in lines[lines.index(head) + 1:]]
    assert len(rows) == len(d.scores)
    for column in ("schedule", "time", "vs best"):
        assert column in head
    for row in rows:
        name = row.split()[-4] if row.split()[0] == "*" else row.split()[0]
        assert row.index(name) == head.index("schedule"), (head, row)
        assert row.index(" ms") + len(" ms") == head.index("time") + len("time"), (head, row)
        assert row.rstrip().endswith("x") and len(row.rstrip()) == len(head.rstrip()) + 0


def _decision_logs(rank, world, ranks_setting, rows):
    """The 'ficco decision' records this rank logs for one call of a new shape at
    FICCO_LOG=info, with FICCO_LOG_RANKS=ranks_setting."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("ficco").addHandler(handler)
    try:
        with config.scope(log="info", log_ranks=ranks_setting):
            ficco.all_gather_matmul(torch.randn(rows, 8), torch.randn(8, 3))
    finally:
        logging.getLogger("ficco").removeHandler(handler)
    return [r for r in records if "ficco decision" in r]


def test_logs_come_from_rank_zero_unless_every_rank_is_asked_for():
    from .. import harness

    pool = harness.pool(2)
    rank0, rank1 = pool.run(_decision_logs, "0", 37)
    assert len(rank0) == 1 and "rank 0" in rank0[0] and rank1 == [], (rank0, rank1)
    rank0, rank1 = pool.run(_decision_logs, "all", 41)
    assert len(rank0) == 1 and len(rank1) == 1 and "rank 1" in rank1[0], (rank0, rank1)


def test_a_forced_schedule_shows_its_predicted_time():
    """explain() of a forced schedule said only "forced by argument": it now shows
    the model's predicted time for it beside the candidates, labelled simulated."""
    problem = Problem(4096, 512, (1024,), "bfloat16", 4)
    decision = choose(problem, forced="hetero-fused-1d", forced_by="argument",
                      target="cuda:sm_90")
    assert decision.schedule == "hetero-fused-1d" and decision.selector == "forced"
    predicted = decision.scores["hetero-fused-1d"]
    assert predicted == model.predict("hetero-fused-1d", problem, profiles.load("h100"),
                                      None, "dma")
    assert f"predicts {predicted * 1e3:.3f} ms" in decision.reason
    assert "simulated on h100" in decision.reason
    assert "* hetero-fused-1d" in str(decision) and " ms " in str(decision)
