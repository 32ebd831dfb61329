"""``torch.ops.ficco.matmul_all_reduce``: the all-reduce op as a torch custom op, with its fake
kernel, autograd and autocast, and the public function in front of it.

Built on :mod:`ficco.ops.library` as the other GEMM ops are (the same front end, epilogue
schema and error path through torch.compile; see that module for why custom ops, and why sizes
travel as arguments). The output's shape is ``a``'s with the last dim ``n``, on every rank, so the op
needs no per-rank size; it takes the group's size ``world`` as the others do, for its
backward (``avg`` divides the gradient by it).

The backward is local: the output is replicated (every rank holds the same sum and the same
gradient of it), so the all-reduce's gradient is the identity and ``grad_a = grad @ b^T``,
``grad_b = a^T @ grad`` on each rank's own shards (Megatron's row-parallel linear without
sequence parallelism).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...group import by_name, name_rank_world, world_arg
from ...runtime import path as runtime
from ...runtime.call import FORWARD
from .. import autograd
from ..front import eager_path, front_end
from ..library import (
    EPILOGUE_SCHEMA,
    cached_layout,
    epilogue_kwargs,
    errors_reach_the_caller,
    fresh_outputs,
    prepared,
)
from .spec import SPEC, check_arguments, check_epilogue

_OP = "matmul_all_reduce"


def _run_matmul_all_reduce(a, b, group, reduce_op, schedule, role=FORWARD, world=None,
                           **epilogue):
    """The eager implementation: the op's real kernel and the public function's path when the
    dispatcher adds nothing. A call refused here still takes its place in the group's sequence
    (:func:`ficco.ops.library.prepared`)."""
    return runtime.run(prepared(SPEC, group, a, b, group, reduce_op, role=role, world=world,
                                **epilogue), schedule)


@torch.library.custom_op(
    "ficco::matmul_all_reduce", mutates_args=(),
    schema="(Tensor a, Tensor[] bs, str group, str reduce_op, str? schedule, "
           f"{EPILOGUE_SCHEMA}, str role=\"{FORWARD}\", int? world=None) -> Tensor[]")
def matmul_all_reduce_op(a: Tensor, bs: list[Tensor], group: str, reduce_op: str,
                         schedule: str | None, a_scale: Tensor | None = None, b_scales=None,
                         biases=None, out_dtype: torch.dtype | None = None,
                         role: str = FORWARD, world: int | None = None) -> list[Tensor]:
    """``[all_reduce(a @ b, reduce_op) (+ bias) for b in bs]``; ``world``: the group's size."""
    epilogue = {} if (a_scale is None and b_scales is None and biases is None
                      and out_dtype is None) else epilogue_kwargs(a_scale, b_scales, biases, out_dtype)
    outs = _run_matmul_all_reduce(a, list(bs), by_name(group), reduce_op, schedule, role, world,
                                  **epilogue)
    shape = tuple(a.shape)
    return fresh_outputs(outs, [cached_layout(shape, 0, shape[0], b.shape[1]) for b in bs], [a, *bs])


@matmul_all_reduce_op.register_fake
@errors_reach_the_caller
def _(a, bs, group, reduce_op, schedule, a_scale=None, b_scales=None, biases=None,
      out_dtype=None, role=FORWARD, world=None):
    bs, b_is_list = check_arguments(a, bs, reduce_op)      # the eager path's words
    check_epilogue(a, bs, b_is_list, **epilogue_kwargs(a_scale, b_scales, biases, out_dtype))
    world_arg(_OP, group, world)
    return [a.new_empty((*a.shape[:-1], b.shape[1]), dtype=out_dtype or a.dtype) for b in bs]


def matmul_all_reduce(a, b, group=None, *, reduce_op="sum", schedule=None, a_scale=None,
                      b_scale=None, out_dtype=None, bias=None):
    """``ficco.matmul_all_reduce`` through the ``ficco::matmul_all_reduce`` op. DTensor
    operands are taken as for the reduce-scatter (``a`` ``Shard(-1)``, ``b`` ``Shard(0)``)."""
    f = front_end(_OP, a, b, group, 0, a_scale, b_scale, bias, out_dtype)
    if eager_path(f, schedule, reduce_op):
        return _run_matmul_all_reduce(f.a, f.b, f.group, reduce_op, schedule, a_scale=a_scale,
                                      b_scale=b_scale, out_dtype=out_dtype, bias=bias)
    if a_scale is not None and torch.is_grad_enabled():   # before any communication
        autograd.refuse_fp8_gradients(f.a, f.bs, a_scale, b_scale=b_scale)
    name, _, world = name_rank_world(f.group)
    outs = torch.ops.ficco.matmul_all_reduce(f.a, f.bs, name, reduce_op, schedule, *f.extra,
                                             world=world)
    return outs if f.b_is_list else outs[0]


# -- autograd: local GEMMs ------------------------------------------------------------------------
def _ar_setup_context(ctx, inputs, output):
    a, bs, group, reduce_op, _schedule, *epilogue = inputs
    a_scale, b_scales, biases, _out_dtype, _role, world = (epilogue + [None] * 6)[:6]
    if a_scale is not None:
        autograd.refuse_fp8_gradients(a, bs, a_scale, b_scale=b_scales)
    ctx.set_materialize_grads(False)
    ctx.reduce_op = reduce_op
    ctx.world = world if world is not None else autograd.world_of(group)
    ctx.a_needs = a.requires_grad
    ctx.b_needs = [b.requires_grad for b in bs]
    ctx.a_shape = tuple(a.shape)
    autograd.save_epilogue(ctx, a, b_scales, biases)
    ctx.save_for_backward(a if any(ctx.b_needs) else None, *(bs if ctx.a_needs else ()))


def _ar_backward(ctx, grad_outs):
    """``y_j = all_reduce(a @ b_j)`` is replicated, so its gradient is too and the
    all-reduce's gradient is the identity: local GEMMs only (``avg`` scales by 1/W)."""
    a, *bs = ctx.saved_tensors
    grad_b_scales, grad_biases = autograd.bias_grads(ctx, grad_outs)
    grad_a, grad_bs = None, []
    for j, (g, b_needs) in enumerate(zip(grad_outs, ctx.b_needs)):
        if g is None:
            grad_bs.append(None)
            continue
        g = autograd.as_rows(g if g.dtype == ctx.dtype else g.to(ctx.dtype), 0)
        if ctx.reduce_op == "avg":
            g = g / ctx.world
        if ctx.a_needs:
            part = (g @ bs[j].t()).reshape(ctx.a_shape)
            grad_a = part if grad_a is None else grad_a + part
        grad_bs.append(autograd.as_rows(a, 0).t() @ g if b_needs else None)
    return (grad_a, grad_bs, None, None, None, None, grad_b_scales, grad_biases, None, None,
            None)


matmul_all_reduce_op.register_autograd(autograd.first_order_only(_ar_backward),
                                       setup_context=_ar_setup_context)
autograd.register_autocast(matmul_all_reduce_op)
