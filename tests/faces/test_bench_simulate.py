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


def test_simulate_shape_draws_a_png_per_scenario(tmp_path, monkeypatch):
    out = tmp_path / "sim"
    from ficco.bench import gantt

    titles, real = [], gantt.draw_gantt

    def keep_title(rows, path, title):
        titles.append(title)
        return real(rows, path, title)

    monkeypatch.setattr(gantt, "draw_gantt", keep_title)
    assert bench_main(["simulate", "--profile", "h100", "--scenarios", "none", "--shape",
                       "4096,2048,1024", "--world", "4", "--out", str(out)]) == 0
    pngs = list(out.glob("*.png"))
    assert titles and all(t.startswith("simulated: ") for t in titles), titles 
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


def test_timeline_labels_fit_their_bars_and_never_overlap():
    """GEMM labels overlapped on simulate charts (a label was drawn whenever its bar
    was 6% of the axis, however long the text). A kept label lies inside its own bar."""
    from ficco.bench.gantt import figure

    rows = [{"queue": "compute", "start_s": i * 1e-4, "end_s": (i + 1) * 1e-4, "kind": "gemm",
             "label": f"gemm 131072r s{i} a long label"} for i in range(12)]
    rows.append({"queue": "compute", "start_s": 12e-4, "end_s": 40e-4, "kind": "gemm",
                 "label": "wide"})
    fig = figure([("t", rows)])
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    texts = [t for t in ax.texts]
    assert [t.get_text() for t in texts] == ["wide"]
    boxes = [t.get_window_extent(renderer) for t in texts]
    x0, _ = ax.transData.transform((12e-1, 0))
    x1, _ = ax.transData.transform((40e-1, 0))
    assert all(x0 <= b.x0 and b.x1 <= x1 for b in boxes)


def test_simulate_with_an_unknown_profile_says_which_exist_in_one_line(tmp_path, capsys):
    """``simulate --profile nope`` printed a traceback."""
    assert bench_main(["simulate", "--profile", "nope", "--no-png", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "unknown profile 'nope'" in err and "mi300x" in err and "h100" in err


def test_ratio_plot_says_why_points_sit_above_the_ideal_curve(tmp_path):
    """The ratio plot showed points above the "ideal" curve with no word why. The
    curve assumes serial takes g + c; each scenario also gets a tick at the ideal over the
    serial call the speedups are measured against, and a point that did not move data faster
    than the ccl all-gather it was compared with stays under its tick."""
    from ficco.bench import plots

    base = {"status": "ok", "scenario": "s", "gemm_s": 1.0, "comm_s": 1.0, "gemm_comm_ratio": 1.0,
                "reference_s": 3.0, "transport": "dma"}
    records = [dict(base, kind="baseline", schedule="serial", transport="ccl", median_s=3.0,
                    speedup=1.0),
               dict(base, kind="schedule", schedule="hetero-fused-1d", median_s=1.2,
                    speedup=2.5)]
    assert plots.ideal_speedup(1.0) == 2.0
    assert records[1]["speedup"] == 2.5 <= plots.measured_ideal(records[1])
    # a schedule no faster than the longer of GEMM and all-gather alone is under its tick
    for t in (1.0, 1.5, 3.0):
        assert 3.0 / t <= plots.measured_ideal(records[1])
    path = plots.plot_ratio(records, tmp_path / "ratio.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "serial paid more than g + c" in plots.RATIO_NOTE


def test_images_say_simulated_or_measured_where():
    """A simulated timeline says "simulated" on the image, a sweep's plots "measured,
    <backend>, W=..." (the words are drawn into the figures: checked on their text artists)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from ficco.bench import plots

    where = plots.measured_where([{"env_backend": "cpu", "env_device": "ci", "env_world": 2}])
    assert where == "measured, cpu (ci), W=2"
    seen = []
    real_save = plt.Figure.savefig

    def keep_text(fig, *args, **kwargs):
        seen.append([t.get_text() for t in fig.texts])
        return real_save(fig, *args, **kwargs)

    import tempfile
    from pathlib import Path
    from unittest import mock

    with mock.patch.object(plt.Figure, "savefig", keep_text):
        plots.save_figure(plt.figure(), Path(tempfile.mkdtemp()) / "x.png", where=where)
    assert seen == [[where]]


def test_the_docs_decode_tables_are_what_bench_decode_prints(capsys):
    """Every row `python -m ficco.bench decode` prints for a corner of the grid (two
    profiles, TP 8 and 2, batch 1 and 256) is in docs/all_reduce.md as printed: the docs'
    tables are that command's output, regenerated whenever the model changes."""
    from pathlib import Path

    assert bench_main(["decode", "--profiles", "h100,mi355x", "--tp", "8,2",
                       "--batches", "1,256"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| h100 ", "| mi355x "))]
    assert len(rows) == 2 * 2 * 2 * 3, rows
    docs = (Path(__file__).resolve().parents[2] / "docs" / "all_reduce.md").read_text()
    stale = [line for line in rows if line not in docs]
    assert not stale, "docs/all_reduce.md's decode tables differ from the command: " \
        f"rerun python -m ficco.bench decode; first stale row {stale[0]}"


def test_decode_holds_each_row_against_the_nearest_fastest_published_custom_all_reduce():
    """The published time beside a message is a custom all-reduce of the same profile and
    rank count within 2x of its size, no other one nearer, none at that size faster; the
    best one-kernel time is the faster kernel's."""
    import csv
    import math
    from pathlib import Path

    from ficco.bench import decode

    table = Path(__file__).resolve().parents[2] / "ficco" / "bench" / "validation" / \
        "published.csv"
    rows = [r for r in csv.DictReader(table.read_text().splitlines())
            if r["family"] == "decode" and r["quantity"] in decode.CUSTOM]
    for profile, world in (("h100", 8), ("mi355x", 8), ("h100", 4)):
        for nbytes in (8 << 10, 24 << 10, 256 << 10, 2 << 20, 4 << 20):
            found = decode.published_near(profile, nbytes, world)
            mine = [(abs(math.log(int(s["size"]) / nbytes)), float(r["published"]), r["id"])
                    for r in rows for s in [dict(x.split("=") for x in r["shapes"].split())]
                    if r["profile"] == profile and int(s.get("world", 8)) == world]
            near = [m for m in mine if m[0] <= math.log(2) + 1e-9]
            if not near:
                assert found is None, (profile, nbytes, found)
                continue
            assert found is not None, (profile, nbytes)
            distance = abs(math.log(found[1] / nbytes))
            assert distance <= min(m[0] for m in near) + 1e-9, (profile, nbytes, found)
            assert found[0] == min(m[1] for m in near if abs(m[0] - distance) < 1e-9)
    row = decode.row("mi300x", "70B down", 256, 8192, 28672, 8)
    assert row["kernel"][0] == "two-shot-kernel" and row["k"] == 28672
    with pytest.raises(InvalidArgumentError, match="does not split"):
        decode.row("h100", "odd", 1, 4096, 4097, 8)


def test_bench_decode_refuses_a_bad_list(capsys):
    assert bench_main(["decode", "--tp", "eight"]) == 2
    assert "--tp 'eight'" in capsys.readouterr().err
