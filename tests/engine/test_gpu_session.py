"""The rank-side parts of ``python -m ficco.bench.gpu_session`` (what the lease scripts run on
a lent GPU) on the fake GPU of tests/fake_gpu.py, tiny shapes: a GPU lease must not be the
first place they run."""
from __future__ import annotations

from .. import fake_gpu, harness


def _parts(rank, world):
    from ficco.bench import gpu_session

    fake_gpu.install("cuda", 8)
    args = {"shape": (16, 32, 24), "dtype": "float32", "calls": 3, "seed": 5,
            "schedule": "uniform-fused-1d",
            "schedules": ("serial", "ring", "hetero-unfused-2d", "uniform-fused-1d")}
    host = gpu_session.host(rank, world, args)
    timeline = gpu_session.timeline(rank, world, args)
    sanitize = gpu_session.sanitize(rank, world, args)
    return host, timeline, gpu_session.fit_host_op(host), sanitize


def test_gpu_session_parts_run_on_the_fake_gpu():
    for host, timeline, per_op, sanitize in harness.pool(2, {"FICCO_TIMEOUT": "20"}).run(
            _parts, timeout_s=240):
        assert {(r["op"], r["schedule"]) for r in host} == {
            (op, s) for op in ("all_gather_matmul", "matmul_reduce_scatter")
            for s in ("serial", "ring", "hetero-unfused-2d", "uniform-fused-1d")}
        assert {r["fence"] for r in host} == {True, False} and all(r["ops"] > 0 for r in host)
        assert per_op > 0 and any(r["kind"] == "gemm" for r in timeline), timeline
        assert all(err <= 3e-2 for err in sanitize.values()), sanitize
