"""Rank-side functions for the matmul_all_reduce tests (importable by spawned ranks).

Every case draws fresh operands (one generator, the same on every rank): each rank's K-slice
of ``a`` and K-rows of the weights (K split unevenly, ``even_split``; a rank may hold none),
and checks every rank's output against the float64 sum and against the other ranks' outputs
bit for bit (tensor parallelism keeps activations replicated).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import ficco
from ficco import config, runtime
from ficco.problem import even_split

from .fp8_cases import E4M3, quantize
from .reference import ROW_TOL, max_row_rel_err

# (label, a's leading dims, K over all ranks, ns): M not divisible by W, 3-D, rows < W,
# several b (one narrower than most W)
SHAPES = [("2d-uneven", (13,), 20, (7,)), ("3d", (2, 5), 12, (6,)), ("rows<W", (2,), 9, (5,)),
          ("several-b", (9,), 16, (5, 3))]
DTYPES = (torch.float32, torch.bfloat16)


def k_slices(k: int, world: int) -> list[int]:
    return [length for _, length in even_split(k, world)]


def make_inputs(seed, world, lead, k, ns, dtype, scaling=""):
    """``(a per rank, [b_j] per rank, a_scale per rank, [b_scale_j] per rank, bias, refs)``;
    ``refs[j]`` is the float64 sum with ``.scale``, its rounding scale. fp8 (``scaling``
    "tensor" or "row"): e4m3 operands, bf16 outputs, the reference of the dequantized ones."""
    gen = torch.Generator().manual_seed(seed)
    a_s, b_s, a_sc, b_sc = [], [], [], []
    for kr in k_slices(k, world):
        a = torch.randn(*lead, kr, generator=gen)
        bs = [torch.randn(kr, n, generator=gen) for n in ns]
        if scaling:
            rows = scaling == "row"
            a, sa = quantize(a, E4M3, rows)
            quantized = [quantize(b, E4M3, rows, dim=0) for b in bs]
            bs, sbs = [q for q, _ in quantized], [s for _, s in quantized]
            a_sc.append(sa)
            b_sc.append(sbs)
        a_s.append(a.to(dtype) if not scaling else a)
        b_s.append([b.to(dtype) for b in bs] if not scaling else bs)
    bias = torch.randn(ns[0], generator=gen)
    refs = []
    for j in range(len(ns)):
        total = scale = 0
        for q in range(world):
            a = a_s[q].double() * (a_sc[q].double() if scaling else 1)
            b = b_s[q][j].double() * (b_sc[q][j].double() if scaling else 1)
            total = total + a @ b
            scale = scale + a.abs() @ b.abs()
        refs.append((total, scale))
    return a_s, b_s, a_sc, b_sc, bias, refs


def expected(refs, j, reduce_op, world, bias=None):
    total, scale = refs[j]
    if reduce_op == "avg":
        total, scale = total / world, scale / world
    if bias is not None:
        total, scale = total + bias.double(), scale + bias.double().abs()
    total.scale = scale
    return total


def run_case(rank, world, seed, case) -> list[str]:
    """One call: ``case`` holds schedule, transport, shape (index into SHAPES), dtype,
    reduce_op, bias (bool), scaling ("", "tensor", "row"). Returns failures."""
    label, lead, k, ns = SHAPES[case["shape"]]
    scaling = case.get("scaling", "")
    dtype = case.get("dtype", torch.float32)
    a_s, b_s, a_sc, b_sc, bias, refs = make_inputs(seed, world, lead, k, ns, dtype, scaling)
    use_bias = case.get("bias", False)
    biases = [bias] + [None] * (len(ns) - 1) if use_bias else None
    kwargs = {}
    if scaling:
        kwargs = {"a_scale": a_sc[rank], "b_scale": b_sc[rank], "out_dtype": torch.bfloat16}
    if biases is not None:
        kwargs["bias"] = biases if len(ns) > 1 else biases[0]
    reduce_op = case.get("reduce_op", "sum")
    with config.scope(transport=case["transport"]):
        outs = ficco.matmul_all_reduce(a_s[rank], b_s[rank] if len(ns) > 1 else b_s[rank][0],
                                       reduce_op=reduce_op, schedule=case["schedule"], **kwargs)
    outs = outs if isinstance(outs, list) else [outs]
    name = (f"{case['schedule']}/{case['transport']}/{label}/{dtype}/{reduce_op}"
            f"{'/bias' if use_bias else ''}{'/fp8-' + scaling if scaling else ''}")
    failures = []
    if world > 1 and runtime.last_run() != (case["schedule"], case["transport"]):
        failures.append(f"{name}: ran {runtime.last_run()}")
    tol = ROW_TOL[torch.bfloat16 if scaling else dtype]
    for j, out in enumerate(outs):
        ref = expected(refs, j, reduce_op, world, bias if use_bias and j == 0 else None)
        err = max_row_rel_err(out, ref)
        want_dtype = torch.bfloat16 if scaling else dtype
        if out.dtype != want_dtype or not out.is_contiguous() or not err <= tol:
            failures.append(f"{name}/b{j}: {out.dtype} {tuple(out.shape)} vs "
                            f"{tuple(ref.shape)}, error {err:.3g}")
        # (collective: every rank checks, whatever it found above)
        if world > 1 and not _same_everywhere(out):
            failures.append(f"{name}/b{j}: ranks hold different values")
    return failures


def _same_everywhere(out: torch.Tensor) -> bool:
    """Whether every rank's ``out`` holds the same bits (collective: every rank calls it)."""
    flat = out.detach().contiguous().view(-1).view(torch.uint8)
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(other, flat) for other in everyone)


def run_grid(rank, world, seed, cases) -> list[str]:
    failures = []
    for i, case in enumerate(cases):
        failures += run_case(rank, world, seed + i, case)
    return failures
