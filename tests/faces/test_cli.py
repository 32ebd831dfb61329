"""The ``python -m ficco.bench`` command line as a first-time user meets it: every verb's
``--help`` lists its options, defaults and an example; a missing ``bench`` extra is named in
one line before any work; multi-rank verbs started without torchrun say how to start them;
a scenario too big for memory is refused with its size and the flag that shrinks it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ficco.bench import __main__ as bench_cli

REPO = Path(__file__).resolve().parents[2]
VERB_OPTIONS = {
    "sweep": ["--scenarios", "--shape", "--scale-nk", "--schedules", "--transports", "--repeat",
              "--no-plots", "--single-rank"],
    "characterize": ["--size", "--parts", "--only", "--copy-queues", "--copy-to", "--refit",
                     "--no-plots"],
    "simulate": ["--profile", "--scenarios", "--shape", "--world", "--no-png"],
    "timeline": ["--shape", "--schedule", "--transport", "--rank", "--no-plots"],
}


def _bench(args: list[str], tmp_path: Path, block: tuple[str, ...] = (), env_extra=None):
    """Run the CLI in a fresh interpreter on the CPU backend, with the modules in ``block``
    made unimportable (as if the ``bench`` extra were not installed)."""
    code = ("import sys\n"
            f"for name in {list(block)!r}: sys.modules[name] = None\n"
            "from ficco.bench.__main__ import main\n"
            f"sys.exit(main({args!r}))\n")
    # a cache of its own: characterize installs its profile there
    env = dict(os.environ, FICCO_BACKEND="cpu", OMP_NUM_THREADS="1",
               FICCO_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "FICCO_PROFILE"):
        env.pop(name, None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("verb", sorted(VERB_OPTIONS))
def test_each_verb_help_lists_options_defaults_and_an_example(verb, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.main([verb, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in VERB_OPTIONS[verb]:
        assert option in text, f"{verb} --help lacks {option}"
    assert "(default" in text
    assert "examples:" in text and f"ficco.bench {verb}" in text.split("examples:")[1]


def test_every_registered_verb_has_help_with_an_example(capsys):
    for verb in bench_cli.verbs():
        with pytest.raises(SystemExit) as exit_info:
            bench_cli.main([verb, "--help"])
        assert exit_info.value.code == 0
        text = capsys.readouterr().out
        assert text.count("examples:") == 1 and f"ficco.bench {verb}" in text, verb
        assert "--" in text.split("options:")[1].split("examples:")[0].replace("--help", ""), verb


def test_top_level_help_lists_the_verbs(capsys):
    with pytest.raises(SystemExit):
        bench_cli.main(["--help"])
    text = capsys.readouterr().out
    assert all(verb in text for verb in VERB_OPTIONS)


@pytest.mark.parametrize("verb, args, flag", [
    ("sweep", ["--shape", "64,32,16"], "--no-plots"),
    ("characterize", [], "--no-plots"),
    ("simulate", ["--scenarios", "none", "--shape", "64,32,16"], "--no-png"),
    ("timeline", [], "--no-plots"),
])
def test_missing_matplotlib_is_one_line_before_any_work(verb, args, flag, tmp_path):
    proc = _bench([verb, *args, "--out", str(tmp_path / "out")], tmp_path,
                  block=("matplotlib",))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [(f"error: ficco.bench {verb} draws its plots with matplotlib, which is not "
                     f"installed: pip install 'ficco[bench]' (or pass {flag})")]
    assert not (tmp_path / "out").exists()


def test_missing_tqdm_warns_and_runs_without_a_bar(tmp_path):
    out = tmp_path / "char"
    proc = _bench(["characterize", "--size", "quick", "--parts", "copy", "--no-plots",
                   "--out", str(out)], tmp_path, block=("tqdm", "matplotlib"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tqdm is not installed, so ficco.bench characterize runs without a progress bar: " \
           "pip install 'ficco[bench]'" in proc.stderr
    assert (out / "profile.json").is_file()


@pytest.mark.parametrize("verb", ["sweep", "timeline"])
def test_multi_rank_verbs_without_torchrun_say_how_to_start(verb, tmp_path):
    proc = _bench([verb, "--no-plots", "--out", str(tmp_path / "out")], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "run under torchrun --nproc-per-node N" in proc.stderr
    assert f"torchrun --nproc-per-node 2 -m ficco.bench {verb}" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_characterize_defaults_to_quick_sizes_on_cpu(tmp_path):
    import argparse

    import torch

    from ficco.bench import characterize

    parser = argparse.ArgumentParser()
    characterize.add_arguments(parser)
    settings = characterize.settings_for(parser.parse_args([]), torch.device("cpu"))
    assert max(g.big_m * g.n * g.k for g in settings.gemms) <= 1024 * 256 * 1024
    assert max(settings.copy_sizes) <= 1 << 20
    full = characterize.settings_for(parser.parse_args(["--size", "full", "--only", "g1"]),
                                     torch.device("cpu"))
    assert [g.name for g in full.gemms] == ["g1"] and max(full.copy_sizes) == 1 << 28


def test_characterize_bar_weighs_points_by_their_work():
    """The bar's share of a point follows its estimated time: a Table I GEMM weighs more than
    a 4 KiB copy (the old bar counted both as one point, so its ETA was wrong by minutes)."""
    import argparse

    import torch

    from ficco.bench import characterize
    from ficco.heuristics import profiles

    parser = argparse.ArgumentParser()
    characterize.add_arguments(parser)
    st = characterize.settings_for(parser.parse_args(["--size", "full", "--only", "g1,g14"]),
                                   torch.device("cpu"))
    work = characterize.Work(st, profiles.load("h100"), "bfloat16", bar=None)
    assert work.dil_s(st.gemms[0]) > 1000 * work.copy_s(st.copy_sizes[0])
    total = work.total_s(("copy", "dil", "cil"))
    parts = sum(work.copy_s(n) for n in st.copy_sizes) * 2 \
        + work.copy_s(st.width_probe_bytes) * len(st.widths_2d) \
        + sum(work.dil_s(g) + work.cil_s(g) for g in st.gemms)
    assert total == pytest.approx(parts)


def test_sweep_refuses_a_scenario_too_big_for_memory(monkeypatch):
    import torch

    from ficco.bench import scenarios, sweep
    from ficco.errors import InvalidArgumentError

    monkeypatch.setattr(sweep, "free_memory_bytes", lambda device: (8 << 30, 2))
    big = scenarios.paper(scale=4096)          # g1: B is 131072 x 8192 per rank at W=2
    with pytest.raises(InvalidArgumentError) as info:
        sweep.check_memory(big, 2, "float32", torch.device("cpu"))
    text = str(info.value)
    assert "GiB per rank" in text and "--scale-nk" in text
    factor = int(text.split("--scale-nk ")[1].split()[0].rstrip(","))
    fits = [sweep.shrunk(s, factor) for s in big]
    sweep.check_memory(fits, 2, "float32", torch.device("cpu"))     # the advice works
    worst = max(big, key=lambda s: sweep.memory_bytes(s, 2, "float32"))
    assert f"scenario {worst.name} " in text
    assert sweep.memory_bytes(big[0], 2, "float32") > 4 * 131072 * 8192


def test_speedup_plot_keeps_a_readable_width(tmp_path):
    import struct

    from ficco.bench import plots, results

    recs = results.read_jsonl(REPO / "bench/results/sweep-cpu-20261122-191934/results.jsonl")
    path = plots.plot_speedups(recs, tmp_path / "speedup.png")
    width, height = struct.unpack(">II", path.read_bytes()[16:24])
    assert width <= plots.MAX_WIDTH_IN * 110 and height > width / 2
