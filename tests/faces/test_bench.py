"""Benchmarks (ficco/bench): scenario sets, the result schema and its summaries, the fits that
turn measurements into a profile, and smoke runs of sweep, characterize and timeline on CPU
that check the files they write (never their timings)."""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ficco.bench import fit as profile_fit
from ficco.bench import results, scenarios

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(args: list[str], tmp_path: Path, ranks: int | None = None) -> str:
    """Run ``python -m ficco.bench ...`` (under torch.distributed.run when ``ranks``) on the
    CPU backend and return its output; a failure shows that output."""
    # a cache of its own: a characterize run installs its profile there, which must
    # not change what the rest of the suite decides
    env = dict(os.environ, FICCO_BACKEND="cpu", OMP_NUM_THREADS="1", FICCO_TIMEOUT="60",
               FICCO_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FICCO_PROFILE", None)
    cmd = [sys.executable]
    if ranks:
        cmd += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                "--master-port", str(_free_port())]
    cmd += ["-m", "ficco.bench", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{output[-6000:]}"
    return output


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


# -- scenarios --------------------------------------------------------------------------------
def test_paper_table_is_complete_and_scales_m_only():
    full, scaled = scenarios.paper(), scenarios.paper(scale=64)
    assert [s.name for s in full] == [f"g{i}" for i in range(1, 17)]
    assert (full[0].big_m, full[0].n, full[0].k) == (16384, 16384, 131072)
    assert (full[12].big_m, full[12].n, full[12].k) == (1607680, 57344, 8192)
    for f, s in zip(full, scaled):
        assert (s.big_m, s.n, s.k) == (f.big_m // 64, f.n, f.k)
    # each rank multiplies by its N / W slice of the layer's weight (ficco.heuristics' reading)
    assert scaled[1].problem(world=8).ns == (16384 // 8,)
    tiny = scenarios.paper(scale=4096, scale_nk=1024)[4]
    assert (tiny.big_m, tiny.n, tiny.k) == (2, 8, 256)


def test_llama_presets_shard_n_or_k_by_tp():
    by_name = {s.name: s for s in scenarios.llama("70B", seq_len=4096, tp=8)}
    assert (by_name["llama-70B-qkv"].n, by_name["llama-70B-qkv"].k) == ((8 + 2) * 128, 8192)
    assert (by_name["llama-70B-o"].n, by_name["llama-70B-o"].k) == (8192, 1024)
    assert (by_name["llama-70B-upgate"].n, by_name["llama-70B-upgate"].k) == (2 * 3584, 8192)
    assert (by_name["llama-70B-down"].n, by_name["llama-70B-down"].k) == (8192, 3584)
    assert all(s.big_m == 4096 for s in by_name.values())
    with pytest.raises(ValueError, match="8B, 70B, 405B"):
        scenarios.llama("7B", 4096, 8)


def test_shapes_parse_and_uneven_m_rounds_down_per_rank():
    sc = scenarios.parse_shape("1001,64,32")
    assert (sc.name, sc.big_m, sc.n, sc.k) == ("1001x64x32", 1001, 64, 32)
    assert sc.problem(world=4).m == 250 and sc.problem(world=4).big_m == 1000
    assert sc.problem(world=4).ns == (16,)
    with pytest.raises(ValueError, match="M,N,K"):
        scenarios.parse_shape("12,abc")


# -- results: summaries and schema ------------------------------------------------------------
def _fake(scenario, schedule, median_s, transport="dma", kind="schedule"):
    return {"schema": results.SWEEP_SCHEMA, "scenario": scenario, "schedule": schedule,
                "transport": transport, "kind": kind, "status": "ok", "median_s": median_s}


def test_percentiles_match_numpy():
    np = pytest.importorskip("numpy")
    values = list(np.random.default_rng().random(17))
    for q in (10, 50, 90):
        assert results.percentile(values, q) == pytest.approx(np.percentile(values, q))
    summary = results.timing_summary(values)
    assert summary["median_s"] == pytest.approx(np.median(values))


def test_finalize_and_selector_accuracy():
    recs_a = [_fake("a", "serial", 4.0, "ccl", "baseline"), _fake("a", "ring", 2.0),
              _fake("a", "uniform-fused-1d", 1.0)]
    recs_b = [_fake("b", "serial", 3.0, "ccl", "baseline"), _fake("b", "ring", 3.0),
              _fake("b", "uniform-fused-1d", 1.02)]
    results.finalize_scenario(recs_a, {"paper": "ring", "model": "uniform-fused-1d"})
    results.finalize_scenario(recs_b, {"paper": "uniform-fused-1d", "model": "ring"})
    assert [r["speedup"] for r in recs_a] == [1.0, 2.0, 4.0]
    assert recs_a[0]["best_schedule"] == "uniform-fused-1d" and recs_a[0]["best_speedup"] == 4.0
    assert recs_a[0]["pick_speedups"] == {"paper": 2.0, "model": 4.0}
    assert recs_a[1]["picked_by"] == ["paper"] and recs_a[2]["picked_by"] == ["model"]
    acc = results.selector_accuracy(recs_a + recs_b)
    # paper: misses a (loses half), hits b (1.02 is within 5% of 1.02); model the reverse.
    assert acc["paper"] == {"scenarios": 2, "hits": 1, "accuracy": 0.5,
                            "mean_loss_when_missed": pytest.approx(0.5)}
    assert acc["model"]["hits"] == 1
    assert acc["model"]["mean_loss_when_missed"] == pytest.approx(1 - 1.02 / 3.0)


def test_validate_names_each_problem():
    bad = _fake("a", "ring", None)
    bad.update(status="ok", times_s=[], env={})
    with pytest.raises(ValueError) as info:
        results.validate(bad)
    text = str(info.value)
    assert "times_s" in text and "median_s" in text and "env lacks" in text and "big_m" in text


# -- characterize fits ------------------------------------------------------------------------
def test_fits_recover_the_simulator_parameters():
    latency_s, bandwidth = 5e-6, 2e10
    points = [(s, latency_s + s / bandwidth) for s in (4096, 65536, 1 << 20, 1 << 24)]
    fit_latency, fractions = profile_fit.fit_copy_curve(points)
    # a latency no larger than the true one (it must leave every copy a transfer part) ...
    assert 0.9 * latency_s <= fit_latency <= latency_s
    assert fractions[str(1 << 20)] == pytest.approx(1.0, rel=0.01)
    # ... and a curve that gives back every measured time (what the simulator will predict)
    for size, seconds in points[:-1]:
        assert fit_latency + size / (fractions[str(size)] * points[-1][0] / points[-1][1]) \
            == pytest.approx(seconds, rel=1e-3)
    recs = [{"victim": v, "mt_bytes": mt, "cil": 1 + coef * mt / (mt + 3e8)}
            for v, coef in (("gemm", 0.3), ("copy", 0.1)) for mt in (1e7, 1e8, 1e9, 1e10)]
    fit = profile_fit.fit_cil(recs)
    assert fit["dma_gemm"] == pytest.approx(0.3, rel=0.1)
    assert fit["dma_copy"] == pytest.approx(0.1, rel=0.1)
    assert 1e8 < fit["mt_half_bytes"] < 1e9


@pytest.mark.parametrize("backend", ["cpu", "cuda:sm_90"])
def test_a_characterized_profile_keeps_the_copy_bandwidth_it_measured(backend):
    """Characterize measured ~55 GB/s copies on a CPU and wrote a profile that kept
    the built-in 5 GB/s (only the curve's fractions were written). On CPU the profile now
    prices the largest measured copy at its measured time; on a GPU, where the copy measured is
    local and says nothing about the links, the built-in link numbers stay."""
    from ficco.heuristics import profiles, simulator
    from ficco.plan import Block, Copy, Plan
    from ficco.plan.problem import Problem

    base = profiles.load("cpu" if backend == "cpu" else "h100")
    bandwidth, latency = 55e9, 3e-6
    env = {"env_backend": backend}
    recs = [{"kind": "copy", "shape": "1d", "bytes": size, "time_s": latency + size / bandwidth, "env": env}
            for size in (1 << 12, 1 << 16, 1 << 20, 1 << 24)]
    fitted = profile_fit.fit_profile(base, recs, "float32", "t", "test")
    if backend != "cpu":
        assert (fitted.copy_engine_bytes_per_s, fitted.link_bytes_per_s) == \
            (base.copy_engine_bytes_per_s, base.link_bytes_per_s)
        return
    big = 1 << 24
    assert fitted.copy_engine_bytes_per_s == pytest.approx(big / (latency + big / bandwidth))
    assert "GB/s" in fitted.sources["copy_engine_bytes_per_s"]
    problem = Problem(big // 4, 1, (1,), "float32", 2)
    copy = Copy("copy0", Block("input", 0, big // 4, 0, 1, peer=1), Block("gathered", 0,
                                                                         big // 4, 0, 1))
    plan = Plan("one-copy", "dma", problem, ("copy0",), (copy,))
    predicted = simulator.simulate(plan, dataclasses.replace(fitted, host_op_s=0.0)).makespan_s
    assert predicted == pytest.approx(latency + big / bandwidth, rel=0.05)


# -- smoke runs on CPU ------------------------------------------------------------------------
def test_sweep_two_ranks_writes_schema_and_plots(tmp_path):
    out = tmp_path / "sweep"
    schedules = ["ring", "uniform-fused-1d", "hetero-unfused-1d"]
    text = _run(["sweep", "--scenarios", "paper", "--only", "g1,g2", "--scale", "2048",
                 "--scale-nk", "512", "--schedules", ",".join(schedules), "--warmup", "1",
                 "--repeat", "2", "--out", str(out)], tmp_path, ranks=2)
    assert "speedup" in text and "selector paper" in text
    records = results.read_jsonl(out / "results.jsonl")
    expected = {(sc, name, t) for sc in ("g1", "g2")
                for name, t in [("serial", "ccl"), ("torch-fused", "symm_mem")]
                + [(s, "dma") for s in schedules]}
    assert {(r["scenario"], r["schedule"], r["transport"]) for r in records} == expected
    for r in records:
        results.validate(r)
        assert r["world"] == 2 and r["env"]["env_world"] == 2
        if r["schedule"] == "torch-fused":
            assert r["status"] == "skipped" and "CUDA" in r["reason"]
            continue
        assert r["status"] == "ok", r["reason"]
        assert len(r["times_s"]) == 2 and r["p10_s"] <= r["median_s"] <= r["p90_s"]
        # the sweep checks each schedule's first result against a float64 reference
        assert r["max_abs_err"] < 1e-3
        assert set(r["picks"]) <= set(results.SELECTORS)
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(results.SWEEP_FIELDS) and len(rows) == len(records)
    for name in ("speedup.png", "ratio.png", "selectors.png"):
        assert _is_png(out / name), name
    assert (out / "table.txt").read_text().startswith("scenario")


def test_characterize_quick_writes_a_loadable_profile(tmp_path):
    """`characterize --quick` on CPU measures GEMM rates per dtype, copies,
    contention and the four collectives' curves over two gloo ranks, and installs the profile
    for this SKU: a new process with no settings prices with it."""
    from ficco.heuristics import profiles

    out = tmp_path / "char"
    printed = _run(["characterize", "--quick", "--out", str(out), "--name", "cpu-test"],
                   tmp_path)
    assert "installed as this machine's calibrated profile" in printed
    profile = profiles.load(str(out / "profile.json"))
    assert profile.name == "cpu-test"
    assert any("characterize" in v for v in profile.sources.values())
    assert 0 < profile.dil["gemm_efficiency"] <= 1
    assert sorted(profile.ccl["busbw"]) == ["all_gather", "all_reduce", "all_to_all",
                                            "reduce_scatter"]
    assert profile.ccl["busbw_world"] == 2 and "ccl.busbw" in profile.sources
    assert all(bw > 0 for curve in profile.ccl["busbw"].values() for bw in curve.values())
    probe = ("from ficco.heuristics import profiles\n"
             "p, origin = profiles.in_force('cpu')\n"
             "print(p.name, p.ccl['busbw_world'], origin.split()[0])\n")
    env = dict(os.environ, FICCO_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FICCO_PROFILE", None)
    nxt = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert nxt.returncode == 0, nxt.stderr
    assert nxt.stdout.split() == ["cpu-test", "2", "calibrated"]
    recs = [json.loads(line) for line in (out / "characterize.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in recs}
    assert kinds == {"dil", "copy", "copy_width", "cil", "gemm_rate", "ccl"}
    assert {r["dtype"] for r in recs if r["kind"] == "gemm_rate"} == {"float32", "bfloat16"}
    assert {(r["split"], r["ways"]) for r in recs if r["kind"] == "dil"} == \
        {("row", 8), ("row", 64), ("col", 8), ("col", 64)}
    assert all(r["schema"] == results.CHARACTERIZE_SCHEMA for r in recs)
    for name in ("dil.png", "copy_efficiency.png", "cil.png"):
        assert _is_png(out / name), name


def test_characterize_enqueue_on_cpu_measures_host_op_s_into_the_profile(tmp_path):
    """Host_op_s comes from a measuring command, not a constant. On CPU
    ``--parts enqueue`` times eager W = 8 calls of every schedule of both ops on the real CPU
    backend and the profile it writes holds their fitted cost per op."""
    from ficco.heuristics import profiles

    out = tmp_path / "enq"
    _run(["characterize", "--parts", "enqueue", "--no-plots", "--out", str(out)], tmp_path)
    recs = [json.loads(line) for line in (out / "characterize.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in recs} == {"enqueue"}
    assert {r["op"] for r in recs} == {"all_gather_matmul", "matmul_reduce_scatter"}
    assert all(r["ops"] > 0 and r["enqueue_s"] > 0 and r["world"] == 8 for r in recs)
    profile = profiles.load(str(out / "profile.json"))
    assert profile.host_op_s == pytest.approx(profile_fit.fit_host_op(recs))
    assert "--parts enqueue" in profile.sources["host_op_s"]
    # the fit is the slope through the origin: it gives back a plan's measured time on average
    predicted = sum(r["ops"] * profile.host_op_s for r in recs)
    assert predicted == pytest.approx(sum(r["enqueue_s"] for r in recs), rel=0.5)


def test_timeline_two_ranks_draws_measured_and_predicted(tmp_path):
    out = tmp_path / "tl"
    _run(["timeline", "--shape", "64,32,48", "--schedule", "uniform-fused-1d", "--warmup", "1",
          "--rank", "all", "--out", str(out)], tmp_path, ranks=2)
    assert _is_png(out / "timeline-uniform-fused-1d.png")
    trace = json.loads((out / "timeline-uniform-fused-1d.trace.json").read_text())
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "process_name"}
    assert [name.split(":")[0] for name in processes.values()] == \
        ["measured, rank 0", "measured, rank 1", "predicted on profile cpu"]
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert ops and all(e["dur"] >= 0 and e["ts"] >= 0 for e in ops)
    record = json.loads((out / "timeline.json").read_text())
    assert record["schema"] == results.TIMELINE_SCHEMA and record["world"] == 2
    assert record["max_abs_err"] < 1e-3
    for rows in (record["measured_rows"]["0"], record["predicted_rows"]):
        assert rows and all({"queue", "start_s", "end_s", "kind"} <= set(r) for r in rows)
        assert all(r["end_s"] >= r["start_s"] for r in rows)
    assert {r["queue"] for r in record["measured_rows"]["1"]} >= {"compute", "copy0"}
    # the trace holds exactly the bars of the record, per rank, in microseconds
    by_pid = {pid: sorted(e["ts"] for e in ops if e["pid"] == pid) for pid in processes}
    assert by_pid[0] == sorted(r["start_s"] * 1e6 for r in record["measured_rows"]["0"])
    assert len(by_pid[2]) == len(record["predicted_rows"])


def test_docs_list_every_sweep_field():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    missing = [f for f in results.SWEEP_FIELDS if f"| `{f}` |" not in text]
    assert not missing, f"docs/benchmarks.md lacks schema rows for {missing}"


def test_bench_default_pairs_each_round_so_a_drifting_load_cancels_out():
    """``bench default``'s ratios are the median of per-round ratios: a load that drifts
    between rounds slows both samples of a round alike, so the ratio stays the true one, where
    a ratio of medians follows whichever variant the machine's bursts caught in the light
    rounds."""
    import numpy as np

    from ficco.bench.default import summary

    rng = np.random.default_rng()
    rounds = 21
    load = np.linspace(1, 3, rounds) * (1 + 0.01 * rng.random(rounds))  # a drifting load
    dma_s, ccl_s, true = rng.uniform(1e-3, 2e-3), rng.uniform(2e-3, 3e-3), 1.05
    dma, ccl = dma_s * load, ccl_s * load
    burst = np.where(np.arange(rounds) < 8, 2.0, 1.0)  # bursts caught the default's 8 first
    default = true * dma_s * load * burst
    same = true * dma_s * load
    row = summary([list(default), list(dma), list(ccl), list(same)])
    assert row["vs_serial"] == pytest.approx(true, rel=1e-12)     # paired with serial over dma
    assert np.median(default) / np.median(dma) > 1.1 * true       # what medians' ratio says
    assert row["vs_itself"] == pytest.approx(1.0, rel=1e-12)
    assert row["serial_dma_s"] == pytest.approx(np.median(dma))
    assert row["default_s"] == pytest.approx(np.median(default))
    assert row["fastest_vs_serial"] == pytest.approx(default.min() / dma.min())
    # the better serial is the one with the lower median: ccl, once it is faster
    row = summary([list(default), list(dma), list(0.5 * dma_s * load), list(same)])
    assert row["vs_serial"] == pytest.approx(2 * true, rel=1e-12)


def test_bench_default_has_cases_for_every_registered_op():
    """``python -m ficco.bench default`` is how "never slower than serial" is checked: an op
    without cases there is not checked (the verb then exits 1)."""
    from ficco import ops
    from ficco.bench import default

    assert sorted(set(ops.names()) - set(default.CASES)) == []
    import ficco

    for op in default.FROM_EXAMPLE:        # their inputs and explain() come from the spec
        _, explain = default.inputs(op, 0, 1, default.CASES[op][0][1], 3)
        assert explain().schedule in ficco.schedules.names(op=op)
