"""What the GPU lease scripts (``bench/gpu_lease.sh``, ``bench/gpu_lease_next.sh``) run on a
lent GPU that no other verb does: several ranks as processes sharing one GPU (gloo group, IPC
symmetric memory), each part writing JSON lines and a short table. (Correctness of every
schedule is ``python -m ficco selftest``'s; the ``check`` part that did it here could not
survive one failing schedule.)

- ``host``: host time of one warm call end to end (``ficco.all_gather_matmul`` /
  ``matmul_reduce_scatter`` entry to return, i.e. dispatch, runtime, executor and the fence's
  launch), the fence on and off, per schedule; plus ``host_op_s`` fitted over the plans' op
  counts (seconds per plan op, slope through the origin: the simulator's form), written as a
  profile fragment ``host_op_s.json`` (``{"host_op_s": ..., "sources": {...}}``);
- ``sanitize``: a few small calls, one per kind of copy and barrier (no gated schedule: those
  wait for their own lease), to run under ``compute-sanitizer --tool memcheck``;
- ``timeline``: one traced call per queue (run it under CUDA_DEVICE_MAX_CONNECTIONS=1 and
  8 to compare), rows as JSON and a Gantt PNG;
- ``speed``: the default call, serial over dma, the default on torch's symmetric memory and
  torch's own fused ops at the lease's shapes, then decode's ``matmul_all_reduce`` (the
  default, the one-kernel all-reduce forced, ``torch.mm`` + torch's ``one_shot_all_reduce``),
  each checked against float64 and timed (:mod:`.lease_speed`), one line each into
  ``speed.jsonl`` as it is measured.

Example (from the repository root, on a GPU machine)::

    python -m ficco.bench.gpu_session host --world 4 --out bench/runs/gpu-host
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

#: the shape of ``host``: rows per rank, K, n (bf16)
MEDIUM = (1024, 4096, 4096)


# -- ranks ----------------------------------------------------------------------------------------
def _rank_main(rank, world, init_file, part, args, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=240))
    try:
        result = PARTS[part](rank, world, args)
        error = None
    except BaseException:  # noqa: BLE001 - reported by the parent
        import traceback

        result, error = None, traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"result": result, "error": error}))
    try:
        import ficco

        ficco.shutdown()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - the result is written already
        print(f"rank {rank}: teardown: {type(exc).__name__}: {exc}", file=sys.stderr)


def spawn(part: str, world: int, args) -> list:
    """Run ``part`` on ``world`` ranks sharing the GPU(s); every rank's result, in rank order
    (raises with every failing rank's traceback)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ficco-gpu-session-") as tmp:
        init_file = os.path.join(tmp, "pg")
        mp.start_processes(_rank_main, args=(world, init_file, part, args, tmp), nprocs=world,
                           join=True, start_method="spawn")
        answers = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    failed = [(r, a["error"]) for r, a in enumerate(answers) if a["error"]]
    if failed:
        raise RuntimeError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failed))
    return [a["result"] for a in answers]


def _inputs(op: str, rank: int, world: int, m: int, k: int, n: int, dtype, seed: int):
    """This rank's (a, b) on the GPU and its float64 reference block (on the GPU: a CPU
    float64 GEMM of this size per rank would take minutes), with the rounding scale. They are
    drawn on the device (a host generator drew them on one CPU thread)."""
    from ..backends import get_backend
    from ..plan.problem import even_split

    dev = get_backend().device()
    gen = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    if op == "all_gather_matmul":
        shards = [randn(m, k) for _ in range(world)]
        b = randn(k, n)
        full = torch.cat(shards).to(dtype).double()
        bd = b.to(dtype).double()
        return shards[rank].to(dtype), b.to(dtype), full @ bd, full.abs() @ bd.abs()
    a_s = [randn(world * m, k) for _ in range(world)]
    b_s = [randn(k, n) for _ in range(world)]
    ref = torch.zeros(world * m, n, dtype=torch.float64, device=dev)
    scale = torch.zeros_like(ref)
    for a, b in zip(a_s, b_s):
        ad, bd = a.to(dev, dtype).double(), b.to(dev, dtype).double()
        ref += ad @ bd
        scale += ad.abs() @ bd.abs()
    start, rows = even_split(world * m, world)[rank]
    return (a_s[rank].to(dev, dtype), b_s[rank].to(dev, dtype), ref[start:start + rows],
            scale[start:start + rows])


def _row_error(out, ref, scale) -> float:
    """Worst row's error over its rounding scale (tests/reference.py's measure); NaN: inf."""
    out64 = out.double()
    if torch.isnan(out64).any() or out64.shape != ref.shape:
        return float("inf")
    return float(((out64 - ref).norm(dim=1) / scale.norm(dim=1).clamp_min(1e-30)).max())


def _call(op, a, b, schedule):
    import ficco

    fn = ficco.all_gather_matmul if op == "all_gather_matmul" else ficco.matmul_reduce_scatter
    with ficco.config.scope(transport="dma"):
        return fn(a, b, schedule=schedule)


def _ops_of(op, schedule, world, m, k, n, dtype_name) -> int:
    """Runtime calls a warm call of the plan this rank runs makes on this backend
    (:meth:`~ficco.executor.compiler.CompiledPlan.issue_calls`), the simulator's host_op_s
    unit."""
    from .. import schedules
    from ..backends import get_backend
    from ..executor.compiler import compile_plan
    from ..plan.problem import Problem

    p = Problem(m=m if op == "all_gather_matmul" else world * m, k=k, ns=(n,), dtype=dtype_name,
                world=world, op=op)
    plan = schedules.get(schedule, op=op).plan(p, "dma")
    return compile_plan(plan).issue_calls(get_backend().batches_copies)[1]


def _schedules(op: str, args: dict) -> list[str]:
    """Every (non-optional) schedule of ``op`` (``args["schedules"]``: only those)."""
    from .. import schedules

    every = schedules.names(op=op)
    return [s for s in every if not args.get("schedules") or s in args["schedules"]]


# -- parts --------------------------------------------------------------------------------------------
def sanitize(rank, world, args):
    """Small calls of one schedule of each kind (row and column pulls, both ops)."""
    dtype = getattr(torch, args["dtype"])
    errors = {}
    for i, (op, schedule) in enumerate([("all_gather_matmul", "ring"),
                                        ("all_gather_matmul", "uniform-fused-2d"),
                                        ("matmul_reduce_scatter", "uniform-unfused-1d")]):
        a, b, ref, scale = _inputs(op, rank, world, 64, 256, 128, dtype, 7 + i)
        out = _call(op, a, b, schedule)
        torch.cuda.synchronize()
        errors[f"{op}/{schedule}"] = _row_error(out, ref, scale)
    return errors


def host(rank, world, args):
    """Host seconds of one warm call end to end, fence on and off, every schedule of both
    ops (the device is synchronised between calls, outside the timed region); the inputs
    are made once per op, and rank 0 appends each row to ``args["stream"]`` as measured."""
    from ..backends import get_backend

    m, k, n = args["shape"]
    dtype = getattr(torch, args["dtype"])
    backend = get_backend()
    real_fence = backend.fence
    rows = []
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        a, b, _, _ = _inputs(op, rank, world, m, k, n, dtype, 11)
        for schedule in _schedules(op, args):
            ops = _ops_of(op, schedule, world, m, k, n, args["dtype"])
            for fence in (True, False):
                backend.fence = real_fence if fence else (lambda outputs, symm=None: None)
                try:
                    for _ in range(3):     # warm: agreement, plan, binding, autotune
                        _call(op, a, b, schedule)
                    torch.cuda.synchronize()
                    times = []
                    for _ in range(args["calls"]):
                        start = time.perf_counter()
                        _call(op, a, b, schedule)
                        times.append(time.perf_counter() - start)
                        torch.cuda.synchronize()
                finally:
                    backend.fence = real_fence
                rows.append({"op": op, "schedule": schedule, "world": world, "ops": ops,
                             "fence": fence, "host_us_median": 1e6 * statistics.median(times),
                             "host_us_p10": 1e6 * sorted(times)[len(times) // 10],
                             "calls": len(times)})
                if rank == 0 and args.get("stream"):
                    with open(args["stream"], "a") as fh:
                        fh.write(json.dumps(rows[-1]) + "\n")
    return rows


def timeline(rank, world, args):
    """One traced call of ``args['schedule']`` (rank 0's rows, relative to its first op)."""
    from .. import api

    m, k, n = args["shape"]
    a, b, _, _ = _inputs("all_gather_matmul", rank, world, m, k, n, torch.bfloat16, 3)
    for _ in range(3):
        _call("all_gather_matmul", a, b, args["schedule"])
    torch.cuda.synchronize()
    import ficco

    with ficco.config.scope(transport="dma"):
        _, _, rows = api.traced_all_gather_matmul(a, b, schedule=args["schedule"])
    torch.cuda.synchronize()
    return rows


def speed(rank, world, args):
    """The lease's speed part (:mod:`.lease_speed`)."""
    from .lease_speed import measure

    return measure(rank, world, args)


PARTS = {"sanitize": sanitize, "host": host, "timeline": timeline, "speed": speed}


# -- what the parent writes ---------------------------------------------------------------------------
def fit_host_op(rows: list[dict]) -> float:
    """Seconds per runtime call: least-squares slope through the origin of host time against
    the calls a warm call makes (``ops``; fence on), the simulator's ``host_op_s`` form.

    >>> round(fit_host_op([{"ops": 10, "host_us_median": 20.0, "fence": True},
    ...                    {"ops": 20, "host_us_median": 40.0, "fence": True}]) * 1e6, 3)
    2.0
    """
    on = [r for r in rows if r["fence"]]
    return sum(r["ops"] * r["host_us_median"] for r in on) / \
        sum(r["ops"] ** 2 for r in on) / 1e6


def _write(out: Path, name: str, rows: list[dict]) -> None:
    with open(out / name, "w") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ficco.bench.gpu_session",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=sorted(PARTS))
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--shape", default=",".join(map(str, MEDIUM)),
                        help="rows per rank, K, n (default %(default)s)")
    parser.add_argument("--dtype", default="bfloat16",
                        choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--calls", type=int, default=30, help="host: timed calls")
    parser.add_argument("--schedule", default="uniform-fused-1d", help="timeline: schedule")
    parser.add_argument("--label", default="", help="timeline: file name suffix")
    parser.add_argument("--schedules", default="",
                        help="host: comma-separated schedules (default: every one)")
    parser.add_argument("--speed-shape", action="append", metavar="M,N,K",
                        help="speed: a shape, M rows in all (repeat; default the lease's "
                             "4096^3, 8192^3 and 16384x4096x4096)")
    parser.add_argument("--decode-shape", action="append", metavar="B,N,K",
                        help="speed: a decode shape of matmul_all_reduce, batch B, the "
                             "layer's N and K (each rank's GEMM TP 8's K/8; repeat; default "
                             "Llama-3 8B o and 70B down at batch 1 and 32; 'none': no decode "
                             "shapes)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="bench/runs/gpu-session")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = tuple(int(v) for v in args.shape.split(","))
    world = 2 if args.part == "sanitize" else args.world
    spec = {"shape": shape, "dtype": args.dtype, "calls": args.calls,
            "schedule": args.schedule, "seed": args.seed,
            "schedules": tuple(filter(None, args.schedules.split(",")))}
    if args.part == "host":
        spec["stream"] = str(out / "host.jsonl")
        Path(spec["stream"]).write_text("")
    if args.part == "speed":
        from . import lease_speed

        lease_speed.prepare_environment()
        spec["shapes"] = [tuple(int(v) for v in s.split(",")) for s in args.speed_shape] \
            if args.speed_shape else list(lease_speed.SHAPES)
        given = args.decode_shape or []
        spec["decode_shapes"] = [] if given == ["none"] else \
            [tuple(int(v) for v in s.split(",")) for s in given] if given \
            else list(lease_speed.DECODE_SHAPES)
        spec["out"] = str(lease_speed.out_file(out))
        Path(spec["out"]).write_text("")
        return lease_speed.exit_code(spawn(args.part, world, spec)[0])
    results = spawn(args.part, world, spec)
    if args.part == "sanitize":
        print(json.dumps(results))
        return 0 if all(e <= 3e-2 for errs in results for e in errs.values()) else 1
    if args.part == "host":
        rows = results[0]
        _write(out, "host.jsonl", rows)
        per_op = fit_host_op(rows)
        target = f"cuda:sm_{''.join(map(str, torch.cuda.get_device_capability()))}" \
            if not torch.version.hip else "rocm"
        fragment = {"host_op_s": per_op, "sources": {"host_op_s": (
            f"measured: python -m ficco.bench.gpu_session host --world {world} on "
            f"{torch.cuda.get_device_name()} ({target}), {datetime.date.today()}: host time of "
            f"a warm ficco call end to end (entry to return, fence launched) over both ops' "
            f"schedules, slope through the origin per plan op")}}
        (out / "host_op_s.json").write_text(json.dumps(fragment, indent=1) + "\n")
        for r in rows:
            print(f"{r['op']:22s} {r['schedule']:20s} ops {r['ops']:4d} fence "
                  f"{'on ' if r['fence'] else 'off'} {r['host_us_median']:8.1f} us")
        print(f"host_op_s = {per_op * 1e6:.2f} us per plan op")
        return 0
    rows = results[0]
    name = f"timeline-{args.schedule}{args.label}"
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    try:
        from .gantt import draw_gantt

        draw_gantt(rows, out / f"{name}.png", f"{args.schedule}, rank 0, "
                   f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}")
    except ImportError as exc:   # matplotlib missing: the JSON is the result
        print(f"no PNG: {exc}", file=sys.stderr)
    span = max((r["end_s"] for r in rows), default=0.0)
    print(f"{name}: {len(rows)} ops, makespan {span * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
