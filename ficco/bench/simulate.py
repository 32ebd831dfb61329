"""``python -m ficco.bench simulate``: predicted time of every schedule on a device profile.

For each scenario: the simulated time of every schedule, its speedup over ``serial``, the
ideal speedup (serial with GEMM and all-gather perfectly overlapped) and the pick of the
``paper`` and ``model`` selectors; printed as a table, written as ``table.txt`` and
``simulate.json``, and drawn as one PNG timeline per scenario (``serial`` above the model's
pick). No GPU needed::

    python -m ficco.bench simulate --profile mi300x --scenarios paper --world 8
    python -m ficco.bench simulate --profile h100 --shape 65536,8192,8192 --out /tmp/sim
    python -m ficco.bench simulate --op matmul-reduce-scatter --scenarios llama --profile h100
    python -m ficco.bench simulate --op matmul-all-reduce --scenarios llama-decode --graph
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from .. import config, schedules
from ..errors import InvalidArgumentError
from ..heuristics import bands, model, profiles, simulator
from ..heuristics.paper import paper_choice
from ..heuristics.scenarios import PAPER_TABLE_I, gemm_problem
from ..plan.problem import Problem

EXAMPLES = """\
  python -m ficco.bench simulate --profile mi300x --scenarios paper --world 8
  python -m ficco.bench simulate --profile h100 --shape 65536,8192,8192 --out /tmp/sim
  python -m ficco.bench simulate --profile my_profile.json --no-png
  python -m ficco.bench simulate --op matmul-reduce-scatter --scenarios llama --profile h100
  python -m ficco.bench simulate --op matmul-all-reduce --scenarios llama-decode --profile h100"""

SHORT = {"serial": "serial", "ring": "ring", "ring-bidir": "ring-bi", "gated-1d": "gated1d",
         "gated-2d": "gated2d", "rs-ag-uniform-fused-1d": "rsag-uf1", "rs-ag-ring": "rsag-r",
         "one-shot": "1shot", "one-shot-sm": "1shot-sm", "two-shot": "2shot",
         "two-shot-sm": "2shot-sm", "chunked-2": "chunk2", "chunked-4": "chunk4",
         "chunked-8": "chunk8"}
#: decode batches (rows M of a row-parallel GEMM in one decode step) of ``--scenarios
#: llama-decode``
DECODE_BATCHES = (1, 32, 256)
_ROW_PARALLEL = ("matmul_reduce_scatter", "matmul_all_reduce")


def short_name(name: str) -> str:
    """``hetero-unfused-1d`` -> ``h-u-1d``: table headers that fit a terminal."""
    return SHORT.get(name) or "-".join(part[0] for part in name.split("-")[:2]) \
        + "-" + name.split("-")[-1]


def add_arguments(parser) -> None:
    parser.add_argument("--profile", default="mi300x",
                        help=f"built-in profile ({', '.join(profiles.builtin_names())}) or a "
                             f"profile JSON path")
    parser.add_argument("--op", default="all-gather-matmul",
                        choices=["all-gather-matmul", "matmul-reduce-scatter",
                                 "matmul-all-reduce"],
                        help="which op's schedules: the all-gather in front of a column-"
                             "parallel GEMM, the reduce-scatter after a row-parallel one, or "
                             "the all-reduce after a row-parallel one (no sequence parallelism)")
    parser.add_argument("--scenarios", default="paper",
                        choices=["paper", "llama", "llama-decode", "none"],
                        help="scenario set: paper = Table I g1-g16, llama = the llama 8B/70B/"
                             "405B GEMMs at seq 8192, TP = --world (column-parallel qkv/upgate "
                             "for all-gather, row-parallel o/down for the reduce-scatter and "
                             "all-reduce), llama-decode = their row-parallel o/down at decode "
                             f"batches {DECODE_BATCHES} (M = the batch), none = only --shape")
    parser.add_argument("--shape", action="append", default=[], metavar="M,N,K",
                        help="an extra layer GEMM (M rows gathered, N weight columns split "
                             "over the world, K); repeatable")
    parser.add_argument("--world", type=int, default=8, help="group size W")
    parser.add_argument("--dtype", default="bfloat16",
                        choices=["bfloat16", "float16", "float32", "float64", "float8_e4m3fn",
                                 "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"],
                        help="the operands' dtype; fp8 runs row-wise scaled with bfloat16 "
                             "outputs (--scaling tensor for one scale each)")
    parser.add_argument("--scaling", default="row", choices=["row", "tensor"],
                        help="fp8 scales (docs/fp8.md); ignored for other dtypes")
    parser.add_argument("--scale", type=int, default=1, help="divide every M by this")
    parser.add_argument("--transport", default="dma", choices=["dma", "ccl"])
    parser.add_argument("--topology", default=None, choices=list(profiles.TOPOLOGIES),
                        help="override the profile's topology")
    parser.add_argument("--out", default=None,
                        help="output folder (default bench/runs/simulate-<profile>, overwritten)")
    parser.add_argument("--no-png", action="store_true", help="skip the timeline PNGs")
    parser.add_argument("--graph", action="store_true",
                        help="price CUDA-graph replays: no host enqueue time per runtime call "
                             "(the profile's host_op_s set to 0)")
    parser.add_argument("--markdown", action="store_true",
                        help="print the summary as markdown tables (what the docs quote): per "
                             "scenario the paper rule's, the fastest and the selector's pick "
                             "with their simulated speedups, the band and what it costs")
    parser.add_argument("--host-op-us", default=None, metavar="LIST",
                        help="also print the selector's pick at each of these host costs per "
                             "runtime call, in us (e.g. 0,1,2,3,5,8,14): where eager picks flip")
    parser.add_argument("--optional", action="store_true",
                        help="also simulate the optional schedules (gated-1d, gated-2d: need "
                             "Triton on the device) and let the model pick among them")


def _profile(args, host_op_s: float | None = None):
    from dataclasses import replace

    profile = profiles.load(args.profile)
    if getattr(args, "graph", False):
        profile = replace(profile, host_op_s=0.0)
    if host_op_s is not None:
        profile = replace(profile, host_op_s=host_op_s)
    return profile


def selector_pick(problem, profile, topology, transport, engines, names) -> dict:
    """What the ``model`` selector picks with its error band (:mod:`ficco.heuristics.bands`),
    weighing ``transport`` and ``ccl`` as ``FICCO_TRANSPORT=auto`` does, and what the band
    costs: the predicted time of the pick over the fastest candidate's, minus one."""
    op = problem.op
    transports = (transport, "ccl") if transport == "dma" else (transport,)
    width, cls = bands.band(problem, profile, topology)
    choice = model.banded_choice(problem, profile, topology, transports, engines,
                                 lambda via: names if via == transport
                                 else schedules.names(op=op), width, cls)
    picked_s = choice.scores[choice.schedule]
    fastest_s = model.predict(choice.fastest, problem, profile, topology,
                              choice.fastest_transport, engines)
    return {"schedule": choice.schedule, "transport": choice.transport, "gain": choice.gain,
            "band": width, "class": cls, "fastest": choice.fastest,
            "fastest_transport": choice.fastest_transport, "time_s": picked_s,
            "cost": picked_s / fastest_s - 1 if fastest_s > 0 else 0.0}


def _ideal(serial_run, op: str) -> float:
    """The ideal speedup over serial. Reduce-scatter's (and all-reduce's) serial is the GEMM,
    then the move and the reduction: overlapped perfectly it takes the longer of the two (the
    all-gather's reading, which counts communication from time 0, does not apply)."""
    if op not in _ROW_PARALLEL:
        return simulator.ideal_speedup(serial_run)
    gemm_s = serial_run.busy_s("gemm")
    rest_s = serial_run.makespan_s - gemm_s
    return serial_run.makespan_s / max(gemm_s, rest_s, 1e-12)


def _op(args) -> str:
    return getattr(args, "op", "all-gather-matmul").replace("-", "_")


def _problem(args, big_m: int, n: int, k: int):
    """The Problem of one layer GEMM (M, N, K) for the chosen op: all-gather splits N over the
    world, reduce-scatter splits K (each rank holds its K-shard of the weight)."""
    fp8 = args.dtype.startswith("float8")
    # "" is Problem's own default for both: no epilogue unless the dtype is fp8
    scaling: str = getattr(args, "scaling", "row") if fp8 else ""
    out_dtype = "bfloat16" if fp8 else ""
    if _op(args) in _ROW_PARALLEL:
        return Problem(big_m, max(k // args.world, 1), (n,), args.dtype, args.world,
                       op=_op(args), out_dtype=out_dtype, scaling=scaling)
    return dataclasses.replace(gemm_problem(big_m, n, k, args.world, args.dtype),
                               out_dtype=out_dtype, scaling=scaling)


def _llama(args) -> list[tuple[str, tuple[int, int, int]]]:
    from .scenarios import llama

    row_parallel = _op(args) in _ROW_PARALLEL
    decode = args.scenarios == "llama-decode"
    out = []
    for preset in ("8B", "70B", "405B"):
        for sc in llama(preset, 8192, args.world):
            if sc.name.endswith(("-o", "-down")) == row_parallel:
                # presets are per rank: back to the layer GEMM the problem splits again
                n, k = (sc.n, sc.k * args.world) if row_parallel else (sc.n * args.world, sc.k)
                name = sc.name.removeprefix("llama-")
                for m in DECODE_BATCHES if decode else (sc.big_m,):
                    out.append((f"{name}-b{m}" if decode else name, (m, n, k)))
    return out


def scenarios(args) -> list[tuple[str, tuple[int, int, int]]]:
    chosen = list(PAPER_TABLE_I.items()) if args.scenarios == "paper" else []
    if args.scenarios in ("llama", "llama-decode"):
        chosen = _llama(args)
    for text in args.shape:
        try:
            big_m, n, k = (int(v) for v in text.split(","))
        except ValueError:
            raise InvalidArgumentError(f"--shape {text!r}: expected three integers M,N,K, "
                                       f"e.g. --shape 65536,8192,8192") from None
        chosen.append((f"{big_m}x{n}x{k}", (big_m, n, k)))
    if not chosen:
        raise InvalidArgumentError("no scenarios: use --scenarios paper or give --shape M,N,K")
    # (the all-reduce keeps every M: a decode step's single row goes to every rank)
    floor = 1 if _op(args) == "matmul_all_reduce" else args.world
    return [(name, (max(m // args.scale, floor), n, k)) for name, (m, n, k) in chosen]


def run(args) -> dict:
    """Simulate every schedule on every scenario; returns the JSON-ready report."""
    if args.world < 1:
        raise InvalidArgumentError(f"--world must be >= 1; got {args.world}")
    profile = _profile(args)
    topology = args.topology or profile.topology
    low, high = config.paper_thresholds()
    engines = config.copy_engines()
    op = _op(args)
    report = {"profile": profile.name, "world": args.world, "dtype": args.dtype, "op": op,
              "transport": args.transport, "topology": topology, "scenarios": []}
    names = schedules.names(op=op) + (schedules.optional_names(op=op)
                                      if getattr(args, "optional", False) else [])
    report["schedules"] = names
    for name, (big_m, n, k) in scenarios(args):
        problem = _problem(args, big_m, n, k)
        times = model.predict_all(problem, profile, topology, args.transport, engines, names)
        serial_s = times["serial"]
        pick_model, _, _ = model.model_choice(problem, profile, topology, args.transport,
                                              engines, names)
        pick_paper, score = (paper_choice(problem, profile, low, high)[:2]
                             if op == "all_gather_matmul" else ("(model)", 0.0))
        serial_run = model.simulate_schedule("serial", problem, profile, topology,
                                             args.transport, engines)
        selected = selector_pick(problem, profile, topology, args.transport, engines, names)
        by_host = {}
        for us in _host_costs(args):
            priced = _profile(args, us * 1e-6)
            pick = selector_pick(problem, priced, topology, args.transport, engines, names)
            by_host[f"{us:g}"] = {k: pick[k] for k in ("schedule", "transport", "gain")}
        report["scenarios"].append({
            "name": name, "M": big_m, "N": n, "K": k, "local_n": problem.n_total,
            "times_s": times,
            "speedup": {s: serial_s / t if t > 0 else 1.0 for s, t in times.items()},
            "ideal_speedup": _ideal(serial_run, op),
            "picks": {"paper": pick_paper, "model": pick_model}, "paper_score": score,
            "selector": selected, "selector_by_host_op_us": by_host})
    return report


def _host_costs(args) -> list[float]:
    text = getattr(args, "host_op_us", None)
    if not text:
        return []
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise InvalidArgumentError(f"--host-op-us {text!r}: expected a comma list of "
                                   f"microseconds, e.g. 0,1,2,5,14") from None


def table(report: dict) -> str:
    """The printed report: simulated speedups over serial, the ``paper`` rule's pick, the
    fastest schedule (``model``, no band) and the selector's pick with its band and what the
    band costs; then, with ``--host-op-us``, the selector's pick at each host cost per op."""
    names = report.get("schedules") or schedules.names()
    head = f"{'scenario':<10} {'serial ms':>10} {'ideal':>6} " \
        + " ".join(f"{short_name(s):>7}" for s in names) \
        + f"  {'paper':<18} {'fastest':<18} {'selector (transport)':<26} {'gain':>5} " \
          f"{'band':>5} {'cost':>5}"
    lines = [(f"{report.get('op', 'all_gather_matmul')}: "
             f"profile {report['profile']} ({report['topology']}), W={report['world']}, "
             f"{report['dtype']}, transport {report['transport']}; simulated speedup over "
             f"serial"), head, "-" * len(head)]
    for sc in report["scenarios"]:
        sel = sc["selector"]
        lines.append(
            f"{sc['name']:<10} {sc['times_s']['serial'] * 1e3:>10.3f} "
            f"{sc['ideal_speedup']:>5.2f}x "
            + " ".join(f"{sc['speedup'][s]:>6.2f}x" for s in names)
            + f"  {sc['picks']['paper']:<18} {sc['picks']['model']:<18} "
              f"{sel['schedule'] + ' (' + sel['transport'] + ')':<26} {sel['gain']:>5.0%} "
              f"{sel['band']:>5.0%} {sel['cost']:>5.0%}")
    costs = [sc for sc in report["scenarios"] if sc.get("selector_by_host_op_us")]
    if costs:
        values = list(costs[0]["selector_by_host_op_us"])
        lines += ["", ("selector's pick (transport, simulated gain over the best serial) by host "
                      "time per runtime call, us:"),
                  f"{'scenario':<10} " + " ".join(f"{v + ' us':<30}" for v in values)]
        for sc in costs:
            cells = [f"{p['schedule']} ({p['transport']}) {p['gain']:+.0%}"
                     for p in sc["selector_by_host_op_us"].values()]
            lines.append(f"{sc['name']:<10} " + " ".join(f"{c:<30}" for c in cells))
    return "\n".join(lines)


def markdown(report: dict) -> str:
    """The docs' tables: per scenario the simulated speedup over serial (dma) of the paper
    rule's pick, of the fastest schedule and of the selector's pick (over dma or ccl, kept
    only above the band), the band and what it costs; then the picks by host time per op."""
    op = report.get("op", "all_gather_matmul")
    names = report.get("schedules") or schedules.names(op=op)
    lines = [(f"simulated on {report['profile']} ({report['topology']}), W={report['world']}, "
             f"{report['dtype']}; speedups over serial over {report['transport']}"), "",
             "| GEMM (M, N, K) | serial ms | " + " | ".join(names) + " |",
             "|---|---:|" + "---:|" * len(names)]
    for sc in report["scenarios"]:
        best = max(names, key=lambda n: sc["speedup"][n])
        lines.append(f"| {sc['name']} ({sc['M']}, {sc['N']}, {sc['K']}) | "
                     f"{sc['times_s']['serial'] * 1e3:.3f} | "
                     + " | ".join((f"**{sc['speedup'][n]:.2f}**" if n == best
                                   else f"{sc['speedup'][n]:.2f}") for n in names) + " |")
    lines += ["", ("| GEMM (M, N, K) | serial ms | ideal | paper | fastest | selector | gain "
                  "| band | cost |"), "|---|---:|---:|---|---|---|---:|---:|---:|"]
    for sc in report["scenarios"]:
        sel, serial_s = sc["selector"], sc["times_s"]["serial"]

        def cell(name, transport=report["transport"], time_s=None):
            time_s = time_s if time_s is not None else sc["times_s"].get(name)
            return f"{name} ({serial_s / time_s:.2f}x)" if time_s else name

        paper = sc["picks"]["paper"]
        paper_cell = cell(paper) if paper in sc["times_s"] else "-"
        chosen = cell(sel["schedule"], time_s=sel["time_s"]) + \
            ("" if sel["transport"] == report["transport"] else f" over {sel['transport']}")
        lines.append(f"| {sc['name']} ({sc['M']}, {sc['N']}, {sc['K']}) | {serial_s * 1e3:.3f} "
                     f"| {sc['ideal_speedup']:.2f}x | {paper_cell} | {cell(sc['picks']['model'])} "
                     f"| {chosen} | {sel['gain']:.0%} | \u00b1{sel['band']:.0%} "
                     f"| {sel['cost']:.0%} |")
    costs = [sc for sc in report["scenarios"] if sc.get("selector_by_host_op_us")]
    if costs:
        values = list(costs[0]["selector_by_host_op_us"])
        lines += ["", (f"{op}: the selector's pick (simulated gain over the best serial) by host "
                      f"time per runtime call"), "",
                  "| GEMM | " + " | ".join(f"{v} us" for v in values) + " |",
                  "|---|" + "---|" * len(values)]
        for sc in costs:
            cells = [f"{p['schedule']}{'' if p['transport'] == 'dma' else ' (ccl)'} "
                     f"{p['gain']:+.0%}" for p in sc["selector_by_host_op_us"].values()]
            lines.append(f"| {sc['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw(report: dict, args, out_dir: Path) -> list[Path]:
    from .gantt import draw_gantt

    profile = _profile(args)
    paths = []
    for sc in report["scenarios"]:
        problem = _problem(args, sc["M"], sc["N"], sc["K"])
        rows = []
        for label in dict.fromkeys(["serial", sc["picks"]["model"]]):
            result = model.simulate_schedule(label, problem, profile, report["topology"],
                                             args.transport, config.copy_engines())
            rows += [{**r, "queue": f"{label}/{r['queue']}"} for r in result.rows]
        pick = sc["picks"]["model"]
        title = (f"simulated: {sc['name']} (M={sc['M']}, N={sc['N']}, K={sc['K']}, "
                 f"W={args.world}) on "
                 f"{report['profile']}: serial {sc['times_s']['serial'] * 1e3:.2f} ms, "
                 f"{pick} {sc['times_s'][pick] * 1e3:.2f} ms ({sc['speedup'][pick]:.2f}x)")
        paths.append(draw_gantt(rows, out_dir / f"{sc['name']}.png", title))
    return paths


def main(args) -> int:
    from .cli import require_plots, run_dir

    require_plots("simulate", not args.no_png, "--no-png")
    started = time.perf_counter()
    report = run(args)
    out_dir = run_dir("simulate", report["profile"], args.out, stamp=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = table(report)
    print(markdown(report) if getattr(args, "markdown", False) else text)
    (out_dir / "table.txt").write_text(text + "\n")
    (out_dir / "simulate.json").write_text(json.dumps(report, indent=1) + "\n")
    pngs = [] if args.no_png else draw(report, args, out_dir)
    print(f"wrote simulate.json, table.txt and {len(pngs)} PNG timelines in {out_dir} "
          f"({time.perf_counter() - started:.1f} s)")
    return 0
