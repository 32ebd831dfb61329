"""Training with fp8 GEMMs through ficco's ops: fp8 forward, backward in the output dtype.

The contract (what torchao's float8 training does, with a higher-precision backward):

- **Forward.** The caller passes high-precision tensors (bf16/fp32: the activations and the
  weight it trains). They are quantized here to ``float8_e4m3fn`` (``dtype=``) with
  *dynamic* scales (``amax / fp8 max``): ``recipe="rowwise"`` (default) scales each row of A
  and each column of B, ``"tensorwise"`` one scale each. The fp8 GEMM pieces run through
  ``torch._scaled_mm`` inside ficco's overlapped op (so the all-gather moves fp8: half the
  bytes of bf16), and the output comes back in the input's dtype, the bias added once.
- **Backward.** Straight through the quantization: the gradients are those of the
  *dequantized* operands (``a8 * a_scale``, ``w8 * w_scale``), computed in the output dtype by
  the other overlapped op (``grad_a`` of the all-gather is a ``matmul_reduce_scatter``, and
  vice versa), ``grad_w`` from the saved fp8 operand (dequantized: torchao also saves the
  fp8 input). torchao runs its backward GEMMs in fp8 (e5m2 gradients) by default; here they
  run in the output dtype: more accurate, and the part fp8 speeds up is the forward.
- **Tensor-wise A of the all-gather** is quantized on one grid for all W shards, as the
  unsharded tensor would be: the ranks agree on the largest amax first (one small bounded
  exchange per call, a host synchronisation on GPUs; the op itself would also take each
  rank's own scale, which travels with its shard); row-wise needs none (each row's scale
  travels with it), which is why it is the default. A reduce-scatter's A is each rank's own K-slice: its scales are local either way.

``ficco.all_gather_matmul`` / ``matmul_reduce_scatter`` with fp8 tensors and scales are for
callers who quantize themselves (inference, or their own training recipe): autograd cannot
give an fp8 tensor a usable gradient (it would arrive as unscaled fp8), so those ops refuse
fp8 operands that require grad and point here.

>>> import torch, ficco.float8 as f8
>>> x = torch.randn(4, 32, requires_grad=True); w = torch.randn(32, 16, requires_grad=True)
>>> y = f8.all_gather_matmul(x, w)              # world size 1: one fp8 GEMM, output float32
>>> y.sum().backward(); x.grad.shape, w.grad.shape
(torch.Size([4, 32]), torch.Size([32, 16]))
"""
from __future__ import annotations

import torch

from .errors import InvalidArgumentError
from .group import name_of, rank_world, resolve
from .ops.all_gather_matmul import torch_op as all_gather_op
from .ops.matmul_reduce_scatter import torch_op as reduce_scatter_op
from .runtime import agreement

RECIPES = ("rowwise", "tensorwise")


def quantize(t: torch.Tensor, *, dtype=torch.float8_e4m3fn, rowwise: bool = True,
             dim: int = -1, amax: torch.Tensor | None = None):
    """``(t8, scale)`` with ``t ~= t8.float() * scale``: one float32 scale per slice along
    ``dim`` kept (``rowwise``: ``dim=-1`` gives A's rows ``(..., 1)``, ``dim=0`` B's columns
    ``(1, n)``), or one for the whole tensor (shape ``()``), from the absolute maximum
    (``amax``: a tensor-wise one given, e.g. agreed over the ranks).

    >>> t = torch.tensor([[1.0, -2.0], [4.0, 0.5]])
    >>> t8, s = quantize(t)
    >>> t8.dtype, tuple(s.shape), torch.allclose(t8.float() * s, t)
    (torch.float8_e4m3fn, (2, 1), True)
    """
    fmax = torch.finfo(dtype).max
    if rowwise:
        amax = t.detach().abs().amax(dim=dim, keepdim=True)
    elif amax is None:
        amax = t.detach().abs().amax()
    scale = amax.float().clamp_min(torch.finfo(torch.float32).tiny) / fmax
    t8 = (t.detach() / scale).clamp(-fmax, fmax).to(dtype)
    return t8, scale if rowwise else scale.reshape(())


def _check(recipe, dtype):
    if recipe not in RECIPES:
        raise InvalidArgumentError(f"recipe={recipe!r}; use one of {', '.join(RECIPES)}")
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                     torch.float8_e5m2fnuz):
        raise InvalidArgumentError(f"dtype={dtype} is not an fp8 dtype")


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.movedim(dim, 0).flatten(0, -2)


def _deq(t8: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    return (t8.float() * scale).to(dtype)


def all_gather_matmul(a_shard, w, group=None, *, gather_dim=0, bias=None, recipe="rowwise",
                      dtype=torch.float8_e4m3fn, schedule=None):
    """``all_gather(a_shard, gather_dim) @ w (+ bias)`` with both operands quantized to fp8
    (see the module docstring), differentiable in ``a_shard``, ``w`` and ``bias``; the output
    in ``a_shard``'s dtype.

    >>> import torch, ficco.float8 as f8
    >>> f8.all_gather_matmul(torch.randn(4, 32), torch.randn(32, 16)).dtype
    torch.float32
    """
    _check(recipe, dtype)
    return _AllGatherMatmul.apply(a_shard, w, bias, resolve(group), gather_dim % a_shard.dim(),
                                  recipe == "rowwise", dtype, schedule)


def matmul_reduce_scatter(a, w, group=None, *, scatter_dim=0, reduce_op="sum", bias=None,
                          recipe="rowwise", dtype=torch.float8_e4m3fn, schedule=None):
    """``reduce_scatter(a @ w, scatter_dim) (+ bias, once)`` with both operands quantized to
    fp8 (see the module docstring), differentiable in ``a``, ``w`` and ``bias``; the output in
    ``a``'s dtype.

    >>> import torch, ficco.float8 as f8
    >>> f8.matmul_reduce_scatter(torch.randn(4, 32), torch.randn(32, 16)).shape
    torch.Size([4, 16])
    """
    _check(recipe, dtype)
    return _MatmulReduceScatter.apply(a, w, bias, resolve(group), scatter_dim % a.dim(),
                                      reduce_op, recipe == "rowwise", dtype, schedule)


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_shard, w, bias, group, gather_dim, rowwise, dtype, schedule):
        amax = None
        if not rowwise:   # one scale for every shard: the ranks' largest amax
            rank, world = rank_world(group)
            local = float(a_shard.detach().abs().amax())
            amax = torch.tensor(agreement.max_over_ranks(group, rank, world, local,
                                                         what="fp8 tensor-wise amax")
                                if world > 1 else local, device=a_shard.device)
        a8, sa = quantize(a_shard, dtype=dtype, rowwise=rowwise, amax=amax)
        w8, sw = quantize(w, dtype=dtype, rowwise=rowwise, dim=0)
        gathered8, out = all_gather_op.all_gather_matmul(
            a8, w8, group, gather_dim=gather_dim, schedule=schedule, return_gathered=True,
            a_scale=sa, b_scale=sw, out_dtype=a_shard.dtype,
            bias=None if bias is None else bias.detach())
        ctx.save_for_backward(gathered8, sa, w8, sw)
        ctx.group, ctx.dim, ctx.dtype = group, gather_dim, a_shard.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        gathered8, sa, w8, sw = ctx.saved_tensors
        grad_a = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:   # the input's gradient, reduce-scattered overlapped
            grad_a = reduce_scatter_op.matmul_reduce_scatter(grad, _deq(w8, sw, ctx.dtype).t(),
                                                   ctx.group, scatter_dim=ctx.dim)
        if ctx.needs_input_grad[1]:
            if sa.dim():   # row-wise: every gathered row's scale, gathered like the rows
                sa = _gather(sa, ctx.group, ctx.dim)
            grad_w = _rows(_deq(gathered8, sa, ctx.dtype), ctx.dim).t() @ _rows(grad, ctx.dim)
        if ctx.needs_input_grad[2]:
            grad_bias = _rows(grad, ctx.dim).sum(0)
        return grad_a, grad_w, grad_bias, None, None, None, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, w, bias, group, scatter_dim, reduce_op, rowwise, dtype, schedule):
        a8, sa = quantize(a, dtype=dtype, rowwise=rowwise)   # this rank's K-slice: local
        w8, sw = quantize(w, dtype=dtype, rowwise=rowwise, dim=0)
        out = reduce_scatter_op.matmul_reduce_scatter(
            a8, w8, group, scatter_dim=scatter_dim, reduce_op=reduce_op, schedule=schedule,
            a_scale=sa, b_scale=sw, out_dtype=a.dtype,
            bias=None if bias is None else bias.detach())
        ctx.save_for_backward(a8, sa, w8, sw)
        ctx.group, ctx.dim, ctx.reduce_op, ctx.dtype = group, scatter_dim, reduce_op, a.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        a8, sa, w8, sw = ctx.saved_tensors
        _, world = rank_world(ctx.group)
        g = grad / world if ctx.reduce_op == "avg" else grad
        grad_a = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:   # the all-gather of the output gradient, overlapped
            gathered, grad_a = all_gather_op.all_gather_matmul(
                g, _deq(w8, sw, ctx.dtype).t(), ctx.group, gather_dim=ctx.dim,
                return_gathered=True)
        elif ctx.needs_input_grad[1]:
            gathered = _gather(g, ctx.group, ctx.dim)
        if ctx.needs_input_grad[1]:
            grad_w = _rows(_deq(a8, sa, ctx.dtype), ctx.dim).t() @ _rows(gathered, ctx.dim)
        if ctx.needs_input_grad[2]:
            grad_bias = _rows(grad, ctx.dim).sum(0)
        return grad_a, grad_w, grad_bias, None, None, None, None, None, None


def _gather(t, group, dim):
    """all_gather(t, dim) over ``group`` (functional collective; a world of one: t)."""
    _, world = rank_world(group)
    if world == 1:
        return t
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return funcol.wait_tensor(gather(t.contiguous(), dim, name_of(group)))
