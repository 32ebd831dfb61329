"""``python -m ficco.bench simulate`` and the Gantt drawer."""
from __future__ import annotations

import json

import pytest

from ficco import schedules
from ficco.bench.__main__ import main as bench_main
from ficco.bench.gantt import draw_gantt
from ficco.bench.simulate import short_name
from ficco.errors import InvalidArgumentError


def test_simulate_paper_scenarios_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "sim"
    assert bench_main(["simulate", "--profile", "mi300x", "--scenarios", "paper", "--world", "8",
                       "--no-png", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    report = json.loads((out / "simulate.json").read_text())
    assert [sc["name"] for sc in report["scenarios"]] == [f"g{i}" for i in range(1, 17)]
    for sc in report["scenarios"]:
        assert set(sc["times_s"]) == set(schedules.names())
        assert sc["speedup"]["serial"] == 1.0
        assert sc["times_s"][sc["picks"]["model"]] == min(sc["times_s"].values())
        assert sc["picks"]["paper"] in schedules.names()
        assert sc["name"] in text
    assert "hetero-fused-1d" in text and short_name("hetero-unfused-2d") in text


def test_simulate_shape_draws_a_png_per_scenario(tmp_path):
    out = tmp_path / "sim"
    assert bench_main(["simulate", "--profile", "h100", "--scenarios", "none", "--shape",
                       "4096,2048,1024", "--world", "4", "--out", str(out)]) == 0
    pngs = list(out.glob("*.png"))
    assert [p.name for p in pngs] == ["4096x2048x1024.png"]
    assert pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_rejects_a_bad_shape(tmp_path, capsys):
    assert bench_main(["simulate", "--scenarios", "none", "--shape", "1,2",
                       "--out", str(tmp_path)]) == 2
    assert "M,N,K" in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match="M,N,K"):
        from ficco.bench import simulate
        simulate.scenarios(type("Args", (), {"scenarios": "none", "shape": ["1,2"],
                                             "scale": 1, "world": 8})())


def test_draw_gantt_lanes_and_file(tmp_path):
    rows = [{"queue": q, "start_s": i * 1e-4, "end_s": (i + 1) * 1e-4, "kind": kind,
             "label": f"op {i}"}
            for i, (q, kind) in enumerate([("copy1", "copy_1d"), ("compute", "gemm"),
                                           ("copy0", "copy_2d"), ("comm", "all_gather")])]
    path = draw_gantt(rows, tmp_path / "deep" / "t.png", "test")
    assert path.exists() and path.stat().st_size > 1000
