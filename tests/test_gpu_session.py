"""The rank-side parts of ``python -m ficco.bench.gpu_session`` (what ``bench/gpu_session.sh``
runs on a lent GPU) on the fake GPU of tests/fake_gpu.py, tiny shapes: a GPU session must not
be the first place they run."""
from __future__ import annotations

from . import fake_gpu, harness


def _parts(rank, world):
    from ficco.bench import gpu_session

    fake_gpu.install("cuda", 8)
    args = {"shape": (16, 32, 24), "dtype": "float32", "repeat": 2, "calls": 3, "seed": 5,
            "schedule": "uniform-fused-1d",
            "schedules": ("serial", "ring", "hetero-unfused-2d", "uniform-fused-1d", "gated-1d")}
    check = gpu_session.check(rank, world, args)
    host = gpu_session.host(rank, world, args)
    timeline = gpu_session.timeline(rank, world, args)
    return check, host, timeline, gpu_session.fit_host_op(host)


def test_gpu_session_parts_run_and_check_results_on_the_fake_gpu():
    for check, host, timeline, per_op in harness.pool(2, {"FICCO_TIMEOUT": "20"}).run(
            _parts, timeout_s=240):
        assert {(r["op"], r["schedule"]) for r in check} == {
            ("all_gather_matmul", s) for s in ("serial", "ring", "hetero-unfused-2d",
                                               "uniform-fused-1d", "gated-1d")} | {
            ("matmul_reduce_scatter", s) for s in ("serial", "ring", "hetero-unfused-2d",
                                                   "uniform-fused-1d")}
        assert all(r["ok"] and r["failure"] is None and r["median_s"] > 0 for r in check), check
        assert {r["fence"] for r in host} == {True, False} and all(r["ops"] > 0 for r in host)
        assert per_op > 0 and any(r["kind"] == "gemm" for r in timeline), timeline
