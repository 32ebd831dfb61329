"""Rank-side functions for the fp8 / epilogue tests (importable by the spawned ranks).

Every case draws fresh fp8 operands and scales (the same generator on every rank), runs one
forced schedule over one transport, and checks the result against a float64 reference of the
dequantized operands and against torch's own fallback (the oracle of the compat twins).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory  # torch 2.11 loads it only when asked
from torch.utils._python_dispatch import TorchDispatchMode

import ficco
from ficco import api, config
from ficco.plan.epilogue import cpu_rowwise_scaled_mm
from ficco.plan.problem import even_split

from .reference import ROW_TOL, max_row_rel_err

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
ACT = {"gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu, "": lambda t: t}


class Fp8AsBytes(TorchDispatchMode):
    """gloo has no fp8 type: torch's fallbacks gather fp8 through functional collectives, so
    in the tests those move the tensor's bytes (a uint8 view), as ficco's own collectives do.
    Where torch's CPU ``_scaled_mm`` has no row-wise scales (torch 2.11: "Now _scaled_mm only
    supports per-tensor scaling for CPU backend"), the fallbacks' row-wise GEMMs run as the
    float64 product of the dequantized operands, rounded once to the output dtype: the
    oracle's gathers, reductions, shapes and strides stay torch's own."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default \
                and args[0].dtype in FP8:
            return func(args[0].view(torch.uint8), *args[1:], **kwargs).view(args[0].dtype)
        if func is torch.ops.aten._scaled_mm.default and args[0].device.type == "cpu" \
                and args[2].numel() * args[3].numel() > 1 and not cpu_rowwise_scaled_mm():
            return _dequantized_mm(*args, **kwargs)
        return func(*args, **kwargs)


def _dequantized_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                    use_fast_accum=False):
    assert scale_result is None, "the fallbacks pass no result scale"
    out = (a.double() * scale_a.double()) @ (b.double() * scale_b.double())
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype or a.dtype)


@contextmanager
def oracle():
    with Fp8AsBytes():
        yield


def quantize(t: torch.Tensor, dtype, rows: bool, dim: int = -1, amax=None):
    """(t in fp8, its float32 dequantization scale): one scale, or one per slice along every
    dim but ``dim`` (per row of A: dim=-1; per column of B: dim=0), from the amax (``amax``:
    a tensor-wise one given, e.g. all ranks' shards' for a sharded A: its one scale must be
    the same on every rank)."""
    fmax = torch.finfo(dtype).max
    if rows:
        amax = t.abs().amax(dim=dim, keepdim=True)
    elif amax is None:
        amax = t.abs().amax()
    scale = (amax.float().clamp_min(1e-12) / fmax)
    return (t / scale).clamp(-fmax, fmax).to(dtype), scale.reshape(scale.shape if rows else ())


def ag_inputs(seed, world, case):
    """Every rank's shard, the b's (2: the first with a bias), their scales and the float64
    reference of the gathered product (with its rounding scale)."""
    gen = torch.Generator().manual_seed(seed)
    shard_shape, gather_dim, adt, bdt, rows = (case["shape"], case["gather_dim"], case["a"],
                                               case["b"], case["scaling"] == "row")
    hp = [torch.randn(*shard_shape, generator=gen) for _ in range(world)]
    amax = max(h.abs().amax() for h in hp)
    shards, scales = zip(*[quantize(h, adt, rows, amax=amax) for h in hp])
    k = shard_shape[-1]
    bs, b_scales = zip(*[quantize(torch.randn(k, n, generator=gen), bdt, rows, dim=0)
                         for n in case["ns"]])
    bias = torch.randn(case["ns"][0], generator=gen)
    deq = torch.cat([s.double() * sc.double() for s, sc in zip(shards, scales)], gather_dim)
    refs = []
    for j, (b, sb) in enumerate(zip(bs, b_scales)):
        bd = b.double() * sb.double()
        ref = deq @ bd + (bias.double() if j == 0 else 0)
        ref_scale = deq.abs() @ bd.abs() + (bias.double().abs() if j == 0 else 0)
        ref = ACT[case["activation"]](ref)
        ref.scale = ref_scale
        refs.append(ref)
    return shards, scales, bs, b_scales, bias, refs


def ag_grid(rank, world, cases, seed):
    """One ficco.all_gather_matmul per case; returns failures as strings."""
    failures = []
    group_name = dist.group.WORLD.group_name
    for i, case in enumerate(cases):
        shards, scales, bs, b_scales, bias, refs = ag_inputs(seed + i, world, case)
        label = (f"{case['schedule']}/{case['transport']}/{case['scaling']}/W={world}/"
                 f"{case['shape']}")
        with config.scope(transport=case["transport"]):
            gathered, outs = ficco.all_gather_matmul(
                shards[rank], list(bs), gather_dim=case["gather_dim"], return_gathered=True,
                schedule=case["schedule"], a_scale=scales[rank], b_scale=list(b_scales),
                out_dtype=torch.bfloat16, bias=[bias, None],
                activation=case["activation"] or None)
        if world > 1 and api.last_run() != (case["schedule"], case["transport"]):
            failures.append(f"{label}: ran {api.last_run()}")
        full = torch.cat(shards, case["gather_dim"])
        if gathered.dtype != full.dtype or not torch.equal(gathered.view(torch.uint8),
                                                           full.view(torch.uint8)):
            failures.append(f"{label}: gathered A differs")
        with oracle():
            _want_a, want = torch.distributed._symmetric_memory \
                ._fused_all_gather_scaled_matmul_fallback(
                    shards[rank], list(bs), scales[rank], list(b_scales), case["gather_dim"],
                    group_name, [bias, None], [None, None], [torch.bfloat16] * 2, [False] * 2)
        for j, (out, ref, fallback) in enumerate(zip(outs, refs, want)):
            fallback = ACT[case["activation"]](fallback.float())
            err = max_row_rel_err(out, ref)
            vs_torch = max_row_rel_err(out, _with_scale(fallback, ref.scale))
            if out.dtype != torch.bfloat16 or out.shape != ref.shape \
                    or out.stride() != want[j].stride():
                failures.append(f"{label}/b{j}: {out.dtype} {tuple(out.shape)} "
                                f"{out.stride()} vs torch's {want[j].stride()}")
            elif not err <= ROW_TOL[torch.bfloat16] or not vs_torch <= ROW_TOL[torch.bfloat16]:
                failures.append(f"{label}/b{j}: error {err:.3g}, vs torch's {vs_torch:.3g}")
    return failures


def _with_scale(t, scale):
    t = t.double()
    t.scale = scale
    return t


def rs_inputs(seed, world, case):
    """Every rank's a and b shard, their scales, a bias and the float64 reference blocks."""
    gen = torch.Generator().manual_seed(seed)
    rows = case["scaling"] == "row"
    a_shape, ns = case["shape"], case["ns"]
    a_s, sa_s = zip(*[quantize(torch.randn(*a_shape, generator=gen), case["a"], rows)
                      for _ in range(world)])
    b_s, sb_s = [], []
    for _ in range(world):
        q = [quantize(torch.randn(a_shape[-1], n, generator=gen), case["b"], rows, dim=0)
             for n in ns]
        b_s.append([b for b, _ in q])
        sb_s.append([s for _, s in q])
    bias = torch.randn(ns[0], generator=gen)
    refs = []
    for j in range(len(ns)):
        parts = [(a.double() * sa.double()) @ (b[j].double() * sb[j].double())
                 for a, sa, b, sb in zip(a_s, sa_s, b_s, sb_s)]
        full, scale = sum(parts), sum(p.abs() for p in parts)
        if case["reduce_op"] == "avg":
            full, scale = full / world, scale / world
        if j == 0:
            full, scale = full + bias.double(), scale + bias.double().abs()
        refs.append((full, scale))
    return a_s, sa_s, b_s, sb_s, bias, refs


def rs_grid(rank, world, cases, seed):
    """One ficco.matmul_reduce_scatter per case; returns failures as strings."""
    failures = []
    group_name = dist.group.WORLD.group_name
    for i, case in enumerate(cases):
        a_s, sa_s, b_s, sb_s, bias, refs = rs_inputs(seed + i, world, case)
        label = (f"{case['schedule']}/{case['transport']}/{case['scaling']}/"
                 f"{case['reduce_op']}/W={world}")
        dim = case["scatter_dim"]
        with config.scope(transport=case["transport"]):
            outs = ficco.matmul_reduce_scatter(
                a_s[rank], b_s[rank], scatter_dim=dim, reduce_op=case["reduce_op"],
                schedule=case["schedule"], a_scale=sa_s[rank], b_scale=sb_s[rank],
                out_dtype=torch.bfloat16, bias=[bias, None])
        if world > 1 and api.last_run() != (case["schedule"], case["transport"]):
            failures.append(f"{label}: ran {api.last_run()}")
        start, length = even_split(case["shape"][dim], world)[rank]
        for j, out in enumerate(outs):
            full, scale = refs[j]
            ref = full.narrow(dim, start, length)
            ref.scale = scale.narrow(dim, start, length)
            err = max_row_rel_err(out, ref)
            if out.dtype != torch.bfloat16 or not err <= ROW_TOL[torch.bfloat16]:
                failures.append(f"{label}/b{j}: {out.dtype} error {err:.3g}")
            if case["shape"][dim] % world:
                continue   # torch's reduce-scatter needs equal blocks
            shape = [*a_s[rank].shape[:-1], out.shape[-1]]
            with oracle():
                want = torch.distributed._symmetric_memory \
                    ._fused_scaled_matmul_reduce_scatter_fallback(
                        a_s[rank], b_s[rank][j], sa_s[rank], sb_s[rank][j], case["reduce_op"],
                        dim, dim, group_name, shape, out_dtype=torch.bfloat16)
            want = want.float() + (bias if j == 0 else 0)   # ficco's bias: once
            vs_torch = max_row_rel_err(out, _with_scale(want, ref.scale))
            if want.shape != out.shape or not vs_torch <= ROW_TOL[torch.bfloat16]:
                failures.append(f"{label}/b{j}: vs torch's fallback {vs_torch:.3g}, shape "
                                f"{tuple(out.shape)} vs {tuple(want.shape)}")
    return failures


# -- the compat twins, on torch's own test cases (test/distributed/test_symmetric_memory.py:
#    test_fused_all_gather_scaled_matmul, test_fused_scaled_matmul_reduce_scatter) -------------
def _same(got, want) -> str | None:
    """None when ``got`` is torch's ``want``: dtype, shape, strides, and values within the
    output dtype's rounding (per row, relative to the row's size: torch rounds each rank's
    partial product and its sum, ficco the float32 sum once, so they differ by an ulp)."""
    if got.dtype != want.dtype or got.shape != want.shape or got.stride() != want.stride():
        return f"{got.dtype} {tuple(got.shape)} {got.stride()} vs torch's {want.dtype} " \
               f"{tuple(want.shape)} {want.stride()}"
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}.get(got.dtype, 0.13)
    err = max_row_rel_err(got, want)
    if not err <= tol:
        return f"values differ by {err:.3g} of their rows' size (tolerance {tol})"
    return None


def compat_ag_cases(rank, world, seed):
    """torch's AG cases (BATCH 8, M 64, N 16, K 32; gather_dim 0/1; tensor-wise, row-wise
    sharded and replicated), with torch's constant 0.1 scales and with random ones."""
    from ficco.compat import fused_all_gather_scaled_matmul

    group_name = dist.group.WORLD.group_name
    batch, m, n, k = 8, 64, 16, 32
    problems = []
    for gather_dim in (0, 1):
        lead = (batch // world, m) if gather_dim == 0 else (batch, m // world)
        full_lead = (batch, m)
        for mode in ("tensor-wise", "row-wise-sharded", "row-wise-replicated"):
            for random_scales in (False, True):
                gen = torch.Generator().manual_seed(seed + 7 * rank + gather_dim)
                shared = torch.Generator().manual_seed(seed)   # the same on every rank
                a_shard = torch.rand(*lead, k, generator=gen).to(E4M3)
                bs = [torch.rand(n, k, generator=shared).to(E4M3).T for _ in range(3)]

                def scale(*shape, g=gen):
                    if not random_scales:
                        return torch.full(shape, 0.1)
                    return torch.rand(*shape, generator=g) + 0.05
                if mode == "tensor-wise":
                    a_scale = scale(1, g=shared).reshape(())
                    b_scales = [scale(1, g=shared).reshape(()) for _ in range(3)]
                    out_dtypes = [None, torch.bfloat16, torch.float32]
                elif mode == "row-wise-sharded":
                    a_scale = scale(*lead, 1)
                    b_scales = [scale(1, n, g=shared) for _ in range(3)]
                    out_dtypes = [torch.bfloat16] * 3
                else:
                    a_scale = scale(*full_lead, 1, g=shared)
                    b_scales = [scale(1, n, g=shared) for _ in range(3)]
                    out_dtypes = [torch.bfloat16] * 3
                biases = [None, torch.randn(n, generator=shared).bfloat16(), None]
                args = (a_shard, bs, a_scale, b_scales, gather_dim, group_name, biases,
                        [None] * 3, out_dtypes, [None] * 3)
                with oracle():
                    want_a, want = torch.distributed._symmetric_memory \
                        ._fused_all_gather_scaled_matmul_fallback(*args)
                got_a, got = fused_all_gather_scaled_matmul(*args)
                label = f"gather_dim {gather_dim} {mode} random {random_scales}"
                for what, g, w in [("A", got_a, want_a)] + [(f"out{j}", g, w) for j, (g, w)
                                                             in enumerate(zip(got, want))]:
                    why = _same(g, w)
                    if why:
                        problems.append(f"{label} {what}: {why}")
    return problems


def compat_rs_cases(rank, world, seed):
    """torch's RS cases (BATCH 8, M 64, N 16, K 32; scatter_dim 0/1; row-wise or tensor-wise;
    "avg"; bf16 output), plus "sum" and "avg" with a bias of each rank's own (torch adds it
    in every rank's GEMM: the sum or mean of the ranks' biases) and A flattened to 2-D with a
    3-D output_shape."""
    from ficco.compat import fused_scaled_matmul_reduce_scatter

    group_name = dist.group.WORLD.group_name
    batch, m, n, k = 8, 64, 16, 32
    problems = []
    for scatter_dim in (0, 1):
        for rowwise in (True, False):
            for variant in ("torch", "sum+bias", "avg+bias", "flat"):
                gen = torch.Generator().manual_seed(seed + 11 * rank + scatter_dim)
                a = torch.rand(batch, m, k, generator=gen).to(E4M3)
                b = torch.rand(n, k, generator=gen).to(E4M3).T
                if rowwise:
                    a_scale = torch.rand(batch, m, 1, generator=gen) + 0.05
                    b_scale = torch.rand(1, n, generator=gen) + 0.05
                else:
                    a_scale, b_scale = torch.tensor(0.1), torch.tensor(0.1)
                shape = [batch, m, n]
                reduce_op, bias, after = "avg", None, scatter_dim
                if variant.endswith("+bias"):
                    reduce_op = variant[:3]
                    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + rank)
                                       ).bfloat16()
                if variant == "flat":
                    a, after = a.flatten(0, 1), 0
                    a_scale = a_scale.flatten(0, 1) if rowwise else a_scale
                args = (a, b, a_scale, b_scale, reduce_op, scatter_dim, after, group_name,
                        shape)
                kwargs = {"bias": bias, "out_dtype": torch.bfloat16}
                with oracle():
                    want = torch.distributed._symmetric_memory \
                        ._fused_scaled_matmul_reduce_scatter_fallback(*args, **kwargs)
                got = fused_scaled_matmul_reduce_scatter(*args, **kwargs)
                why = _same(got, want)
                if why:
                    problems.append(f"scatter_dim {scatter_dim} rowwise {rowwise} {variant}: "
                                    f"{why}")
    return problems


def bad_scales(rank, world):
    """Rank 0 alone calls with a bad scale / bias: each raises InvalidArgumentError at once
    (before any communication: rank 1 never calls); returns the messages. A refused call
    still takes its place in the group's sequence, so every rank resets after."""
    try:
        return _bad_scales(rank) if rank == 0 else []
    finally:
        ficco.shutdown()


def _bad_scales(rank):
    from ficco.errors import InvalidArgumentError

    a = torch.randn(4, 32).to(E4M3)
    b = torch.randn(32, 16).to(E4M3)
    one = torch.tensor(1.0)
    cases = {
        "a_scale shape": {"a_scale": torch.ones(3, 1), "b_scale": one},
        "a_scale dtype": {"a_scale": torch.tensor(1.0, dtype=torch.float64), "b_scale": one},
        "a_scale device": {"a_scale": torch.ones((), device="meta"), "b_scale": one},
        "b_scale shape": {"a_scale": torch.ones(4, 1), "b_scale": torch.ones(16, 1)},
        "b_scale recipe": {"a_scale": torch.ones(4, 1), "b_scale": one},
        "b_scale dtype": {"a_scale": one, "b_scale": one.bfloat16()},
        "missing b_scale": {"a_scale": one},
        "bias shape": {"a_scale": one, "b_scale": one, "bias": torch.ones(15)},
        "bias device": {"a_scale": one, "b_scale": one, "bias": torch.ones(16, device="meta")},
        "out_dtype": {"a_scale": one, "b_scale": one, "out_dtype": torch.int32},
        "activation": {"a_scale": one, "b_scale": one, "activation": "tanh"},
        "scales on bf16": {"a_scale": one, "b_scale": one, "bf16": True},
    }
    seen = []
    for label, kwargs in cases.items():
        bf16 = kwargs.pop("bf16", False)
        x, w = (a.float().bfloat16(), b.float().bfloat16()) if bf16 else (a, b)
        for op in ("all_gather_matmul", "matmul_reduce_scatter"):
            if op == "matmul_reduce_scatter" and "activation" in kwargs:
                kwargs = {**kwargs, "activation": None}
                kw = {k: v for k, v in kwargs.items() if k != "activation"}
                try:   # the reduce-scatter takes no activation at all
                    ficco.matmul_reduce_scatter(x, w, reduce_op="sum", **kw, activation="gelu")
                    seen.append(f"{label}/{op}: no error")
                except InvalidArgumentError:
                    seen.append(f"{label}/{op}: refused")
                continue
            try:
                getattr(ficco, op)(x, w, **kwargs)
                seen.append(f"{label}/{op}: no error")
            except InvalidArgumentError as exc:
                seen.append(f"{label}/{op}: refused" if str(exc) else f"{label}: empty")
    return seen
