"""Shard widths that do not divide by W. Only rows travel, so the width of
this rank's weight shard (``n`` of all_gather_matmul, ``K`` of matmul_reduce_scatter) may differ
across ranks: every schedule, both transports, W 2-4 against float64; gradients (gradcheck in
float64, and ficco.nn layers of 64 features at W=3, 22/21/21, trained against the unsharded
model); one decision on every rank; real disagreement still caught."""
from __future__ import annotations

import random

import pytest
import torch

import ficco
from ficco import api
from ficco.plan.problem import even_split

from .. import harness
from ..reference import ROW_TOL, max_row_rel_err


def _cols(t: torch.Tensor, dim: int, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``t`` along ``dim``, split as ficco.nn splits features."""
    start, size = even_split(t.shape[dim], world)[rank]
    return t.narrow(dim, start, size)


def _with_scale(ref: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    ref.scale = scale
    return ref


def _every_schedule(rank, world, seed, dtype):
    """all_gather_matmul with per-rank n (two b's, one 13 and one 2 columns wide in all: at
    W=3 a rank has none of the second) and matmul_reduce_scatter with per-rank K (25 in all;
    19 rows scattered), every schedule x transport, against float64."""
    gen = torch.Generator().manual_seed(seed)
    failures = []
    shards = [torch.randn(5, 12, generator=gen).to(dtype) for _ in range(world)]
    full_bs = [torch.randn(12, n, generator=gen).to(dtype) for n in (13, 2)]
    gathered = torch.cat(shards).double()
    mine = [_cols(b, 1, world, rank) for b in full_bs]
    ag_refs = [_with_scale(gathered @ b.double(), gathered.abs() @ b.double().abs())
               for b in mine]
    a_full = torch.randn(19, 25, generator=gen).to(dtype)
    b_full = torch.randn(25, 6, generator=gen).to(dtype)
    start, rows = even_split(19, world)[rank]
    rs_ref = _with_scale((a_full.double() @ b_full.double())[start:start + rows],
                         (a_full.double().abs() @ b_full.double().abs())[start:start + rows])
    a_mine, b_mine = _cols(a_full, 1, world, rank), _cols(b_full, 0, world, rank)
    for transport in ("dma", "ccl"):
        with ficco.config.scope(transport=transport):
            for name in ficco.schedules.names():
                outs = ficco.all_gather_matmul(shards[rank], mine, schedule=name)
                for j, (out, ref) in enumerate(zip(outs, ag_refs)):
                    err = max_row_rel_err(out, ref)
                    if not err <= ROW_TOL[dtype] or out.shape != ref.shape:
                        failures.append(f"all_gather_matmul {name}/{transport} b{j} "
                                        f"{tuple(out.shape)}: {err:.3g}")
                if api.last_run() != (name, transport):
                    failures.append(f"{name}/{transport} ran {api.last_run()}")
            for name in ficco.schedules.names(op="matmul_reduce_scatter"):
                out = ficco.matmul_reduce_scatter(a_mine, b_mine, schedule=name)
                err = max_row_rel_err(out, rs_ref)
                if not err <= ROW_TOL[dtype]:
                    failures.append(f"matmul_reduce_scatter {name}/{transport}: {err:.3g}")
                if api.last_run() != (name, transport):
                    failures.append(f"{name}/{transport} ran {api.last_run()}")
    ficco.shutdown()
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_schedule_and_transport_takes_per_rank_widths(world):
    """Before: MismatchError blaming the caller (the ops demanded equal n and K)."""
    seed = random.randrange(1 << 30)
    for dtype in (torch.float32, torch.bfloat16):
        results = harness.pool(world).run(_every_schedule, seed, dtype, timeout_s=600)
        assert results == [[]] * world, (seed, dtype, results)


def _zero_width_epilogues(rank, world, seed):
    """W=3 with 2 output features (all_gather_matmul) and 2 input features
    (matmul_reduce_scatter): rank 2 holds none of them. Each op with a bias, fp8 with
    tensor-wise and row-wise scales, on both transports, against float64."""
    gen = torch.Generator().manual_seed(seed)
    f8 = torch.float8_e4m3fn
    shards = [torch.randn(4, 16, generator=gen) for _ in range(world)]
    b, bias = torch.randn(16, 2, generator=gen), torch.randn(2, generator=gen)
    a_rs, b_rs = torch.randn(6, 2, generator=gen), torch.randn(2, 16, generator=gen)
    bias_rs = torch.randn(16, generator=gen)
    row_a = torch.rand(world * 4, 1, generator=gen) + 0.5      # row-wise scales (fp8)
    col_b = torch.rand(1, 2, generator=gen) + 0.5
    start, n = even_split(2, world)[rank]
    cols = slice(start, start + n)
    first, rows = even_split(6, world)[rank]
    gathered = torch.cat(shards)
    failures = []

    def check(what, out, ref):
        if out.shape != ref.shape or (out.numel() and not torch.allclose(
                out.double(), ref, rtol=1e-5, atol=1e-5)):
            failures.append(f"{what}: {tuple(out.shape)} vs {tuple(ref.shape)}")

    for transport in ("dma", "ccl"):
        with ficco.config.scope(transport=transport):
            ref = (gathered.double() @ b.double() + bias.double())[:, cols]
            check(f"{transport} ag bias",
                  ficco.all_gather_matmul(shards[rank], b[:, cols], bias=bias[cols]), ref)
            a8, b8 = gathered.to(f8), b.t().contiguous().to(f8).t()
            for scaling, sa, sb in (("tensor", torch.tensor(0.5), torch.tensor(2.0)),
                                    ("row", row_a, col_b)):
                mine_sa = sa if sa.dim() == 0 else sa[rank * 4:(rank + 1) * 4]
                mine_sb = sb if sb.dim() == 0 else sb[:, cols]
                ref = ((a8.double() * sa.double()) @ (b8.double() * sb.double())
                       + bias.double())[:, cols]
                out = ficco.all_gather_matmul(a8[rank * 4:(rank + 1) * 4], b8[:, cols],
                                              a_scale=mine_sa, b_scale=mine_sb,
                                              out_dtype=torch.float32, bias=bias[cols])
                check(f"{transport} ag fp8 {scaling}-wise bias", out, ref)
            ref = (a_rs.double() @ b_rs.double() + bias_rs.double())[first:first + rows]
            check(f"{transport} rs bias",
                  ficco.matmul_reduce_scatter(a_rs[:, cols], b_rs[cols], bias=bias_rs), ref)
            a8, b8 = a_rs.to(f8), b_rs.t().contiguous().to(f8).t()
            one = torch.tensor(1.5)
            ref = ((a8.double() @ b8.double()) * 2.25 + bias_rs.double())[first:first + rows]
            check(f"{transport} rs fp8 bias",
                  ficco.matmul_reduce_scatter(a8[:, cols], b8[cols], a_scale=one, b_scale=one,
                                              out_dtype=torch.float32, bias=bias_rs), ref)
    ficco.shutdown()
    return failures


def test_a_rank_with_no_features_takes_a_bias_and_fp8_scales():
    """Before: rank 2 failed in its GEMM's epilogue (its b ran as one zero column, its bias
    and scales kept none: "expanded size ... (1) must match ... (0)"), poisoning the group."""
    seed = random.randrange(1 << 30)
    assert harness.pool(3).run(_zero_width_epilogues, seed) == [[]] * 3, seed


def _decided_alike(rank, world, seed):
    """The selector's choice with widths 1 and 4096 on different ranks: the same everywhere
    (it sees the widest), and right."""
    gen = torch.Generator().manual_seed(seed)
    shard = torch.randn(64, 256, generator=gen)
    b = torch.randn(256, 1 if rank == 0 else 4096, generator=gen)
    out = ficco.all_gather_matmul(shard, b)
    full = torch.cat([shard] * world)    # every rank passes the same shard here
    err = max_row_rel_err(out, _with_scale(full.double() @ b.double(),
                                           full.double().abs() @ b.double().abs()))
    decision = ficco.explain(shard, b)
    ficco.shutdown()
    return api.last_run(), err, (decision.schedule, decision.transport)


def test_ranks_with_different_widths_make_one_decision():
    results = harness.pool(2).run(_decided_alike, random.randrange(1 << 30))
    assert results[0][0] == results[1][0], results
    assert results[0][2] == results[1][2], results          # explain agrees with the run
    assert all(err <= ROW_TOL[torch.float32] for _, err, _ in results), results


def _real_disagreement(rank, world, seed, op):
    gen = torch.Generator().manual_seed(seed)
    try:
        if op == "all_gather_matmul":       # the shard rows travel: they must agree
            ficco.all_gather_matmul(torch.randn(4 + rank, 8, generator=gen),
                                    torch.randn(8, 3 + rank, generator=gen))
        else:                               # the partial products travel: n must agree
            ficco.matmul_reduce_scatter(torch.randn(6, 4 + rank, generator=gen),
                                        torch.randn(4 + rank, 3 + rank, generator=gen))
    except ficco.errors.MismatchError as exc:
        return str(exc)
    finally:
        ficco.shutdown()
    return "no error"


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_widths_that_travel_must_still_agree(op):
    for message in harness.pool(2).run(_real_disagreement, random.randrange(1 << 30), op):
        assert "rank 0" in message and "rank 1" in message, message
        assert ("shard_shape" if op == "all_gather_matmul" else "ns") in message, message


# -- gradients -----------------------------------------------------------------------------------
class _Mine(torch.autograd.Function):
    """Forward: this rank's piece of ``full`` along ``dim`` (pieces of ``sizes``). Backward:
    every rank's gradient piece in place (all ranks evaluate the same global function, as in
    tests/ops/test_custom_ops.py's gradcheck)."""

    @staticmethod
    def forward(ctx, full, dim, sizes, rank):
        ctx.dim, ctx.sizes = dim, sizes
        start = sum(sizes[:rank])
        return full.narrow(dim, start, sizes[rank]).clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather_pieces(grad, ctx.dim, ctx.sizes), None, None, None


class _Everyone(torch.autograd.Function):
    """Forward: every rank's ``piece`` along ``dim``, concatenated. Backward: this rank's."""

    @staticmethod
    def forward(ctx, piece, dim, sizes, rank):
        ctx.dim, ctx.sizes, ctx.rank = dim, sizes, rank
        return _gather_pieces(piece, dim, sizes)

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.sizes[:ctx.rank])
        return grad.narrow(ctx.dim, start, ctx.sizes[ctx.rank]), None, None, None


def _gather_pieces(piece, dim, sizes):
    """Every rank's ``piece`` (``sizes[r]`` long along ``dim``), concatenated: padded to the
    longest for one all_gather, then cut."""
    import torch.distributed as dist

    longest = max(sizes)
    pad = list(piece.shape)
    pad[dim] = longest - piece.shape[dim]
    padded = torch.cat([piece, piece.new_zeros(pad)], dim).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim)


def _gradcheck_widths(rank, world, seed):
    import ficco.ops.all_gather_matmul.torch_op as ag_op
    import ficco.ops.matmul_reduce_scatter.torch_op as rs_op

    torch.manual_seed(seed)        # the same inputs and gradcheck vectors on every rank
    n_sizes = [n for _, n in even_split(2 * world + 1, world)]     # e.g. 3/2 at W=2
    k_sizes = [k for _, k in even_split(world + 2, world)]         # e.g. 2/1/1 at W=3
    failures = []
    for schedule, transport in (("serial", "ccl"), ("ring", "dma"), ("hetero-fused-1d", "dma"),
                                ("uniform-unfused-2d", "ccl")):
        a = torch.randn(world * 2, 3, dtype=torch.float64, requires_grad=True)
        b = torch.randn(3, sum(n_sizes), dtype=torch.float64, requires_grad=True)
        a_rs = torch.randn(2 * world, sum(k_sizes), dtype=torch.float64, requires_grad=True)
        b_rs = torch.randn(sum(k_sizes), 2, dtype=torch.float64, requires_grad=True)

        def ag(a, b):
            gathered, c = ag_op.all_gather_matmul(_Mine.apply(a, 0, [2] * world, rank),
                                                _Mine.apply(b, 1, n_sizes, rank),
                                                schedule=schedule, return_gathered=True)
            # every rank's gathered a, side by side (its gradient is reduce-scattered)
            return (_Everyone.apply(c, 1, n_sizes, rank),
                    _Everyone.apply(gathered.sin(), 1, [3] * world, rank))

        def rs(a, b):
            d = rs_op.matmul_reduce_scatter(_Mine.apply(a, 1, k_sizes, rank),
                                          _Mine.apply(b, 0, k_sizes, rank), schedule=schedule
                                          if schedule in ficco.schedules.names(
                                              op="matmul_reduce_scatter") else None)
            return _Everyone.apply(d, 0, [2] * world, rank)

        with ficco.config.scope(transport=transport):
            for name, f, inputs in (("ag", ag, (a, b)), ("rs", rs, (a_rs, b_rs))):
                try:
                    ok = torch.autograd.gradcheck(f, inputs, fast_mode=True, atol=1e-7,
                                                  raise_exception=False)
                except Exception as exc:  # noqa: BLE001 - reported with its case
                    ok = f"{type(exc).__name__}: {exc}"
                if ok is not True:
                    failures.append((name, schedule, transport, ok))
    ficco.shutdown()
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_gradcheck_float64_with_per_rank_widths(world):
    seed = random.randrange(1 << 30)
    assert harness.pool(world).run(_gradcheck_widths, seed) == [[]] * world, seed


def _train_64_features(rank, world, seed, steps=4):
    """ficco.nn Column(16 -> 64) then Row(64 -> 16) at W=3: 22/21/21 features per rank,
    trained with SGD against the unsharded pair."""
    from torch import nn

    from ficco.nn import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(seed)
    up, down = nn.Linear(16, 64), nn.Linear(64, 16)
    col, row = ColumnParallelLinear.from_linear(up), RowParallelLinear.from_linear(down)
    widths = (col.weights[0].shape[0], row.weight.shape[1])
    sharded = torch.optim.SGD([*col.parameters(), *row.parameters()], lr=0.05)
    plain = torch.optim.SGD([*up.parameters(), *down.parameters()], lr=0.05)
    losses = []
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(seed))
    target = torch.randn(6, 16, generator=torch.Generator().manual_seed(seed + 1))
    for _ in range(steps):             # one batch, so the loss falls step by step
        mine = _cols(x, 0, world, rank)
        part = (row(torch.relu(col(mine))) - _cols(target, 0, world, rank)).square().sum() \
            / target.numel()
        # the loss of the whole batch: each rank's rows, summed over the group
        import torch.distributed as dist

        total = part.detach().clone()
        dist.all_reduce(total)
        sharded.zero_grad()
        part.backward()
        sharded.step()
        ref = (down(torch.relu(up(x))) - target).square().mean()
        plain.zero_grad()
        ref.backward()
        plain.step()
        losses.append((float(total), float(ref.detach())))
    start, size = even_split(64, world)[rank]
    pairs = [(col.weights[0], up.weight[start:start + size]),
             (col.biases[0], up.bias[start:start + size]),
             (row.weight, down.weight[:, start:start + size]), (row.bias, down.bias)]
    weight_diff = max(float((m - r).abs().max() / r.abs().max()) for m, r in pairs)
    ficco.shutdown()
    return widths, losses, weight_diff


def test_nn_layers_with_64_features_on_3_ranks_train_like_the_unsharded_model():
    results = harness.pool(3).run(_train_64_features, random.randrange(1 << 30))
    assert [w for w, _, _ in results] == [(22, 22), (21, 21), (21, 21)], results
    for _, losses, weight_diff in results:
        assert all(abs(s - p) <= 1e-4 * abs(p) for s, p in losses), losses
        assert losses[-1][1] < losses[0][1], losses                 # it trains
        assert weight_diff <= 1e-4, weight_diff
