"""``python -m ficco.bench calls``: what a *warm* call costs the caller's thread in Python.

A warm call (same shapes, same settings, same group as the call before) should only validate,
look up what it decided the first time and run (STYLE guideline 11). This verb spawns ``--world``
CPU ranks (gloo, the cpu backend), makes each case's call ``--warmup`` times, then profiles
``--calls`` more with cProfile, which records only the thread that enabled it: the caller's.
Per warm call it reports

- ``ficco calls``: function calls whose code lives in the ``ficco`` package
  (tests/engine/test_state.py holds both dense ops to 70 per warm call);
- ``all calls``: every profiled call (torch's Python included, C functions too);
- ``json.dumps`` / ``pickle``: serialisations (a warm call should make none).

With ``--new-shapes N`` it measures instead what a *first* call costs: N new sequence lengths
(rows per rank from the shape's m up), each called twice, over dma and over ccl; it prints the
median seconds of the first call of a length and of the second (warm) one, slowest rank.

With ``--first-sight N`` it measures what the first sight of a *new key* costs under the
default selector, in each ``FICCO_AUTO`` mode (a fresh ``FICCO_CACHE_DIR`` per mode):
``all_gather_matmul`` in float32, K = 384, n = 256, N keys of distinct row buckets (rows per
rank 1-8, 10, 12, 14, 16, 20, ...), after one call on another shape (what a process pays once).
Per key: its first call; in ``explore`` its next calls until the decision settled (what they
ran, the exploring calls); then 5 repeats. It prints the medians over the keys (first call,
exploring call, repeat, first / repeat) and the slowest first call, rank 0's host clock.

Cases: ``all_gather_matmul`` and ``matmul_reduce_scatter`` (no autograd: the direct path),
``ColumnParallelLinear`` forward with trainable weights and ``RowParallelLinear`` forward with
trainable weights and its bias (through ``torch.ops.ficco``, the dispatcher and autograd), and
``all_gather_matmul fp8+bias``: float8_e4m3fn operands with tensor-wise scales, a bfloat16
output and a bias (the epilogue's checks run in full at every call). The slowest rank's
numbers are printed (they differ by a few calls at most: a barrier may poll once more on one
rank).
"""
from __future__ import annotations

import cProfile
import os
import pstats
from pathlib import Path

EXAMPLES = """examples:
  python -m ficco.bench calls                     # W=2, the five cases, 20 warm calls each
  python -m ficco.bench calls --top 25            # and the 25 ficco functions called most
  python -m ficco.bench calls --schedule hetero-fused-1d --transport dma
  python -m ficco.bench calls --new-shapes 40 --shape 500,64,64   # first calls of new lengths
  python -m ficco.bench calls --first-sight 20    # first sight of 20 new keys, both auto modes
"""
#: rows per rank of the first-sight keys: one per bucket (ficco.heuristics.auto.bucketed)
FIRST_SIGHT_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80,
                    96, 112, 128, 160, 192, 224, 256)

CASES = ("all_gather_matmul", "matmul_reduce_scatter", "ColumnParallelLinear",
         "RowParallelLinear", "all_gather_matmul fp8+bias")
LAYERS = ("ColumnParallelLinear", "RowParallelLinear")   # no schedule argument
PACKAGE = str(Path(__file__).resolve().parents[1])


def add_arguments(parser) -> None:
    parser.add_argument("--world", type=int, default=2, help="ranks to spawn")
    parser.add_argument("--shape", default="64,64,64",
                        help="m,n,K: rows per rank, output columns, inner dimension")
    parser.add_argument("--warmup", type=int, default=5, help="calls before profiling")
    parser.add_argument("--calls", type=int, default=20, help="profiled warm calls per case")
    parser.add_argument("--schedule", default=None, help="force a schedule (default: chosen)")
    parser.add_argument("--transport", default=None, help="force a transport (auto|dma|ccl)")
    parser.add_argument("--top", type=int, default=0,
                        help="also list the N ficco functions called most per warm call")
    parser.add_argument("--new-shapes", type=int, default=0,
                        help="time the first call of N new sequence lengths instead")
    parser.add_argument("--first-sight", type=int, default=0,
                        help=f"time the first sight of N new keys (at most "
                             f"{len(FIRST_SIGHT_ROWS)}) in both FICCO_AUTO modes instead")


def _serialisation(func: tuple) -> str | None:
    filename, _, name = func
    if name == "dumps" and filename.endswith(os.path.join("json", "__init__.py")):
        return "json"
    if "pickle" in name and "dump" in name:
        return "pickle"
    return None


def count(stats: pstats.Stats, calls: int) -> dict:
    """Per-call counts from a cProfile run of ``calls`` calls: ficco calls, all calls, and
    serialisations by kind; ``top``: (count, function) of the ficco functions."""
    ficco_calls = all_calls = 0
    serial = {"json": 0, "pickle": 0}
    top = []
    raw = stats.stats  # type: ignore[attr-defined]  # the documented table; typeshed lacks it
    for func, (_cc, nc, _tt, _ct, _callers) in raw.items():
        all_calls += nc
        kind = _serialisation(func)
        if kind:
            serial[kind] += nc
        if func[0].startswith(PACKAGE) and func[0] != __file__:   # not this verb's own lambdas
            ficco_calls += nc
            top.append((nc / calls, f"{os.path.relpath(func[0], PACKAGE)}:{func[2]}"))
    top.sort(reverse=True)
    return {"ficco": ficco_calls / calls, "all": all_calls / calls,
            "json": serial["json"] / calls, "pickle": serial["pickle"] / calls, "top": top}


def _case(name, rank, world, m, n, k):
    """A no-argument function making one call of case ``name`` on fresh tensors."""
    import torch

    import ficco

    gen = torch.Generator().manual_seed(100 + rank)
    if name == "all_gather_matmul":
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        return lambda schedule: ficco.all_gather_matmul(a, b, schedule=schedule)
    if name == "matmul_reduce_scatter":
        a, b = torch.randn(world * m, k, generator=gen), torch.randn(k, n, generator=gen)
        return lambda schedule: ficco.matmul_reduce_scatter(a, b, schedule=schedule)
    if name == "all_gather_matmul fp8+bias":
        e4m3, one = torch.float8_e4m3fn, torch.tensor(1.0)
        a8 = torch.randn(m, k, generator=gen).to(e4m3)
        b8, bias = torch.randn(k, n, generator=gen).to(e4m3), torch.randn(n, generator=gen)
        return lambda schedule: ficco.all_gather_matmul(
            a8, b8, schedule=schedule, a_scale=one, b_scale=one, out_dtype=torch.bfloat16,
            bias=bias)
    from ficco.nn import ColumnParallelLinear, RowParallelLinear

    if name == "RowParallelLinear":
        row = RowParallelLinear(world * k, n)
        x = torch.randn(world * m, k, generator=gen)
        return lambda schedule: row(x)
    layer = ColumnParallelLinear(k, world * n, bias=False)
    x = torch.randn(m, k, generator=gen)
    return lambda schedule: layer(x)


def _profiled(rank, world, args):
    """This rank's counts per case (every rank makes the same calls)."""
    import torch.distributed as dist

    import ficco

    m, n, k = (int(x) for x in args["shape"].split(","))
    if args.get("new_shapes"):
        return _first_calls(rank, world, m, n, k, args["new_shapes"])
    rows = {}
    with ficco.config.scope(**({"transport": args["transport"]} if args["transport"] else {})):
        for name in CASES:
            call = _case(name, rank, world, m, n, k)
            schedule = None if name in LAYERS else args["schedule"]
            for _ in range(args["warmup"]):
                call(schedule)
            dist.barrier()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args["calls"]):
                call(schedule)
            profiler.disable()
            rows[name] = count(pstats.Stats(profiler), args["calls"])
            rows[name]["ran"] = ficco.api.last_run()
    return rows


def _first_calls(rank, world, m, n, k, count) -> dict:
    """{transport: (median seconds of the first call of a new length, of a warm one)}."""
    import time

    import torch

    import ficco

    gen = torch.Generator().manual_seed(rank)
    b = torch.randn(k, n, generator=gen)
    out = {}
    for transport in ("dma", "ccl"):
        with ficco.config.scope(transport=transport):
            for rows in (8, 9):                                     # the process's first uses
                ficco.all_gather_matmul(torch.randn(rows, k, generator=gen), b)
            first: list[float] = []
            warm: list[float] = []
            for rows in range(m, m + count):
                a = torch.randn(rows, k, generator=gen)
                for times in (first, warm):
                    start = time.perf_counter()
                    ficco.all_gather_matmul(a, b)
                    times.append(time.perf_counter() - start)
        out[transport] = (sorted(first)[count // 2], sorted(warm)[count // 2])
        ficco.shutdown()
    return out


def _first_sights(rank, world, count, root) -> dict:
    """{mode: per key (first call s, [exploring call s], [repeat s], ran)} on this rank."""
    import os
    import time

    import torch

    import ficco
    from ficco.heuristics import auto

    gen = torch.Generator().manual_seed(rank)
    k, n = 384, 256
    b, b_other = torch.randn(k, n, generator=gen), torch.randn(320, n, generator=gen)
    out = {}
    for mode in ("explore", "upfront"):
        auto.CACHE.forget()       # (in memory, another mode's decisions would be offered)
        with ficco.config.scope(auto=mode, selector="auto",
                                cache_dir=os.path.join(root, mode)):
            ficco.all_gather_matmul(torch.randn(3, 320, generator=gen), b_other)
            session = ficco.session_of()
            keys = []
            for rows in FIRST_SIGHT_ROWS[:count]:
                a = torch.randn(rows, k, generator=gen)
                start = time.perf_counter()
                ficco.all_gather_matmul(a, b)
                first = time.perf_counter() - start
                exploring: list[float] = []
                while not session.last.final and len(exploring) < 1000:
                    start = time.perf_counter()
                    ficco.all_gather_matmul(a, b)
                    exploring.append(time.perf_counter() - start)
                repeats = []
                for _ in range(5):
                    start = time.perf_counter()
                    ficco.all_gather_matmul(a, b)
                    repeats.append(time.perf_counter() - start)
                keys.append((first, exploring, repeats, ficco.api.last_run()))
        out[mode] = keys
        ficco.shutdown()
    return out


def first_sight(world: int = 2, count: int = 20) -> dict:
    """{mode: summary} of :func:`_first_sights` on rank 0 (medians over the keys)."""
    import statistics
    import tempfile

    from .cli import cpu_ranks

    with tempfile.TemporaryDirectory(prefix="ficco-first-sight-") as root:
        per_rank = cpu_ranks(_first_sights, world, count, root)
    out = {}
    for mode, keys in per_rank[0].items():
        firsts = [first for first, _, _, _ in keys]
        repeats = [statistics.median(r) for _, _, r, _ in keys]
        exploring = [t for _, e, _, _ in keys for t in e]
        out[mode] = {
            "first_s": statistics.median(firsts), "repeat_s": statistics.median(repeats),
            "ratio": statistics.median(f / r for f, r in zip(firsts, repeats)),
            "slowest_first_s": max(firsts),
            "exploring_s": statistics.median(exploring) if exploring else None,
            "exploring_calls": statistics.median(len(e) for _, e, _, _ in keys),
            "exploring_ratio": statistics.median(
                statistics.median(e) / statistics.median(r) for _, e, r, _ in keys if e)
            if exploring else None,
            "ran": sorted({"/".join(ran) for _, _, _, ran in keys})}
    return out


def measure(world: int = 2, shape: str = "64,64,64", warmup: int = 5, calls: int = 20,
            schedule: str | None = None, transport: str | None = None,
            new_shapes: int = 0) -> dict:
    """``{case: counts}`` of the slowest rank (most ficco calls) per case."""
    from .cli import cpu_ranks

    args = {"shape": shape, "warmup": warmup, "calls": calls, "schedule": schedule,
            "transport": transport, "new_shapes": new_shapes}
    per_rank = cpu_ranks(_profiled, world, args)
    if new_shapes:
        return {t: tuple(max(rows[t][i] for rows in per_rank) for i in (0, 1))
                for t in ("dma", "ccl")}
    return {name: max((rows[name] for rows in per_rank), key=lambda r: r["ficco"])
            for name in CASES}


def main(args) -> int:
    if args.first_sight:
        count = min(args.first_sight, len(FIRST_SIGHT_ROWS))
        rows = first_sight(args.world, count)
        print(f"first sight of {count} new keys (all_gather_matmul float32, K=384, n=256, rows "
              f"per rank {', '.join(map(str, FIRST_SIGHT_ROWS[:count]))}), W={args.world}, cpu "
              f"backend; medians over the keys, rank 0's host clock:")
        print(f"{'FICCO_AUTO':<10} {'first call':>11} {'repeat':>9} {'first/repeat':>12} "
              f"{'slowest first':>13} {'exploring calls':>15} {'each':>9} {'vs repeat':>9}  ran")
        for mode, r in rows.items():
            each = "-" if r["exploring_s"] is None else f"{r['exploring_s'] * 1e3:.2f} ms"
            vs = "-" if r["exploring_ratio"] is None else f"{r['exploring_ratio']:.2f}x"
            print(f"{mode:<10} {r['first_s'] * 1e3:>8.2f} ms {r['repeat_s'] * 1e3:>6.2f} ms "
                  f"{r['ratio']:>11.2f}x {r['slowest_first_s'] * 1e3:>10.1f} ms "
                  f"{r['exploring_calls']:>15.0f} {each:>9} {vs:>9}  {', '.join(r['ran'])}")
        return 0
    if args.new_shapes:
        firsts = measure(args.world, args.shape, new_shapes=args.new_shapes)
        print(f"first calls of {args.new_shapes} new sequence lengths from m={args.shape}, "
              f"W={args.world}, cpu backend; median seconds, slowest rank:")
        for transport, (first, warm) in firsts.items():
            print(f"  {transport}: first call {first * 1e3:.1f} ms, warm call {warm * 1e3:.2f} ms")
        return 0
    worst = measure(args.world, args.shape, args.warmup, args.calls, args.schedule,
                    args.transport)
    print(f"warm calls, W={args.world}, cpu backend, shape m,n,K={args.shape}, "
          f"{args.calls} profiled after {args.warmup}; per call, slowest rank:")
    print(f"{'case':<28} {'ficco calls':>11} {'all calls':>10} {'json.dumps':>10} "
          f"{'pickle':>7}  ran")
    for name, row in worst.items():
        ran = "/".join(row["ran"]) if row["ran"] else "plain"
        print(f"{name:<28} {row['ficco']:>11.1f} {row['all']:>10.1f} {row['json']:>10.1f} "
              f"{row['pickle']:>7.1f}  {ran}")
    for name, row in worst.items():
        if args.top:
            print(f"\n{name}: the {args.top} ficco functions called most per warm call")
            for per_call, func in row["top"][:args.top]:
                print(f"  {per_call:>6.1f}  {func}")
    return 0
