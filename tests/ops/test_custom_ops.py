"""ficco's ops as torch custom ops: autograd (gradcheck), grad/inference mode, autocast, fake
kernels, torch.compile / torch.export, DTensor and DeviceMesh.

Each defect of the first custom ops has a test here that failed on the code before the ops existed:
a weight with requires_grad, inference_mode, autocast ignored, torch.compile, DeviceMesh.
"""
from __future__ import annotations

import random

import pytest
import torch

import ficco
from ficco.group import name_of

from .. import harness
from ..reference import ROW_TOL, make_inputs, max_row_rel_err


def _rs_reference(a_full_per_rank, bs, world, scatter_dim):
    """float64 reduce_scatter(sum_r a_r @ b_r) blocks, one list of outputs per rank."""
    outs = []
    for rank in range(world):
        per_b = []
        for j in range(len(bs[0])):
            total = sum(a_full_per_rank[r].double() @ bs[r][j].double() for r in range(world))
            per_b.append(total.chunk(world, dim=scatter_dim)[rank])
        outs.append(per_b)
    return outs


# -- The custom ops' defects ---------------------------------------------------------------------
def _modes(rank, world, seed):
    """One W=2 forward in each mode a training/inference loop uses; returns errors by mode."""
    shards, bs, _full, refs = make_inputs(seed, world, (6, 8), (5,), torch.float32)
    a = shards[rank]
    w = bs[0].clone().requires_grad_(True)
    errs = {}
    errs["requires_grad weight"] = max_row_rel_err(ficco.all_gather_matmul(a, w), refs[0])
    with torch.no_grad():
        errs["no_grad"] = max_row_rel_err(ficco.all_gather_matmul(a, w), refs[0])
    with torch.inference_mode():
        out = ficco.all_gather_matmul(a, bs[0])
        errs["inference_mode"] = max_row_rel_err(out, refs[0])
    with ficco.config.scope(disable=True):
        errs["FICCO_DISABLE requires_grad"] = max_row_rel_err(ficco.all_gather_matmul(a, w),
                                                              refs[0])
        with torch.inference_mode():
            errs["FICCO_DISABLE inference_mode"] = max_row_rel_err(
                ficco.all_gather_matmul(a, bs[0]), refs[0])
    return errs


def test_requires_grad_no_grad_and_inference_mode_calls_work():
    """Before: 'mm(): functions with out=... don't support automatic differentiation' for a
    weight that requires grad, and 'Inplace update to inference tensor outside InferenceMode'
    under inference_mode (the CPU queues' threads did not see the caller's modes)."""
    seed = random.randrange(1 << 30)
    for errs in harness.pool(2).run(_modes, seed):
        assert all(e <= ROW_TOL[torch.float32] for e in errs.values()), (seed, errs)


def _autocast(rank, world, seed):
    shards, bs, full, refs = make_inputs(seed, world, (6, 8), (5,), torch.float32)
    w = bs[0].clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ficco.all_gather_matmul(shards[rank], w)
        plain = full @ w
    out.float().sum().backward()
    return out.dtype, plain.dtype, w.grad.dtype, max_row_rel_err(out, refs[0])


def test_autocast_runs_the_gemm_in_the_autocast_dtype():
    """Before: autocast was ignored (float32 out where a plain matmul gives bfloat16)."""
    seed = random.randrange(1 << 30)
    for dtype, plain, grad_dtype, err in harness.pool(2).run(_autocast, seed):
        assert dtype == plain == torch.bfloat16
        assert grad_dtype == torch.float32          # fp32 master weight, bf16 GEMM
        assert err <= ROW_TOL[torch.bfloat16], (seed, err)


# -- gradcheck ------------------------------------------------------------------------------------
# gradcheck perturbs one input element at a time and watches the outputs. Per rank that would
# miss every cross-rank derivative, so each rank evaluates the same global function: it takes
# every rank's inputs (identical on all ranks), feeds its own slice to the op, and gathers every
# rank's outputs. All ranks perturb the same element at the same time (lockstep) and agree.
class _OwnSlice(torch.autograd.Function):
    """Forward: rank ``r``'s entry of a stacked per-rank tensor. Backward: every rank's
    gradient, stacked (all ranks evaluate the same global function)."""

    @staticmethod
    def forward(ctx, stacked, rank):
        return stacked[rank].clone()

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, grad.contiguous())
        return torch.stack(parts), None


class _EveryRank(torch.autograd.Function):
    """Forward: every rank's output, stacked. Backward: this rank's entry (the cotangent is the
    same on all ranks, so summing over ranks would count it W times)."""

    @staticmethod
    def forward(ctx, out, rank):
        import torch.distributed as dist

        ctx.rank = rank
        parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, out.contiguous())
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank], None


AG_SCHEDULES = ("serial", "ring-bidir", "hetero-fused-1d", "uniform-unfused-2d")


def _rs_schedules():
    try:
        names = ficco.schedules.names(op="matmul_reduce_scatter")
    except TypeError:
        return (None,)
    wanted = [n for n in names if n in ("serial", "ring", "hetero-unfused-1d",
                                         "uniform-fused-2d")]
    return tuple(wanted or names[:4])


def _gradcheck_op(rank, world, seed, op):
    import ficco.ops.all_gather_matmul.torch_op as ag_op
    import ficco.ops.matmul_reduce_scatter.torch_op as rs_op

    torch.manual_seed(seed)          # the same inputs and gradcheck vectors on every rank
    failures = []
    schedules = AG_SCHEDULES if op == "ag" else _rs_schedules()
    for schedule in schedules:
        for transport in ("dma", "ccl"):
            if op == "ag":               # a_shard (2, 2, 3) gathered on dim 1, two b's
                a = torch.randn(world, 2, 2, 3, dtype=torch.float64, requires_grad=True)
                bs = torch.randn(world, 2, 3, 2, dtype=torch.float64, requires_grad=True)

                def f(a, bs):
                    mine = _OwnSlice.apply(bs, rank)
                    gathered, (c1, c2) = ag_op.all_gather_matmul(
                        _OwnSlice.apply(a, rank), [mine[0], mine[1]], gather_dim=1,
                        schedule=schedule, return_gathered=True)
                    # the gathered a feeds the loss too: its gradient is reduce-scattered
                    return tuple(_EveryRank.apply(t, rank) for t in (c1, c2, gathered.sin()))
            else:                        # a (2, 2*W, 3) scattered on dim 1, two b's
                a = torch.randn(world, 2, 2 * world, 3, dtype=torch.float64, requires_grad=True)
                bs = torch.randn(world, 2, 3, 2, dtype=torch.float64, requires_grad=True)

                def f(a, bs):
                    mine = _OwnSlice.apply(bs, rank)
                    d1, d2 = rs_op.matmul_reduce_scatter(_OwnSlice.apply(a, rank),
                                                       [mine[0], mine[1]], scatter_dim=1,
                                                       schedule=schedule)
                    return _EveryRank.apply(d1, rank), _EveryRank.apply(d2, rank)
            with ficco.config.scope(transport=transport):
                try:
                    ok = torch.autograd.gradcheck(f, (a, bs), fast_mode=True, atol=1e-7,
                                                  raise_exception=False)
                except Exception as exc:  # noqa: BLE001 - reported with its case
                    ok = f"{type(exc).__name__}: {exc}"
            if ok is not True:
                failures.append((schedule, transport, ok))
    return failures


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("world", [2, 3])
def test_gradcheck_float64(world, op):
    """Gradients w.r.t. every input (a, each b, and through return_gathered's gathered a) of
    both ops, one schedule of every family, both transports, against finite differences."""
    seed = random.randrange(1 << 30)
    results = harness.pool(world).run(_gradcheck_op, seed, op)
    assert results == [[]] * world, f"seed {seed}: {results}"


def _regather(rank, world, seed):
    """FICCO_BACKWARD_GATHER=regather gives the gradients of the default (save)."""
    torch.manual_seed(seed)
    a = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    grads = {}
    for mode in ("save", "regather"):
        with ficco.config.scope(backward_gather=mode):
            out = ficco.all_gather_matmul(a, w)
            (out.sin().sum()).backward()
        grads[mode] = (a.grad.clone(), w.grad.clone())
        a.grad = w.grad = None
    return [float((x - y).abs().max()) for x, y in zip(grads["save"], grads["regather"])]


def test_regather_backward_matches_saved():
    for diffs in harness.pool(2).run(_regather, random.randrange(1 << 30)):
        assert max(diffs) < 1e-5, diffs


# -- fake kernels ------------------------------------------------------------------------------
FAKE_CASES = [  # (op, a shape (per rank), gather/scatter dim, b widths, return_gathered)
    ("ag", (4, 6), 0, (5,), False), ("ag", (4, 6), 0, (5, 3), True),
    ("ag", (2, 3, 6), 1, (5,), True), ("ag", (3, 2, 6), -2, (1, 4), False),
    ("ag", (0, 6), 0, (5,), True),
    ("rs", (8, 6), 0, (5,), None), ("rs", (2, 4, 6), 1, (5, 3), None),
    ("rs", (4, 2, 6), 0, (7,), None),
]


def _layouts(rank, world, seed):
    """(real via op, real via the eager fast path, fake) layouts of every variant."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import ficco.ops.library as lib
    import ficco.ops.matmul_reduce_scatter.torch_op as rs_op

    gen = torch.Generator().manual_seed(seed)
    found = []
    for op, shape, dim, ns, ret in FAKE_CASES:
        if world > 1 and 0 in shape:
            continue   # zero-row shards: checked at W=1; the W>1 runtime path is tested elsewhere
        shape = list(shape)
        if op == "rs":
            shape[dim] *= world
        a = torch.randn(*shape, generator=gen)
        bs = [torch.randn(shape[-1], n, generator=gen) for n in ns]
        name = name_of(None)

        def call(a, bs):
            if op == "ag":
                g, outs = torch.ops.ficco.all_gather_matmul(a, bs, name, dim, None, ret,
                                                            world=world)
                return [g, *outs] if ret else list(outs)
            return list(torch.ops.ficco.matmul_reduce_scatter(
                a, bs, name, dim, "sum", None, world=world,
                out_rows=lib.scattered_rows(a.shape[dim], rank, world)))

        def layout(ts):
            return [(tuple(t.shape), tuple(t.stride()) if t.numel() else None, t.dtype)
                    for t in ts]

        real = layout(call(a, bs))
        if op == "ag":
            res = ficco.all_gather_matmul(a, bs, gather_dim=dim, return_gathered=bool(ret))
            eager = layout(([res[0]] if ret else []) + list(res[1] if ret else res))
        else:
            eager = layout(rs_op.matmul_reduce_scatter(a, bs, scatter_dim=dim))
        with FakeTensorMode() as mode:
            fake = layout(call(mode.from_tensor(a), [mode.from_tensor(b) for b in bs]))
        found.append((op, tuple(shape), dim, ns, ret, real, eager, fake))
    return found


@pytest.mark.parametrize("world", [1, 2])
def test_fake_kernels_give_the_real_layouts(world):
    """Shapes, strides and dtypes of the fake kernels equal the real outputs (through the op
    and through the eager fast path) for every op variant."""
    for per_rank in harness.pool(world).run(_layouts, random.randrange(1 << 30)):
        for op, shape, dim, ns, ret, real, eager, fake in per_rank:
            assert real == eager == fake, (op, shape, dim, ns, ret, real, eager, fake)


# -- DTensor and DeviceMesh ------------------------------------------------------------------------
def _dtensor(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ficco.errors import InvalidArgumentError

    shards, bs, full, refs = make_inputs(seed, world, (2, 3, 8), (6,), torch.float32, 1)
    mesh = init_device_mesh("cpu", (world,))
    errs = {"mesh": max_row_rel_err(ficco.all_gather_matmul(shards[rank], bs[0], mesh,
                                                            gather_dim=1), refs[0])}
    a_dt = distribute_tensor(full, mesh, [Shard(1)])
    errs["dtensor"] = max_row_rel_err(ficco.all_gather_matmul(a_dt, bs[0], gather_dim=1),
                                      refs[0])
    # DTensor weights: a replicated one, and this rank's columns (Shard(1)) giving its columns
    b_rep = distribute_tensor(bs[0], mesh, [Replicate()])
    errs["replicated weight"] = max_row_rel_err(ficco.all_gather_matmul(a_dt, b_rep,
                                                                        gather_dim=1), refs[0])
    cols = ficco.all_gather_matmul(a_dt, distribute_tensor(bs[0], mesh, [Shard(1)]),
                                   gather_dim=1)
    start = rank * bs[0].shape[1] // world
    errs["column-sharded weight"] = max_row_rel_err(
        cols, refs[0][..., start:start + cols.shape[-1]])
    refused = []
    for call in (lambda: ficco.all_gather_matmul(distribute_tensor(full, mesh, [Replicate()]),
                                                 bs[0], gather_dim=1),
                 lambda: ficco.all_gather_matmul(a_dt, distribute_tensor(bs[0], mesh,
                                                                         [Shard(0)]),
                                                 gather_dim=1),
                 lambda: ficco.matmul_reduce_scatter(a_dt, bs[0].T)):
        try:
            call()
            refused.append(None)
        except InvalidArgumentError as exc:
            refused.append(str(exc))
    return errs, refused


def test_device_mesh_group_and_dtensor_input():
    """Before: a DeviceMesh was rejected as group and a DTensor failed inside a worker
    thread; then DTensor weights were refused. Now a 1-D mesh is a group, DTensor
    operands placed as the op needs them are used by their local tensors, and any other
    DTensor is refused naming the placement to use and what to pass instead."""
    for errs, refused in harness.pool(2).run(_dtensor, random.randrange(1 << 30)):
        assert all(e <= ROW_TOL[torch.float32] for e in errs.values()), errs
        assert refused[0] and "to_local()" in refused[0] and "Shard(1)" in refused[0], refused
        assert refused[1] and "Replicate() or Shard(1)" in refused[1], refused
        assert refused[2] and "Shard(-1)" in refused[2], refused


# -- single process: double backward, export --------------------------------------------------
def test_double_backward_raises_clearly():
    a = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    out = ficco.all_gather_matmul(a, w)
    (grad_a,) = torch.autograd.grad(out.pow(2).sum(), a, create_graph=True)
    torch.testing.assert_close(grad_a, 2 * (a @ w) @ w.T)    # first order still right
    with pytest.raises(ficco.errors.FiccoError, match="double backward"):
        grad_a.sum().backward()


def test_export_keeps_both_ops_as_nodes():
    import ficco.ops.matmul_reduce_scatter.torch_op as rs_op

    class TwoOps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Parameter(torch.randn(8, 16))
            self.down = torch.nn.Parameter(torch.randn(16, 8))

        def forward(self, x):
            h = ficco.all_gather_matmul(x, self.up, gather_dim=1)
            return rs_op.matmul_reduce_scatter(torch.relu(h), self.down, scatter_dim=1)

    model, x = TwoOps(), torch.randn(2, 3, 8)
    program = torch.export.export(model, (x,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"ficco.all_gather_matmul.default", "ficco.matmul_reduce_scatter.default"} <= targets
    torch.testing.assert_close(program.module()(x), model(x))


def test_a_bad_argument_reads_the_same_compiled_and_eager():
    """One validator feeds the eager path and the fake kernels: before, a bad
    gather_dim said "does not name a row dimension" under torch.compile and "is the last (K)
    dimension" eagerly. Now the fake kernel raises the eager words, and a compiled call
    carries them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ficco.errors import InvalidArgumentError

    a, w = torch.randn(4, 8), torch.randn(8, 3)
    bad = [lambda a, w: ficco.all_gather_matmul(a, [w], gather_dim=1),
           lambda a, w: ficco.all_gather_matmul(a, [w], gather_dim=-3),
           lambda a, w: ficco.matmul_reduce_scatter(a, [w], scatter_dim=-1),
           lambda a, w: ficco.all_gather_matmul(a, [w[:6]])]
    ops = [lambda a, w: torch.ops.ficco.all_gather_matmul(a, [w], "", 1, None, False),
           lambda a, w: torch.ops.ficco.all_gather_matmul(a, [w], "", -3, None, False),
           lambda a, w: torch.ops.ficco.matmul_reduce_scatter(a, [w], "", -1, "sum", None),
           lambda a, w: torch.ops.ficco.all_gather_matmul(a, [w[:6]], "", 0, None, False)]
    for eager_call, op_call in zip(bad, ops):
        with pytest.raises(InvalidArgumentError) as eager:
            eager_call(a, w)
        with FakeTensorMode() as mode, pytest.raises(InvalidArgumentError) as fake:
            op_call(mode.from_tensor(a), mode.from_tensor(w))
        assert str(fake.value) == str(eager.value)
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:
        torch.compile(bad[0], fullgraph=True, backend="eager")(a, w)
    with pytest.raises(InvalidArgumentError) as eager:
        bad[0](a, w)
    assert str(eager.value) in str(compiled.value)


def test_bad_arguments_on_the_autograd_path_get_ficco_errors():
    """Through the op (a weight that requires grad) a bad call still gets ficco's errors."""
    from ficco.errors import InvalidArgumentError

    w = torch.randn(8, 3, requires_grad=True)
    with pytest.raises(InvalidArgumentError, match="K=6"):
        ficco.all_gather_matmul(torch.randn(4, 6), w)
    with pytest.raises(InvalidArgumentError, match="gather_dim"):
        ficco.all_gather_matmul(torch.randn(4, 8), w, gather_dim="0")
    with pytest.raises(InvalidArgumentError, match="gather_dim"):
        ficco.all_gather_matmul(torch.randn(4, 8), w, gather_dim=1)
    with pytest.raises(InvalidArgumentError):
        ficco.matmul_reduce_scatter(torch.randn(4, 6), w)


# -- Bad input gets ficco's errors, compiled too; meta tensors are shapes -------
@pytest.mark.parametrize("fullgraph", [True, False])
def test_validation_errors_under_torch_compile_are_ficco_errors(fullgraph):
    """Before: torch.compile wrapped the fake kernel's InvalidArgumentError in dynamo's
    TorchRuntimeError, so `except ficco.errors.FiccoError` missed it."""
    from ficco.errors import FiccoError, InvalidArgumentError

    a, w = torch.randn(4, 8), torch.randn(8, 3)
    bad = [(lambda a, w: ficco.all_gather_matmul(a, [w], gather_dim=1), "gather_dim"),
           (lambda a, w: ficco.all_gather_matmul(a, [w[:6]]), "6 rows"),
           (lambda a, w: ficco.matmul_reduce_scatter(a, [w], scatter_dim=-1), "scatter_dim")]
    for call, words in bad:
        torch._dynamo.reset()
        with pytest.raises(FiccoError, match=words) as caught:
            torch.compile(call, fullgraph=fullgraph, backend="eager")(a, w)
        assert isinstance(caught.value, InvalidArgumentError), type(caught.value).__mro__


def test_meta_tensors_give_meta_outputs_of_the_right_shape():
    """Before: `RuntimeError: unknown device type for autocast` from ficco's front end. Now,
    as torch's own ops do, meta tensors give meta outputs shaped as the plain expression, with
    no communication, and a backward on them does the same."""
    a = torch.randn(2, 4, 8, device="meta", requires_grad=True)
    w = torch.randn(8, 3, device="meta", requires_grad=True)
    out = ficco.all_gather_matmul(a, w, gather_dim=1)
    assert out.device.type == "meta" and out.shape == (2, 4, 3)
    out.sum().backward()
    assert a.grad.shape == a.shape and w.grad.shape == w.shape
    d = ficco.matmul_reduce_scatter(a.detach(), [w.detach(), w.detach()], scatter_dim=1)
    assert [t.device.type for t in d] == ["meta"] * 2 and d[0].shape == (2, 4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ficco.all_gather_matmul(a, w, gather_dim=1).shape == (2, 4, 3)


def _meta_on_ranks(rank, world):
    a = torch.randn(3, 8, device="meta")
    return tuple(ficco.all_gather_matmul(a, torch.randn(8, 5, device="meta")).shape), \
        tuple(ficco.matmul_reduce_scatter(torch.randn(7, 8, device="meta"),
                                          torch.randn(8, 5, device="meta")).shape)


def test_meta_tensors_on_a_group_are_shapes_with_no_communication():
    results = harness.pool(2).run(_meta_on_ranks)
    assert results == [((6, 5), (4, 5)), ((6, 5), (3, 5))], results
