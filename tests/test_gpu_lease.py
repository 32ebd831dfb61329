"""The lease scripts (bench/gpu_lease.sh, bench/gpu_lease_next.sh) in CI: for real on the fake
GPU of tests/fake_gpu.py (every Python they start runs ficco there, tests/fake_gpu_site), every
part shrunk (FICCO_LEASE_QUICK=1); and with a stand-in Python whose parts fail, hang or get
killed on cue, for the bounds, a failing part, the smoke's early exit and a killed lease."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def test_the_lease_runs_every_part_on_the_fake_gpu(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    done = _lease("gpu_lease.sh", out, FAKE)
    log = (out / "lease.log").read_text()
    parts = _parts(log)
    assert list(parts) == ["versions", "smoke", "selftest-w2", "selftest-w3", "gpu-suite",
                           "kernel-tests", "host-time"], log
    assert parts["versions"] == parts["smoke"] == parts["host-time"] == 0, log
    assert parts["gpu-suite"] == 0 and parts["kernel-tests"] in (0, 5), log
    assert time.monotonic() - start < 3 * 550, log               # within the bounds' sum
    for world in (2, 3):     # every schedule right; the fake GPU has no CUDA graphs
        bundle = json.loads((out / f"selftest-w{world}.json").read_text())
        assert bundle["failed"] == ["all_gather_matmul uniform-fused-1d dma capture/replay"]
        assert sum(c["check"] == "schedule" and c["status"] == "ok"
                   for c in bundle["checks"]) >= 22
        assert parts[f"selftest-w{world}"] == 1
    assert json.loads((out / "host_op_s.json").read_text())["host_op_s"] > 0
    assert "torch" in (out / "versions.txt").read_text()
    assert {p.name for p in _returned(out)} <= {
        "lease.log", "versions.txt", "selftest-w2.json", "selftest-w3.json", "pytest.txt",
        "host.jsonl", "host_op_s.json"}
    assert done.stdout.splitlines()[-1].startswith("parts: versions=0 smoke=0"), done.stdout


def test_the_next_lease_runs_every_part_on_the_fake_gpu(tmp_path):
    out = tmp_path / "out"
    _lease("gpu_lease_next.sh", out, FAKE)
    log = (out / "next.log").read_text()
    parts = _parts(log)
    assert list(parts) == ["memcheck", "timeline-connections-8", "timeline-connections-1",
                           "gated-wait-exit", "gated-tflops", "enqueue-profile"], log
    assert parts["gated-wait-exit"] == 0, log     # no GPU here: the probe skips, naming why
    assert parts["timeline-connections-8"] == parts["timeline-connections-1"] == 0, log
    assert parts["gated-tflops"] == parts["enqueue-profile"] == 0, log
    for c in (8, 1):
        rows = json.loads((out / f"timeline-uniform-fused-1d-connections-{c}.json").read_text())
        assert any(r["kind"] == "gemm" for r in rows)
    assert {p.name for p in _returned(out)} >= {"next.log", "kernels.json", "enqueue.tar.gz"}


STUB = """#!/usr/bin/env bash
# A stand-in Python: what each part of the lease does, on cue.
case "$*" in
    *--smoke*) echo "smoke"; [ -n "${STUB_SMOKE_FAILS:-}" ] && exit 1; exit 0 ;;
    *"selftest --share-gpu 2 "*) echo "selftest w2 starts"; sleep 60 ;;      # hangs: cut
    *selftest*) echo "selftest wide fails"; exit 1 ;;
    *pytest*) echo "1 passed"; exit 0 ;;
    *gpu_session*) echo "host"; exit 0 ;;
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
    assert parts["selftest-w2"] == 124 and parts["selftest-w4"] == 1, parts    # cut; failed
    assert parts["gpu-suite"] == parts["kernel-tests"] == parts["host-time"] == 0, parts
    assert took < 30, took                     # 60 s of hang cut at its 5 s bound
    assert "cut at its bound" in done.stdout


def test_a_failed_smoke_ends_the_lease_at_once(tmp_path):
    out = tmp_path / "out"
    done = _lease("gpu_lease.sh", out, {"STUB_SMOKE_FAILS": "1"}, py=_stub(tmp_path))
    assert done.returncode == 1
    assert list(_parts((out / "lease.log").read_text())) == ["versions", "smoke"]


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
