"""``torch.ops.ficco.matmul_reduce_scatter``: the reduce-scatter op as a torch custom op, with
its fake kernel, autograd and autocast, and the public function in front of it
(:mod:`ficco.ops.library` says why custom ops, and how sizes travel as arguments: this op takes
``out_rows``, this rank's rows of the output).

Backward of ``d_j = reduce_scatter(a @ b_j)``: ``grad_a = sum_j all_gather_matmul(grad_d_j,
b_j^T)`` (the all-gather op, overlapped too), the gathered ``grad_d_j`` reused for ``grad_b_j
= a^T @ gathered``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...errors import InvalidArgumentError
from ...group import by_name, name_rank_world, rank_world, world_arg
from ...runtime import path as runtime
from ...runtime.call import FORWARD
from .. import autograd, library
from ..front import eager_path, front_end
from ..library import scattered_rows
from .spec import SPEC, check_arguments, check_epilogue

OP = "matmul_reduce_scatter"
#: the role of the call its backward makes (the all-gather of grad_d), as the all-gather's
GRAD_OF_MATMUL_REDUCE_SCATTER = "backward of matmul_reduce_scatter (grad of a)"


# -- the real kernel: host work, run at call time ------------------------------------------------
def _run_matmul_reduce_scatter(a, b, group, scatter_dim, reduce_op, schedule, role=FORWARD,
                               world=None, out_rows=None, **epilogue):
    def check_out_rows(call) -> None:
        rows = scattered_rows(a.shape[scatter_dim], call.rank, call.world)
        if out_rows != rows:
            raise InvalidArgumentError(
                f"torch.ops.ficco.matmul_reduce_scatter: out_rows={out_rows}, but rank "
                f"{call.rank} of {call.world} gets {rows} of the {a.shape[scatter_dim]} "
                f"rows along scatter_dim (longer blocks first); pass ficco.ops.library."
                f"scattered_rows(rows, rank, world) or call ficco.matmul_reduce_scatter")

    return runtime.run(library.prepared(SPEC, group, a, b, group, scatter_dim,
                                reduce_op, role=role, world=world,
                                then=None if out_rows is None else check_out_rows, **epilogue),
                       schedule)




@torch.library.custom_op(
    "ficco::matmul_reduce_scatter", mutates_args=(),
    schema="(Tensor a, Tensor[] bs, str group, int scatter_dim, str reduce_op, str? schedule, "
           f"{library.EPILOGUE_SCHEMA}, str role=\"{FORWARD}\", int? world=None, "
           "SymInt? out_rows=None) -> Tensor[]")
def matmul_reduce_scatter_op(a: Tensor, bs: list[Tensor], group: str, scatter_dim: int,
                             reduce_op: str, schedule: str | None,
                             a_scale: Tensor | None = None, b_scales=None, biases=None,
                             out_dtype: torch.dtype | None = None, role: str = FORWARD,
                             world: int | None = None, out_rows: int | None = None
                             ) -> list[Tensor]:
    """``[reduce_scatter(a @ b, scatter_dim, reduce_op) (+ bias) for b in bs]``; ``world``: the
    group's size, ``out_rows``: this rank's rows of the output along ``scatter_dim``."""
    pg = by_name(group)
    epilogue = {} if (a_scale is None and b_scales is None and biases is None
                      and out_dtype is None) else library.epilogue_kwargs(a_scale, b_scales, biases, out_dtype)
    outs = _run_matmul_reduce_scatter(a, list(bs), pg, scatter_dim, reduce_op, schedule, role,
                                      world, out_rows, **epilogue)
    scatter_dim %= a.dim()
    moved = library.moved_shape(a, scatter_dim)
    rows = out_rows if out_rows is not None else scattered_rows(moved[0], *rank_world(pg))
    return library.fresh_outputs(outs, [library.cached_layout(moved, scatter_dim, rows, b.shape[1]) for b in bs], [a, *bs])




# -- the fake kernel: shapes only, and the eager path's argument errors --------------------------
@matmul_reduce_scatter_op.register_fake
@library.errors_reach_the_caller
def _(a, bs, group, scatter_dim, reduce_op, schedule, a_scale=None, b_scales=None, biases=None,
      out_dtype=None, role=FORWARD, world=None, out_rows=None):
    scatter_dim, bs, b_is_list = check_arguments(a, bs, scatter_dim, reduce_op)
    check_epilogue(a, bs, b_is_list, scatter_dim,
                                  **library.epilogue_kwargs(a_scale, b_scales, biases, out_dtype))
    moved = library.moved_shape(a, scatter_dim)
    if world_arg(OP, group, world) == 1:
        rows = moved[0]       # a world of one keeps every row
    elif out_rows is None:
        raise InvalidArgumentError(
            f"torch.ops.ficco.matmul_reduce_scatter on group {group!r} was traced without "
            f"out_rows (this rank's rows of the output): its fake kernel reads sizes only from "
            f"its arguments; call ficco.matmul_reduce_scatter, which passes them, or pass "
            f"out_rows=ficco.ops.library.scattered_rows(rows, rank, world)")
    else:
        rows = out_rows
    return [a.new_empty_strided(*library.restored_layout(moved, scatter_dim, rows, b.shape[1]),
                                dtype=out_dtype or a.dtype) for b in bs]




# -- autograd: the backward is the all-gather op -------------------------------------------------
def _rs_setup_context(ctx, inputs, output):
    a, bs, group, scatter_dim, reduce_op, _schedule, *epilogue = inputs
    a_scale, b_scales, biases, _out_dtype, _role, world = (epilogue + [None] * 6)[:6]
    if a_scale is not None:   # (the common call skips the check's frame)
        autograd.refuse_fp8_gradients(a, bs, a_scale, b_scale=b_scales)
    ctx.set_materialize_grads(False)
    ctx.group, ctx.dim, ctx.reduce_op = group, scatter_dim % a.dim(), reduce_op
    ctx.a_needs = a.requires_grad
    ctx.b_needs = [b.requires_grad for b in bs]
    autograd.save_epilogue(ctx, a, b_scales, biases)
    if world is None:
        world = autograd.world_of(group)
    rows = a.shape[ctx.dim]
    if rows % world and (ctx.a_needs or any(ctx.b_needs)):
        raise InvalidArgumentError(
            f"the backward of matmul_reduce_scatter gathers the output gradient, which needs "
            f"equal shards: {rows} rows along scatter_dim={scatter_dim} do not split evenly "
            f"over {world} ranks; pad the rows to a multiple of {world} to train through it")
    ctx.world = world
    ctx.save_for_backward(a if any(ctx.b_needs) else None, *(bs if ctx.a_needs else ()))


def _rs_backward(ctx, grad_outs):
    a, *bs = ctx.saved_tensors
    grad_b_scales, grad_biases = autograd.bias_grads(ctx, grad_outs)
    grad_outs = [g if g is None or g.dtype == ctx.dtype else g.to(ctx.dtype) for g in grad_outs]
    grad_a, grad_bs = None, []
    for j, (g, b_needs) in enumerate(zip(grad_outs, ctx.b_needs)):
        if g is None:
            grad_bs.append(None)
            continue
        if ctx.reduce_op == "avg":
            g = g / ctx.world
        if ctx.a_needs:
            # grad_a = all_gather(grad_d) @ b^T, the gathered grad_d reused for grad_b.
            gathered, (part,) = torch.ops.ficco.all_gather_matmul(
                g, [bs[j].t()], ctx.group, ctx.dim, None, b_needs,
                role=GRAD_OF_MATMUL_REDUCE_SCATTER, world=ctx.world)
            grad_a = part if grad_a is None else grad_a + part
        elif b_needs:
            gathered = autograd.gather(g, ctx.group, ctx.world, ctx.dim)
        grad_bs.append(autograd.as_rows(a, ctx.dim).t() @ autograd.as_rows(gathered, ctx.dim) if b_needs else None)
    return (grad_a, grad_bs, None, None, None, None, None, grad_b_scales, grad_biases, None, None,
            None, None)




# -- the public function's front end -------------------------------------------------------------
def matmul_reduce_scatter(a, b, group=None, *, scatter_dim=0, reduce_op="sum", schedule=None,
                          a_scale=None, b_scale=None, out_dtype=None, bias=None,
                          activation=None):
    """``ficco.matmul_reduce_scatter`` through the ``ficco::matmul_reduce_scatter`` op."""
    if activation is not None:   # the eager path's validation refuses it, naming why
        return _run_matmul_reduce_scatter(a, b, group, scatter_dim, reduce_op, schedule,
                                          activation=activation)
    f = front_end(OP, a, b, group, scatter_dim, a_scale, b_scale, bias, out_dtype)
    if eager_path(f, schedule, reduce_op):
        return _run_matmul_reduce_scatter(f.a, f.b, f.group, scatter_dim, reduce_op, schedule,
                                          a_scale=a_scale, b_scale=b_scale,
                                          out_dtype=out_dtype, bias=bias)
    if a_scale is not None and torch.is_grad_enabled():   # before any communication
        autograd.refuse_fp8_gradients(f.a, f.bs, a_scale, b_scale=b_scale)
    a, dim = f.a, f.dim
    name, rank, world = name_rank_world(f.group)
    # (a dim out of range: no out_rows, and the op's validation names the problem)
    out_rows = scattered_rows(a.shape[dim], rank, world) if -a.dim() <= dim < a.dim() else None
    outs = torch.ops.ficco.matmul_reduce_scatter(a, f.bs, name, dim, reduce_op, schedule, *f.extra,
                                                 world=world, out_rows=out_rows)
    return outs if f.b_is_list else outs[0]




matmul_reduce_scatter_op.register_autograd(autograd.first_order_only(_rs_backward),
                                           setup_context=_rs_setup_context)
autograd.register_autocast(matmul_reduce_scatter_op)
