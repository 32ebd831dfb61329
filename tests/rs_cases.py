"""Rank-side functions for the matmul_reduce_scatter tests (importable by spawned ranks)."""
from __future__ import annotations

import torch

import ficco
from ficco import config, runtime
from ficco.problem import even_split

from .reference import ROW_TOL, max_row_rel_err

# (label, a shape, ns, scatter_dim): divisible, uneven, rows < W, 3-D scatter_dim 1, several b
SHAPES = [
    ("divisible", (24, 16), (20,), 0),
    ("uneven", (13, 10), (7,), 0),
    ("rows<W", (2, 9), (5,), 0),
    ("3d-dim1", (2, 5, 12), (6,), 1),
    ("several-b", (9, 16), (7, 11, 3), 0),
]
DTYPES = (torch.float32, torch.bfloat16)


def make_inputs(seed, world, a_shape, ns, dtype, scatter_dim=0):
    """Every rank's a and b shards (same generator on all ranks) and float64 references of
    every rank's block: ``[ref_j per rank]`` with ``.scale`` the rounding scale."""
    gen = torch.Generator().manual_seed(seed)
    a_s = [torch.randn(*a_shape, generator=gen).to(dtype) for _ in range(world)]
    b_s = [[torch.randn(a_shape[-1], n, generator=gen).to(dtype) for n in ns]
           for _ in range(world)]
    refs = []
    for j in range(len(ns)):
        full = sum(a.double() @ b[j].double() for a, b in zip(a_s, b_s))
        scale = sum(a.double().abs() @ b[j].double().abs() for a, b in zip(a_s, b_s))
        per_rank = []
        for start, length in even_split(a_shape[scatter_dim], world):
            ref = full.narrow(scatter_dim, start, length)
            ref.scale = scale.narrow(scatter_dim, start, length)
            per_rank.append(ref)
        refs.append(per_rank)
    return a_s, b_s, refs


def run_matrix(rank, world, schedule, transport, seed, reduce_op="sum", shapes=None):
    """Every shape x dtype for one schedule/transport; returns failures as strings."""
    failures = []
    with config.scope(transport=transport):
        for case, (label, shape, ns, sdim) in enumerate(shapes or SHAPES):
            for dtype in DTYPES:
                a_s, b_s, refs = make_inputs(seed + case, world, shape, ns, dtype, sdim)
                b_arg = b_s[rank] if len(ns) > 1 else b_s[rank][0]
                outs = ficco.matmul_reduce_scatter(a_s[rank], b_arg, scatter_dim=sdim,
                                                   reduce_op=reduce_op, schedule=schedule)
                outs = outs if isinstance(outs, list) else [outs]
                for j, out in enumerate(outs):
                    ref = refs[j][rank]
                    if reduce_op == "avg":
                        scale = ref.scale / world
                        ref = ref / world
                        ref.scale = scale
                    err = max_row_rel_err(out, ref)
                    if tuple(out.shape) != tuple(ref.shape) or not err <= ROW_TOL[dtype]:
                        failures.append(f"{label}/{dtype}/b{j}: shape {tuple(out.shape)} vs "
                                        f"{tuple(ref.shape)} err {err:.3g}")
                if world > 1 and min(shape) > 0 and runtime.last_run() != (schedule, transport):
                    failures.append(f"{label}: ran {runtime.last_run()}")
    return failures
