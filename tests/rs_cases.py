"""Rank-side functions for the matmul_reduce_scatter tests (importable by spawned ranks)."""
from __future__ import annotations

import torch

import ficco
from ficco import config
from ficco.plan.problem import even_split
from ficco.runtime import path as runtime

from .reference import ROW_TOL, invalid_argument_report, max_row_rel_err

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


def expected(refs, j: int, rank: int, reduce_op: str, world: int):
    """Rank ``rank``'s float64 reference for output ``j`` (divided by ``world``, with its
    rounding scale, for ``reduce_op="avg"``)."""
    ref = refs[j][rank]
    if reduce_op == "avg":
        scale = ref.scale / world
        ref = ref / world
        ref.scale = scale
    return ref


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
                    ref = expected(refs, j, rank, reduce_op, world)
                    err = max_row_rel_err(out, ref)
                    if tuple(out.shape) != tuple(ref.shape) or not err <= ROW_TOL[dtype]:
                        failures.append(f"{label}/{dtype}/b{j}: shape {tuple(out.shape)} vs "
                                        f"{tuple(ref.shape)} err {err:.3g}")
                if world > 1 and min(shape) > 0 and runtime.last_run() != (schedule, transport):
                    failures.append(f"{label}: ran {runtime.last_run()}")
    return failures


COMPAT_CASES = [((8, 12), 0, 6), ((3, 4, 12), 1, 5), ((4, 6, 12), 0, 3), ((6, 10), -1, 4),
                ((2, 3, 4, 8), 2, 3)]


def compat_compare(rank, world, seed):
    """ficco.compat.fused_matmul_reduce_scatter against torch's fallback: values, shapes,
    strides, for sum and avg."""
    import torch.distributed as dist
    from torch.distributed._symmetric_memory import _fused_matmul_reduce_scatter_fallback

    group_name = dist.group.WORLD.group_name
    problems = []
    for case, (shape, sdim, n) in enumerate(COMPAT_CASES):
        gen = torch.Generator().manual_seed(seed + case)
        a_s = [torch.randn(*shape, generator=gen) for _ in range(world)]
        b_s = [torch.randn(shape[-1], n * world, generator=gen) for _ in range(world)]
        for reduce_op in ("sum", "avg"):
            want = _fused_matmul_reduce_scatter_fallback(a_s[rank], b_s[rank], reduce_op, sdim,
                                                         group_name)
            got = ficco.compat.fused_matmul_reduce_scatter(a_s[rank], b_s[rank], reduce_op,
                                                           sdim, group_name)
            label = f"shape {shape} scatter_dim {sdim} {reduce_op}"
            if got.shape != want.shape or got.stride() != want.stride():
                problems.append(f"{label}: shape/stride {tuple(got.shape)}/{got.stride()} vs "
                                f"{tuple(want.shape)}/{want.stride()}")
            elif not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                problems.append(f"{label}: values differ by {(got - want).abs().max()}")
    return problems


def bad_inputs(rank, world):
    """Every bad argument raises InvalidArgumentError on the rank that made it, before any
    communication (a rank that then waited on its peers would hang this test)."""
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    cases = {
        "K mismatch": lambda: ficco.matmul_reduce_scatter(a, torch.randn(5, 4)),
        "scatter K": lambda: ficco.matmul_reduce_scatter(a, b, scatter_dim=1),
        "scatter range": lambda: ficco.matmul_reduce_scatter(a, b, scatter_dim=3),
        "reduce_op": lambda: ficco.matmul_reduce_scatter(a, b, reduce_op="max"),
        "dtype": lambda: ficco.matmul_reduce_scatter(a, b.double()),
        "1-D a": lambda: ficco.matmul_reduce_scatter(torch.randn(6), b),
        "empty b list": lambda: ficco.matmul_reduce_scatter(a, []),
        "schedule": lambda: ficco.matmul_reduce_scatter(a, b, schedule="uniform-fused-3d"),
        "compat divisibility": lambda: ficco.compat.fused_matmul_reduce_scatter(
            torch.randn(world * 2 + 1, 6), b, "sum", 0, "0"),
    }
    return invalid_argument_report(cases)


def disagree(rank, world, op="matmul_reduce_scatter", schedule="ring", transport=None):
    """Rank 0 passes another shape to ``op``: every rank gets MismatchError naming it, none
    hangs (``transport``: None, the setting's)."""
    from ficco.errors import MismatchError

    rows = 8 if rank else 12
    try:
        with config.scope(**({} if transport is None else {"transport": transport})):
            getattr(ficco, op)(torch.randn(rows, 6), torch.randn(6, 4), schedule=schedule)
    except MismatchError as exc:
        return "mismatch" if "differ" in str(exc) or "different" in str(exc) else str(exc)
    finally:
        ficco.shutdown()      # a MismatchError poisons the group until every rank resets
    return "no error"


def disagree_on_cached_shapes(rank, world, seed):
    """Both shapes agreed and cached, then rank 0 calls with the other one (dma): every rank
    raises MismatchError at the plan's first barrier (the call flag); the next call is
    refused (the group poisoned), and after ficco.shutdown() on every rank the calls in step
    are right against float64."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"small": (4 * world, 6), "large": (6 * world, 6)}
    b = torch.randn(6, 5, generator=gen, dtype=torch.float64)

    def call(name):
        a = torch.randn(*shapes[name], generator=torch.Generator().manual_seed(seed + rank),
                        dtype=torch.float64)
        got = ficco.matmul_reduce_scatter(a.float(), b.float(), schedule="uniform-fused-1d")
        parts = [torch.randn(*shapes[name], generator=torch.Generator().manual_seed(seed + r),
                             dtype=torch.float64) @ b for r in range(world)]
        rows = shapes[name][0] // world
        ref = sum(parts)[rank * rows:(rank + 1) * rows]
        return float((got.double() - ref).abs().max() / ref.abs().max())

    return stale_shape_mismatch(rank, call)


def stale_shape_mismatch(rank, call) -> list:
    """``call("small")`` and ``call("large")`` (each returns its error against float64), then
    rank 0 calls the other shape than its peers (dma: both agreed before), then all call
    "small": [small error, large error, "mismatch" (or what happened), "refused" (the group
    poisoned), error after ficco.shutdown()]."""
    from ficco.errors import MismatchError, PoisonedGroupError

    out = []
    with config.scope(transport="dma", timeout=20):
        out += [call("small"), call("large")]
        try:
            call("small" if rank == 0 else "large")
            out.append("returned")
        except MismatchError as exc:
            out.append("mismatch" if "different call" in str(exc) else str(exc))
        try:
            call("small")
            out.append("returned")
        except PoisonedGroupError:
            out.append("refused")
        ficco.shutdown()
        out.append(call("small"))
    ficco.shutdown()
    return out


def survivors_fail(rank, world, dead, op="matmul_reduce_scatter", transport="dma",
                   schedule="uniform-fused-1d"):
    """Rank ``dead`` exits mid-way; the others raise (timeout or comm error), never hang."""
    import os

    from ficco.errors import FiccoError

    if rank == dead:
        os._exit(3)
    try:
        with config.scope(transport=transport):
            getattr(ficco, op)(torch.randn(8, 6), torch.randn(6, 4), schedule=schedule)
    except (FiccoError, RuntimeError) as exc:
        return type(exc).__name__
    return "no error"


def explain_and_run(op, a, b):
    """``explain(op=op)`` under the paper rule, then under the model, and the call with no
    schedule forced under the model: (the paper rule's selector and reason, the model's
    schedule, transport and scored names, what ran, the output)."""
    with config.scope(selector="paper"):
        paper = ficco.explain(a, b, op=op)
    with config.scope(selector="model"):
        decision = ficco.explain(a, b, op=op)
        out = getattr(ficco, op)(a, b)
    return (paper.selector, paper.reason, decision.schedule, decision.transport,
            sorted(decision.scores), runtime.last_run(), out)


def check_selector_picks(results, names) -> None:
    """The ranks' :func:`explain_and_run` rows (the output replaced by its error): the paper
    rule hands over to the model and says so; the model scores every schedule in ``names``,
    its pick runs, agrees on every rank, and is right."""
    assert len({(r[2], r[3], r[5]) for r in results}) == 1, results   # one decision everywhere
    for paper_selector, reason, schedule, transport, scored, ran, err in results:
        assert paper_selector == "model" and "paper's rule covers the all-gather only" in reason
        assert set(scored) >= set(names) and ran == (schedule, transport)
        assert err <= ROW_TOL[torch.float32]


def selector_picks(rank, world, seed):
    """:func:`explain_and_run` of the reduce-scatter, with its output's error."""
    a_s, b_s, refs = make_inputs(seed, world, (24, 32), (40,), torch.float32)
    *picks, out = explain_and_run("matmul_reduce_scatter", a_s[rank], b_s[rank][0])
    return (*picks, max_row_rel_err(out, refs[0][rank]))


def empty_inner_shapes(rank, world):
    """Output shapes (and the backward's input-gradient shape) of a 3-D ``a`` whose inner
    dimension is empty: no canonical rows, yet a scatter_dim of several rows."""
    out = []
    for shape, dim in (((2 * world, 0, 4), 0), ((world, 0, 4), 0), ((1, 0, 4), 0),
                       ((3, 2 * world, 0), 1), ((0, world, 3), 1)):
        train = shape[dim] % world == 0   # (training needs equal shards)
        a = torch.randn(shape, requires_grad=train)
        b = torch.randn(shape[-1], 5, requires_grad=train)
        d = ficco.matmul_reduce_scatter(a, b, scatter_dim=dim)
        want = list(shape[:-1]) + [5]
        want[dim] = even_split(shape[dim], world)[rank][1]
        grad = None
        if train:
            d.backward(torch.randn(d.shape))
            grad = tuple(a.grad.shape)
        out.append((tuple(d.shape) == tuple(want), grad in (None, shape)))
    return out
