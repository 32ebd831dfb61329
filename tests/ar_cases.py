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
from ficco import config
from ficco.plan.problem import even_split
from ficco.runtime import path as runtime

from .fp8_cases import E4M3, quantize
from .reference import ROW_TOL, max_row_rel_err

# (label, a's leading dims, K over all ranks, ns): M not divisible by W, 3-D, rows < W,
# several b (one narrower than most W), K < W (a rank holds none of it; fp8 cases skip it)
SHAPES = [("2d-uneven", (13,), 20, (7,)), ("3d", (2, 5), 12, (6,)), ("rows<W", (2,), 9, (5,)),
          ("several-b", (9,), 16, (5, 3)), ("K<W", (5,), 2, (3,))]
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


# -- gradients --------------------------------------------------------------------------------------
def gradcheck_ranks(rank, world, seed, reduce_op):
    """torch.autograd.gradcheck in float64 of ``A, B, bias -> all_reduce(A_r @ B_r) + bias`` on
    every rank at once: each rank takes its K-slice of the full A and B (uneven) through
    ``ficco.nn.replicated`` (identity forward, gradient summed over the ranks: Megatron's copy
    into the tensor-parallel region), so the check sees the whole op, all-reduce included. Every
    rank perturbs the same element in lockstep (same shapes, so the same calls)."""
    from ficco.nn import replicated

    gen = torch.Generator().manual_seed(seed)
    k = 2 * world - 1
    a = torch.randn(3, k, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(k, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(2, dtype=torch.float64, generator=gen, requires_grad=True)
    start, width = even_split(k, world)[rank]

    def f(a, b, bias):
        mine_a = replicated(a)[:, start:start + width]
        mine_b = replicated(b)[start:start + width]
        return ficco.matmul_all_reduce(mine_a, mine_b, reduce_op=reduce_op, bias=bias)

    return torch.autograd.gradcheck(f, (a, b, bias), eps=1e-6, atol=1e-7)


def gradients_vs_float64(rank, world, seed, schedule, transport):
    """Forward and backward of ``sum(g * matmul_all_reduce(a_r, [b_r, c_r]))`` in float32 with
    a bias, against the float64 gradients of the unsharded ``A @ B``: worst relative errors of
    (output, grad a_r, grad b_r, grad c_r, grad bias)."""
    gen = torch.Generator().manual_seed(seed)
    k = 3 * world + 1
    full = [torch.randn(5, 2, k, generator=gen, dtype=torch.float64),
            torch.randn(k, 6, generator=gen, dtype=torch.float64),
            torch.randn(k, 3, generator=gen, dtype=torch.float64)]
    bias, g = torch.randn(6, generator=gen, dtype=torch.float64), \
        torch.randn(5, 2, 6, generator=gen, dtype=torch.float64)
    g2 = torch.randn(5, 2, 3, generator=gen, dtype=torch.float64)
    start, width = even_split(k, world)[rank]
    leaves = [full[0][..., start:start + width], full[1][start:start + width],
              full[2][start:start + width], bias]
    mine = [t.float().requires_grad_(True) for t in leaves]
    ref = [t.clone().requires_grad_(True) for t in (*full, bias)]
    with config.scope(transport=transport):
        y, z = ficco.matmul_all_reduce(mine[0], [mine[1], mine[2]], schedule=schedule,
                                       bias=[mine[3], None])
    ((y.double() * g).sum() + (z.double() * g2).sum()).backward()
    y_ref, z_ref = ref[0] @ ref[1] + ref[3], ref[0] @ ref[2]
    ((y_ref * g).sum() + (z_ref * g2).sum()).backward()
    want = [ref[0].grad[..., start:start + width], ref[1].grad[start:start + width],
            ref[2].grad[start:start + width], ref[3].grad]

    def rel(x, y):
        return float((x.double() - y).norm() / y.norm().clamp_min(1e-30))
    return [rel(y, y_ref.detach()), rel(z, z_ref.detach())] + \
        [rel(t.grad, w) for t, w in zip(mine, want)]


def nn_parity(rank, world, seed, steps=3):
    """A TP MLP without sequence parallelism: every rank holds the whole input, a plain linear
    of its up-projection rows and ``RowParallelLinear(sequence_parallel=False)``; a few SGD
    steps against the unsharded MLP: worst relative loss difference, worst parameter
    difference after training, whether the losses went down."""
    from torch import nn

    from ficco.nn import RowParallelLinear

    torch.manual_seed(seed)
    up, down = nn.Linear(12, 20), nn.Linear(20, 12)
    start, rows = even_split(20, world)[rank]
    my_up = nn.Linear(12, rows)
    with torch.no_grad():
        my_up.weight.copy_(up.weight[start:start + rows])
        my_up.bias.copy_(up.bias[start:start + rows])
    my_down = RowParallelLinear.from_linear(down, sequence_parallel=False)
    sharded, reference = [my_up, my_down], [up, down]
    opts = [torch.optim.SGD([p for m in ms for p in m.parameters()], lr=0.1)
            for ms in (sharded, reference)]
    gen = torch.Generator().manual_seed(seed + 1)
    x, target = torch.randn(4, 3, 12, generator=gen), torch.randn(4, 3, 12, generator=gen)
    worst, losses = 0.0, []
    for _ in range(steps):
        step = []
        for (first, second), opt in zip((sharded, reference), opts):
            opt.zero_grad()
            loss = ((second(torch.relu(first(x))) - target) ** 2).mean()
            loss.backward()
            opt.step()
            step.append(loss.item())
        worst = max(worst, abs(step[0] - step[1]) / step[1])
        losses.append(step[0])
    param = max(float((my_down.weight - down.weight[:, start:start + rows]).abs().max()),
                float((my_up.weight - up.weight[start:start + rows]).abs().max()),
                float((my_down.bias - down.bias).abs().max()))
    return worst, param, losses[-1] < losses[0]


# -- reliability ------------------------------------------------------------------------------------
def bad_inputs(rank, world):
    """Every bad argument raises InvalidArgumentError on the rank that made it, before any
    communication (a rank that then waited on its peers would hang this test)."""
    from .reference import invalid_argument_report

    a, b = torch.randn(8, 6), torch.randn(6, 4)
    cases = {
        "K mismatch": lambda: ficco.matmul_all_reduce(a, torch.randn(5, 4)),
        "reduce_op": lambda: ficco.matmul_all_reduce(a, b, reduce_op="max"),
        "dtype": lambda: ficco.matmul_all_reduce(a, b.double()),
        "1-D a": lambda: ficco.matmul_all_reduce(torch.randn(6), b),
        "3-D b": lambda: ficco.matmul_all_reduce(a, torch.randn(1, 6, 4)),
        "empty b list": lambda: ficco.matmul_all_reduce(a, []),
        "schedule": lambda: ficco.matmul_all_reduce(a, b, schedule="rs-ag-uniform-fused-3d"),
        "bias shape": lambda: ficco.matmul_all_reduce(a, b, bias=torch.randn(5)),
        "fp8 without scales": lambda: ficco.matmul_all_reduce(a.to(E4M3), b.to(E4M3)),
        "a DTensor placed wrong": lambda: _dtensor_a(a, b, world),
        "world argument": lambda: torch.ops.ficco.matmul_all_reduce(
            a, [b], dist.group.WORLD.group_name, "sum", None, world=world + 1),
    }
    return invalid_argument_report(cases)


def _dtensor_a(a, b, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return ficco.matmul_all_reduce(distribute_tensor(a, mesh, [Replicate()]), b)


def disagree_on_cached_shapes(rank, world, seed, schedule):
    """Both shapes agreed and cached, then rank 0 calls with the other one (dma): every rank
    raises MismatchError at the plan's first barrier, the next call is refused (the group
    poisoned), and after ficco.shutdown() on every rank the calls in step are right."""
    from .rs_cases import stale_shape_mismatch

    b = torch.randn(6, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    rows = {"small": 3, "large": 7}

    def call(name):
        def a_of(r):
            return torch.randn(rows[name], 6, generator=torch.Generator().manual_seed(seed + r),
                               dtype=torch.float64)
        got = ficco.matmul_all_reduce(a_of(rank).float(), b.float(), schedule=schedule)
        ref = sum(a_of(r) @ b for r in range(world))
        return float((got.double() - ref).abs().max() / ref.abs().max())

    return stale_shape_mismatch(rank, call)


def selector_picks(rank, world, seed):
    """:func:`.rs_cases.explain_and_run` of the all-reduce, with its output's error."""
    from .rs_cases import explain_and_run

    a_s, b_s, _, _, _, refs = make_inputs(seed, world, (6, 4), 16, (10,), torch.float32)
    *picks, out = explain_and_run("matmul_all_reduce", a_s[rank], b_s[rank][0])
    return (*picks, max_row_rel_err(out, expected(refs, 0, "sum", world)))


def decode_example(rank, world, seed, schedule):
    """examples/tp_decode.py's check: one decode step of its block at several batch sizes,
    the down and out projections forced to ``schedule``: errors against the unsharded block."""
    import pathlib
    import sys

    examples = str(pathlib.Path(__file__).resolve().parents[1] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    from tp_decode import DecodeBlock, TPDecodeBlock, decode_step

    torch.manual_seed(seed)
    ref = DecodeBlock(32, 4, 48)
    tp = TPDecodeBlock(ref, rank, world)
    with config.scope(schedule=schedule):
        return [decode_step(ref, tp, batch, 5, rank, world)[0] for batch in (1, 3, 17)]
