"""``python -m ficco demo`` (ficco/demo/__init__.py, ficco/demo/model.py): the README's first command.
Its model covers ficco's four patterns, each part checked against float64; a broken op must
fail its part and only its part."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ficco import demo
from ficco.demo import model as demo_model

from .. import harness

REPO = Path(__file__).resolve().parents[2]
OPS = ["all_gather_matmul", "matmul_reduce_scatter", "all_to_all_grouped_mm",
       "grouped_mm_all_to_all", "matmul_all_reduce"]
#: the part each op serves in the demo's model
PART_OF = {"all_gather_matmul": "prefill", "matmul_reduce_scatter": "prefill",
           "all_to_all_grouped_mm": "MoE", "grouped_mm_all_to_all": "MoE",
           "matmul_all_reduce": "decode"}


def _nudged(out):
    """A wrong answer: one element of the first output off by 1% of the largest."""
    first = out[0] if isinstance(out, (list, tuple)) else out
    first[(0,) * first.dim()] += 0.01 * first.abs().max()
    return out


def _demo_parts(rank, world, broken):
    import ficco

    real = getattr(ficco, broken) if broken else None
    if broken:
        setattr(ficco, broken, lambda *args, **kwargs: _nudged(real(*args, **kwargs)))
    try:
        return demo_model.run(rank, world, repeats=0)
    finally:
        if broken:
            setattr(ficco, broken, real)


def test_every_part_matches_float64_and_a_broken_op_fails_its_part():
    pool = harness.pool(2)
    parts = pool.run(_demo_parts, None)[0]
    assert [name for name, *_ in parts] == ["prefill", "MoE", "decode"]
    calls = [call for *_, part_calls in parts for call in part_calls]
    assert sorted({op for _, op, *_ in calls}) == sorted(OPS)
    for name, _, err, _ in parts:
        assert err <= demo_model.TOL, (name, err)
    for label, op, pick, *_ in calls:      # two ranks: a schedule ran, over a transport
        schedule, over, transport = pick.split()
        assert over == "over" and transport in ("dma", "ccl"), (label, op, pick)
        assert schedule in __import__("ficco").schedules.names(op=op), (label, op, pick)
    for op in OPS:
        errors = {name: err for name, _, err, _ in pool.run(_demo_parts, op)[0]}
        assert errors[PART_OF[op]] > demo_model.TOL, (op, errors)
        assert all(err <= demo_model.TOL for name, err in errors.items()
                   if name != PART_OF[op]), (op, errors)


def test_the_report_counts_a_failed_part_and_a_failed_schedule():
    calls = [("qkv", "all_gather_matmul", "ring over dma", 1e-3, 2e-3)]
    good = [("prefill", "block", 1e-7, calls)]
    bad = [("prefill", "block", 1e-2, calls)]
    row = ("all_gather_matmul", "ring", "dma", 1e-7, 1e-3)
    wrong_row = ("all_gather_matmul", "ring", "ccl", float("inf"), 1e-3)
    assert demo.report(2, good, [row]) == (0, 2)
    assert demo.report(2, bad, [row]) == (1, 2)
    assert demo.report(2, good, [row, wrong_row]) == (1, 3)


def test_the_demo_runs_on_one_rank():
    """Before: 'demo --world 1' died in a TypeError (no schedule runs on one rank, so the
    default row had no pick to print)."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "ficco", "demo", "--world", "1"], env=env,
                          capture_output=True, text=True, timeout=180, cwd=REPO, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for op in OPS:
        assert op in out, op
    assert "plain matmul (1 rank)" in out and "FAILED" not in out, out
    assert " checks within tolerance" in out, out
