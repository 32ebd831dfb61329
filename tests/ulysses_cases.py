"""Rank-side functions for the Ulysses tests (importable by spawned ranks).

Every rank builds the same global case from one seed (every rank's tensors and the weight),
runs its own part, and checks it against a float64 reference of that global case: the ops'
own oracle's all-to-all (chunk j along scatter_dim to rank j, concatenated along gather_dim in
rank order, longer chunks first: ``ficco.ops.ulysses.spec.all_to_all``) and a float64 GEMM.
"""
from __future__ import annotations

import torch

import ficco
from ficco import config
from ficco.ops.ulysses.spec import all_to_all as reference_all_to_all
from ficco.plan.problem import even_split
from ficco.runtime import path as runtime

from .reference import ROW_TOL, invalid_argument_report, max_row_rel_err

OPS = ("matmul_all_to_all", "all_to_all_matmul")


#: (op, per-rank shape of the tensor that travels as a function of (rank, world), scatter,
#: gather, k, n): the product's for matmul_all_to_all, a's for all_to_all_matmul. Lengths along
#: the gathered dim differ per rank (uneven sequence shards), chunks along the scattered dim
#: do not always divide (uneven heads).
def shapes(world: int, chunk_rule: bool = False) -> list[tuple]:
    # uneven sequence shards: any lengths, or the chunk rule's (longer first: the gradients')
    seq = [length for _, length in even_split(3 * world + 1, world)] if chunk_rule else \
        [2 + (q * 3) % 4 for q in range(world)]
    return [
        # QKV: (S_q, 3*H*D) product, columns (heads) scattered, sequence gathered
        ("matmul_all_to_all", lambda q: (seq[q], 7), -1, 0, 6, 7),
        # batch-major (B, S_q, n): scatter the batch, gather the sequence
        ("matmul_all_to_all", lambda q: (world + 1, seq[q], 5), 0, 1, 4, 5),
        # out-projection input (S, H_q*D): sequence scattered, heads gathered along K
        ("all_to_all_matmul", lambda q: (2 * world + 1, seq[q]), 0, -1, None, 3),
        # (B, S, H_q, D): sequence scattered, heads gathered on a row dim
        ("all_to_all_matmul", lambda q: (2, world + 2, seq[q], 4), 1, 2, 4, 6),
    ]


def rounded(t: torch.Tensor, dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype``, kept in float64."""
    return t.to(dtype).to(torch.float64)


def make_case(seed: int, world: int, op, shape_of, scatter, gather, k, n, dtype=torch.float64):
    """Every rank's ``a`` and the shared ``b`` (float64, rounded to ``dtype``: the reference
    is exact for the operands the op sees), and every rank's reference output."""
    gen = torch.Generator().manual_seed(seed)
    nd = len(shape_of(0))
    s, g = scatter % nd, gather % nd
    if op == "matmul_all_to_all":
        # the product's last dim is b's n; a gathered last dim means per-rank n (unused here)
        b = rounded(torch.randn(k, n, generator=gen, dtype=torch.float64) / k ** 0.5, dtype)
        a_s = [rounded(torch.randn(*shape_of(q)[:-1], k, generator=gen, dtype=torch.float64),
                       dtype) for q in range(world)]
        refs = [reference_all_to_all([x @ b for x in a_s], s, g, r) for r in range(world)]
        return a_s, b, refs
    a_s = [rounded(torch.randn(*shape_of(q), generator=gen, dtype=torch.float64), dtype)
           for q in range(world)]
    gathered = [reference_all_to_all(a_s, s, g, r) for r in range(world)]
    kk = gathered[0].shape[-1]
    b = rounded(torch.randn(kk, n, generator=gen, dtype=torch.float64) / kk ** 0.5, dtype)
    return a_s, b, [x @ b for x in gathered]


def ulysses_matrix(rank, world, transport, seed, dtypes=(torch.float64, torch.bfloat16),
                   schedules=None):
    """Every shape of :func:`shapes` x schedule x dtype over ``transport``; returns failures
    (empty: every output right against float64 and the forced schedule ran)."""
    failures = []
    with config.scope(transport=transport):
        for i, (op, shape_of, scatter, gather, k, n) in enumerate(shapes(world)):
            fn = getattr(ficco, op)
            names = schedules or ficco.schedules.names(op=op)
            for which, schedule in enumerate(names):
                # float64 for every schedule, the others on alternate ones (a sampled grid)
                for dtype in dtypes[:1] + dtypes[1:] * ((which + i) % 2 == 0 or len(names) == 1):
                    a_s, b, refs = make_case(seed + i, world, op, shape_of, scatter, gather, k,
                                             n, dtype)
                    out = fn(a_s[rank].to(dtype), b.to(dtype), scatter_dim=scatter,
                             gather_dim=gather, schedule=schedule)
                    err = max_row_rel_err(out, refs[rank])
                    tol = 1e-9 if dtype == torch.float64 else ROW_TOL[dtype]
                    label = f"{op} {schedule} {dtype} shape {shape_of(rank)} s={scatter} g={gather}"
                    if out.dtype != dtype or not err <= tol:
                        failures.append(f"{label}: err {err:.3g} dtype {out.dtype}")
                    if world > 1 and runtime.last_run() != (schedule, transport):
                        failures.append(f"{label}: ran {runtime.last_run()}")
    return failures


def bad_inputs(rank, world):
    """Bad arguments raise InvalidArgumentError on the rank that made them, before any
    communication (each case alone: no peer waits for it)."""
    a, b = torch.randn(4, 6, 8), torch.randn(8, 5)
    m2a, a2m = ficco.matmul_all_to_all, ficco.all_to_all_matmul
    return invalid_argument_report({
        "same dims": lambda: m2a(a, b, scatter_dim=1, gather_dim=-2),
        "dim out of range": lambda: a2m(a, b, scatter_dim=3, gather_dim=0),
        "bool dim": lambda: a2m(a, b, scatter_dim=True, gather_dim=0),
        "K mismatch": lambda: m2a(a, torch.randn(7, 5), scatter_dim=0, gather_dim=1),
        "a2m K mismatch": lambda: a2m(a, torch.randn(7, 5), scatter_dim=0, gather_dim=1),
        "b not 2-D": lambda: m2a(a, torch.randn(8), scatter_dim=0, gather_dim=1),
        "dtype mismatch": lambda: m2a(a, b.double(), scatter_dim=0, gather_dim=1),
        "int dtype": lambda: m2a(a.long(), b.long(), scatter_dim=0, gather_dim=1),
        "unknown schedule": lambda: m2a(a, b, scatter_dim=0, gather_dim=1, schedule="ring"),
        "scattered K": lambda: a2m(a, torch.randn(8, 5), scatter_dim=-1, gather_dim=0),
    })


def after_bad_inputs(rank, world, seed):
    """After every rank's refused calls, a good call still pairs and is right."""
    report = bad_inputs(rank, world)
    failures = [f"{k}: {v}" for k, v in report.items() if v != "ok"]
    failures += ulysses_matrix(rank, world, "ccl", seed, dtypes=(torch.float64,),
                               schedules=["pieces"])
    return failures



def reference_gradients(op, a_s, b, shape_of, scatter, gather, world, seed):
    """Autograd through the float64 reference: every rank's ``a`` and a per-rank copy of
    ``b`` (each rank's gradient is its copy's), with ``sum over ranks of (out_r * w_r)``
    backpropagated for fresh random ``w_r``; returns ``(outs, a_ref, b_ref, ws)``."""
    nd = len(shape_of(0))
    s, g = scatter % nd, gather % nd
    a_ref = [x.clone().requires_grad_() for x in a_s]
    b_ref = [b.clone().requires_grad_() for _ in range(world)]
    if op == "matmul_all_to_all":
        outs = [reference_all_to_all([x @ y for x, y in zip(a_ref, b_ref)], s, g, r)
                for r in range(world)]
    else:
        outs = [reference_all_to_all(a_ref, s, g, r) @ b_ref[r] for r in range(world)]
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
    sum((o * w).sum() for o, w in zip(outs, ws)).backward()
    return outs, a_ref, b_ref, ws

def gradient_parity(rank, world, seed):
    """Every shape of :func:`shapes`, every schedule, in float64: the gradients of
    ``sum over ranks of (out_r * w_r)`` by ficco's backward (each op's the other's) against
    autograd through the float64 reference, ``b`` a per-rank copy (each rank's gradient is
    its copy's); once with only ``a`` needing one (the other op's path alone)."""
    failures = []
    for i, (op, shape_of, scatter, gather, k, n) in enumerate(shapes(world, chunk_rule=True)):
        a_s, b, _ = make_case(seed + i, world, op, shape_of, scatter, gather, k, n)
        fn = getattr(ficco, op)
        _, a_ref, b_ref, ws = reference_gradients(op, a_s, b, shape_of, scatter, gather,
                                                  world, seed + 100 + i)
        for schedule in ficco.schedules.names(op=op):
            for with_b in (True, False):
                a = a_s[rank].clone().requires_grad_()
                bb = b.clone().requires_grad_(with_b)
                out = fn(a, bb, scatter_dim=scatter, gather_dim=gather, schedule=schedule)
                (out * ws[rank]).sum().backward()
                label = f"{op} {schedule} b grad {with_b} shape {shape_of(rank)}"
                err = max_row_rel_err(a.grad, a_ref[rank].grad)
                if not err <= 1e-9:
                    failures.append(f"{label}: da err {err:.3g}")
                if with_b:
                    err = max_row_rel_err(bb.grad, b_ref[rank].grad)
                    if not err <= 1e-9:
                        failures.append(f"{label}: db err {err:.3g}")
    return failures


def gradient_off_the_chunk_rule(rank, world):
    """Lengths that are not the chunk rule's: the backward raises InvalidArgumentError on
    every rank (the lengths are agreed), after a forward that is right."""
    a = torch.randn(2 + rank, 4, dtype=torch.float64, requires_grad=True)   # 2, 3: not 3, 2
    out = ficco.matmul_all_to_all(a, torch.randn(4, 4, dtype=torch.float64), scatter_dim=-1,
                                  gather_dim=0)
    return invalid_argument_report({"backward": lambda: out.sum().backward()})


def attention_parity(rank, world, seed, heads, causal):
    """ficco.nn.UlyssesAttention on sequence shards (the chunk rule's, uneven) against the
    unsharded attention in float64: this rank's rows of the output, x's gradient, and the
    weights' gradients summed over the ranks."""
    import torch.distributed as dist

    from ficco.ops.ulysses.attention import reference_attention

    torch.manual_seed(seed)
    seq, hidden = 2 * world + 1, 8
    layer = ficco.nn.UlyssesAttention(hidden, heads, 4, causal=causal, dtype=torch.float64)
    x = torch.randn(2, seq, hidden, dtype=torch.float64)
    weights = (layer.w_qkv.detach().clone().requires_grad_(),
               layer.w_out.detach().clone().requires_grad_())
    x_ref = x.clone().requires_grad_()
    ref = reference_attention(x_ref, *weights, heads, causal)
    grad = torch.randn(ref.shape, dtype=torch.float64)
    (ref * grad).sum().backward()
    start, rows = even_split(seq, world)[rank]
    mine = x[:, start: start + rows].clone().requires_grad_()
    out = layer(mine)
    (out * grad[:, start: start + rows]).sum().backward()
    failures = []
    checks = {"out": (out, ref[:, start: start + rows]),
              "dx": (mine.grad, x_ref.grad[:, start: start + rows])}
    for name, param, want in (("dw_qkv", layer.w_qkv, weights[0]),
                              ("dw_out", layer.w_out, weights[1])):
        summed = param.grad.clone()
        dist.all_reduce(summed)
        checks[name] = (summed, want.grad)
    for name, (got, want) in checks.items():
        err = max_row_rel_err(got, want)
        if not err <= 1e-9:
            failures.append(f"{name} heads={heads} causal={causal}: err {err:.3g}")
    return failures


def compiled_parity(rank, world, seed):
    """Both ops under ``torch.compile(fullgraph=True)`` (AOT autograd: forward and backward
    traced through the fake kernels, one graph each, no break) on every rank's equal length
    along gather_dim: the output and the gradients of ``a`` and ``b`` against autograd
    through the float64 reference; then lengths that differ raise InvalidArgumentError on
    every rank."""
    from torch._dynamo import reset
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    graphs = []

    def record(gm, _inputs):
        graphs.append(gm)
        return gm

    failures = []
    seq = 2 * world - 1
    equal = [("matmul_all_to_all", lambda q: (seq, 7), -1, 0, 6, 7),
             ("matmul_all_to_all", lambda q: (world + 1, seq, 5), 0, 1, 4, 5),
             ("all_to_all_matmul", lambda q: (2 * world + 1, seq), 0, -1, None, 3),
             ("all_to_all_matmul", lambda q: (2, world + 2, seq, 4), 1, 2, 4, 6)]
    for i, (op, shape_of, scatter, gather, k, n) in enumerate(equal):
        a_s, b, _ = make_case(seed + i, world, op, shape_of, scatter, gather, k, n)
        outs, a_ref, b_ref, ws = reference_gradients(op, a_s, b, shape_of, scatter, gather,
                                                     world, seed + 100 + i)
        fn = getattr(ficco, op)

        def step(a, bb, fn=fn, scatter=scatter, gather=gather):
            return fn(a, bb, scatter_dim=scatter, gather_dim=gather)

        reset()
        counters.clear()
        graphs.clear()
        compiled = torch.compile(step, fullgraph=True,
                                 backend=aot_autograd(fw_compiler=record, bw_compiler=record))
        a = a_s[rank].clone().requires_grad_()
        bb = b.clone().requires_grad_()
        out = compiled(a, bb)
        (out * ws[rank]).sum().backward()
        label = f"{op} shape {shape_of(rank)} scatter {scatter} gather {gather}"
        for name, got, want in (("out", out, outs[rank]), ("da", a.grad, a_ref[rank].grad),
                                ("db", bb.grad, b_ref[rank].grad)):
            err = max_row_rel_err(got, want)
            if not err <= 1e-9:
                failures.append(f"{label}: {name} err {err:.3g}")
        calls = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
        if getattr(torch.ops.ficco, op).default not in calls:
            failures.append(f"{label}: the forward graph holds no ficco op: {calls}")
        if len(graphs) != 2 or sum(counters["graph_break"].values()):
            failures.append(f"{label}: {len(graphs)} graphs, breaks {dict(counters['graph_break'])}")
    # lengths that differ by rank: refused on every rank, after the agreement
    reset()
    a = torch.randn(2 + rank, 4, dtype=torch.float64)
    compiled = torch.compile(lambda x, w: ficco.matmul_all_to_all(x, w, scatter_dim=-1,
                                                                  gather_dim=0),
                             fullgraph=True, backend="eager")
    report = invalid_argument_report({"uneven": lambda: compiled(a, torch.randn(4, 4,
                                                                          dtype=torch.float64))})
    if report != {"uneven": "ok"}:
        failures.append(f"uneven lengths under compile: {report}")
    return failures


class _Attention(torch.nn.Module):
    """Self-attention as model code writes it: Q, K, V and output linears with biases, the
    heads inferred from the projection's width (``view(..., -1, head_dim)``), so the same
    module runs unsharded or with ficco.parallel's Ulysses styles on its linears."""

    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv = (torch.nn.Linear(hidden, heads * head_dim,
                                                     dtype=torch.float64) for _ in range(3))
        self.wo = torch.nn.Linear(heads * head_dim, hidden, dtype=torch.float64)

    def forward(self, x):
        def heads(t):
            return t.view(t.shape[0], t.shape[1], -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1))


def style_parity(rank, world, seed, heads):
    """ficco.parallel's Ulysses pair on an attention block's linears against the unsharded
    block in float64: this rank's rows of the output and of x's gradient, and every
    parameter's gradient (whole on every rank, as a replicated parameter's)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from ficco.parallel import UlyssesHeadsParallel, UlyssesSequenceParallel

    torch.manual_seed(seed)
    seq, hidden = 2 * world + 1, 8
    block = _Attention(hidden, heads, 4)
    sharded = parallelize_module(copy.deepcopy(block), init_device_mesh("cpu", (world,)),
                                 {"wq": UlyssesHeadsParallel(), "wk": UlyssesHeadsParallel(),
                                  "wv": UlyssesHeadsParallel(),
                                  "wo": UlyssesSequenceParallel()})
    x = torch.randn(2, seq, hidden, dtype=torch.float64)
    x_ref = x.clone().requires_grad_()
    ref = block(x_ref)
    grad = torch.randn(ref.shape, dtype=torch.float64)
    (ref * grad).sum().backward()
    start, rows = even_split(seq, world)[rank]
    mine = x[:, start: start + rows].clone().requires_grad_()
    out = sharded(mine)
    (out * grad[:, start: start + rows]).sum().backward()
    checks = {"out": (out, ref[:, start: start + rows]),
              "dx": (mine.grad, x_ref.grad[:, start: start + rows])}
    for (name, p), (_, p_ref) in zip(sharded.named_parameters(), block.named_parameters()):
        if not isinstance(p, DTensor):
            return [f"{name} is not a DTensor: {type(p).__name__}"]
        checks[name] = (p.grad.to_local(), p_ref.grad)
    failures = []
    for name, (got, want) in checks.items():
        # (absolute too: the key bias's gradient is zero, softmax does not see a shift of
        # every key by the same vector, so the reference holds rounding only)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-9, atol=1e-12):
            failures.append(f"{name} heads={heads}: {got} vs {want}")
    return failures


def lengths_change(rank, world, seed):
    """Calls whose shared fields are the same but whose ranks' lengths along gather_dim
    change from call to call (this rank's own length kept on some ranks): each call is
    exact against float64 (every rank's lengths are this call's, never a former call's)."""
    failures = []
    rounds = [[2 + (q + i) % 3 for q in range(world)] for i in range(4)]
    rounds.insert(2, rounds[0])        # a repeat of the first lengths: the warm call
    for i, seq in enumerate(rounds):
        for op, scatter, gather in (("matmul_all_to_all", -1, 0), ("all_to_all_matmul", 1, 0)):
            def shape_of(q, seq=seq):
                return (seq[q], 2 * world)     # the tensor that travels
            a_s, b, refs = make_case(seed + i, world, op, shape_of, scatter, gather, 3,
                                     2 * world if op == "matmul_all_to_all" else 5)
            for transport in ("dma", "ccl"):
                with config.scope(transport=transport):
                    out = getattr(ficco, op)(a_s[rank], b, scatter_dim=scatter,
                                             gather_dim=gather, schedule="pieces")
                err = max_row_rel_err(out, refs[rank])
                if not err <= 1e-9:
                    failures.append(f"round {i} {op} {transport} lengths {seq}: err {err:.3g}")
    return failures
