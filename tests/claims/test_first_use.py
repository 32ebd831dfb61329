"""The rough edges a first-time user hit (the bench and heuristics ones are in
tests/faces/test_cli.py and the simulator's tests): each reproduced as it was met, then fixed."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ficco
from ficco import config
from ficco.errors import ConfigError, InvalidArgumentError, MismatchError

from .. import harness

REPO = Path(__file__).resolve().parents[2]


def _python(*args, timeout=120):
    env = dict(os.environ, FICCO_BACKEND="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, check=False)


@pytest.mark.parametrize("module", ["ficco", "ficco.bench"])
def test_version_flag(module):
    """Before: 'unrecognized arguments: --version'."""
    done = _python("-m", module, "--version")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == f"ficco {ficco.__version__}", lines
    assert lines[1].startswith(f"torch {torch.__version__} ("), lines


def test_backend_names_are_case_blind_and_the_error_lists_no_none(monkeypatch):
    """Before: FICCO_BACKEND=CPU was rejected, listing 'None' as a valid value."""
    monkeypatch.setenv("FICCO_BACKEND", "CPU")
    assert config.backend() == "cpu"
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    torch.testing.assert_close(ficco.all_gather_matmul(a, b), a @ b)
    monkeypatch.setenv("FICCO_BACKEND", "tpu")
    with pytest.raises(ConfigError) as info:
        config.backend()
    assert "None" not in str(info.value)
    assert "cpu, cuda, rocm, or leave FICCO_BACKEND unset" in str(info.value)


def test_progress_in_a_redirected_log_is_lines_not_carriage_returns(monkeypatch):
    """Before: tqdm redrew its bar with carriage returns into log files."""
    from ficco.bench.cli import progress_bar

    log = io.StringIO()                        # not a terminal, as a redirected stderr
    monkeypatch.setattr(sys, "stderr", log)
    with progress_bar("sweep", 20, "points") as bar:
        for _ in range(20):
            bar.update()
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 10 and lines[-1].startswith("sweep: 100% (20/20 points)"), lines


def _mismatch_and_outsider(rank, world):
    import torch.distributed as dist

    found = []
    try:                                # ranks pass different shard shapes
        ficco.all_gather_matmul(torch.randn(8 * (rank + 1), 32), torch.randn(32, 24))
    except MismatchError as exc:
        found.append(str(exc))
    ficco.shutdown()                    # a MismatchError poisons the group until every rank resets
    outside = dist.new_group([0])       # rank 1 is not in it
    try:
        ficco.all_gather_matmul(torch.randn(8, 32), torch.randn(32, 24), outside)
        found.append(None)
    except InvalidArgumentError as exc:
        found.append(str(exc))
    return found


def test_mismatch_names_its_fields_and_an_outsider_is_told_so():
    """Before: 'problem=(16, 32, (24,), 'float32', 2)' in a MismatchError, and a rank outside
    a new_group got "group must be ... got int"."""
    (mismatch0, inside), (mismatch1, outsider) = harness.pool(2).run(_mismatch_and_outsider)
    for text in (mismatch0, mismatch1):
        assert "rows m=8" in text and "rows m=16" in text and "problem=(" not in text, text
    assert inside is None
    assert "global rank 1) is not a member of the group" in outsider, outsider


def test_demo_refuses_zero_ranks():
    """Before: 'demo --world 0' printed '0/0 within tolerance' and exited 0."""
    done = _python("-m", "ficco", "demo", "--world", "0")
    assert done.returncode == 2 and "needs at least 1 rank; got 0" in done.stderr, done.stderr
    from ficco import demo

    with pytest.raises(InvalidArgumentError, match="at least 1 rank"):
        demo.main(0)


def test_readme_says_training_has_not_run_on_a_gpu():
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Train with ficco"):]
    section = section[:section.index("\n## ", 1)]
    assert "not run on a GPU yet" in section, section
