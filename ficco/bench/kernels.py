"""Benchmarks of the gated GEMM alone: ``python -m ficco.bench kernels <what>`` (here, not in
``ficco.kernels``: the kernels package never reaches up into the API).

``kernel`` (needs a GPU): the gated GEMM with every arrival flag preset, against
``torch.matmul`` on the same device, for Table I layer shapes at per-rank TP sizes (``M``
gathered rows, ``N / W`` weight columns, ``K``), in TFLOP/s, both variants (1d: row chunks,
2d: K chunks); the arrival order and segment walk of a real W-rank call are kept (rank 0's
segments). Shapes that do not fit the free device memory are skipped and say so.

``timeline`` (GPU or CPU): W ranks as processes on ONE device (gloo group, IPC symmetric
memory on GPUs), one traced gated call, drawn as ``bench timeline`` draws it, with a mark per
output tile when it saw its chunk's flag, and per chunk when its flags were raised and its
tiles started. ``compile`` (no GPU): builds every autotune config of a device family offline.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ..errors import BackendUnavailableError
from ..heuristics.scenarios import PAPER_TABLE_I
from ..ops.all_gather_matmul.schedules.gated import Gated
from ..plan import GatedGemm
from ..plan.problem import Problem
from .cli import BenchUsageError

EXAMPLES = """examples:
  python -m ficco.bench kernels kernel --world 8 --dtype bfloat16 --out /tmp/gated.json
  python -m ficco.bench kernels kernel --shape 65536,8192,8192 --variant 2d
  python -m ficco.bench kernels timeline --world 4 --schedule gated-1d --shape 8192,4096,4096
  python -m ficco.bench kernels compile --target rocm:gfx942
  python -m ficco.bench kernels gpu --out /tmp/gated      # kernel + both timelines
"""


def _problem(big_m: int, n: int, k: int, world: int, dtype: str) -> Problem:
    return Problem(m=big_m // world, k=k, ns=(max(n // world, 1),), dtype=dtype, world=world)


def kernel(args) -> list[dict]:
    """TFLOP/s of the gated GEMM (flags preset) and of torch.matmul, per shape and variant."""
    from ..kernels import configs, unavailable_reason
    from ..kernels.gated_gemm import Segment, check_error, gated_gemm

    if args.interpret:   # the same code path on CPU, tiny shapes: checks the script, not speed
        dev, target, do_bench = "cpu", "cpu", _wall_ms
    else:
        from triton.testing import do_bench as triton_do_bench

        do_bench = triton_do_bench

        if not torch.cuda.is_available():
            raise BackendUnavailableError("the kernel benchmark needs a CUDA or ROCm GPU "
                                          "(--interpret runs its code path on CPU)")
        dev, target = "cuda", configs.current_target()
    reason = unavailable_reason(target)
    if reason:
        raise BackendUnavailableError(reason)
    family = configs.family(target)
    args.dtype = args.dtype or "bfloat16"
    args.world = args.world or 8
    dtype = getattr(torch, args.dtype)
    wanted = [n for n in (args.scenarios or "").split(",") if n]
    unknown = [n for n in wanted if n not in PAPER_TABLE_I]
    if unknown:
        raise BackendUnavailableError(f"--scenarios: unknown {unknown}; use g1..g16")
    shapes = [(name, shape) for name, shape in PAPER_TABLE_I.items()
              if not wanted or name in wanted] if not args.shape else \
        [(s, tuple(int(v) for v in s.split(","))) for s in args.shape]
    variants = ["1d", "2d"] if args.variant == "both" else [args.variant]
    rows = []
    for name, (big_m, n, k) in shapes:
        p = _problem(big_m, n, k, args.world, args.dtype)
        need = (p.big_m * k + k * p.ns[0] + p.big_m * p.ns[0]) * dtype.itemsize
        free = torch.cuda.mem_get_info()[0] if dev == "cuda" else need
        if need > 0.85 * free and dev == "cuda":
            print(f"{name:<10} skipped: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free",
                  flush=True)
            rows.append({"scenario": name, "skipped": f"needs {need} bytes, {free} free"})
            continue
        a = torch.randn(p.big_m, k, device=dev, dtype=dtype)
        b = torch.randn(k, p.ns[0], device=dev, dtype=dtype)
        c = torch.empty(p.big_m, p.ns[0], device=dev, dtype=dtype)
        # The reference on a sample of rows: a float copy of the whole A would not fit.
        sample = torch.randperm(p.big_m, device=dev)[:2048]
        ref = a[sample].double() @ b.double()
        scale = (a[sample].double().abs() @ b.double().abs()).max()
        torch_ms = do_bench(lambda: torch.matmul(a, b, out=c))
        flop = 2 * p.big_m * p.ns[0] * k
        for variant in variants:
            op = next(o for o in Gated(two_d=variant == "2d").plan(p, "dma").ops
                      if isinstance(o, GatedGemm))
            segments = tuple(Segment(*s) for s in op.segments)
            flags = torch.ones(op.num_flags, dtype=torch.int32, device=dev)
            local = a[:p.m]
            c.fill_(float("nan"))
            err = gated_gemm(local, a, b, c, segments, flags, local_row0=0, family=family)
            if dev == "cuda":
                torch.cuda.synchronize()
            check_error(err)
            worst = float((c[sample].double() - ref).abs().max() / scale)
            gated_ms = do_bench(lambda: gated_gemm(local, a, b, c, segments, flags,
                                                   local_row0=0, err=err, family=family))
            row = {"scenario": name, "M": p.big_m, "n": p.ns[0], "K": k, "world": args.world,
                   "variant": variant, "dtype": args.dtype, "target": target,
                   "gated_ms": gated_ms, "torch_ms": torch_ms,
                   "gated_tflops": flop / gated_ms / 1e9, "torch_tflops": flop / torch_ms / 1e9,
                   "max_rel_err_sampled": worst}
            row["ratio"] = row["gated_tflops"] / row["torch_tflops"]
            rows.append(row)
            print(f"{name:<10} {variant} M={p.big_m:<7} n={p.ns[0]:<6} K={k:<6} gated "
                  f"{row['gated_tflops']:7.1f} TFLOP/s  torch {row['torch_tflops']:7.1f}  "
                  f"ratio {row['ratio']:.2f}  err {worst:.1e}", flush=True)
        # free this shape's buffers before the next one (an empty tensor holds no memory)
        a = b = c = ref = torch.empty(0)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def _wall_ms(fn) -> float:
    """Milliseconds of one call by the host clock (``--interpret``: no GPU events)."""
    import time

    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _timeline_rank(rank, world, init_file, args, env):
    """One rank of ``timeline``: join a gloo group (so several ranks can share one GPU), run
    one traced gated call under TileTrace, gather the rows; rank 0 writes the files."""
    import datetime
    import os

    os.environ.update(env)
    import torch.distributed as dist

    from .. import api, config
    from ..backends import get_backend
    from ..kernels.launch import TileTrace
    from . import timeline
    from .scenarios import Scenario

    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        backend = get_backend()
        device = backend.device()
        dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else
                                              "float32"))
        big_m, n, k = (int(v) for v in args.shape.split(","))
        m, n_local = big_m // world, max(1, n // world)
        gen = torch.Generator().manual_seed(args.seed)   # every rank builds every shard
        shards = [torch.randn(m, k, generator=gen) for _ in range(world)]
        b = (torch.randn(k, n_local, generator=gen) / k ** 0.5)
        a_dev, b_dev = shards[rank].to(device, dtype), b.to(device, dtype)
        with config.scope(transport="dma"):
            for _ in range(args.warmup):
                api.all_gather_matmul(a_dev, b_dev, schedule=args.schedule)
            backend.synchronize()
            with TileTrace() as tiles:
                out, plan, rows = api.traced_all_gather_matmul(a_dev, b_dev,
                                                               schedule=args.schedule)
            backend.synchronize()
        rows = rows + timeline.tile_rows(plan, rows, tiles.tiles())
        # float64 on CPU; on a GPU float32 there (a CPU float64 GEMM of this size per rank
        # would take minutes), far below bf16's rounding either way.
        wide = torch.float64 if device.type == "cpu" else torch.float32
        full = torch.cat([s.to(dtype) for s in shards]).to(device, wide)
        ref = full @ b.to(dtype).to(device, wide)
        err = float((out.to(wide) - ref).abs().max())
        everyone = [None] * world
        dist.all_gather_object(everyone, {"rows": rows, "max_abs_err": err,
                                          "chunks": timeline.chunk_summary(plan, rows)})
        if rank == 0:
            scenario = Scenario("shape", world * m, n, k)
            ns = argparse.Namespace(profile=args.profile, out=args.out, schedule=args.schedule,
                                    rank="all", no_plots=args.no_plots, transport="dma")
            timeline.write_timeline(ns, scenario, plan, everyone, backend, device, world)
        dist.barrier()
        return err
    finally:
        api.shutdown()
        dist.destroy_process_group()


def timeline_one_device(args) -> int:
    """Spawn ``args.world`` ranks on this machine's one device (or the CPU) and draw one
    traced gated call; every rank's error against float64 must be within tolerance."""
    import multiprocessing as mp
    import os
    import tempfile

    if args.schedule not in ("gated-1d", "gated-2d"):
        raise BackendUnavailableError(f"timeline draws the gated schedules; got {args.schedule}")
    args.world = args.world or 4
    args.shape = args.shape[-1] if args.shape else (
        "8192,4096,4096" if torch.cuda.is_available() else "192,64,64")
    fd, init_file = tempfile.mkstemp(prefix="ficco-pg-")
    os.close(fd)
    os.unlink(init_file)
    env = {"FICCO_TIMEOUT": str(args.timeout), "OMP_NUM_THREADS": "1"}
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_timeline_rank, args=(r, args.world, init_file, args, env))
             for r in range(args.world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(args.timeout + 300)
    codes = [proc.exitcode for proc in procs]
    if any(code != 0 for code in codes):
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        print(f"error: rank exit codes {codes}", file=sys.stderr)
        return 1
    return 0


def compile_all(args) -> list[dict]:
    """Compile every autotune config of ``args.target``'s family offline."""
    from ..kernels import configs
    from ..kernels.gated_gemm import compile_offline

    rows = []
    for config in configs.for_family(configs.family(args.target)):
        meta = dict(config.kwargs)
        block = (meta.pop("BLOCK_M"), meta.pop("BLOCK_N"), meta.pop("BLOCK_K"))
        asm = compile_offline(args.target, args.dtype_short, block, config.num_warps,
                              config.num_stages, **meta)
        binary = asm.get("cubin") or asm.get("hsaco")
        assert binary is not None   # compile_offline's targets: cuda makes a cubin, rocm an hsaco
        rows.append({"block": block, "num_warps": config.num_warps,
                     "num_stages": config.num_stages, **meta, "bytes": len(binary)})
        print(f"{args.target} {block} warps={config.num_warps} stages={config.num_stages} "
              f"{meta} -> {len(binary)} bytes", flush=True)
    return rows


def gpu_session(args) -> int:
    """Every GPU measurement of the gated GEMM, each step run even if one before failed;
    nonzero when any failed. Results under ``args.out``."""
    import os
    import traceback

    os.makedirs(args.out, exist_ok=True)
    steps = [["kernel", "--world", "8", "--out", os.path.join(args.out, "gated-kernel.json")]
             + (["--scenarios", args.scenarios] if args.scenarios else [])]
    steps += [["timeline", "--world", "4", "--schedule", name,
               "--out", os.path.join(args.out, f"timeline-{name}")]
              for name in ("gated-1d", "gated-2d")]
    failed = []
    for step in steps:
        print("== python -m ficco.bench kernels " + " ".join(step), flush=True)
        try:
            if run(step) != 0:
                failed.append(step[0])
        except Exception:  # noqa: BLE001 - report, then run the next step
            traceback.print_exc()
            failed.append(step[0])
    print("failed: " + (", ".join(failed) or "none"), flush=True)
    return 1 if failed else 0


def run(argv: list[str]) -> int:
    """This verb from an argument list, as on the command line after ``kernels``.

    >>> run(["compile", "--help"])  # doctest: +SKIP
    """
    from .__main__ import main as bench_main

    return bench_main(["kernels", *argv])


def add_arguments(parser) -> None:
    parser.add_argument("what", choices=["kernel", "timeline", "gpu", "compile"],
                        help="kernel: the gated GEMM vs torch.matmul (GPU); timeline: W ranks on "
                             "one device, one traced gated call; gpu: what a GPU session runs, "
                             "kernel (Table I, TP 8) then both timelines (W = 4); compile: every "
                             "autotune config offline (no GPU)")
    parser.add_argument("--world", type=int, default=None,
                        help="ranks (default: 8 for kernel, 4 for timeline)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="default: bfloat16 for kernel; timeline: bfloat16 on a GPU, "
                             "float32 on CPU")
    parser.add_argument("--shape", action="append", default=[], metavar="M,N,K",
                        help="kernel: shapes to run (repeatable; replaces --scenarios); "
                             "timeline: gathered M, N (split over ranks), K (default "
                             "8192,4096,4096 on a GPU, 192,64,64 on CPU)")
    parser.add_argument("--scenarios", default=None,
                        help="kernel, gpu: Table I rows, e.g. g1,g6 (default: all 16)")
    parser.add_argument("--variant", default="both", choices=["1d", "2d", "both"],
                        help="kernel: the segments of gated-1d, gated-2d, or both")
    parser.add_argument("--interpret", action="store_true",
                        help="kernel: run on CPU in Triton's interpreter (tiny --shape only): "
                             "checks the script; its times mean nothing")
    parser.add_argument("--schedule", default="gated-1d", choices=["gated-1d", "gated-2d"],
                        help="timeline: the schedule drawn")
    parser.add_argument("--warmup", type=int, default=1,
                        help="timeline: calls before the traced one")
    parser.add_argument("--seed", type=int, default=1, help="timeline: input seed")
    parser.add_argument("--timeout", type=float, default=120.0, help="timeline: FICCO_TIMEOUT")
    parser.add_argument("--profile", default=None, help="timeline: device profile drawn below")
    parser.add_argument("--no-plots", action="store_true", help="timeline: JSON only")
    parser.add_argument("--target", default="cuda:sm_90", help="compile: the device target")
    parser.add_argument("--dtype-short", default="bf16", choices=["bf16", "fp16", "fp32"],
                        help="compile: the element type")
    parser.add_argument("--out", default=None,
                        help="kernel, compile: JSON rows here; timeline: a directory (default "
                             "bench/runs/timeline-...); gpu (required): a directory for all")


def main(args) -> int:
    if args.what == "gpu":
        if not args.out:
            raise BenchUsageError("kernels gpu needs --out DIR (a directory for every result)")
        return gpu_session(args)
    if args.what == "timeline":
        return timeline_one_device(args)
    rows = kernel(args) if args.what == "kernel" else compile_all(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
