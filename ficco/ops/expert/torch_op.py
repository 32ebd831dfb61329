"""The expert-parallel ops as torch custom ops, with fake kernels, autograd and autocast:
``torch.ops.ficco.all_to_all_grouped_mm`` (dispatch) and ``torch.ops.ficco.grouped_mm_all_to_all``
(combine); and the public functions in front of them.

The backward of each is the other, overlapped too:

- ``y = dispatch(x, counts, w)``: ``grad_x = combine(grad_y, recv_counts, w^T)`` (back to x's
  rows) and ``grad_w[l] = received_l^T @ grad_y_l`` (the rows of expert l are consecutive in y's
  order; ``received`` is what dispatch moved, kept from the forward when ``w`` needs a gradient);
- ``z = combine(h, recv_counts, w2)``: ``grad_h = dispatch(grad_z, counts, w2^T)`` (to h's
  rows), whose moved rows give ``grad_w2[l] = h_l^T @ routed_l``.

Each forward returns its agreed routing (the W x E matrix) and each backward hands it to the
other op, so the backward exchanges no counts. Row counts are data, so the fake kernels give
the outputs a data-dependent number of rows.

A backward reads nothing of the process but its saved tensors (combine's forward returns this
rank's row of the routing for its backward's dispatch): torch.compile caches a compiled
forward and backward under a key made from the forward graph alone, which is the same on
every rank, so a rank number read while tracing a backward would be baked into a graph every
rank may load. For the same reason the fake kernels take the group's size as an argument
(``world``, which the public functions read where torch.compile traces them, so the graph
carries it), and the backwards take it from the routing's shape.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ... import group as groups
from ...runtime import path as runtime
from ...runtime.call import FORWARD
from .. import library
from ..autograd import first_order_only, register_autocast
from ..front import eager_path, plain_front
from .combine import SPEC as COMBINE_SPEC
from .dispatch import SPEC as DISPATCH_SPEC

# The roles of the calls a backward makes: part of what the ranks agree on (its signature, its
# digest in the counts exchange, the barriers' flag, the ccl check), so a rank that skipped a
# backward never pairs its next forward with its peers' backward.
GRAD_OF_DISPATCH = "backward of all_to_all_grouped_mm (grad of x)"
GRAD_OF_COMBINE = "backward of grouped_mm_all_to_all (grad of h)"


def _counts_tensor(counts) -> Tensor:
    if isinstance(counts, Tensor):
        return counts
    from .routing import as_int_list

    return torch.tensor(as_int_list(counts, "counts", (None,)), dtype=torch.int64)


# -- the ops ------------------------------------------------------------------------------------
@torch.library.custom_op("ficco::all_to_all_grouped_mm", mutates_args=())
def dispatch_op(x: Tensor, counts: Tensor, ws: list[Tensor], group: str,
                schedule: str | None, routing: Tensor | None, return_received: bool,
                role: str = FORWARD, world: int | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(y, recv_counts, received or an empty tensor, routing)``; ``role``: FORWARD, or the
    backward this call belongs to; ``world``: the group's size
    (:func:`ficco.group.name_rank_world`)."""
    pg = groups.by_name(group)
    call = library.prepared(DISPATCH_SPEC, pg, x, counts, ws, pg, routing=routing,
                            return_received=return_received, role=role, world=world)
    y, recv_counts, received, agreed = runtime.run(call, schedule)
    if received is None:
        received = x.new_empty(0, x.shape[1])
    elif received.data_ptr() == x.data_ptr():
        received = received.clone()     # custom ops return fresh tensors
    return y, recv_counts, received, agreed


@dispatch_op.register_fake
@library.errors_reach_the_caller
def _(x, counts, ws, group, schedule, routing, return_received, role=FORWARD, world=None):
    world = groups.world_arg("all_to_all_grouped_mm", group, world)
    rows = torch.library.get_ctx().new_dynamic_size()
    big_l = len(ws)
    return (x.new_empty(rows, ws[0].shape[1]),
            torch.empty(big_l, world, dtype=torch.int64, device="cpu"),
            x.new_empty(rows if return_received else 0, x.shape[1]),
            torch.empty(world, world * big_l, dtype=torch.int64, device="cpu"))


@torch.library.custom_op("ficco::grouped_mm_all_to_all", mutates_args=())
def combine_op(h: Tensor, recv_counts: Tensor, ws: list[Tensor], group: str,
               schedule: str | None, routing: Tensor | None,
               send_counts: Tensor | None, role: str = FORWARD, world: int | None = None
               ) -> tuple[Tensor, Tensor, Tensor]:
    """``(z, routing, this rank's row of the routing)``: the counts of z's rows, what the
    backward's dispatch takes; ``role`` as for dispatch."""
    pg = groups.by_name(group)
    call = library.prepared(COMBINE_SPEC, pg, h, recv_counts, ws, pg, routing=routing,
                            send_counts=send_counts, role=role, world=world)
    z, agreed = runtime.run(call, schedule)
    return z, agreed, agreed[call.rank].clone()


@combine_op.register_fake
@library.errors_reach_the_caller
def _(h, recv_counts, ws, group, schedule, routing, send_counts, role=FORWARD, world=None):
    world = groups.world_arg("grouped_mm_all_to_all", group, world)
    rows = torch.library.get_ctx().new_dynamic_size()
    return (h.new_empty(rows, ws[0].shape[1]),
            torch.empty(world, world * len(ws), dtype=torch.int64, device="cpu"),
            torch.empty(world * len(ws), dtype=torch.int64, device="cpu"))


# -- autograd -----------------------------------------------------------------------------------
def _expert_slices(recv_counts: Tensor) -> list[tuple[int, int]]:
    """(first row, rows) of every local expert in y's order, from ``recv_counts`` (L, W)."""
    out, at = [], 0
    for rows in recv_counts.sum(1).tolist():
        out.append((at, rows))
        at += rows
    return out


def _grad_weights(rows_in: Tensor, grad_out: Tensor, recv_counts: Tensor, needs) -> list:
    return [rows_in[a: a + n].t() @ grad_out[a: a + n] if need else None
            for (a, n), need in zip(_expert_slices(recv_counts), needs)]


def _dispatch_setup(ctx, inputs, output):
    x, _counts, ws, group, *_ = inputs
    _y, recv_counts, received, routing = output
    ctx.set_materialize_grads(False)
    ctx.group, ctx.x_needs = group, x.requires_grad
    ctx.w_needs = [w.requires_grad for w in ws]
    ctx.save_for_backward(recv_counts, routing, received if any(ctx.w_needs) else None,
                          *(ws if ctx.x_needs else ()))


def _dispatch_backward(ctx, grad_y, _grad_counts, _grad_received, _grad_routing):
    recv_counts, routing, received, *ws = ctx.saved_tensors
    if grad_y is None:
        return None, None, [None] * len(ctx.w_needs), None, None, None, None, None
    grad_x = None
    if ctx.x_needs:
        grad_x = torch.ops.ficco.grouped_mm_all_to_all(
            grad_y, recv_counts, [w.t() for w in ws], ctx.group, None, routing, None,
            GRAD_OF_DISPATCH, world=routing.shape[0])[0]
    grad_ws = _grad_weights(received, grad_y, recv_counts, ctx.w_needs) \
        if any(ctx.w_needs) else [None] * len(ctx.w_needs)
    return grad_x, None, grad_ws, None, None, None, None, None, None


def _combine_setup(ctx, inputs, output):
    h, recv_counts, ws, group, *_ = inputs
    _z, routing, counts = output
    ctx.set_materialize_grads(False)
    ctx.group, ctx.h_needs = group, h.requires_grad
    ctx.w_needs = [w.requires_grad for w in ws]
    ctx.save_for_backward(recv_counts, routing, counts, h if any(ctx.w_needs) else None,
                          *(ws if ctx.h_needs else ()))


def _combine_backward(ctx, grad_z, _grad_routing, _grad_counts):
    recv_counts, routing, counts, h, *ws = ctx.saved_tensors
    if grad_z is None:
        return None, None, [None] * len(ctx.w_needs), None, None, None, None, None
    # Without grad_h only the moved rows are needed: multiply them by one column of zeros.
    w_t = [w.t() for w in ws] if ctx.h_needs else \
        [grad_z.new_zeros(grad_z.shape[1], 1) for _ in ctx.w_needs]
    grad_h, _, routed, _ = torch.ops.ficco.all_to_all_grouped_mm(
        grad_z, counts, w_t, ctx.group, None, routing, any(ctx.w_needs), GRAD_OF_COMBINE,
        world=routing.shape[0])
    grad_ws = _grad_weights(h, routed, recv_counts, ctx.w_needs) \
        if any(ctx.w_needs) else [None] * len(ctx.w_needs)
    return grad_h if ctx.h_needs else None, None, grad_ws, None, None, None, None, None, None


dispatch_op.register_autograd(first_order_only(_dispatch_backward), setup_context=_dispatch_setup)
combine_op.register_autograd(first_order_only(_combine_backward), setup_context=_combine_setup)
register_autocast(dispatch_op, combine_op)


# -- the public functions' front end ---------------------------------------------------------------
def all_to_all_grouped_mm(x, counts, w, group=None, *, schedule=None):
    """``ficco.all_to_all_grouped_mm`` (see it for the arguments): the eager runtime when no
    autograd, autocast or tracing is involved, else the ``ficco::all_to_all_grouped_mm`` op."""
    ws = list(w.unbind(0)) if isinstance(w, Tensor) and w.dim() == 3 else w
    if eager_path(plain_front(x, ws, group), schedule):
        y, recv_counts, _, _ = runtime.run(
            library.prepared(DISPATCH_SPEC, group, x, counts, w, group), schedule)
        return y, recv_counts
    name, _, world = groups.name_rank_world(group)
    y, recv_counts, _, _ = torch.ops.ficco.all_to_all_grouped_mm(
        x, _counts_tensor(counts), list(ws), name, schedule, None,
        torch.is_grad_enabled() and any(t.requires_grad for t in ws), world=world)
    return y, recv_counts


def grouped_mm_all_to_all(h, recv_counts, w2, group=None, *, schedule=None, send_counts=None):
    """``ficco.grouped_mm_all_to_all`` through the ``ficco::grouped_mm_all_to_all`` op (or the
    eager runtime when nothing needs the dispatcher)."""
    ws = list(w2.unbind(0)) if isinstance(w2, Tensor) and w2.dim() == 3 else w2
    if eager_path(plain_front(h, ws, group), schedule):
        call = library.prepared(COMBINE_SPEC, group, h, recv_counts, w2, group,
                                send_counts=send_counts)
        return runtime.run(call, schedule)[0]
    send = None if send_counts is None else _counts_tensor(send_counts)
    name, _, world = groups.name_rank_world(group)
    return torch.ops.ficco.grouped_mm_all_to_all(
        h, recv_counts if isinstance(recv_counts, Tensor) else torch.tensor(recv_counts),
        list(ws), name, schedule, None, send, world=world)[0]
