"""The lease scripts (bench/gpu_lease.sh, bench/gpu_lease_next.sh) in CI: the rehearsal, for
real on the fake GPU of tests/fake_gpu.py (every Python they start runs ficco there,
tests/fake_gpu_site), every part in order with its real files, shrunk (FICCO_LEASE_QUICK=1);
`make rehearse-lease-image` runs the same rehearsal with the GPU image's versions. And with a
stand-in Python whose parts fail, hang or get killed on cue: the bounds, a failing part, the
smoke's stop on a wrong result or a hang only, a killed lease; pytest's --timeout without
pytest-timeout; the kernel tests' GPU cases collected where the interpreter cannot run."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lease(script, out, env=None, py=sys.executable, timeout=600, **popen):
    full = {**os.environ, "OUT": str(out), "PY": str(py), "OMP_NUM_THREADS": "1",
            "TRITON_CACHE_DIR": str(out.parent / "triton-cache"),
            # a lease calibrates profiles (characterize): into a cache of its own, never the
            # suite's, whose decisions later tests check against the built-in profiles
            "FICCO_CACHE_DIR": str(out.parent / "ficco-cache"), **(env or {})}
    return subprocess.run(["bash", str(ROOT / "bench" / script)], cwd=ROOT, env=full,
                           capture_output=True, text=True, timeout=timeout, check=False)


def _parts(log: str) -> dict:
    """name -> exit code of every part, from its log."""
    return {m[0]: int(m[1]) for m in re.findall(r"^== (\S+): exit (\d+) after", log, re.MULTILINE)}


def _returned(out: Path) -> list[Path]:
    """What the device tool brings back: at most 8 files, at most two folders down."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    assert all(len(p.relative_to(out).parts) <= 3 for p in files), files
    return files


#: the fake GPU, every part shrunk; bounds x3 (a loaded 2-core CI machine starts the ranks'
#: interpreters slowly: a bound cut would stop the lease at its smoke)
FAKE = {"FICCO_LEASE_QUICK": "1", "FICCO_LEASE_SCALE": "3", "FICCO_FAKE_GPU": "cuda:8",
        "PYTHONPATH": str(ROOT / "tests" / "fake_gpu_site")}


#: what the first lease returns, and in which order its parts run
LEASE_FILES = {"lease.log", "versions.txt", "smoke.jsonl", "selftest-w2.jsonl", "pytest.txt",
               "speed.jsonl"}
LEASE_PARTS = ["versions", "smoke", "selftest-w2", "correctness", "kernel-tests", "warp-exit",
               "speed", "faults"]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_lease_runs_every_part_on_the_fake_gpu(tmp_path):
    """The rehearsal: every part, in order, passes on the fake GPU and leaves the files the
    real lease returns, each as the lease writes it (streamed JSON lines; pytest -v naming
    every GPU test, collected and skipped here for want of a GPU; the speed part's numbers
    checked against float64, torch's fused ops a skipped line with its reason)."""
    out = tmp_path / "out"
    start = time.monotonic()
    done = _lease("gpu_lease.sh", out, FAKE)
    log = (out / "lease.log").read_text()
    parts = _parts(log)
    assert list(parts) == LEASE_PARTS, log
    # every part passes but selftest W=2, whose one failure is the fake GPU's missing graphs
    assert {name: rc for name, rc in parts.items() if rc} == {"selftest-w2": 1}, log
    assert time.monotonic() - start < 3 * 540, log               # within the bounds' sum
    assert {p.name for p in _returned(out)} == LEASE_FILES
    versions = (out / "versions.txt").read_text()
    assert "torch" in versions and "device" in versions
    smoke = _jsonl(out / "smoke.jsonl")
    assert "environment" in smoke[0] and smoke[0]["world"] == 2
    assert [r["row"]["status"] for r in smoke[1:]] == ["ok"], smoke
    rows = [r["row"] for r in _jsonl(out / "selftest-w2.jsonl")[1:]]
    assert [r["name"] for r in rows if r["status"] == "FAIL"] == [
        "all_gather_matmul uniform-fused-1d dma capture/replay"], rows
    assert sum(r["check"] == "schedule" and r["status"] == "ok" for r in rows) >= 22
    pytest_txt = (out / "pytest.txt").read_text()
    for name in ("test_compiled_kernel_on_the_gpu_matches_float64",     # collected, named
                 "test_gated_waits_end_alike_in_every_warp_on_gpu",
                 "test_schedule_on_gpu", "test_a_stalled_rank_is_released_and_named_on_gpu"):
        assert re.search(rf"{name}\S* SKIPPED", pytest_txt), name
    assert pytest_txt.index("test_schedule_on_gpu") < pytest_txt.index(
        "test_a_stalled_rank_is_released_and_named_on_gpu")     # correctness before faults
    speed = _jsonl(out / "speed.jsonl")
    assert len(speed) == 12, speed
    measured = [r for r in speed if r["status"] == "ok"]
    assert {(r["op"], r["variant"]) for r in measured} == {
        (op, v) for op in ("all_gather_matmul", "matmul_reduce_scatter")
        for v in ("default", "serial-dma")} | {
        ("matmul_all_reduce", v) for v in ("default", "one-shot-kernel", "two-shot-kernel")}
    assert all(r["max_row_err_sampled"] <= r["tolerance"] and r["ms_median_slowest_rank"] > 0
               for r in measured)
    # the decode lines: TP 8's GEMM, the one-kernel all-reduce forced and run (the
    # interpreter here), every row checked against float64
    decode = [r for r in measured if r["op"] == "matmul_all_reduce"]
    assert all(r["tp_simulated"] == 8 and r["shape"] == [2, 48, 64] for r in decode), decode
    assert [r["pick"] for r in decode if r["variant"] != "default"] == [
        ["one-shot-kernel", "dma"], ["two-shot-kernel", "dma"]], decode
    skipped = [r for r in speed if r["status"] == "skipped"]
    assert len(skipped) == 5 and all("CUDA tensors" in r["reason"] and "tflops" not in r
                                     for r in skipped)
    assert [r["variant"] for r in skipped if r["op"] == "matmul_all_reduce"] == \
        ["mm+torch-one-shot"]
    assert done.stdout.splitlines()[-1].startswith("parts: versions=0 smoke=0"), done.stdout


def test_the_next_lease_runs_every_part_on_the_fake_gpu(tmp_path):
    out = tmp_path / "out"
    _lease("gpu_lease_next.sh", out, FAKE)
    log = (out / "next.log").read_text()
    parts = _parts(log)
    assert list(parts) == ["memcheck", "selftest-wide", "timeline-connections-8",
                           "timeline-connections-1", "gated-tflops", "host-time",
                           "enqueue-profile"], log
    assert parts["timeline-connections-8"] == parts["timeline-connections-1"] == 0, log
    assert parts["gated-tflops"] == parts["enqueue-profile"] == parts["host-time"] == 0, log
    assert parts["selftest-wide"] == 1, log          # the fake GPU's missing graphs only
    with tarfile.open(out / "timelines.tar.gz") as tar:
        names = tar.getnames()
        for c in (8, 1):
            member = f"timelines/timeline-uniform-fused-1d-connections-{c}.json"
            assert member in names, names
            rows = json.load(tar.extractfile(member))  # type: ignore[arg-type]
            assert any(r["kind"] == "gemm" for r in rows)
    assert json.loads((out / "host_op_s.json").read_text())["host_op_s"] > 0
    assert len(_jsonl(out / "host.jsonl")) == 4                   # streamed as measured
    assert "environment" in _jsonl(out / "selftest-w4.jsonl")[0]
    assert {p.name for p in _returned(out)} == {
        "next.log", "selftest-w4.jsonl", "timelines.tar.gz", "kernels.json", "host.jsonl",
        "host_op_s.json", "enqueue.tar.gz"}


STUB = """#!/usr/bin/env bash
# A stand-in Python: what each part of the lease does, on cue.
case "$*" in
    "-c "*) echo "python $*" ;;                                        # the versions part
    *--smoke*) echo "smoke"; exit "${STUB_SMOKE_EXIT:-0}" ;;
    *"selftest --share-gpu 2 "*) echo "selftest w2 starts"; [ -n "${STUB_NO_HANG:-}" ] ||
        sleep 60 ;;                                                       # hangs: cut
    *test_gpu_backend.py*) echo "diagnosis: 7 passed"; exit 0 ;;
    *--ignore=tests/gpu/test_gpu_faults.py*) echo "correctness fails"; exit 1 ;;
    *pytest*) echo "1 passed"; exit 0 ;;
    *gpu_session*) echo "speed"; exit 0 ;;
    *) echo "python $*" ;;
esac
"""


def _stub(tmp_path) -> Path:
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    return stub


def test_a_part_past_its_bound_is_cut_and_a_failing_part_stops_nothing(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    done = _lease("gpu_lease.sh", out, {"FICCO_LEASE_SCALE": "0.05"}, py=_stub(tmp_path))
    took = time.monotonic() - start
    parts = _parts((out / "lease.log").read_text())
    assert list(parts) == LEASE_PARTS, parts
    assert parts["selftest-w2"] == 124 and parts["correctness"] == 1, parts    # cut; failed
    assert parts["kernel-tests"] == parts["speed"] == parts["faults"] == 0, parts
    assert took < 30, took                     # 60 s of hang cut at its 5 s bound
    assert "cut at its bound" in done.stdout


@pytest.mark.parametrize("code,what", [(4, "wrong result"), (3, "hang")])
def test_a_smoke_that_finds_a_wrong_result_or_a_hang_ends_the_lease_after_the_diagnosis(
        tmp_path, code, what):
    out = tmp_path / "out"
    done = _lease("gpu_lease.sh", out, {"STUB_SMOKE_EXIT": str(code)}, py=_stub(tmp_path))
    assert done.returncode == 1
    log = (out / "lease.log").read_text()
    assert list(_parts(log)) == ["versions", "smoke", "diagnosis"], log
    assert f"found a {what}" in log
    assert "diagnosis: 7 passed" in (out / "pytest.txt").read_text()


@pytest.mark.parametrize("code", [1, 124])
def test_a_smoke_that_fails_otherwise_or_is_cut_stops_nothing(tmp_path, code):
    """A failed check that returned no wrong numbers (a refused call), or a smoke cut at its
    bound (a slow first start), still lets every later part run."""
    out = tmp_path / "out"
    _lease("gpu_lease.sh", out, {"STUB_SMOKE_EXIT": str(code), "FICCO_LEASE_SCALE": "0.05"},
           py=_stub(tmp_path))
    assert list(_parts((out / "lease.log").read_text())) == LEASE_PARTS


@pytest.mark.parametrize("script", ["gpu_lease.sh", "gpu_lease_next.sh"])
def test_the_bounds_and_their_kill_grace_fit_one_device_call(tmp_path, script):
    """<= 540 s of bounds, and with 5 s of kill grace per part <= 590 s: one call whose
    timeout_s is ~590 s ends after its last part, never cutting the lease's summary."""
    out = tmp_path / "out"
    _lease(script, out, {"STUB_NO_HANG": "1"}, py=_stub(tmp_path))
    log = next(out.glob("*.log")).read_text()
    bounds = [int(b) for b in re.findall(r"^== \S+ \(bound (\d+)s", log, re.MULTILINE)]
    assert len(bounds) >= 7, log
    assert sum(bounds) <= 540 and sum(bounds) + 5 * len(bounds) <= 590, bounds


def test_a_killed_lease_leaves_what_it_wrote_before(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PY": str(_stub(tmp_path))}
    proc = subprocess.Popen(["bash", str(ROOT / "bench" / "gpu_lease.sh")], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while "selftest w2 starts" not in _text(out / "lease.log") and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)      # the device tool's kill at its limit
    proc.wait(10)
    log = _text(out / "lease.log")
    assert _parts(log) == {"versions": 0, "smoke": 0}, log
    assert "selftest w2 starts" in log and "python -c" in _text(out / "versions.txt")


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_pytests_timeout_works_without_pytest_timeout(tmp_path):
    """The GPU image may lack pytest-timeout: the lease's `--timeout N` then comes from
    tests/timeout_fallback.py (through tests/conftest.py), which fails the test past N s."""
    (tmp_path / "test_sleepy.py").write_text(
        "import time\n\ndef test_sleeps():\n    time.sleep(60)\n\n"
        "def test_adds():\n    assert 1 + 1 == 2\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:timeout", "-p",
                           "tests.timeout_fallback", "-p", "no:cacheprovider", "-q",
                           "--rootdir", str(tmp_path), "--timeout", "2",
                           str(tmp_path / "test_sleepy.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert time.monotonic() - start < 50
    assert done.returncode == 1 and "1 failed, 1 passed" in done.stdout, done.stdout
    assert "ran past its --timeout of 2 s" in done.stdout


def test_the_kernel_tests_gpu_cases_are_collected_where_the_interpreter_cannot_run(tmp_path):
    """Where Triton's interpreter cannot run the kernel (the GPU image's Triton 3.6, planted
    here), tests/engine/test_kernels.py still collects its GPU tests; the interpreted ones skip one
    by one, naming why."""
    pytest.importorskip("triton")
    (tmp_path / "old_interpreter.py").write_text(
        "def pytest_configure(config):\n"
        "    import ficco.kernels as k\n"
        "    k.MIN_TRITON_INTERPRETER = (99, 0)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "old_interpreter", "-p",
                           "no:cacheprovider", "-q", "--collect-only", "-m", "gpu",
                           "tests/engine/test_kernels.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("test_compiled_kernel_on_the_gpu_matches_float64",
                 "test_compiled_kernel_trace_reads_the_device_clock",
                 "test_compiled_kernel_gives_up_on_a_flag_that_never_comes"):
        assert name in done.stdout, done.stdout
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "old_interpreter", "-p",
                           "no:cacheprovider", "-q", "-rs", "tests/engine/test_kernels.py", "-k",
                           "test_wait_past_its_deadline"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False, env=env)
    assert "1 skipped" in done.stdout and "interpreter cannot run" in done.stdout, done.stdout


def test_the_speed_parts_decode_check_refuses_a_wrong_sum():
    """The decode lines' float64 check: the sum over the ranks passes; one rank's partial
    (an all-reduce that did not reduce), a NaN, a wrong shape or a K that TP 8 does not split
    do not."""
    import torch

    from ficco.bench.lease_speed import TOLERANCE, DecodeProblem
    from ficco.errors import InvalidArgumentError

    p = DecodeProblem(0, 3, (2, 48, 64), torch.float32, 11, torch.device("cpu"))
    assert p.a.shape == (2, 8) and p.b.shape == (8, 48)
    assert p.error(p.ref.float()) <= 1e-6
    assert p.error(p.a @ p.b) > TOLERANCE["float32"]
    nan = p.ref.float().clone()
    nan[1, 3] = float("nan")
    assert p.error(nan) == float("inf") and p.error(p.ref.float()[:1]) == float("inf")
    with pytest.raises(InvalidArgumentError, match="TP 8"):
        DecodeProblem(0, 2, (1, 48, 60), torch.float32, 11, torch.device("cpu"))
