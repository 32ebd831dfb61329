"""Benchmarks of the gated GEMM alone: ``python -m ficco.kernels.bench <verb>``.

``kernel`` (needs a GPU): the gated GEMM with every arrival flag preset, against
``torch.matmul`` on the same device, for Table I layer shapes at per-rank TP sizes (``M``
gathered rows, ``N / W`` weight columns, ``K``), in TFLOP/s; the arrival order and segment
walk of a real W-rank call are kept (rank 0's segments). ``compile`` (no GPU): builds every
autotune config of a device family offline, to catch a config that does not compile::

    python -m ficco.kernels.bench kernel --world 8 --dtype bfloat16 --out /tmp/gated.json
    python -m ficco.kernels.bench kernel --shape 65536,8192,8192 --two-d
    python -m ficco.kernels.bench compile --target rocm:gfx942
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ..errors import BackendUnavailableError
from ..heuristics.scenarios import PAPER_TABLE_I
from ..problem import Problem
from ..schedules.gated import Gated


def _problem(big_m: int, n: int, k: int, world: int, dtype: str) -> Problem:
    return Problem(m=big_m // world, k=k, ns=(max(n // world, 1),), dtype=dtype, world=world)


def kernel(args) -> list[dict]:
    """TFLOP/s of the gated GEMM (flags preset) and of torch.matmul, per shape."""
    from triton.testing import do_bench

    from . import configs, unavailable_reason
    from .gated_gemm import Segment, check_error, gated_gemm

    if not torch.cuda.is_available():
        raise BackendUnavailableError("the kernel benchmark needs a CUDA or ROCm GPU")
    target = configs.current_target()
    reason = unavailable_reason(target)
    if reason:
        raise BackendUnavailableError(reason)
    family = configs.family(target)
    dtype = getattr(torch, args.dtype)
    shapes = [(name, shape) for name, shape in PAPER_TABLE_I.items()] if not args.shape else \
        [(s, tuple(int(v) for v in s.split(","))) for s in args.shape]
    rows = []
    for name, (big_m, n, k) in shapes:
        p = _problem(big_m, n, k, args.world, args.dtype)
        op = next(o for o in Gated(two_d=args.two_d).plan(p, "dma").ops
                  if o.kind == "gated_gemm")
        segments = tuple(Segment(*s) for s in op.segments)
        a = torch.randn(p.big_m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, p.ns[0], device="cuda", dtype=dtype)
        c = torch.empty(p.big_m, p.ns[0], device="cuda", dtype=dtype)
        flags = torch.ones(op.num_flags, dtype=torch.int32, device="cuda")
        local = a[:p.m]
        err = gated_gemm(local, a, b, c, segments, flags, local_row0=0, family=family)
        torch.cuda.synchronize()
        check_error(err)
        worst = float(((c.float() - (a.float() @ b.float())).abs().max()
                       / (a.float().abs() @ b.float().abs()).max()))
        gated_ms = do_bench(lambda: gated_gemm(local, a, b, c, segments, flags, local_row0=0,
                                               err=err, family=family))
        torch_ms = do_bench(lambda: torch.matmul(a, b, out=c))
        flop = 2 * p.big_m * p.ns[0] * k
        row = {"scenario": name, "M": p.big_m, "n": p.ns[0], "K": k, "world": args.world,
               "two_d": args.two_d, "dtype": args.dtype, "target": target,
               "gated_tflops": flop / gated_ms / 1e9, "torch_tflops": flop / torch_ms / 1e9,
               "max_rel_err": worst}
        row["ratio"] = row["gated_tflops"] / row["torch_tflops"]
        rows.append(row)
        print(f"{name:<10} M={p.big_m:<6} n={p.ns[0]:<6} K={k:<6} gated "
              f"{row['gated_tflops']:7.1f} TFLOP/s  torch {row['torch_tflops']:7.1f}  "
              f"ratio {row['ratio']:.2f}  err {worst:.1e}", flush=True)
    return rows


def compile_all(args) -> list[dict]:
    """Compile every autotune config of ``args.target``'s family offline."""
    from . import configs
    from .gated_gemm import compile_offline

    rows = []
    for config in configs.for_family(configs.family(args.target)):
        meta = dict(config.kwargs)
        block = (meta.pop("BLOCK_M"), meta.pop("BLOCK_N"), meta.pop("BLOCK_K"))
        asm = compile_offline(args.target, args.dtype_short, block, config.num_warps,
                              config.num_stages, **meta)
        binary = asm.get("cubin") or asm.get("hsaco")
        rows.append({"block": block, "num_warps": config.num_warps,
                     "num_stages": config.num_stages, **meta, "bytes": len(binary)})
        print(f"{args.target} {block} warps={config.num_warps} stages={config.num_stages} "
              f"{meta} -> {len(binary)} bytes", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ficco.kernels.bench",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    k = verbs.add_parser("kernel", help="gated GEMM vs torch.matmul (GPU)")
    k.add_argument("--world", type=int, default=8)
    k.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    k.add_argument("--shape", action="append", default=[], metavar="M,N,K")
    k.add_argument("--two-d", action="store_true", help="the 2d variant's segments")
    k.add_argument("--out", default=None, help="write the rows as JSON here")
    c = verbs.add_parser("compile", help="compile every autotune config offline (no GPU)")
    c.add_argument("--target", default="cuda:sm_90")
    c.add_argument("--dtype-short", default="bf16", choices=["bf16", "fp16", "fp32"])
    c.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = kernel(args) if args.verb == "kernel" else compile_all(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
