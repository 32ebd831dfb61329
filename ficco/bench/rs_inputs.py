"""``--op matmul-reduce-scatter`` for ``sweep`` and ``timeline``: the row-parallel GEMM of a
scenario, its operands, a float32/64 reference of this rank's block and the calls to time.

A scenario ``(M, N, K)`` becomes: every rank holds ``a`` (M x K_r) and ``b`` (K_r x N), K_r its
share of K (``K / W`` for layer-level shapes; the llama presets are already per rank), and
receives its block of rows of the sum over ranks (``Problem.block``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan.problem import Problem

OP_CHOICES = ("all-gather-matmul", "matmul-reduce-scatter")


def add_op_argument(parser) -> None:
    parser.add_argument("--op", default="all-gather-matmul", choices=OP_CHOICES,
                        help="all-gather before a column-parallel GEMM, or reduce-scatter "
                             "after a row-parallel one")


def wants(args) -> bool:
    return getattr(args, "op", "all-gather-matmul") == "matmul-reduce-scatter"


def problem(sc, world: int, rank: int, dtype: str) -> Problem:
    k = max(1, sc.k // world) if sc.split_n else sc.k
    return Problem(sc.big_m, k, (sc.n,), dtype, world, rank, op="matmul_reduce_scatter")


def operands(p: Problem, device, seed: int):
    """(a, b) of this rank, scaled so the sum over W ranks stays O(1)."""
    torch.manual_seed(seed)
    a = torch.randn(p.m, p.k, device=device).to(p.torch_dtype)
    b = (torch.randn(p.k, p.ns[0], device=device) / (p.k * p.world) ** 0.5).to(p.torch_dtype)
    return a, b


def block_reference(p: Problem, a, b, limit: int, ref_dtype):
    """(rows, values): up to ``limit`` rows of this rank's block of ``sum over ranks a_q @ b_q``
    in ``ref_dtype``. Every rank computes its part of every block's checked rows and reduces
    it to that block's owner (the same row spread everywhere)."""
    mine = (torch.empty(0, dtype=torch.long, device=a.device), None)
    for r in range(p.world):
        row0, count = p.block(r)
        if count == 0:
            continue
        rows = torch.linspace(0, count - 1, min(count, limit),
                              device=a.device).round().long().unique()
        part = a[row0 + rows].to(ref_dtype) @ b.to(ref_dtype)
        if p.world > 1:
            # dst is a global rank: the default group's ranks are the global ranks
            dist.reduce(part, dst=r, op=dist.ReduceOp.SUM)
        if r == p.rank:
            mine = (rows, part)
    return mine


def comm_call(p: Problem, full_product):
    """The unoverlapped reduce-scatter of the whole product (the comm time of ``serial``)."""
    pieces = [full_product[r0: r0 + n] for r0, n in map(p.block, range(p.world))]
    out = full_product.new_empty(p.block_rows, full_product.shape[1])
    return lambda: dist.reduce_scatter(out, [x.contiguous() for x in pieces])


def torch_fused_call(a, b, device, world: int):
    """torch's own fused op where it runs (CUDA symmetric memory, W dividing M)."""
    if device.type != "cuda":
        return None, (f"torch.ops.symm_mem.fused_matmul_reduce_scatter needs CUDA; device is "
                      f"{device.type}")
    if a.shape[0] % world:
        return None, f"torch's op needs W={world} to divide M={a.shape[0]}"
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        group = dist.group.WORLD
        assert group is not None    # timed runs initialise the default group first
        group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        op = torch.ops.symm_mem.fused_matmul_reduce_scatter
    except Exception as exc:  # noqa: BLE001 - any failure only means "skip this baseline"
        return None, f"torch symmetric memory unavailable: {type(exc).__name__}: {exc}"
    return (lambda: op(a, b, "sum", 0, group_name)), None


def traced_run(sc, args, world: int, rank: int, dtype: str, device):
    """``timeline --op matmul-reduce-scatter``: warm up, run one traced call; returns
    (plan, this rank's measured rows, max |error| over checked rows of its block)."""
    import ficco

    from .. import api, config

    p = problem(sc, world, rank, dtype)
    a, b = operands(p, device, rank + 1)
    with config.scope(transport=args.transport):
        for _ in range(args.warmup):
            ficco.matmul_reduce_scatter(a, b, schedule=args.schedule)
    out, plan, rows = api.traced_matmul_reduce_scatter(a, b, schedule=args.schedule,
                                                       transport=args.transport)
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
    checked, reference = block_reference(p, a, b, 8192, ref_dtype)
    err = (out[checked].to(ref_dtype) - reference).abs().max().item() if len(checked) else 0.0
    return plan, rows, err
