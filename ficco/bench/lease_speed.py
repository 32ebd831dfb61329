"""The first GPU lease's speed part (``python -m ficco.bench.gpu_session speed``): W ranks
sharing one GPU, at each shape (M, N, K) and for both ops, these variants:

- ``default``: the call a user makes (the selector's pick, transport ``auto``);
- ``serial-dma``: ``schedule="serial"`` over dma (ficco's plain path);
- ``default-symm-torch``: the default call on torch's symmetric memory (``FICCO_SYMM=torch``,
  a fresh session);
- ``torch-fused``: torch's own ``torch.ops.symm_mem.fused_all_gather_matmul`` /
  ``fused_matmul_reduce_scatter`` (ranks sharing a GPU need
  ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``, which :func:`main` sets).

Each variant's output is checked against float64 on sampled rows after a synchronize, then
timed as the slowest rank's median of ``calls`` calls, each between a barrier and a
synchronize. Rank 0 writes one JSON line per variant as it is measured (a part cut at its
bound keeps every line before the cut). A variant that cannot run here (torch's fused ops
on CPU tensors, the fake GPU) is a ``"status": "skipped"`` line with the reason, never a
number. On ranks time-slicing one GPU this measures a call's overhead, not its overlap: the
ranks' GEMMs share the same SMs.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from ..ops import of_collective as collective_ops
from ..plan.problem import ALL_GATHER, REDUCE_SCATTER

#: the lease's shapes (M, N, K): M rows in all (the all-gather's output, the reduce-scatter's
#: input), N output columns, K the contraction
SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 4096))
VARIANTS = ("default", "serial-dma", "default-symm-torch", "torch-fused")
#: the ops the lease times: the all-gather's and the reduce-scatter's
OPS = collective_ops(ALL_GATHER, REDUCE_SCATTER)
#: sampled output rows per check, and the worst row error over its rounding scale accepted
SAMPLED_ROWS = 16
TOLERANCE = {"bfloat16": 3e-2, "float16": 6e-3, "float32": 1e-4}


def _randn(shape, seed: int, dtype, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


class Problem:
    """One op at one shape on this rank: its inputs, made once on the device, and the float64
    rows of its output at the sampled indices (each rank's operands are regenerated from their
    seeds, so every rank knows the whole problem)."""

    def __init__(self, op, rank, world, shape, dtype, seed, device):
        big_m, n, k = shape
        self.op, self.rank, self.world, self.device = op, rank, world, device
        self.m = big_m // world
        gen = torch.Generator().manual_seed(seed)
        if op == "all_gather_matmul":
            self.a = _randn((self.m, k), seed + 1 + rank, dtype, device)
            self.b = _randn((k, n), seed, dtype, device)
            self.rows = torch.randperm(big_m, generator=gen)[:SAMPLED_ROWS].tolist()
            parts = []
            for r in sorted(self.rows):
                owner, at = divmod(r, self.m)
                shard = _randn((self.m, k), seed + 1 + owner, dtype, device)
                parts.append(shard[at:at + 1])
            self.rows = sorted(self.rows)
            a_rows = torch.cat(parts).double()
            b64 = self.b.double()
            self.ref, self.scale = a_rows @ b64, a_rows.abs() @ b64.abs()
        else:
            kw = k // world
            self.a = _randn((big_m, kw), seed + 1 + rank, dtype, device)
            self.b = _randn((kw, n), seed + 101 + rank, dtype, device)
            self.rows = sorted(torch.randperm(self.m, generator=gen)[:SAMPLED_ROWS].tolist())
            index = torch.tensor([rank * self.m + r for r in self.rows], device=device)
            self.ref = torch.zeros(len(self.rows), n, dtype=torch.float64, device=device)
            self.scale = torch.zeros_like(self.ref)
            for q in range(world):
                a_q = self.a if q == rank else _randn((big_m, kw), seed + 1 + q, dtype, device)
                b_q = self.b if q == rank else _randn((kw, n), seed + 101 + q, dtype, device)
                a_rows, b64 = a_q.index_select(0, index).double(), b_q.double()
                self.ref += a_rows @ b64
                self.scale += a_rows.abs() @ b64.abs()

    def error(self, out: torch.Tensor) -> float:
        """Worst sampled row's error over its rounding scale (NaN or a wrong shape: inf)."""
        want = (self.world * self.m if self.op == "all_gather_matmul" else self.m,
                self.ref.shape[1])
        if tuple(out.shape) != want:
            return float("inf")
        got = out[self.rows].double()
        if torch.isnan(got).any():
            return float("inf")
        return float(((got - self.ref).norm(dim=1) /
                      self.scale.norm(dim=1).clamp_min(1e-30)).max().cpu())


def _torch_fused(op, a, b, group):
    """torch's fused op on ``group`` (its symmetric memory enabled for the group once)."""
    from torch.distributed import _symmetric_memory as symm

    name = group.group_name
    enable = getattr(symm, "enable_symm_mem_for_group", None)
    if enable is not None:
        enable(name)
    if op == "all_gather_matmul":
        _, outs = torch.ops.symm_mem.fused_all_gather_matmul(a, [b], gather_dim=0,
                                                              group_name=name)
        return outs[0]
    return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", scatter_dim=0,
                                                           group_name=name)


def _why_not(variant: str, device) -> str | None:
    """Why ``variant`` cannot run on this device, or None."""
    fused = device.type == "cuda" and hasattr(torch.ops, "symm_mem") and \
        hasattr(torch.ops.symm_mem, "fused_all_gather_matmul")
    if variant == "torch-fused" and not fused:
        return (f"torch.ops.symm_mem's fused ops run on CUDA tensors only; these are on "
                f"{device.type} (torch {torch.__version__})")
    if variant == "default-symm-torch" and device.type != "cuda":
        return f"torch's symmetric memory (FICCO_SYMM=torch) needs CUDA tensors; these are " \
               f"on {device.type}"
    return None


def measure(rank: int, world: int, args: dict) -> list[dict]:
    """Every (shape, op, variant) on this rank, in order; rank 0 appends each one's JSON line
    to ``args["out"]`` as it is measured. Returns the lines."""
    import torch.distributed as dist

    import ficco
    from ficco.backends import get_backend
    from ficco.runtime import path as runtime
    from ficco.runtime.agreement import max_over_ranks

    backend = get_backend()
    device = backend.device()
    group = dist.group.WORLD
    dtype = getattr(torch, args["dtype"])
    lines: list[dict] = []

    def emit(line: dict) -> None:
        lines.append(line)
        if rank == 0:
            with open(args["out"], "a") as fh:
                fh.write(json.dumps(line) + "\n")
            print(_row_text(line), flush=True)

    for shape in args["shapes"]:
        for op in OPS:
            problem = Problem(op, rank, world, shape, dtype, args["seed"], device)
            fn = getattr(ficco, op)
            for variant in VARIANTS:
                line = {"op": op, "shape": list(shape), "variant": variant, "world": world,
                        "dtype": args["dtype"], "calls": args["calls"]}
                why = _why_not(variant, device)
                if why is not None:
                    emit({**line, "status": "skipped", "reason": why})
                    continue
                settings = {"transport": "dma"} if variant == "serial-dma" else {}
                schedule = "serial" if variant == "serial-dma" else None
                if variant == "default-symm-torch":
                    ficco.shutdown()           # a fresh session on torch's provider
                    settings["symm"] = "torch"

                def call(settings=settings, schedule=schedule, variant=variant):
                    if variant == "torch-fused":
                        return _torch_fused(op, problem.a, problem.b, group)
                    with ficco.config.scope(**settings):
                        return fn(problem.a, problem.b, schedule=schedule)
                try:
                    out = call()
                    backend.synchronize()
                    err = problem.error(out)
                    out = call()                       # warm twice: plans, workspaces
                    backend.synchronize()
                    pick = list(runtime.last_run() or ()) if variant != "torch-fused" else []
                    samples = []
                    for _ in range(args["calls"]):
                        dist.barrier(group)
                        backend.synchronize()
                        start = time.perf_counter()
                        call()
                        backend.synchronize()
                        samples.append(time.perf_counter() - start)
                    slowest = max_over_ranks(group, rank, world, statistics.median(samples),
                                             what="speed part")
                    big_m, n, k = shape
                    tol = TOLERANCE[args["dtype"]]
                    emit({**line, "status": "ok" if err <= tol else "FAIL",
                          "max_row_err_sampled": err, "tolerance": tol, "pick": pick,
                          "ms_median_slowest_rank": slowest * 1e3,
                          "tflops": 2 * big_m * n * k / slowest / 1e12})
                except Exception as exc:  # noqa: BLE001 - one variant's failure is a line
                    emit({**line, "status": "error",
                          "reason": f"{type(exc).__name__}: {exc}"[:300]})
                finally:
                    if variant == "default-symm-torch":
                        ficco.shutdown()
    return lines


def _row_text(line: dict) -> str:
    what = f"{line['op']:22s} {'x'.join(map(str, line['shape'])):17s} {line['variant']:19s}"
    if line["status"] in ("skipped", "error"):
        return f"{what} {line['status']}: {line['reason']}"
    return (f"{what} {line['status']:4s} {line['ms_median_slowest_rank']:9.3f} ms "
            f"{line['tflops']:7.1f} TFLOP/s err {line['max_row_err_sampled']:.1e}"
            f"{' pick ' + ' over '.join(line['pick']) if line['pick'] else ''}")


def exit_code(lines: list[dict]) -> int:
    """1 when a variant returned wrong numbers or raised, else 0 (skipped lines pass)."""
    return 1 if any(line["status"] in ("FAIL", "error") for line in lines) else 0


def prepare_environment() -> None:
    """What every rank needs before CUDA starts: torch's symmetric memory on ranks that share
    a GPU."""
    os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")


def out_file(out_dir: Path) -> Path:
    return out_dir / "speed.jsonl"
