"""Rank-side functions for the layout tests: every operand of every op in a random memory
layout, against float64 (importable by spawned ranks).

A layout never changes a value, so it must never change a result. Each case draws, from one
seed shared by the ranks, an op, its shapes, and a layout per rank for each operand (the
weights, the input, the output gradient): row-major, column-major (a transposed view),
sliced (step and offset), expanded (a stride-0 dimension) or a strided view out of a 3-D
tensor (for 3-D operands: contiguous in a permuted dimension order).
"""
from __future__ import annotations

import random

import torch

import ficco
from ficco import config
from ficco.runtime import path as runtime

from . import ep_cases
from .reference import ROW_TOL, max_row_rel_err

LAYOUTS = ("row", "transposed", "sliced", "expanded", "strided-3d")


def laid_out(shape, kind: str, gen: torch.Generator, dtype) -> torch.Tensor:
    """Fresh random values of ``shape`` in memory layout ``kind`` (an expanded tensor's values
    repeat along its stride-0 dimension, the first one of size > 1)."""
    shape = tuple(shape)
    nd = len(shape)
    if kind == "expanded":
        wide = [d for d, s in enumerate(shape) if s > 1]
        small = list(shape)
        if wide:
            small[wide[0]] = 1
        return torch.randn(small, generator=gen).to(dtype).expand(shape)
    values = torch.randn(shape, generator=gen).to(dtype)
    if kind == "row":
        return values
    if kind == "transposed":   # column-major in the last two dimensions
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "sliced":       # every other row of a wider tensor, from column 1 on
        base = torch.zeros(*shape[:-2], 2 * shape[-2] + 1, shape[-1] + 3, dtype=dtype)
        view = base[..., 1::2, 1:1 + shape[-1]]
        view.copy_(values)
        return view
    if nd == 2:                # the middle plane of a (rows, 3, cols) tensor
        base = torch.zeros(shape[0], 3, shape[1], dtype=dtype)
        base[:, 1].copy_(values)
        return base[:, 1]
    order = (1, 0, 2) if nd == 3 else tuple(reversed(range(nd)))
    return values.permute(order).contiguous().permute(order)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float64 with ``.scale`` = ``|a| @ |b|`` (the rounding scale)."""
    a, b = a.double(), b.double()
    out = a @ b
    out.scale = a.abs() @ b.abs()
    return out


def _sum(parts):
    total = sum(p for p in parts)
    total.scale = sum(p.scale for p in parts)
    return total


def _narrow(t, dim, start, length):
    out = t.narrow(dim, start, length)
    out.scale = t.scale.narrow(dim, start, length)
    return out


def _flat(t):
    return t.reshape(-1, t.shape[-1])


def _kind(turn: int, rank: int, operand: int) -> str:
    """The layout of ``operand`` (0: the input, then the weights, then the output gradients)
    on ``rank`` in the case of ``turn``: rotating, so that over one schedule's cases (a turn
    per transport) each operand meets every layout on some rank at W >= 3, most at W = 2."""
    return LAYOUTS[(turn + rank + 2 * operand) % len(LAYOUTS)]


def dense_case(rank, world, op, schedule, transport, seed, turn):
    """One random case of a dense op, forward and backward (every operand, the output
    gradient included, in a layout of its own on each rank); returns failures as strings."""
    from ficco.plan.problem import even_split

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    dtype = rng.choice((torch.float32, torch.float32, torch.bfloat16))
    three_d = rng.random() < 0.4
    dim = rng.choice((0, 1)) if three_d else 0
    k = rng.randint(1, 9)
    ns = [rng.randint(1, 7) for _ in range(rng.choice((1, 1, 2)))]
    # Rows: mostly equal chunks (whole rows of a; the fused schedules batch equal chunks into
    # one strided GEMM), else uneven, sometimes none; the reduce-scatter's a multiple of W (its
    # backward gathers equal shards).
    per_rank = world if rng.random() < 0.7 else rng.randint(1, 3)   # a shard, or a block
    rows = 0 if rng.random() < 0.1 else \
        per_rank * (1 if op == "all_gather_matmul" else world)
    inner = rng.randint(0 if rng.random() < 0.1 else 1, 3)
    a_shape = ((rows, inner) if dim == 0 else (inner, rows)) + (k,) if three_d else (rows, k)
    a_all = [laid_out(a_shape, _kind(turn, r, 0), gen, dtype) for r in range(world)]
    b_all = [[laid_out((k, n), _kind(turn, r, 1 + j), gen, dtype) for j, n in enumerate(ns)]
             for r in range(world)]
    gather = op == "all_gather_matmul"
    blocks = even_split(a_shape[dim], world)
    if gather:
        full = torch.cat([t.double() for t in a_all], dim)
        outs_ref = [[_mm(full, b_all[r][j]) for j in range(len(ns))] for r in range(world)]
    else:
        sums = [_sum([_mm(a_all[r], b_all[r][j]) for r in range(world)]) for j in range(len(ns))]
        outs_ref = [[_narrow(sums[j], dim, *blocks[r]) for j in range(len(ns))]
                    for r in range(world)]
    grads = [[laid_out(outs_ref[r][j].shape, _kind(turn, r, 3 + j), gen, dtype)
              for j in range(len(ns))] for r in range(world)]
    label = (f"{op} {schedule}/{transport} seed {seed} turn {turn} {dtype} a {tuple(a_shape)} "
             f"dim {dim} ns {ns}")
    a = a_all[rank].detach().requires_grad_()
    bs = [t.detach().requires_grad_() for t in b_all[rank]]
    b_arg = bs if len(ns) > 1 else bs[0]
    with config.scope(schedule=schedule, transport=transport):
        if gather:
            outs = ficco.all_gather_matmul(a, b_arg, gather_dim=dim)
        else:
            outs = ficco.matmul_reduce_scatter(a, b_arg, scatter_dim=dim)
        ran = runtime.last_run()
        outs = outs if isinstance(outs, list) else [outs]
        torch.autograd.backward(outs, grads[rank])
    failures = []
    if world > 1 and a.numel() and ran != (schedule, transport):
        failures.append(f"{label}: ran {ran}")
    tol = ROW_TOL[dtype]

    def check(what, got, ref, factor=1):
        err = max_row_rel_err(got, ref) if got is not None else float("inf")
        if not err <= factor * tol:
            failures.append(f"{label}: {what} err {err:.3g}")

    for j, out in enumerate(outs):
        check(f"out {j}", out, outs_ref[rank][j])
    # Gradients in float64 from the rounded operands and output gradients.
    if gather:
        x_grad = _sum([_mm(grads[s][j], b_all[s][j].transpose(0, 1))
                       for s in range(world) for j in range(len(ns))])
        x_grad = _narrow(x_grad, dim, rank * a_shape[dim], a_shape[dim])
        w_grads = [_mm(_flat(full).transpose(0, 1), _flat(grads[rank][j]))
                   for j in range(len(ns))]
    else:
        gathered = [torch.cat([grads[r][j].double() for r in range(world)], dim)
                    for j in range(len(ns))]
        x_grad = _sum([_mm(gathered[j], b_all[rank][j].transpose(0, 1))
                       for j in range(len(ns))])
        w_grads = [_mm(_flat(a_all[rank]).transpose(0, 1), _flat(gathered[j]))
                   for j in range(len(ns))]
    check("x.grad", a.grad, x_grad, 2)
    for j, b in enumerate(bs):
        check(f"b{j}.grad", b.grad, w_grads[j], 2)
    return failures


def expert_case(rank, world, schedule, transport, seed, turn, experts=2):
    """Dispatch then combine with x, w, h, w2 and the output gradients in rotating layouts;
    checks y, z and x.grad against float64 (every row x @ w[e] @ w2[e])."""
    rng = random.Random(seed)
    counts, xs, w, w2 = ep_cases.make_case(seed, world, experts, rng.randint(1, 9),
                                           rng.randint(1, 7), rng.randint(1, 7), max_rows=7)
    gen = torch.Generator().manual_seed(seed)
    # The layouts replace the values: every rank redraws every rank's x and weights, each
    # rank's block of experts in a layout of its own.
    xs = [laid_out(x.shape, _kind(turn, r, 0), gen, torch.float32) for r, x in enumerate(xs)]
    w_blocks = [laid_out((experts, *w.shape[1:]), _kind(turn, r, 1), gen, torch.float32)
                for r in range(world)]
    w2_blocks = [laid_out((experts, *w2.shape[1:]), _kind(turn, r, 2), gen, torch.float32)
                 for r in range(world)]
    w, w2 = torch.cat(w_blocks), torch.cat(w2_blocks)
    w_local, w2_local = w_blocks[rank], w2_blocks[rank]
    label = f"experts {schedule}/{transport} seed {seed} turn {turn} counts {counts}"
    y_ref, _ = ep_cases.dispatch_reference(counts, [x.double() for x in xs], w.double(), rank,
                                           experts)
    z_ref = ep_cases.round_trip_reference(counts, [x.double() for x in xs], w.double(),
                                          w2.double(), rank)
    grad_z = laid_out(z_ref.shape, _kind(turn, rank, 3), gen, torch.float32)
    x = xs[rank].detach().requires_grad_()
    failures = []
    with config.scope(schedule=schedule, transport=transport):
        y, recv = ficco.all_to_all_grouped_mm(x, torch.tensor(counts[rank]), w_local)
        ran = runtime.last_run()
        h = _relayout(y.detach(), _kind(turn, rank, 4)).requires_grad_()
        z = ficco.grouped_mm_all_to_all(h, recv, w2_local)
        y.backward(_relayout(torch.autograd.grad(z, h, grad_z)[0], _kind(turn, rank, 5)))
    if world > 1 and ran != (schedule, transport):
        failures.append(f"{label}: ran {ran}")
    tol = ROW_TOL[torch.float32]
    for what, got, ref in (("y", y, y_ref), ("z", z, z_ref),
                           ("x.grad", x.grad, _x_grad(counts, grad_z, w, w2, rank))):
        err = max_row_rel_err(got, ref) if got is not None else float("inf")
        if not err <= 2 * tol:
            failures.append(f"{label}: {what} err {err:.3g}")
    return failures


def _relayout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t``'s values in layout ``kind`` (expanded: not possible for given values, so it
    stays row-major)."""
    if kind == "expanded":
        kind = "row"
    gen = torch.Generator().manual_seed(0)
    out = laid_out(t.shape, kind, gen, t.dtype)
    if out.numel():
        out.copy_(t)
    return out


def _x_grad(counts, grad_z, w, w2, rank):
    """dL/dx of ``rank``: each row's output gradient times (w[e] @ w2[e])^T."""
    parts, scales = [], []
    g = grad_z.double()
    for e, at, c in ep_cases.runs(counts, rank):
        both = w[e].double() @ w2[e].double()
        parts.append(g[at: at + c] @ both.T)
        scales.append(g[at: at + c].abs() @ (w[e].double().abs() @ w2[e].double().abs()).T)
    ref = torch.cat(parts)
    ref.scale = torch.cat(scales)
    return ref


DENSE_OPS = ("all_gather_matmul", "matmul_reduce_scatter")


def campaign(rank, world, ops, seed):
    """One random case per (op, schedule, transport) of ``ops``, the layouts rotating from
    case to case (:func:`_kind`); failures as strings."""
    failures = []
    first_turn = seed % len(LAYOUTS)
    cases = [(name, s, t) for name in ops for s in ficco.schedules.names(op=name)
             for t in config.TRANSPORTS]
    for i, (op, schedule, transport) in enumerate(cases):
        if op in DENSE_OPS:
            failures += dense_case(rank, world, op, schedule, transport, seed + i,
                                   first_turn + i * world)
        else:
            failures += expert_case(rank, world, schedule, transport, seed + i,
                                    first_turn + i * world)
    return failures


#: a whole-shard copy, per-peer copies, 2-D column chunks, 1-D row chunks
GPU_SCHEDULES = ("serial", "ring", "uniform-fused-2d", "hetero-unfused-1d")


def gpu_gather_layouts(rank, world, vendor, seed):
    """On the fake GPU, dma: all-gather schedules with the ranks' shards in rotating
    layouts (copy engines read rows of unit-stride columns; a transposed shard was refused
    mid-call, an expanded one read past its rows); the worst error over float64 per layout
    of this rank's shard."""
    from ficco.ops.all_gather_matmul import spec as agm

    from . import fault_cases

    fault_cases._setup(vendor, 8)
    # CUDA's caching allocator frees a call's temporaries in stream order (the caller's
    # stream waits for the copy streams); the fake's CPU tensors are freed at once, so the
    # call's buffers are kept until the synchronize below.
    held, buffers = [], agm.AllGatherMatmul.buffers
    agm.AllGatherMatmul.buffers = lambda *a, **k: held.append(buffers(*a, **k)) or held[-1]
    gen = torch.Generator().manual_seed(seed)
    errors: dict = {}
    try:
        with config.scope(transport="dma"):
            for turn in range(len(LAYOUTS)):
                shards = [laid_out((6, 5), _kind(turn, r, 0), gen, torch.float32)
                          for r in range(world)]
                b = laid_out((5, 4), "row", gen, torch.float32)
                ref = _mm(torch.cat([s.double() for s in shards]), b)
                for name in GPU_SCHEDULES:
                    out = ficco.all_gather_matmul(shards[rank], b, schedule=name)
                    torch.cuda.synchronize()
                    held.clear()
                    kind = _kind(turn, rank, 0)
                    errors[kind] = max(errors.get(kind, 0.0), max_row_rel_err(out, ref))
    finally:
        agm.AllGatherMatmul.buffers = buffers
    return errors
