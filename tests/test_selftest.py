"""``python -m ficco selftest`` (ficco/selftest) on CPU ranks at W = 2 and 3, on the fake GPU,
against a schedule broken on purpose, a hang, and as the command a user runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ficco import ops, schedules
from ficco.selftest import FAILED, OK, exit_code

from . import harness
from . import selftest_cases as cases


def _check(report, world, target="cpu", dtypes=("float32", "bfloat16")):
    rows = report["rows"]
    failed = [r for r in rows if r["status"] == "FAIL"]
    assert failed == [], failed
    ran = {(r["op"], r["transport"], r["schedule"]) for r in rows if r["check"] == "schedule"}
    for op in ops.names():                       # every op, both transports, every pick
        for transport in ("dma", "ccl"):
            for name in schedules.offered(target, transport, op):
                assert (op, transport, name) in ran, (op, transport, name)
    ran_dtypes = {r["dtype"] for r in rows if r["check"] == "schedule"}
    assert set(dtypes) <= ran_dtypes
    faults = [r for r in rows if r["check"] == "fault"]
    assert faults[0]["outcome"] == "exact" and len(faults) == 2, faults
    assert exit_code([report]) == OK


@pytest.mark.parametrize("world", [2, 3])
def test_selftest_passes_on_cpu_ranks(world):
    reports = harness.pool(world).run(cases.quick, timeout_s=300)
    for report in reports:
        _check(report, world)
        graph = [r for r in report["rows"] if r["check"] == "graph"]
        assert graph[0]["status"] == "skip" and "no CUDA graphs" in graph[0]["detail"]
    env = reports[0]["environment"]
    assert env["backend"] == "cpu" and env["torch"] and "settings" in env


def test_selftest_passes_on_the_fake_gpu():
    """GpuBackend's real host code (barriers, watchdog, error words, fences) under selftest;
    no graph capture here (the fake has no torch.cuda.graph)."""
    from ficco.selftest import Options

    options = Options(shapes=("tiny",), dtypes=("float32",), graph=False, fault_timeout_s=1.0)
    reports = harness.pool(2).run(cases.quick, "cuda", options, timeout_s=300)
    for report in reports:
        _check(report, 2, target="cuda:sm_90", dtypes=("float32",))
        assert report["environment"]["pads"]["pads"] == "host"
        assert report["environment"]["pads"]["view_problems"] == []


def test_selftest_fails_on_a_planted_broken_schedule():
    reports = harness.pool(2).run(cases.planted, timeout_s=300)
    for report in reports:
        bad = [r for r in report["rows"] if r["status"] == "FAIL"]
        assert bad and {r["schedule"] for r in bad} == {"ring"}, bad
        assert all(r["transport"] in ("dma", "ccl") for r in bad)
        good = [r for r in report["rows"] if r["status"] == "ok"]
        assert {r["schedule"] for r in good} >= {"serial", "uniform-fused-1d"}
    assert exit_code(reports) == FAILED


def test_a_hung_check_ends_the_run_within_its_bound():
    """Rank 1's call never returns: its watch ends it (exit 3) at the 3 s bound, and rank 0,
    waiting for rank 1's outcome, ends at its own; neither waits out the hang."""
    import time

    start = time.monotonic()
    outcomes = harness.run_alone(2, cases.hangs, timeout_s=120, raw=True)
    assert [o[0] for o in outcomes] == ["err", "err"], outcomes
    assert all("died" in str(o[1]) for o in outcomes), outcomes
    assert time.monotonic() - start < 60


def test_the_command_writes_its_bundle_and_exit_code(tmp_path):
    bundle = tmp_path / "selftest.json"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "ficco", "selftest", "--world", "2", "--smoke",
                           "--json", str(bundle)], capture_output=True, text=True, timeout=300,
                          env=env, check=False)
    assert done.returncode == OK, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ficco ") and lines[-1].startswith("selftest: ")
    data = json.loads(bundle.read_text())
    assert data["failed"] == [] and len(data["environment"]["ranks"]) == 2
    assert {c["op"] for c in data["checks"]} == set(ops.names())
    assert all(c["status"] == "ok" and c["error"] <= c["tolerance"] for c in data["checks"])
