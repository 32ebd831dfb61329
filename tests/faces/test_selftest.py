"""``python -m ficco selftest`` (ficco/selftest) on CPU ranks at W = 2 and 3, on the fake GPU,
against a schedule broken on purpose, a hang, and as the command a user runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ficco import ops, schedules
from ficco.selftest import FAILED, HUNG, OK, WRONG, exit_code

from .. import harness
from .. import selftest_cases as cases


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

    options = Options(shapes=("tiny",), dtypes=("float32", "float8"), graph=False,
                      fault_timeout_s=1.0)
    reports = harness.pool(2).run(cases.quick, "cuda", options, timeout_s=300)
    for report in reports:
        _check(report, 2, target="cuda:sm_90", dtypes=("float32", "float8"))
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
        assert all(r["wrong"] for r in bad)        # the calls returned wrong numbers
    assert exit_code(reports) == WRONG


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
    bundle, stream = tmp_path / "selftest.json", tmp_path / "selftest.jsonl"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "ficco", "selftest", "--world", "2", "--smoke",
                           "--json", str(bundle), "--jsonl", str(stream)], capture_output=True,
                          text=True, timeout=300, env=env, check=False)
    assert done.returncode == OK, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ficco ") and lines[-1].startswith("selftest: ")
    data = json.loads(bundle.read_text())
    assert data["failed"] == [] and len(data["environment"]["ranks"]) == 2
    assert {c["op"] for c in data["checks"]} == set(ops.names())
    assert all(c["status"] == "ok" and c["error"] <= c["tolerance"] for c in data["checks"])
    streamed = [json.loads(line) for line in stream.read_text().splitlines()]
    assert streamed[0]["environment"]["torch"] == data["environment"]["torch"]
    assert [s["row"] for s in streamed[1:]] == data["checks"]      # one line per check


def test_selftest_ends_at_the_first_rank_that_exits_without_a_result(tmp_path):
    """Rank 1 dies inside its first call: the run ends then (exit 3, naming the rank), not
    when rank 0's watch over its call fires (3 x timeout + 60 s: 240 s here); the lines
    streamed before stay. (The bound on the time leaves a loaded machine's start-up of two
    rank processes room.)"""
    import time

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "import ficco\n"
        "real = ficco.all_gather_matmul\n"
        "def crash(*args, **kwargs):\n"
        "    import torch.distributed as dist\n"
        "    if dist.get_rank() == 1:\n"
        "        os._exit(9)\n"
        "    return real(*args, **kwargs)\n"
        "ficco.all_gather_matmul = crash\n")
    stream = tmp_path / "selftest.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{site}:{os.getcwd()}", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ficco", "selftest", "--world", "2", "--smoke",
                           "--ops", "all_gather_matmul", "--dtypes", "float32",
                           "--timeout", "60", "--jsonl", str(stream)], capture_output=True, text=True,
                          timeout=300, env=env, check=False)
    took = time.monotonic() - start
    assert done.returncode == HUNG, done.stdout + done.stderr
    assert "rank(s) [1] exited without a result" in done.stdout, done.stdout
    assert took < 180, took
    assert "environment" in json.loads(stream.read_text().splitlines()[0])


def test_the_timing_row_fails_when_the_pick_is_slower_than_serial():
    """A default path planted slower than serial (20 ms more per call at 32 x 32 x 32) fails
    the timing row, which names serial's transport and the ratio."""
    reports = harness.pool(2).run(cases.slow_pick, timeout_s=300)
    for report in reports:
        (row,) = [r for r in report["rows"] if r["check"] == "timing"]
        assert row["status"] == "FAIL", row
        assert row["pick_over_serial"] > row["band"] and row["serial_transport"] in (
            "dma", "ccl"), row
        assert f"serial over {row['serial_transport']}" in row["detail"], row
    assert exit_code(reports) == FAILED


@pytest.mark.parametrize("device", ["gpu", "cpu"])
def test_every_case_selftest_builds_passes_the_devices_own_checks(device):
    """Each fp8 case selftest builds (every scaled op and shape, W = 2..4) as a GPU would meet
    it: ficco's device-only argument checks (``ficco.plan.epilogue.check_gpu``: K and n
    multiples of 16, B column-major) and ``torch._scaled_mm``'s own (tests/fake_gpu.py); the tiny ones'
    local products then against float64. A case a GPU refuses fails the smoke of a lease at
    its first fp8 call."""
    import torch

    import ficco
    from ficco.plan import epilogue as scaled
    from ficco.selftest import cases as built
    from ficco.selftest.checks import SHAPES

    from ..fake_gpu import check_scaled_mm

    scaled_ops = [op for op in ficco.ops.names() if built.scaled(op)]
    checked = 0
    for shape_name, shape in SHAPES[device].items():
        for world in ((2,) if shape_name == "medium" else (2, 3, 4)):
            for op in scaled_ops:
                case = built.build(op, world - 1, world, shape, "float8", 5, "cpu",
                                   torch.float8_e4m3fn)
                (a, b), kw = case.args, case.kwargs
                sa, sb = kw["a_scale"], kw["b_scale"]
                ops = scaled.operands(a, [b], rows_of=lambda t: t.reshape(-1, t.shape[-1]),
                                      a_name="a", a_scale=sa, b_scale=sb,
                                      out_dtype=kw["out_dtype"])
                scaled.check_gpu(a, [b], ops, "a")
                check_scaled_mm(a, b, sa, sb)
                if shape_name == "tiny":
                    out = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
                    local = (a.double() * sa.double()) @ (b.double() * sb.double())
                    assert torch.allclose(out.double(), local, rtol=1e-5, atol=1e-4), op
                checked += 1
    assert scaled_ops and checked == 4 * len(scaled_ops), checked
