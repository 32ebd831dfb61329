"""Rank-side functions for the tests of what a rank supplies on its own (importable by the
spawned ranks): a tensor-wise fp8 scale each rank draws from its own shard, fp8 partials of the
all-reduce, a bias that differs across ranks, fp8 scales that require grad.

Every case draws fresh operands (one generator, the same on every rank, so every rank can
build the float64 reference of every rank's data), runs one forced schedule over one
transport and returns its failures as strings.
"""
from __future__ import annotations

import warnings

import torch

import ficco
from ficco import config
from ficco.errors import FiccoError, FiccoWarning
from ficco.runtime import path as runtime

from .ar_cases import _same_everywhere, k_slices
from .fp8_cases import E4M3, quantize
from .reference import ROW_TOL, max_row_rel_err


def _label(case, world) -> str:
    return f"{case['schedule']}/{case['transport']}/W={world}"


def _ran(case, world) -> list[str]:
    if world > 1 and runtime.last_run() != (case["schedule"], case["transport"]):
        return [f"{_label(case, world)}: ran {runtime.last_run()}"]
    return []


def ag_own_scales(rank, world, seed, cases) -> list[str]:
    """all_gather_matmul where each rank quantizes its shard with its own tensor-wise scale
    (``amax(shard) / 448``), against the float64 product of the dequantized gathered rows;
    the second call of each case is warm (its scales drawn again)."""
    failures = []
    for i, case in enumerate(cases):
        for call in range(2):
            gen = torch.Generator().manual_seed(seed + 7 * i + call)
            m, k, n = case["m"], 32, 16
            # shards of very different sizes: their own scales differ by up to 8x
            hp = [torch.randn(m, k, generator=gen) * 2.0 ** q for q in range(world)]
            shards, scales = zip(*[quantize(h, E4M3, rows=False) for h in hp])
            b, sb = quantize(torch.randn(k, n, generator=gen), E4M3, rows=False)
            bias = torch.randn(n, generator=gen)
            deq = torch.cat([s.double() * sc.double() for s, sc in zip(shards, scales)])
            bd = b.double() * sb.double()
            ref = deq @ bd + bias.double()
            ref.scale = deq.abs() @ bd.abs() + bias.double().abs()
            with config.scope(transport=case["transport"]):
                out = ficco.all_gather_matmul(shards[rank], b, schedule=case["schedule"],
                                              a_scale=scales[rank], b_scale=sb,
                                              out_dtype=torch.bfloat16, bias=bias)
            failures += _ran(case, world)
            err = max_row_rel_err(out, ref)
            if out.dtype != torch.bfloat16 or not err <= ROW_TOL[torch.bfloat16]:
                failures.append(f"{_label(case, world)}/call {call}: {out.dtype} "
                                f"{tuple(out.shape)}, error {err:.3g}")
    return failures


def ar_fp8_partials(rank, world, seed, cases) -> list[str]:
    """matmul_all_reduce with fp8 operands and a bf16 output: rank 0's partial is 257 and
    rank 1's -256 (every other rank's 0) in every element, exact in float32, so the sum is 1;
    rounding a partial to bf16 first (257 -> 256) makes it 0. Then random fp8 operands with
    each rank's own tensor-wise scales against the float64 sum."""
    failures = []
    k, n, m = 16, 8, 5
    for i, case in enumerate(cases):
        a = torch.zeros(m, k)
        b = torch.zeros(k, n)
        if rank == 0:      # 16 * 16 + 1 * 1 = 257
            a[:, 0], a[:, 1], b[0], b[1] = 16.0, 1.0, 16.0, 1.0
        elif rank == 1:    # -16 * 16 = -256
            a[:, 0], b[0] = -16.0, 16.0
        one = torch.tensor(1.0)
        with config.scope(transport=case["transport"]):
            out = ficco.matmul_all_reduce(a.to(E4M3), b.to(E4M3), schedule=case["schedule"],
                                          a_scale=one, b_scale=one, out_dtype=torch.bfloat16)
        failures += _ran(case, world)
        if out.dtype != torch.bfloat16 or not torch.equal(out.double(),
                                                          torch.ones(m, n, dtype=torch.float64)):
            failures.append(f"{_label(case, world)}: 257 + (-256) gave "
                            f"{sorted(set(out.double().flatten().tolist()))}, not 1")
        gen = torch.Generator().manual_seed(seed + i)
        total = scale = 0
        mine = None
        for q, kq in enumerate(k_slices(48, world)):
            aq, sa = quantize(torch.randn(m, kq, generator=gen) * 2.0 ** q, E4M3, rows=False)
            bq, sb = quantize(torch.randn(kq, n, generator=gen), E4M3, rows=False)
            ad, bd = aq.double() * sa.double(), bq.double() * sb.double()
            total, scale = total + ad @ bd, scale + ad.abs() @ bd.abs()
            if q == rank:
                mine = (aq, bq, sa, sb)
        assert mine is not None
        with config.scope(transport=case["transport"]):
            out = ficco.matmul_all_reduce(mine[0], mine[1], schedule=case["schedule"],
                                          a_scale=mine[2], b_scale=mine[3],
                                          out_dtype=torch.bfloat16)
        total.scale = scale
        err = max_row_rel_err(out, total)
        if not err <= ROW_TOL[torch.bfloat16]:
            failures.append(f"{_label(case, world)}: random fp8 error {err:.3g}")
        if not _same_everywhere(out):
            failures.append(f"{_label(case, world)}: ranks hold different values")
    return failures


def ar_bias_per_rank(rank, world, seed, cases) -> list[str]:
    """matmul_all_reduce with a bias that differs on one rank (a replicated parameter that
    drifted): every rank raises a ficco error naming the bias before any output; then the
    same call with the bias alike runs, against the float64 sum, the same bits on every
    rank."""
    failures = []
    m, k, n = 6, 8 * world, 5
    for i, case in enumerate(cases):
        gen = torch.Generator().manual_seed(seed + i)
        a_full = torch.randn(m, k, generator=gen, dtype=torch.float64)
        b_full = torch.randn(k, n, generator=gen, dtype=torch.float64)
        bias = torch.randn(n, generator=gen, dtype=case["dtype"])
        k0 = 8 * rank
        a, b = a_full[:, k0:k0 + 8].to(case["dtype"]), b_full[k0:k0 + 8].to(case["dtype"])
        drifted = bias.clone()
        if rank == world - 1:
            drifted[0] += 1.0
        with config.scope(transport=case["transport"]):
            try:
                out = ficco.matmul_all_reduce(a, b, schedule=case["schedule"], bias=drifted)
                failures.append(f"{_label(case, world)}: a bias that differs on rank "
                                f"{world - 1} returned an output")
                if not _same_everywhere(out):
                    failures.append(f"{_label(case, world)}: ranks hold different values")
            except FiccoError as exc:
                if "bias" not in str(exc):
                    failures.append(f"{_label(case, world)}: the error names no bias: {exc}")
                # (found by the call's check, or its first barrier's call flags: the group is
                # refused until every rank shuts it down, as for any call ranks disagree on)
                ficco.shutdown()
            out = ficco.matmul_all_reduce(a, b, schedule=case["schedule"], bias=bias)
        failures += _ran(case, world)
        ref = a_full @ b_full + bias.double()
        ref.scale = a_full.abs() @ b_full.abs() + bias.double().abs()
        err = max_row_rel_err(out, ref)
        if not err <= ROW_TOL[case["dtype"]]:
            failures.append(f"{_label(case, world)}: error {err:.3g}")
        if not _same_everywhere(out):
            failures.append(f"{_label(case, world)}: ranks hold different values")
    return failures


def scales_with_grad(rank, world, seed) -> list[str]:
    """Each dense op with fp8 scales that require grad (a_scale, b_scale, each alone): a ficco
    error on every rank before any output; then the call with detached scales runs right."""
    failures = []
    gen = torch.Generator().manual_seed(seed)
    m, k, n = 4, 32, 16
    a, sa = quantize(torch.randn(m * world, k, generator=gen), E4M3, rows=False)
    b, sb = quantize(torch.randn(k, n, generator=gen), E4M3, rows=False)
    ops = {
        "all_gather_matmul": (lambda x, y, **kw: ficco.all_gather_matmul(x, y, **kw),
                              a[rank * m:(rank + 1) * m], (a.double() * sa) @ (b.double() * sb)),
        "matmul_reduce_scatter": (lambda x, y, **kw: ficco.matmul_reduce_scatter(x, y, **kw),
                                  a, world * (a.double() * sa) @ (b.double() * sb)),
        "matmul_all_reduce": (lambda x, y, **kw: ficco.matmul_all_reduce(x, y, **kw),
                              a, world * (a.double() * sa) @ (b.double() * sb)),
    }
    for name, (call, x, full) in ops.items():
        for which in ("a_scale", "b_scale"):
            scales = {"a_scale": sa.clone(), "b_scale": sb.clone()}
            scales[which].requires_grad_(True)
            try:
                out = call(x, b, out_dtype=torch.float32, **scales)
                failures.append(f"{name}: {which} requiring grad returned an output "
                                f"(grad_fn {type(out.grad_fn).__name__})")
            except FiccoError as exc:
                if which not in str(exc):
                    failures.append(f"{name}: the error names no {which}: {exc}")
        out = call(x, b, out_dtype=torch.float32, a_scale=sa, b_scale=sb)
        if name == "matmul_reduce_scatter":
            full = full[rank * m:(rank + 1) * m]
        full.scale = full.abs()
        err = max_row_rel_err(out, full)
        if not err <= ROW_TOL[torch.float32]:
            failures.append(f"{name}: detached scales, error {err:.3g}")
    return failures


def warm_dma_call_then_peer_dies(rank, world, dead):
    """A dma ring call made warm on every rank, then rank ``dead`` exits and the others call
    again: their barrier times out (FICCO_TIMEOUT); the error propagates (its text is the
    test's)."""
    import os

    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with config.scope(transport="dma"):
        ficco.all_gather_matmul(a, b, schedule="ring")
        if rank == dead:
            os._exit(3)
        ficco.all_gather_matmul(a, b, schedule="ring")


# -- a random program over the per-rank knobs (bench/campaigns.py per-rank) ----------------------
CACHE_STATES = ("missing", "unwritable", "corrupt", "huge", "shared")
RECIPES = ("float32", "bfloat16", "fp8-tensor", "fp8-row")


def _draw(gen: torch.Generator, choices):
    return choices[int(torch.randint(len(choices), (1,), generator=gen))]


def _operand(t: torch.Tensor, recipe: str, dim: int):
    """(t in the recipe's dtype, its scale or None, its float64 dequantization)."""
    if recipe.startswith("fp8"):
        q, scale = quantize(t, E4M3, rows=recipe == "fp8-row", dim=dim)
        return q, scale, q.double() * scale.double()
    low = t.to(getattr(torch, recipe))
    return low, None, low.double()


def random_per_rank_program(rank, world, seed, calls, root):
    """``calls`` random calls of the three dense ops (one generator on every rank, so every
    rank knows every rank's data): random schedule and transport, dtype recipe, each rank's own
    fp8 scales and widths, a bias (the all-reduce's drifted on one rank now and then: it must
    be refused), a third of them under ``auto`` with the cache in a random state (corrupt or
    shared: what the first half kept is spoilt at half time, memory forgotten). Returns the
    state and one outcome per call: right, wrong, refused (a drifted bias, as wanted), ficco
    error, raw error."""
    from ficco import schedules
    from ficco.errors import MismatchError
    from ficco.heuristics import auto

    from .cache_cases import spoil

    gen = torch.Generator().manual_seed(seed)
    state = _draw(gen, CACHE_STATES)
    cache_dir = "/proc/ficco-cache-unwritable" if state == "unwritable" else root
    if rank == 0 and state == "huge":
        spoil(root, state)
    outcomes = []
    for i in range(calls):
        if i == calls // 2 and state in ("corrupt", "shared"):   # what the first half kept
            torch.distributed.barrier()
            if rank == 0:
                spoil(root, state)
            torch.distributed.barrier()
            ficco.shutdown()
            auto.CACHE.forget()     # a new process: the files answer
        op = _draw(gen, ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"))
        recipe = _draw(gen, RECIPES)
        schedule = _draw(gen, schedules.names(op=op))
        transport = _draw(gen, ("dma", "ccl"))
        auto_here = bool(torch.rand((), generator=gen) < 0.3)
        drift = op == "matmul_all_reduce" and bool(torch.rand((), generator=gen) < 0.2)
        m, k = 2 + int(torch.randint(5, (1,), generator=gen)), 16 * (1 + i % 2)
        widths = [16 * (1 + int(torch.randint(2, (1,), generator=gen))) for _ in range(world)]
        fp8 = recipe.startswith("fp8")
        out_dtype = torch.bfloat16 if fp8 else None
        kw: dict = {}
        if op == "all_gather_matmul":     # each rank its own n, its shard's own scale
            parts = [_operand(torch.randn(m, k, generator=gen) * 2.0 ** q, recipe, -1)
                     for q in range(world)]
            bs = [_operand(torch.randn(k, n, generator=gen), recipe, 0) for n in widths]
            bias = [torch.randn(n, generator=gen) for n in widths][rank]   # (every rank's)
            ref = torch.cat([p[2] for p in parts]) @ bs[rank][2] + bias.double()
            scale = torch.cat([p[2] for p in parts]).abs() @ bs[rank][2].abs() + bias.abs()
            a, b = parts[rank][0], bs[rank][0]
        else:                             # each rank its own K
            rows = m * world
            parts = [_operand(torch.randn(rows, kq, generator=gen), recipe, -1)
                     for kq in widths]
            bs = [_operand(torch.randn(kq, 16, generator=gen), recipe, 0) for kq in widths]
            bias = torch.randn(16, generator=gen)
            ref = sum(p[2] @ q[2] for p, q in zip(parts, bs)) + bias.double()
            scale = sum(p[2].abs() @ q[2].abs() for p, q in zip(parts, bs)) + bias.abs()
            if op == "matmul_reduce_scatter":
                ref, scale = ref[rank * m:(rank + 1) * m], scale[rank * m:(rank + 1) * m]
            a, b = parts[rank][0], bs[rank][0]
            if drift and rank == world - 1:
                bias = bias + 1.0
        if fp8:
            kw = {"a_scale": parts[rank][1], "b_scale": bs[rank][1], "out_dtype": out_dtype}
        ref.scale = scale
        settings = {"transport": transport}
        if auto_here:
            settings.update(selector="auto", cache_dir=cache_dir)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FiccoWarning)   # the cache's: counted apart
                with config.scope(**settings):
                    out = getattr(ficco, op)(a, b, schedule=None if auto_here else schedule,
                                             bias=bias, **kw)
        except MismatchError as exc:
            outcomes.append("refused" if drift and "bias" in str(exc) else f"ficco error: {exc}")
            ficco.shutdown()
            continue
        except FiccoError as exc:
            outcomes.append(f"ficco error: {type(exc).__name__}: {str(exc)[:200]}")
            ficco.shutdown()
            continue
        except Exception as exc:  # noqa: BLE001 - the campaign counts it
            outcomes.append(f"raw error: {type(exc).__name__}: {str(exc)[:200]}")
            ficco.shutdown()
            continue
        tol = ROW_TOL[torch.bfloat16 if recipe != "float32" else torch.float32]
        err = max_row_rel_err(out, ref)
        if drift:
            outcomes.append(f"wrong: {op} with a drifted bias returned an output")
        elif err <= tol:
            outcomes.append("right")
        else:
            outcomes.append(f"wrong: {op}/{schedule}/{transport}/{recipe}: error {err:.3g}")
    return state, outcomes
