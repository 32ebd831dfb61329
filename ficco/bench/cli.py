"""What every ``python -m ficco.bench`` verb shares before it measures anything: the optional
``bench`` extra (matplotlib for plots, tqdm for the bar), where a run writes, and the
"run me under torchrun" check of the multi-rank verbs.

A missing extra is found before any work: plots that cannot be drawn stop the run with one
line that says how to install them (or which flag skips them); a missing progress bar only
warns and runs without one.

    >>> missing_plot_message("sweep", "--no-plots")  # doctest: +ELLIPSIS
    "ficco.bench sweep draws its plots with matplotlib, which is not installed: pip install 'ficco[bench]' (or pass --no-plots)"
"""
from __future__ import annotations

import datetime
import importlib
import os
import sys
import time
import warnings
from pathlib import Path

INSTALL_HINT = "pip install 'ficco[bench]'"
RUNS_DIR = Path("bench") / "runs"


class BenchUsageError(SystemExit):
    """A verb cannot start here; the message says why and what to type instead (exit code 2)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def importable(module: str) -> bool:
    """True when ``import module`` works (a module set to None in ``sys.modules`` does not)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def missing_plot_message(verb: str, skip_flag: str) -> str:
    return (f"ficco.bench {verb} draws its plots with matplotlib, which is not installed: "
            f"{INSTALL_HINT} (or pass {skip_flag})")


def require_plots(verb: str, wanted: bool, skip_flag: str) -> None:
    """Stop before any work when plots are wanted and matplotlib is missing."""
    if wanted and not importable("matplotlib"):
        raise BenchUsageError(missing_plot_message(verb, skip_flag))


class _NoBar:
    """The progress bar's stand-in without tqdm: same calls, prints nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def update(self, n=1):
        pass

    def set_postfix_str(self, text):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _LineBar(_NoBar):
    """The progress bar where stderr is not a terminal (a log file, CI): a plain line at every
    tenth of the work, no carriage returns redrawing one line."""

    def __init__(self, verb: str, total: float, unit: str, weighted: bool, stream=None):
        self.verb, self.total, self.unit, self.weighted = verb, total, unit, weighted
        self.stream = stream or sys.stderr
        self.done, self.next_tenth, self.start = 0.0, 1, time.monotonic()

    def update(self, n=1):
        self.done += n
        tenth = int(10 * self.done / self.total) if self.total else 10
        if tenth >= self.next_tenth:
            self.next_tenth = tenth + 1
            counts = "" if self.weighted else f" ({self.done:g}/{self.total:g} {self.unit})"
            print(f"{self.verb}: {min(100, 10 * tenth)}%{counts}, "
                  f"{time.monotonic() - self.start:.0f} s", file=self.stream, flush=True)


def progress_bar(verb: str, total: float, unit: str, disable: bool = False, weighted=False):
    """A tqdm bar on a terminal; in a redirected log a line per tenth of the work; without
    tqdm (the ``bench`` extra) a silent stand-in after one warning.

    ``weighted``: ``total`` and each ``update`` are estimated seconds of work rather than
    counts, so the bar shows a percentage and its ETA follows the work, not the point count.

    >>> import io
    >>> log = io.StringIO()                       # not a terminal
    >>> bar = progress_bar("sweep", 4, "points")
    >>> bar.stream = log
    >>> for _ in range(4): bar.update()
    >>> chr(13) in log.getvalue(), log.getvalue().splitlines()[-1].startswith("sweep: 100% (4/4")
    (False, True)
    """
    if disable:
        return _NoBar()
    if not importable("tqdm"):
        warnings.warn(f"tqdm is not installed, so ficco.bench {verb} runs without a progress "
                      f"bar: {INSTALL_HINT}", stacklevel=2)
        return _NoBar()
    if not sys.stderr.isatty():
        return _LineBar(verb, total, unit, weighted)
    from tqdm import tqdm

    if weighted:
        return tqdm(total=total, desc=verb, dynamic_ncols=True,
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}"
                               "{postfix}")
    return tqdm(total=total, desc=verb, unit=unit, dynamic_ncols=True)


def run_dir(verb: str, target: str, out: str | None = None, stamp: bool = True) -> Path:
    """``out`` if given, else ``bench/runs/<verb>-<target>-<UTC date-time>`` (no date for a
    verb that overwrites its folder, ``stamp=False``). ``bench/runs`` is ignored by git.

    >>> run_dir("simulate", "h100", stamp=False).as_posix()
    'bench/runs/simulate-h100'
    """
    if out:
        return Path(out)
    safe = "".join(c if c.isalnum() or c in "_." else "-" for c in target)
    name = f"{verb}-{safe}"
    if stamp:
        name += "-" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return RUNS_DIR / name


def require_torchrun(verb: str, example_args: str, single_rank_ok: bool = False) -> None:
    """Stop a multi-rank verb started with plain ``python``: one rank alone gathers nothing,
    so its "speedups" would be noise."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    hint = (f"ficco.bench {verb} measures a process group: run under torchrun --nproc-per-node "
            f"N, e.g. torchrun --nproc-per-node 2 -m ficco.bench {verb} {example_args}")
    if single_rank_ok:
        hint += " (or pass --single-rank to time one rank on its own, with nothing to gather)"
    raise BenchUsageError(hint)


def cpu_ranks(fn, world: int, *args) -> list:
    """``fn(rank, world, *args)`` on ``world`` spawned CPU ranks (gloo, the cpu backend, one
    thread each), their results in rank order; ``fn`` must be importable (top level)."""
    import tempfile

    import torch.multiprocessing as mp

    fd, init_file = tempfile.mkstemp(prefix="ficco-bench-")
    os.close(fd)
    os.unlink(init_file)
    try:
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(_cpu_rank, args=(world, init_file, fn, args, results), nprocs=world,
                     join=True)
            return [results[rank] for rank in range(world)]
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)


def _cpu_rank(rank, world, init_file, fn, args, results):
    import torch
    import torch.distributed as dist

    os.environ["FICCO_BACKEND"] = "cpu"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    import ficco

    try:
        results[rank] = fn(rank, world, *args)
    finally:
        ficco.shutdown()
        dist.destroy_process_group()


def report_usage_error(exc: BenchUsageError) -> int:
    print(f"error: {exc.message}", file=sys.stderr)
    return 2
