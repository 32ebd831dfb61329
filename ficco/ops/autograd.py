"""What the autograd and autocast of ficco's custom ops share; each op's ``torch_op`` module
registers its own backward with them.

The backward of each GEMM op is another op, overlapped too (the all-reduce's is local):

- ``c_j = all_gather(a) @ b_j``: ``grad_a = matmul_reduce_scatter([grad_c_1 | ...], [b_1^T; ...])``
  and ``grad_b_j = gathered^T @ grad_c_j``, the gathered ``a`` saved from the forward or
  gathered again (``FICCO_BACKWARD_GATHER``);
- ``d_j = reduce_scatter(a @ b_j)``: ``grad_a = sum_j all_gather_matmul(grad_d_j, b_j^T)``, the
  gathered ``grad_d_j`` reused for ``grad_b_j = a^T @ gathered``;
- ``y_j = all_reduce(a @ b_j)`` (replicated): ``grad_a = sum_j grad_y_j @ b_j^T`` and
  ``grad_b_j = a^T @ grad_y_j``, local GEMMs (the all-reduce's gradient is the identity).

Gradients are first order only; autocast runs the GEMMs in the region's dtype.

A backward reads the group's size and the rows it gets from the op's arguments and saved
tensors, never from the process: torch.compile traces the backward from the forward's graph
and caches both on disk under that graph's key, which every rank and job of a machine shares
(:mod:`ficco.ops.library` says how the sizes get into the graph).

Epilogues (:mod:`ficco.plan.epilogue`): a bias gets its gradient (the output gradient summed over
the rows this rank holds; the reduce-scatter's bias sits in the sequence-parallel region, so
its per-rank gradients are summed by ``ficco.nn.replicated`` like a norm's). fp8 operands get
none: autograd hands a gradient to a tensor in the tensor's own dtype, so an fp8 A or B would
receive an unscaled fp8 gradient; :mod:`ficco.float8` quantizes inside a differentiable
function instead (fp8 forward, backward in the output dtype). An activation inside the op has
no gradient either (its backward needs the pre-activation values, which the op does not
keep): ``ficco.all_gather_matmul`` applies it outside the op when a gradient is needed.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..errors import FiccoError, InvalidArgumentError
from ..group import rank_world_of


# -- autograd: first order only -------------------------------------------------------------------
class _FirstOrderOnly(torch.autograd.Function):
    """Identity on a gradient computed by a ficco backward; differentiating it again raises.
    ``anchor`` (a tensor that requires grad) makes the result part of the graph."""

    @staticmethod
    def forward(ctx, t, anchor):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        raise FiccoError(
            "ficco's ops have first-order gradients only: differentiating a gradient of "
            "all_gather_matmul / matmul_reduce_scatter again (double backward) is not "
            "supported; compute the higher-order term without ficco")


def first_order_only(backward):
    """Run ``backward``; under create_graph=True its results get a node that refuses a second
    differentiation, instead of a silently wrong higher-order gradient."""

    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        if not torch.is_grad_enabled():
            return _as_passed(ctx, backward(ctx, *grads))
        flat = [g for x in grads for g in (x if isinstance(x, (list, tuple)) else [x])]
        anchors = [t for t in (*flat, *ctx.saved_tensors)
                   if isinstance(t, Tensor) and t.requires_grad]
        with torch.no_grad():
            result = _as_passed(ctx, backward(ctx, *grads))
        if not anchors:
            return result

        def mark(x):
            if isinstance(x, Tensor):
                return _FirstOrderOnly.apply(x, anchors[0])
            if isinstance(x, list):
                return [mark(v) for v in x]
            return x
        return tuple(mark(x) for x in result)
    return wrapped


def _as_passed(ctx, grads: tuple) -> tuple:
    """One gradient per argument the call passed: the dispatcher drops trailing arguments
    equal to their defaults (the epilogue's Nones, the forward role), and autograd wants
    exactly as many."""
    return grads[:len(ctx.needs_input_grad)]


def as_rows(t: Tensor, dim: int) -> Tensor:
    """``t`` as a matrix of rows, ``dim`` first (the row order both ops use)."""
    return t.movedim(dim, 0).flatten(0, -2)   # (reshape(-1, 0) is ambiguous)


def world_of(group: str) -> int:
    """The size of ``group`` for an op called without ``world``: an eager call written before
    the argument existed (the fake kernels refuse a traced one), so this reads the group at run
    time, as its real kernel just did."""
    return rank_world_of(group)[1]


# The two collectives of the backwards call torch's functional collective ops with the group's
# size as an argument (torch's functional collectives read it from the group: the backward,
# traced from the forward's graph and cached under that graph's key, reads nothing else).
def gather(t: Tensor, group: str, world: int, dim: int) -> Tensor:
    """all_gather(t, dim) over the ``world`` ranks of ``group``: traceable, and in eager mode it
    waits only where the result is first used, so work issued in between overlaps it."""
    if world == 1:
        return t
    from torch.distributed import _functional_collectives as funcol

    out = funcol._maybe_wrap_tensor(torch.ops._c10d_functional.all_gather_into_tensor(
        t.contiguous(), world, group))
    return out if dim == 0 else torch.cat(out.chunk(world), dim)


def reduce_scatter(t: Tensor, group: str, world: int, dim: int) -> Tensor:
    """reduce_scatter(t, dim) (sum) over the ``world`` ranks of ``group``; equal blocks."""
    if world == 1:
        return t
    from torch.distributed import _functional_collectives as funcol

    if dim:   # the blocks along dim, stacked along 0, where the collective cuts
        t = torch.cat(t.chunk(world, dim), 0)
    return funcol._maybe_wrap_tensor(torch.ops._c10d_functional.reduce_scatter_tensor(
        t.contiguous(), "sum", world, group))


def refuse_fp8_gradients(a, bs, a_scale, activation=None, b_scale=None) -> None:
    """The epilogues without a gradient (module docstring), refused with the fix: fp8
    operands or fp8 scales (``a_scale``, ``b_scale``: a tensor or a list) that require grad,
    an activation inside the op."""
    scales = [a_scale, *(b_scale if isinstance(b_scale, (list, tuple)) else [b_scale])]
    wanting = [name for name, t in zip(["a_scale"] + ["b_scale"] * (len(scales) - 1), scales)
               if isinstance(t, torch.Tensor) and t.requires_grad]
    if wanting:
        raise InvalidArgumentError(
            f"{' and '.join(sorted(set(wanting)))} require grad, but ficco gives fp8 scales no "
            f"gradient (it would be None, silently); detach them (ficco.float8 computes its "
            f"dynamic scales without one), or keep the operands unquantized")
    if a_scale is not None and (a.requires_grad or any(b.requires_grad for b in bs)):
        raise InvalidArgumentError(
            "fp8 operands that require grad: autograd would give them an unscaled fp8 "
            "gradient; quantize inside ficco.float8.all_gather_matmul / "
            "matmul_reduce_scatter (fp8 forward, backward in the output dtype), or detach "
            "them (a bias still gets its gradient)")
    if activation and (a.requires_grad or any(b.requires_grad for b in bs)):
        raise InvalidArgumentError(
            f"activation={activation!r} inside the op has no gradient; call "
            f"ficco.all_gather_matmul, which applies it outside the op when one is needed")


def bias_grads(ctx, grads):
    """(b_scales' gradients: none, each bias's gradient: its output's gradient summed over
    this rank's rows), shaped like the inputs (a list where a list was given)."""
    biases = None if ctx.bias_needs is None else [
        g.flatten(0, -2).sum(0) if needs and g is not None else None
        for g, needs in zip(grads, ctx.bias_needs)]
    return ctx.no_scale_grads, biases


def save_epilogue(ctx, a, b_scales, biases) -> None:
    ctx.bias_needs = None if biases is None else [
        b is not None and b.requires_grad for b in biases]
    ctx.no_scale_grads = None if b_scales is None else [None] * len(b_scales)
    ctx.dtype = a.dtype


# -- autocast: the GEMMs run in the autocast dtype, as torch.matmul would -------------------------
_impls = torch.library.Library("ficco", "IMPL")


def register_autocast(*ops) -> None:
    """Autocast on ``ops`` for the devices ficco runs on: the GEMMs in the region's dtype."""
    for op in ops:
        for device in ("cpu", "cuda"):
            register_autocast_with_dtype(op, device)


def register_autocast_with_dtype(op, device_type: str) -> None:
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    overload = op._opoverload

    def cast(value, dtype):
        if isinstance(value, Tensor):
            eligible = (value.is_floating_point() and value.device.type == device_type
                        and value.dtype is not torch.float64)
            return value.to(dtype) if eligible else value
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v, dtype) for v in value)
        return value

    def kernel(_keyset, *args):
        # Unlike torch.library.register_autocast (one fixed dtype), read the dtype the
        # caller's autocast region asks for.
        dtype = torch.get_autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return overload(*(cast(x, dtype) for x in args))

    _impls.impl(overload._name.split("::")[1], kernel, key, with_keyset=True)
