"""The first GPU lease's speed part (``python -m ficco.bench.gpu_session speed``): W ranks
sharing one GPU, at each shape (M, N, K) and for both ops, these variants:

- ``default``: the call a user makes (the selector's pick, transport ``auto``);
- ``serial-dma``: ``schedule="serial"`` over dma (ficco's plain path);
- ``default-symm-torch``: the default call on torch's symmetric memory (``FICCO_SYMM=torch``,
  a fresh session);
- ``torch-fused``: torch's own ``torch.ops.symm_mem.fused_all_gather_matmul`` /
  ``fused_matmul_reduce_scatter`` (ranks sharing a GPU need
  ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``, which :func:`main` sets).

Then the decode shapes (:data:`DECODE_SHAPES`: Llama-3 8B attention out and 70B MLP down,
batch 1 and 32), ``matmul_all_reduce`` with each rank's GEMM as TP 8 has it (K/8 of the
layer's K, the whole N) and the all-reduce of ``batch x N`` over the W ranks sharing the GPU:

- ``default``: the call a user makes;
- ``one-shot-kernel``, ``two-shot-kernel``: ficco's one-kernel all-reduce, forced (selectors
  offer it nowhere until a lease verified it: this is that first run, checked against
  float64 like every variant);
- ``mm+torch-one-shot``: what a serving engine would otherwise call: ``torch.mm`` into a
  buffer of torch's symmetric memory (rendezvoused once), then
  ``torch.ops.symm_mem.one_shot_all_reduce`` (CUDA only).

Each variant's output is checked against float64 on sampled rows (decode: every row) after a
synchronize, then timed as the slowest rank's median of ``calls`` calls, each between a
barrier and a synchronize. Rank 0 writes one JSON line per variant as it is measured (a part cut at its
bound keeps every line before the cut). A variant that cannot run here (torch's fused ops
on CPU tensors, the fake GPU) is a ``"status": "skipped"`` line with the reason, never a
number. On ranks time-slicing one GPU this measures a call's overhead, not its overlap: the
ranks' GEMMs share the same SMs; a one-kernel all-reduce there waits for its peer's kernel
to get the GPU, so its time includes the contexts' time slices and is not what 8 GPUs take.
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
#: the decode shapes (batch, N, K of the layer): Llama-3 8B o (4096, 4096) and 70B down
#: (8192, 28672) at batch 1 and 32; each rank's GEMM is TP 8's, K / DECODE_TP wide
DECODE_SHAPES = ((1, 4096, 4096), (32, 4096, 4096), (1, 8192, 28672), (32, 8192, 28672))
DECODE_TP = 8
DECODE_VARIANTS = ("default", "one-shot-kernel", "two-shot-kernel", "mm+torch-one-shot")
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


class DecodeProblem:
    """``matmul_all_reduce`` at one decode shape on this rank: its GEMM operands (TP
    :data:`DECODE_TP`'s K-slice) and the float64 sum over the W ranks of every output row."""

    op = "matmul_all_reduce"

    def __init__(self, rank, world, shape, dtype, seed, device):
        batch, n, k = shape
        if k % DECODE_TP:
            from ..errors import InvalidArgumentError

            raise InvalidArgumentError(f"decode shape {shape}: K {k} does not split over TP "
                                       f"{DECODE_TP}")
        kw = k // DECODE_TP
        self.rank, self.world, self.m = rank, world, batch
        self.a = _randn((batch, kw), seed + 1 + rank, dtype, device)
        self.b = _randn((kw, n), seed + 101 + rank, dtype, device)
        self.ref = torch.zeros(batch, n, dtype=torch.float64, device=device)
        self.scale = torch.zeros_like(self.ref)
        for q in range(world):
            a_q = self.a if q == rank else _randn((batch, kw), seed + 1 + q, dtype, device)
            b_q = self.b if q == rank else _randn((kw, n), seed + 101 + q, dtype, device)
            self.ref += a_q.double() @ b_q.double()
            self.scale += a_q.double().abs() @ b_q.double().abs()
        self.rows = list(range(batch))

    error = Problem.error


def _mm_torch_one_shot(a, b, group, cache: dict):
    """``torch.mm`` into torch's symmetric memory, then its one-shot all-reduce (the buffer
    allocated and rendezvoused at the first call of a shape: collective)."""
    from torch.distributed import _symmetric_memory as symm

    shape = (a.shape[0], b.shape[1])
    buf = cache.get(shape)
    if buf is None:
        buf = cache[shape] = symm.empty(shape, dtype=a.dtype, device=a.device)
        symm.rendezvous(buf, group.group_name)
    torch.mm(a, b, out=buf)
    return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name)


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
    if variant == "mm+torch-one-shot" and not (
            device.type == "cuda" and hasattr(torch.ops, "symm_mem")
            and hasattr(torch.ops.symm_mem, "one_shot_all_reduce")):
        return (f"torch.ops.symm_mem.one_shot_all_reduce runs on CUDA tensors only; these "
                f"are on {device.type} (torch {torch.__version__})")
    if variant in ("one-shot-kernel", "two-shot-kernel"):
        from .. import kernels

        reason = kernels.triton_reason()
        if reason is None and device.type == "cpu":
            reason = kernels.interpreter_reason()
        if reason is not None:
            return f"{variant} needs Triton: {reason}"
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

    def timed(line, problem, call, runs_ficco, flops):
        """Check ``call`` against float64, then time it: one line."""
        try:
            out = call()
            backend.synchronize()
            err = problem.error(out)
            out = call()                       # warm twice: plans, workspaces
            backend.synchronize()
            pick = list(runtime.last_run() or ()) if runs_ficco else []
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
            tol = TOLERANCE[args["dtype"]]
            emit({**line, "status": "ok" if err <= tol else "FAIL",
                  "max_row_err_sampled": err, "tolerance": tol, "pick": pick,
                  "ms_median_slowest_rank": slowest * 1e3,
                  "tflops": flops / slowest / 1e12})
        except Exception as exc:  # noqa: BLE001 - one variant's failure is a line
            emit({**line, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]})

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
                    big_m, n, k = shape
                    timed(line, problem, call, variant != "torch-fused", 2 * big_m * n * k)
                finally:
                    if variant == "default-symm-torch":
                        ficco.shutdown()
    symmetric: dict = {}
    for shape in args.get("decode_shapes", ()):
        decode = DecodeProblem(rank, world, shape, dtype, args["seed"], device)
        for variant in DECODE_VARIANTS:
            line = {"op": DecodeProblem.op, "shape": list(shape), "variant": variant,
                    "world": world, "tp_simulated": DECODE_TP, "dtype": args["dtype"],
                    "calls": args["calls"]}
            why = _why_not(variant, device)
            if why is not None:
                emit({**line, "status": "skipped", "reason": why})
                continue

            def decode_call(variant=variant):
                if variant == "mm+torch-one-shot":
                    return _mm_torch_one_shot(decode.a, decode.b, group, symmetric)
                schedule = None if variant == "default" else variant
                return ficco.matmul_all_reduce(decode.a, decode.b, schedule=schedule)
            batch, n, k = shape
            timed(line, decode, decode_call, variant != "mm+torch-one-shot",
                  2 * batch * n * (k // DECODE_TP) * world)
    return lines


def _row_text(line: dict) -> str:
    what = f"{line['op']:22s} {'x'.join(map(str, line['shape'])):17s} {line['variant']:19s}"
    if line["status"] == "ok" and "tp_simulated" in line:    # decode: microseconds
        return (f"{what} ok   {line['ms_median_slowest_rank'] * 1e3:9.1f} us "
                f"(TP {line['tp_simulated']}'s GEMM) err {line['max_row_err_sampled']:.1e}"
                f"{' pick ' + ' over '.join(line['pick']) if line['pick'] else ''}")
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
