"""``torch.ops.ficco.all_gather_matmul``: the all-gather op as a torch custom op, with its fake
kernel, autograd and autocast, and the public function in front of it (:mod:`ficco.ops.library`
says why custom ops, and how sizes travel as arguments).

Backward of ``c_j = all_gather(a) @ b_j``: ``grad_a = matmul_reduce_scatter([grad_c_1 | ...],
[b_1^T; ...])`` (the reduce-scatter op, overlapped too) and ``grad_b_j = gathered^T @
grad_c_j``, which needs the gathered ``a``. Two ways, chosen by ``FICCO_BACKWARD_GATHER``
(:mod:`ficco.config`):

- ``save`` (default): the forward keeps its gathered ``a`` (``W*m x K`` per call, the same
  activation a plain non-sequence-parallel linear keeps); the backward moves no extra bytes.
- ``regather``: the forward keeps only the local shard (W times less activation memory); the
  backward gathers ``a`` again, launched before the input-gradient reduce-scatter and waited
  for only after it, so the two overlap (Megatron's choice for sequence parallelism).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ... import config
from ...group import by_name, name_rank_world, rank_world, world_arg
from ...plan.epilogue import activation_fn
from ...runtime import path as runtime
from ...runtime.call import FORWARD, check_flag
from .. import autograd, library
from ..front import eager_path, front_end
from .spec import SPEC, check_arguments, check_epilogue

OP = "all_gather_matmul"
#: the role of the call its backward makes (the reduce-scatter of grad_a): part of what the
#: ranks agree on, so a rank that skipped a backward never pairs its next forward with the
#: peers' backward (in an SP MLP they have the same shapes)
GRAD_OF_ALL_GATHER_MATMUL = "backward of all_gather_matmul (grad of a_shard)"


# -- the real kernel: host work, run at call time ------------------------------------------------
def _run_all_gather_matmul(a, b, group, gather_dim, schedule, return_gathered, role=FORWARD,
                           world=None, **epilogue):
    """The eager implementation: the real kernel of ``ficco::all_gather_matmul`` and the public
    function's path when the dispatcher adds nothing. Straight to the runtime (``api`` sits
    above this module). ``epilogue``: fp8 scales, out_dtype, bias, activation; ``role``:
    FORWARD, or the backward pass the call belongs to; ``world``: the op's argument, checked."""
    return runtime.run(library.prepared(SPEC, group, a, b, group, gather_dim,
                                return_gathered, role=role, world=world, **epilogue), schedule)




@torch.library.custom_op(
    "ficco::all_gather_matmul", mutates_args=(),
    schema="(Tensor a, Tensor[] bs, str group, int gather_dim, str? schedule, "
           f"bool return_gathered, {library.EPILOGUE_SCHEMA}, str? activation=None, "
           f"str role=\"{FORWARD}\", int? world=None) -> (Tensor, Tensor[])")
def all_gather_matmul_op(a: Tensor, bs: list[Tensor], group: str, gather_dim: int,
                         schedule: str | None, return_gathered: bool,
                         a_scale: Tensor | None = None, b_scales=None, biases=None,
                         out_dtype: torch.dtype | None = None,
                         activation: str | None = None, role: str = FORWARD,
                         world: int | None = None) -> tuple[Tensor, list[Tensor]]:
    """``(all_gather(a, gather_dim) or an empty tensor, [gathered @ b for b in bs])``, with
    fp8 scales, output dtype, bias per b and an activation (:mod:`ficco.plan.epilogue`); ``world``:
    the group's size."""
    pg = by_name(group)
    epilogue = {} if (a_scale is None and b_scales is None and biases is None
                      and out_dtype is None and activation is None) else \
        library.epilogue_kwargs(a_scale, b_scales, biases, out_dtype, activation)
    out = _run_all_gather_matmul(a, list(bs), pg, gather_dim, schedule, return_gathered, role,
                                 world, **epilogue)
    gathered, outs = out if return_gathered else (None, out)
    gather_dim %= a.dim()
    if world is None:   # a call written before the argument existed
        _, world = rank_world(pg)
    moved = library.moved_shape(a, gather_dim)
    rows = world * moved[0]
    layouts = [library.cached_layout(moved, gather_dim, rows, b.shape[1]) for b in bs]
    if not return_gathered:
        return a.new_empty(0), library.fresh_outputs(outs, layouts, [a, *bs])
    assert gathered is not None   # the runtime returned (gathered, outs)
    *outs, gathered = library.fresh_outputs([*outs, gathered],
                             [*layouts, library.cached_layout(moved, gather_dim, rows, a.shape[-1])], [a, *bs])
    return gathered, outs




# -- the fake kernel: shapes only, and the eager path's argument errors --------------------------
@all_gather_matmul_op.register_fake
@library.errors_reach_the_caller
def _(a, bs, group, gather_dim, schedule, return_gathered, a_scale=None, b_scales=None,
      biases=None, out_dtype=None, activation=None, role=FORWARD, world=None):
    gather_dim, bs, b_is_list = check_arguments(a, bs, gather_dim)   # eager's words
    check_epilogue(a, bs, b_is_list, gather_dim,
                              **library.epilogue_kwargs(a_scale, b_scales, biases, out_dtype, activation))
    world = world_arg(OP, group, world)
    moved = library.moved_shape(a, gather_dim)
    rows = world * moved[0]

    def new(cols, dtype):
        shape, stride = library.restored_layout(moved, gather_dim, rows, cols)
        return a.new_empty_strided(shape, stride, dtype=dtype)

    gathered = new(a.shape[-1], a.dtype) if return_gathered else a.new_empty(0)
    return gathered, [new(b.shape[1], out_dtype or a.dtype) for b in bs]




# -- autograd: the backward is the reduce-scatter op ---------------------------------------------
def _ag_setup_context(ctx, inputs, output):
    a, bs, group, gather_dim, _schedule, return_gathered, *epilogue = inputs
    a_scale, b_scales, biases, _out_dtype, activation, _role, world = (epilogue + [None] * 7)[:7]
    if a_scale is not None or activation:   # (the common call skips the check's frame)
        autograd.refuse_fp8_gradients(a, bs, a_scale, activation, b_scales)
    gathered, _outs = output
    ctx.set_materialize_grads(False)   # an unused output (the gathered a) gets no zero gradient
    ctx.group, ctx.dim = group, gather_dim % a.dim()
    ctx.world = world if world is not None else autograd.world_of(group)
    ctx.a_needs = a.requires_grad
    ctx.b_needs = [b.requires_grad for b in bs]
    autograd.save_epilogue(ctx, a, b_scales, biases)
    # grad_b needs the gathered a: kept from the forward when it returned it, else the
    # backward gathers the saved shard again (FICCO_BACKWARD_GATHER=regather).
    keep_gathered = return_gathered and any(ctx.b_needs)
    keep_shard = any(ctx.b_needs) and not keep_gathered
    ctx.save_for_backward(gathered if keep_gathered else None, a if keep_shard else None,
                          *(bs if ctx.a_needs else ()))


def _ag_backward(ctx, grad_gathered, grad_outs):
    gathered, shard, *bs = ctx.saved_tensors
    grad_b_scales, grad_biases = autograd.bias_grads(ctx, grad_outs)
    # an out_dtype wider than the operands (float32 of bf16): the backward GEMMs run in theirs
    grad_outs = [g if g is None or g.dtype == ctx.dtype else g.to(ctx.dtype) for g in grad_outs]
    grad_a = None
    if ctx.a_needs:
        pairs = [(g, b) for g, b in zip(grad_outs, bs) if g is not None]
        if pairs:
            # sum_j grad_c_j @ b_j^T as one GEMM: [grad_c_1 | grad_c_2 ...] @ [b_1^T; b_2^T ...]
            grad_c = pairs[0][0] if len(pairs) == 1 else torch.cat([g for g, _ in pairs], -1)
            b_t = pairs[0][1].t() if len(pairs) == 1 else torch.cat([b.t() for _, b in pairs])
            grad_a = torch.ops.ficco.matmul_reduce_scatter(
                grad_c, [b_t], ctx.group, ctx.dim, "sum", None,
                role=GRAD_OF_ALL_GATHER_MATMUL, world=ctx.world,
                out_rows=grad_c.shape[ctx.dim] // ctx.world)[0]   # the shard's rows
    if shard is not None:
        # Issued after the checked reduce-scatter (a rank that skipped this backward makes
        # that raise first, so no unchecked collective is left in flight); on GPUs both are
        # queued on streams and still overlap.
        gathered = autograd.gather(shard, ctx.group, ctx.world, ctx.dim)
    if ctx.a_needs and grad_gathered is not None and grad_gathered.numel():
        # The caller used the gathered a itself: its gradient is reduce-scattered too.
        extra = autograd.reduce_scatter(grad_gathered, ctx.group, ctx.world, ctx.dim)
        grad_a = extra if grad_a is None else grad_a + extra
    grad_bs = []
    for g, needs in zip(grad_outs, ctx.b_needs):
        grad_bs.append(autograd.as_rows(gathered, ctx.dim).t() @ autograd.as_rows(g, ctx.dim)
                       if needs and g is not None else None)
    return (grad_a, grad_bs, None, None, None, None, None, grad_b_scales, grad_biases, None,
            None, None, None)




# -- the public function's front end -------------------------------------------------------------
def all_gather_matmul(a_shard, b, group=None, *, gather_dim=0, schedule=None,
                      return_gathered=False, a_scale=None, b_scale=None, out_dtype=None,
                      bias=None, activation=None):
    """``ficco.all_gather_matmul`` through the ``ficco::all_gather_matmul`` op (see that
    function for the arguments). DTensor operands placed as the op needs them (``a_shard``
    ``Shard(gather_dim)``; ``b`` ``Replicate()`` or ``Shard(1)``) are used through their local
    tensors on their 1-D mesh (:mod:`ficco.ops.dtensor`)."""
    if return_gathered is not False and return_gathered is not True:
        return_gathered = check_flag(return_gathered, "return_gathered")   # or raise
    f = front_end(OP, a_shard, b, group, gather_dim, a_scale, b_scale, bias, out_dtype)
    if eager_path(f, schedule, activation=activation):
        return _run_all_gather_matmul(f.a, f.b, f.group, gather_dim, schedule, return_gathered,
                                      a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype,
                                      bias=bias,
                                      **({} if activation is None else
                                         {"activation": activation}))
    a_shard, bs, tensors = f.a, f.bs, f.tensors
    name, _, world = name_rank_world(f.group)
    wants_grad = any([x.requires_grad for x in bs])  # noqa: C419 - see ficco.ops.front._PLAIN
    grads = torch.is_grad_enabled() and (wants_grad or a_shard.requires_grad or (
        len(tensors) > len(bs) and any([x.requires_grad for x in tensors])))  # noqa: C419
    if grads and a_scale is not None:   # before any communication
        autograd.refuse_fp8_gradients(a_shard, bs, a_scale, b_scale=b_scale)
    keep = return_gathered or (grads and wants_grad and _backward_gather() == "save")
    # The activation runs inside the op only without a gradient to carry: its backward needs
    # the pre-activation values, which the op does not keep (torch's keeps them, as unfused).
    inside = None if grads else activation
    gathered, outs = torch.ops.ficco.all_gather_matmul(a_shard, bs, name, f.dim, schedule, keep,
                                                       *f.extra, inside, world=world)
    if activation and not inside:
        outs = [activation_fn(activation)(o) for o in outs]
    out = outs if f.b_is_list else outs[0]
    return (gathered, out) if return_gathered else out



@torch.compiler.assume_constant_result
def _backward_gather() -> str:
    """FICCO_BACKWARD_GATHER, read when a graph is traced (a compiled graph keeps its value)."""
    return config.backward_gather()



all_gather_matmul_op.register_autograd(autograd.first_order_only(_ag_backward),
                                       setup_context=_ag_setup_context)
autograd.register_autocast(all_gather_matmul_op)
