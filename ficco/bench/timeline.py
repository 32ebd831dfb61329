"""``timeline``: one measured call drawn per queue (from the backend's events) next to the
simulator's prediction for the same Plan.

Run under torchrun; rank 0 writes the files::

    torchrun --nproc-per-node 8 -m ficco.bench timeline --shape 16384,8192,8192 \\
        --schedule hetero-fused-1d
    # -> timeline-<schedule>.png, timeline-<schedule>.trace.json, timeline.json

The PNG stacks the measured view of one rank (``--rank``, or ``--rank all`` for every rank)
above the prediction, on one time axis: each measured bar is an op's start and end event on
its queue, relative to the first op of the call; the predicted one is
:func:`ficco.heuristics.simulator.simulate` of the very Plan that ran, on the profile in force
(``--profile`` or ``FICCO_PROFILE`` or the detected one). The ``.trace.json`` holds the same
bars as a Chrome trace (chrome://tracing, ui.perfetto.dev).
"""
from __future__ import annotations

import contextlib
import json

import torch
import torch.distributed as dist

from ..errors import InvalidArgumentError
from ..kernels.launch import TileTrace
from . import results, rs_inputs, scenarios
from .cli import require_plots, require_torchrun, run_dir
from .sweep import agree_on_failure, all_gather_rows, check_memory, start_run, synchronize

EXAMPLES = """\
  torchrun --nproc-per-node 8 -m ficco.bench timeline --shape 16384,8192,8192 \\
      --schedule hetero-fused-1d --rank all
  torchrun --nproc-per-node 2 -m ficco.bench timeline      # CPU: 2048,1024,1024, fp32"""


def add_arguments(parser) -> None:
    scenarios.add_arguments(parser)
    rs_inputs.add_op_argument(parser)
    parser.add_argument("--schedule", default="uniform-fused-1d", help="schedule to draw")
    parser.add_argument("--no-plots", action="store_true",
                        help="write the JSON and the trace only (no matplotlib needed)")
    parser.add_argument("--transport", default="dma", choices=("dma", "ccl"))
    parser.add_argument("--dtype", default=None,
                        help="element type (default bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untraced calls before the traced one")
    parser.add_argument("--profile", default=None,
                        help="profile for the prediction (name or JSON; default: FICCO_PROFILE "
                             "or the one detected for this device)")
    parser.add_argument("--rank", default="0", help="whose measured timeline to draw, or 'all'")
    parser.add_argument("--out", default=None,
                        help="directory (default bench/runs/timeline-<target>-<date>)")


def _makespan(rows: list[dict]) -> float:
    rows = [r for r in rows if not r.get("mark")]
    if not rows:
        return 0.0
    return max(r["end_s"] for r in rows) - min(r["start_s"] for r in rows)


#: tile mark colours by arrival chunk (own rows first)
_CHUNK_COLOURS = ("#000000", "#e85d04", "#3a0ca3", "#d00000", "#ffba08", "#7209b7", "#6a040f",
                  "#f72585", "#03071e")   # none close to the gated GEMM bar's teal


def tile_rows(plan, rows: list[dict], launches: list[list[dict]]) -> list[dict]:
    """Per-tile marks on the measured gated GEMM rows: one point event per output tile at
    the moment it saw its (first) arrival flag, i.e. started on rows that had landed; tiles
    of this rank's own rows at their start. The kernel's clock (GPU %globaltimer / realtime
    counter, the host's clock in the interpreter) is aligned so that the launch's first
    program starts at the measured bar's start event (the launch latency between the two
    is not measured). Marks are spread vertically by chunk and coloured by it. A 2d tile
    (several K chunks) gets a second mark (``last_part``) when it saw its last chunk's flag."""
    world = plan.problem.world
    out = []
    chunks = 1 + max((f // world for tiles in launches for t in tiles for f in t["flags"]),
                     default=-1)
    for tiles in launches:
        if not tiles:
            continue
        b = tiles[0]["b"]
        bar = next((r for r in rows if r["kind"] == "gated_gemm"
                    and plan.ops[r["op_index"]].b == b), None)
        if bar is None:
            continue
        for t in tiles:
            seen = [(t["flags"][0], t["first_seen"], False)] if t["flags"] else \
                [(None, t["first_seen"], False)]
            if len(t["flags"]) > 1:
                seen.append((t["flags"][-1], t["last_seen"], True))
            for flag, at, last in seen:
                chunk, peer = divmod(flag, world) if flag is not None else \
                    (-1, plan.problem.rank)
                what = "own rows" if flag is None else \
                    f"{'last K ' if last else ''}chunk {chunk} of peer {peer}"
                out.append({
                    "op_index": bar["op_index"], "queue": bar["queue"], "kind": "gated_tile",
                    "mark": True, "last_part": last, "start_s": bar["start_s"] + at,
                    "end_s": bar["start_s"] + t["end"],
                    "label": f"tile r{t['row0']}+{t['rows']} c{t['col0']}+{t['cols']} b{b}: "
                             f"{what}", "chunk": chunk, "peer": peer, "flag": flag,
                    **{key: t[key] for key in ("row0", "rows", "col0", "cols")},
                    "waited_s": t["first_seen"] - t["start"], "ok": t["ok"],
                    "mark_y": -0.3 + 0.6 * (chunk + 1) / max(chunks, 1),
                    "colour": _CHUNK_COLOURS[(chunk + 1) % len(_CHUNK_COLOURS)]})
    return out


def chunk_summary(plan, rows: list[dict]) -> list[dict]:
    """Per arrival chunk of a gated call: when its last flag was raised (the measured Signal
    rows' end), when its tiles first and last saw one of its flags (:func:`tile_rows` marks;
    2d: a tile's first and last K chunk), and how many of those came before their flag's
    Signal op began (``early``; 0 when gated - on GPUs up to the launch latency the alignment
    leaves out)."""
    world = plan.problem.world
    # keyed by chunk (raised, started, early) or flag (signal_start)
    raised: dict[int, float] = {}
    signal_start: dict[int, float] = {}
    started: dict[int, list[float]] = {}
    early: dict[int, int] = {}
    for r in rows:
        if r["kind"] == "signal":
            flag = plan.ops[r["op_index"]].flag
            raised[flag // world] = max(raised.get(flag // world, 0.0), r["end_s"])
            signal_start[flag] = r["start_s"]
    for r in rows:
        if r.get("mark") and r.get("chunk", -1) >= 0:
            started.setdefault(r["chunk"], []).append(r["start_s"])
            if r["start_s"] < signal_start.get(r["flag"], float("-inf")):
                early[r["chunk"]] = early.get(r["chunk"], 0) + 1
    return [{"chunk": c, "flags_raised_by_s": raised.get(c),
             "first_tile_s": min(started[c]), "last_tile_s": max(started[c]),
             "tiles": len(started[c]), "early": early.get(c, 0)} for c in sorted(started)]


def main(args) -> int:
    import ficco

    from .. import api

    require_plots("timeline", not args.no_plots, "--no-plots")
    require_torchrun("timeline", "--shape 2048,1024,1024")
    rank, world, backend, device, dtype = start_run(args.dtype)
    if args.rank != "all" and not (args.rank.isdigit() and int(args.rank) < world):
        raise InvalidArgumentError(f"--rank {args.rank!r}: use 'all' or a rank below {world}")
    ficco.schedules.get(args.schedule, op=args.op.replace("-", "_"))
    if not args.shape and not args.scenarios:
        args.shape = ["2048,1024,1024"]
    scenario = scenarios.from_args(args, world)[0]
    try:
        check_memory([scenario], world, dtype, device, verb="timeline")
        too_big = None
    except InvalidArgumentError as exc:
        too_big = str(exc)
    too_big = agree_on_failure(too_big)
    if too_big:
        raise InvalidArgumentError(too_big)
    if rs_inputs.wants(args):   # the row-parallel GEMM (ficco/bench/rs_inputs.py)
        plan, rows, max_abs_err = rs_inputs.traced_run(scenario, args, world, rank, dtype,
                                                       device)
        everyone = [None] * world
        dist.all_gather_object(everyone, {"rows": rows, "max_abs_err": max_abs_err})
        if rank == 0:
            write_timeline(args, scenario, plan, everyone, backend, device, world)
        dist.barrier()
        return 0
    problem = scenario.problem(world, rank, dtype)
    torch.manual_seed(rank + 1)
    a = torch.randn(problem.m, scenario.k, device=device).to(problem.torch_dtype)
    b = (torch.randn(scenario.k, problem.ns[0], device=device) / scenario.k ** 0.5) \
        .to(problem.torch_dtype)

    from .. import config

    with config.scope(transport=args.transport):
        for _ in range(args.warmup):
            ficco.all_gather_matmul(a, b, schedule=args.schedule)
    synchronize(device)
    gated = getattr(ficco.schedules.get(args.schedule), "optional", False)
    trace = TileTrace() if gated else None
    with trace if trace is not None else contextlib.nullcontext():
        out, plan, rows = api.traced_all_gather_matmul(a, b, schedule=args.schedule,
                                                       transport=args.transport)
    synchronize(device)
    summary = None
    if trace is not None:
        rows = rows + tile_rows(plan, rows, trace.tiles())
        summary = chunk_summary(plan, rows)
    gathered = torch.empty(problem.big_m, scenario.k, device=device, dtype=a.dtype)
    all_gather_rows(gathered, a)
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
    reference = gathered.to(ref_dtype) @ b.to(ref_dtype)
    max_abs_err = (out.to(ref_dtype) - reference).abs().max().item()
    everyone = [None] * world
    dist.all_gather_object(everyone, {"rows": rows, "max_abs_err": max_abs_err,
                                      "chunks": summary})
    if rank == 0:
        write_timeline(args, scenario, plan, everyone, backend, device, world)
    dist.barrier()
    return 0


def write_timeline(args, scenario, plan, everyone, backend, device, world) -> None:
    from ..heuristics import profiles, simulator
    from .gantt import chrome_trace, draw_panels

    target = backend.target()
    profile_name = args.profile or profiles.resolve(target).name
    profile = profiles.load(args.profile) if args.profile else profiles.resolve(target)
    predicted = simulator.simulate(plan, profile)
    out_dir = run_dir("timeline", target, args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = f"{plan.problem.big_m}x{plan.problem.ns[0]}x{scenario.k} {plan.problem.dtype} W={world}"
    ranks = range(world) if args.rank == "all" else [int(args.rank)]
    panels = [(f"measured, rank {r}: {1e3 * _makespan(everyone[r]['rows']):.3f} ms",
               everyone[r]["rows"]) for r in ranks]
    panels.append((f"predicted on profile {profile_name}: {1e3 * predicted.makespan_s:.3f} ms",
                   predicted.rows))
    written = []
    trace = out_dir / f"timeline-{args.schedule}.trace.json"
    trace.write_text(json.dumps(chrome_trace(panels), default=str) + "\n")
    written.append(trace)
    if not args.no_plots:
        written.append(draw_panels(panels, out_dir / f"timeline-{args.schedule}.png",
                                   f"{args.schedule} over {args.transport}, {shape}"))
    record = {"schema": results.TIMELINE_SCHEMA, "scenario": scenario.name,
              "big_m": plan.problem.big_m, "n": plan.problem.ns[0], "k": scenario.k,
              "dtype": plan.problem.dtype, "world": world, "schedule": args.schedule,
              "transport": args.transport, "profile": profile_name,
              "measured_makespan_s": {str(r): _makespan(e["rows"]) for r, e in enumerate(everyone)},
              "predicted_makespan_s": predicted.makespan_s,
              "max_abs_err": max(e["max_abs_err"] for e in everyone),
              "measured_rows": {str(r): e["rows"] for r, e in enumerate(everyone)},
              "chunks": {str(r): e.get("chunks") for r, e in enumerate(everyone)},
              "predicted_rows": predicted.rows,
              "env": results.environment(world, target, device)}
    (out_dir / "timeline.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    written.append(out_dir / "timeline.json")
    print(f"{args.schedule} over {args.transport} on {shape}: measured "
          + ", ".join(f"rank {r} {1e3 * v:.3f} ms"
                      for r, v in record["measured_makespan_s"].items())
          + f"; predicted {1e3 * predicted.makespan_s:.3f} ms on profile {profile_name}; "
          f"max |C - ref| {record['max_abs_err']:.2e}")
    for r, e in enumerate(everyone):
        for c in e.get("chunks") or []:
            raised = c["flags_raised_by_s"]
            print(f"rank {r} chunk {c['chunk']}: flags raised by "
                  + ("?" if raised is None else f"{1e3 * raised:.3f} ms")
                  + f"; {c['tiles']} tiles saw them at {1e3 * c['first_tile_s']:.3f} .. "
                  f"{1e3 * c['last_tile_s']:.3f} ms, {c['early']} before their flag's "
                  f"signal op began")
    print("wrote " + ", ".join(str(p) for p in written))
