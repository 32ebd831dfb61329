"""Rank-side functions for the gradient tests of the epilogues and of ficco.float8."""
from __future__ import annotations

import torch
import torch.distributed as dist

import ficco
import ficco.float8 as f8
from ficco.plan.problem import even_split


def bias_gradcheck(rank, world, seed):
    """torch.autograd.gradcheck in float64 of both ops with a bias (a, b and the bias
    differentiated; the all-gather with an activation too), as one global function every rank
    evaluates in lockstep (tests/ops/test_custom_ops.py's _OwnSlice / _EveryRank), on two
    schedules and both transports. Returns failures."""
    from .ops.test_custom_ops import _EveryRank, _OwnSlice

    torch.manual_seed(seed)          # the same inputs and gradcheck vectors on every rank
    failures = []
    for schedule, transport in (("hetero-fused-1d", "dma"), ("uniform-unfused-2d", "ccl"),
                                ("serial", "dma")):
        a = torch.randn(world, 2 * world, 3, dtype=torch.float64, requires_grad=True)
        b = torch.randn(world, 3, 4, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(world, 4, dtype=torch.float64, requires_grad=True)

        def ag(a, b, bias):
            return _EveryRank.apply(ficco.all_gather_matmul(
                _OwnSlice.apply(a, rank), _OwnSlice.apply(b, rank),
                bias=_OwnSlice.apply(bias, rank), activation="silu", schedule=schedule), rank)

        def rs(a, b, bias):
            return _EveryRank.apply(ficco.matmul_reduce_scatter(
                _OwnSlice.apply(a, rank), _OwnSlice.apply(b, rank),
                bias=_OwnSlice.apply(bias, rank), schedule=schedule), rank)

        for label, fn in (("all_gather_matmul", ag), ("matmul_reduce_scatter", rs)):
            with ficco.config.scope(transport=transport):
                try:
                    ok = torch.autograd.gradcheck(fn, (a, b, bias), fast_mode=True, atol=1e-7,
                                                  raise_exception=False)
                except Exception as exc:  # noqa: BLE001 - reported with its case
                    ok = f"{type(exc).__name__}: {str(exc)[:300]}"
            if ok is not True:
                failures.append(f"{label}/{schedule}/{transport}: {ok}")
    return failures


def _ste(t, rowwise, dim=-1):
    """``t`` quantized and dequantized, with the identity gradient (the straight-through
    estimator ficco.float8's backward implements)."""
    t8, scale = f8.quantize(t, rowwise=rowwise, dim=dim)
    return t + (t8.float() * scale - t).detach()


def _mlp_weights(seed, world, d, f):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(d, f, generator=gen) / d ** 0.5, torch.randn(f, generator=gen) * 0.1,
            torch.randn(f, d, generator=gen) / f ** 0.5, torch.randn(d, generator=gen) * 0.1)


def float8_training_parity(rank, world, seed, recipe):
    """A sequence-parallel MLP block (column-parallel W1 + b1 by all_gather_matmul, GELU,
    row-parallel W2 + b2 by matmul_reduce_scatter), both through ficco.float8, trained three SGD
    steps on W ranks, against its unsharded twin that quantizes the same way (per row of each
    rank's K-slice, per column or per shard of each weight shard) with the straight-through
    gradient. Returns the relative differences of the losses (over the loss's scale) and of
    every weight after the steps."""
    d, f, seq = 32, 64, 8 * world
    rowwise = recipe == "rowwise"
    w1, b1, w2, b2 = _mlp_weights(seed, world, d, f)
    cols = even_split(f, world)
    c0, nc = cols[rank]
    mine = [w1[:, c0:c0 + nc].clone().requires_grad_(), b1[c0:c0 + nc].clone().requires_grad_(),
            w2[c0:c0 + nc].clone().requires_grad_(), b2.clone().requires_grad_()]
    twin = [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]
    r0, rows = even_split(seq, world)[rank]
    diffs = []
    for step in range(3):
        gen = torch.Generator().manual_seed(seed + 100 + step)
        x, target = torch.randn(seq, d, generator=gen), torch.randn(seq, d, generator=gen)
        # ficco, sharded
        h = f8.all_gather_matmul(x[r0:r0 + rows], mine[0], bias=mine[1], recipe=recipe)
        y = f8.matmul_reduce_scatter(torch.nn.functional.gelu(h), mine[2], bias=mine[3],
                                     recipe=recipe)
        loss = (y * target[r0:r0 + rows]).sum()
        loss.backward()
        dist.all_reduce(mine[3].grad)   # b2 sits in the sequence-parallel region: summed
        total = loss.detach().clone()
        dist.all_reduce(total)
        # the twin, unsharded, quantized as the ranks do: each weight shard on its own (one
        # scale per shard when tensor-wise), layer 2's input per rank's K-slice
        hx = torch.cat([_ste(x, rowwise) @ _ste(twin[0][:, a0:a0 + n], rowwise, dim=0)
                        for a0, n in cols], dim=1) + twin[1]
        g = torch.nn.functional.gelu(hx)
        y_twin = sum(_ste(g[:, a0:a0 + n], rowwise) @ _ste(twin[2][a0:a0 + n], rowwise, dim=0)
                     for a0, n in cols) + twin[3]
        loss_twin = (y_twin * target).sum()
        loss_twin.backward()
        # relative to the loss's scale (sum |y * target|): a loss of random sign may be ~0
        scale = (y_twin * target).abs().sum().detach()
        diffs.append(float((total - loss_twin.detach()).abs() / scale))
        with torch.no_grad():
            for p in mine + twin:
                p -= 0.01 * p.grad
                p.grad = None
    pairs = [(mine[0], twin[0][:, c0:c0 + nc]), (mine[1], twin[1][c0:c0 + nc]),
             (mine[2], twin[2][c0:c0 + nc]), (mine[3], twin[3])]
    for got, want in pairs:
        diffs.append(float((got.detach() - want.detach()).norm() / want.detach().norm()))
    return diffs


def float8_gradients(rank, world, seed, recipe, hp):
    """ficco.float8's gradients against the straight-through float64 reference (gradients of
    the dequantized operands), both ops, ``hp`` the input dtype. Returns the largest
    error relative to each gradient's size, per quantity."""
    rowwise = recipe == "rowwise"
    gen = torch.Generator().manual_seed(seed)
    m, k, n = 6, 32, 16
    shards = [torch.randn(m, k, generator=gen).to(hp) for _ in range(world)]
    ws = [torch.randn(k, n, generator=gen).to(hp) for _ in range(world)]
    grads = [torch.randn(world * m, n, generator=gen).to(hp) for _ in range(world)]
    bias = torch.randn(n, generator=gen).to(hp)
    errs = {}

    def rel(got, want):
        return float((got.double() - want).norm() / want.norm())

    def deq(t, dim=-1, amax=None):
        t8, s = f8.quantize(t, rowwise=rowwise, dim=dim, amax=amax)
        return t8.double() * s.double()

    # all-gather: a shards, this rank's w column block
    a = shards[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    bb = bias.clone().requires_grad_()
    out = f8.all_gather_matmul(a, w, bias=bb, recipe=recipe)
    (out * grads[rank]).sum().backward()
    amax = max(s.abs().amax() for s in shards)
    full = torch.cat([deq(s, amax=amax) for s in shards])
    errs["ag out"] = rel(out, full @ deq(ws[rank], dim=0) + bias.double())
    errs["ag grad w"] = rel(w.grad, full.t() @ grads[rank].double())
    errs["ag grad bias"] = rel(bb.grad, grads[rank].double().sum(0))
    grad_a = sum(g.double() @ deq(wq, dim=0).t() for g, wq in zip(grads, ws))
    errs["ag grad a"] = rel(a.grad, grad_a[rank * m:(rank + 1) * m])
    # reduce-scatter: every rank's full-row a (its K-slice), this rank's w rows
    a = torch.cat(shards).clone().requires_grad_()    # (W*m, k): this rank's own values
    w = ws[rank].clone().requires_grad_()
    bb = bias.clone().requires_grad_()
    out = f8.matmul_reduce_scatter(a, w, bias=bb, recipe=recipe)
    g_mine = grads[rank][rank * m:(rank + 1) * m]
    (out * g_mine).sum().backward()
    parts = [deq(torch.cat(shards)) @ deq(wq, dim=0) for wq in ws]   # every rank's a is alike
    errs["rs out"] = rel(out, sum(parts)[rank * m:(rank + 1) * m] + bias.double())
    g_full = torch.cat([grads[r][r * m:(r + 1) * m] for r in range(world)]).double()
    errs["rs grad a"] = rel(a.grad, g_full @ deq(ws[rank], dim=0).t())
    errs["rs grad w"] = rel(w.grad, deq(torch.cat(shards)).t() @ g_full)
    errs["rs grad bias"] = rel(bb.grad, g_mine.double().sum(0))
    return errs
