"""``torch.ops.ficco.matmul_all_to_all`` and ``torch.ops.ficco.all_to_all_matmul``: the Ulysses
pair as torch custom ops, with fake kernels, autograd and autocast, and the public functions in
front of them (:mod:`ficco.ops.library` says why custom ops, and how sizes travel as arguments).

The output's lengths are not all known from shapes: along ``gather_dim`` it holds every rank's
length (``lengths``, the same list on every rank), along ``scatter_dim`` this rank's chunk
(``chunk``: depends on the rank). The public functions pass them where torch.compile traces a
call (every rank's length taken equal: a compiled call whose ranks' lengths differ raises
InvalidArgumentError on every rank, after the agreement, naming them); an eager call passes
none and its real kernel learns the lengths in the agreement.

Each op is the other's backward: the all-to-all's inverse is the all-to-all with the dims
swapped (when every rank's length along ``gather_dim`` is the chunk rule's, ``even_split`` of
their sum: longer first), so

- ``matmul_all_to_all``: ``da = all_to_all_matmul(dy, b^T, scatter_dim=gather_dim,
  gather_dim=scatter_dim)``; with ``db`` wanted too, the all-to-all'd ``dy`` (``z``) is made
  once and ``da = z @ b^T``, ``db = a^T z`` are local;
- ``all_to_all_matmul``: ``da = matmul_all_to_all(dy, b^T, scatter_dim=gather_dim,
  gather_dim=scatter_dim)``; ``db = x^T dy`` with ``x = all_to_all(a)`` made again.

A backward reads its lengths from the saved shapes (the chunk rule), never from the process;
gradients through lengths that do not follow the chunk rule raise (on every rank alike: the
lengths are agreed) instead of returning a wrong gradient.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ... import group as groups
from ...errors import InvalidArgumentError
from ...plan.problem import even_split
from ...runtime import path as runtime
from ...runtime.call import FORWARD
from .. import autograd, library
from ..front import eager_path, plain_front
from .all_to_all_matmul import SPEC as ALL_TO_ALL_MATMUL_SPEC
from .layout import ALL_TO_ALL_MATMUL, MATMUL_ALL_TO_ALL, numel, with_dim
from .matmul_all_to_all import SPEC as MATMUL_ALL_TO_ALL_SPEC
from .spec import check_arguments

SPECS = {s.name: s for s in (MATMUL_ALL_TO_ALL_SPEC, ALL_TO_ALL_MATMUL_SPEC)}
#: the roles of the calls a backward makes (the other op), which the ranks agree on
GRAD_OF = {MATMUL_ALL_TO_ALL: f"backward of {MATMUL_ALL_TO_ALL} (a)",
           ALL_TO_ALL_MATMUL: f"backward of {ALL_TO_ALL_MATMUL} (a)"}
_SCHEMA = ("(Tensor a, Tensor b, str group, int scatter_dim, int gather_dim, str? schedule, "
           "SymInt[]? lengths=None, SymInt? chunk=None, str role=\"" + FORWARD + "\", "
           "int? world=None) -> (Tensor, Tensor)")


# -- the real kernels: host work, run at call time -----------------------------------------------
def run_eager(op: str, a, b, group, scatter_dim, gather_dim, schedule=None, role=FORWARD,
              world=None):
    """``op`` on this rank's tensors, validated before any communication (a refused call
    still takes its place in the group's sequence of calls): ``(the output, its call)``."""
    call = library.prepared(SPECS[op], group, a, b, group, scatter_dim=scatter_dim,
                            gather_dim=gather_dim, role=role, world=world)
    return runtime.run(call, schedule), call


def _kernel(op, a, b, group, scatter_dim, gather_dim, schedule, lengths, chunk, role, world):
    pg = groups.by_name(group)
    out, call = run_eager(op, a, b, pg, scatter_dim, gather_dim, schedule, role, world)
    p = call.problem
    sizes = tuple(p.all_sizes)
    if lengths is not None and tuple(lengths) != sizes:
        raise InvalidArgumentError(
            f"torch.ops.ficco.{op} was traced for every rank's length along gather_dim "
            f"{list(lengths)}, but the ranks' are {list(sizes)}: under torch.compile every "
            f"rank's length along gather_dim must be the same (the compiled graph's output "
            f"shape is made from this rank's alone); call it eagerly for lengths that differ")
    if chunk is not None and chunk != p.chunk(p.rank)[1]:
        raise InvalidArgumentError(
            f"torch.ops.ficco.{op}: chunk={chunk}, but rank {p.rank} of {p.world} gets "
            f"{p.chunk(p.rank)[1]} of the {p.shape[p.scatter]} along scatter_dim (longer "
            f"chunks first); call ficco.{op}, which passes it")
    if out.untyped_storage().data_ptr() in (a.untyped_storage().data_ptr(),
                                            b.untyped_storage().data_ptr()):
        out = out.clone()       # custom ops return fresh tensors
    return out, torch.tensor(sizes, dtype=torch.int64)


@torch.library.custom_op("ficco::matmul_all_to_all", mutates_args=(), schema=_SCHEMA)
def matmul_all_to_all_op(a: Tensor, b: Tensor, group: str, scatter_dim: int, gather_dim: int,
                         schedule: str | None, lengths: list[int] | None = None,
                         chunk: int | None = None, role: str = FORWARD,
                         world: int | None = None) -> tuple[Tensor, Tensor]:
    """``(all_to_all(a @ b), every rank's length along gather_dim)``."""
    return _kernel(MATMUL_ALL_TO_ALL, a, b, group, scatter_dim, gather_dim, schedule, lengths,
                   chunk, role, world)


@torch.library.custom_op("ficco::all_to_all_matmul", mutates_args=(), schema=_SCHEMA)
def all_to_all_matmul_op(a: Tensor, b: Tensor, group: str, scatter_dim: int, gather_dim: int,
                         schedule: str | None, lengths: list[int] | None = None,
                         chunk: int | None = None, role: str = FORWARD,
                         world: int | None = None) -> tuple[Tensor, Tensor]:
    """``(all_to_all(a) @ b, every rank's length along gather_dim)``."""
    return _kernel(ALL_TO_ALL_MATMUL, a, b, group, scatter_dim, gather_dim, schedule, lengths,
                   chunk, role, world)


# -- the fake kernels: shapes only, and the eager path's argument errors -------------------------
def _fake(op, a, b, group, scatter_dim, gather_dim, lengths, chunk, world):
    scatter, gather, shape = check_arguments(op, a, b, scatter_dim, gather_dim)
    world = groups.world_arg(op, group, world)
    if world > 1 and (lengths is None or chunk is None):
        raise InvalidArgumentError(
            f"torch.ops.ficco.{op} on group {group!r} was traced without lengths (every "
            f"rank's length along gather_dim) and chunk (this rank's along scatter_dim): its "
            f"fake kernel reads sizes only from its arguments; call ficco.{op}, which passes "
            f"them")
    if world > 1:
        if len(lengths) != world:
            raise InvalidArgumentError(f"torch.ops.ficco.{op}: lengths needs {world} entries "
                                       f"(one per rank); got {list(lengths)}")
        shape = with_dim(with_dim(shape, scatter, chunk), gather, sum(lengths))
    if op == ALL_TO_ALL_MATMUL:
        shape = (*shape[:-1], b.shape[1])
    return a.new_empty(shape), torch.empty(world, dtype=torch.int64, device="cpu")


@matmul_all_to_all_op.register_fake
@library.errors_reach_the_caller
def _(a, b, group, scatter_dim, gather_dim, schedule, lengths=None, chunk=None, role=FORWARD,
      world=None):
    return _fake(MATMUL_ALL_TO_ALL, a, b, group, scatter_dim, gather_dim, lengths, chunk,
                 world)


@all_to_all_matmul_op.register_fake
@library.errors_reach_the_caller
def _(a, b, group, scatter_dim, gather_dim, schedule, lengths=None, chunk=None, role=FORWARD,
      world=None):
    return _fake(ALL_TO_ALL_MATMUL, a, b, group, scatter_dim, gather_dim, lengths, chunk,
                 world)


# -- autograd: each op is the other's backward --------------------------------------------------
def all_to_all(t: Tensor, group: str, world: int, scatter: int, gather: int, mine: int,
               sizes: list) -> Tensor:
    """The all-to-all alone (the gradients' helper), traceable: chunk j of ``t`` along
    ``scatter`` (``even_split``) to rank j; from rank q a piece ``mine`` long along ``scatter``
    and ``sizes[q]`` along ``gather``, concatenated along ``gather`` in rank order. One torch
    functional ``all_to_all_single`` whose split sizes come from shapes alone."""
    if world == 1:
        return t
    sends = [t.narrow(scatter, s, n).reshape(-1) for s, n in even_split(t.shape[scatter], world)]
    shapes = [with_dim(with_dim(tuple(t.shape), scatter, mine), gather, sizes[q])
              for q in range(world)]
    recv = [numel(s) for s in shapes]
    got = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_to_all_single(
        torch.cat(sends), recv, [x.numel() for x in sends], group))
    return torch.cat([x.view(s) for x, s in zip(got.split(recv), shapes)], dim=gather)


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _setup(op):
    def setup_context(ctx, inputs, output):
        a, b, group, scatter_dim, gather_dim, _schedule, *rest = inputs
        lengths, _chunk, _role, world = (rest + [None] * 4)[:4]
        scatter, gather, shape = check_arguments(op, a, b, scatter_dim, gather_dim)
        ctx.set_materialize_grads(False)
        ctx.group, ctx.dims, ctx.shape = group, (scatter, gather), shape
        ctx.world = groups.world_arg(op, group, world)
        # Traced with every rank's length (torch.compile): the forward checked them equal, so
        # they are the chunk rule's; else the backward checks the agreed lengths.
        ctx.checked = lengths is not None
        ctx.save_for_backward(a, b, output[1])
    return setup_context


def _check_chunk_rule(ctx, op: str, sizes: Tensor) -> None:
    if ctx.checked or ctx.world == 1:
        return
    got = tuple(sizes.tolist())
    rule = tuple(length for _, length in even_split(sum(got), len(got)))
    if got != rule:
        raise InvalidArgumentError(
            f"{op}'s gradient needs every rank's length along gather_dim to be the chunk rule's "
            f"(even_split of {sum(got)}: {list(rule)}); got {list(got)}")


def _rule(total, world: int) -> list:
    return [length for _, length in even_split(total, world)]


def _matmul_all_to_all_backward(ctx, dy, _grad_sizes):
    a, b, sizes = ctx.saved_tensors
    if dy is None:
        return None, None, None, None, None, None, None, None, None, None
    _check_chunk_rule(ctx, MATMUL_ALL_TO_ALL, sizes)
    s, g = ctx.dims
    shape, world = ctx.shape, ctx.world          # shape: the product a @ b's
    need_a, need_b = ctx.needs_input_grad[:2]
    da = db = None
    dy = dy.contiguous()
    if need_a and not need_b:       # the other op, overlapped
        da = torch.ops.ficco.all_to_all_matmul(
            dy, b.t().contiguous(), ctx.group, g, s, None, _rule(shape[s], world), shape[g],
            GRAD_OF[MATMUL_ALL_TO_ALL], world=world)[0]
    elif need_a or need_b:
        z = all_to_all(dy, ctx.group, world, g, s, shape[g], _rule(shape[s], world))
        if need_a:
            da = z @ b.t()
        db = _flat(a).t() @ _flat(z)
    return da, db, None, None, None, None, None, None, None, None


def _all_to_all_matmul_backward(ctx, dy, _grad_sizes):
    a, b, sizes = ctx.saved_tensors
    if dy is None:
        return None, None, None, None, None, None, None, None, None, None
    _check_chunk_rule(ctx, ALL_TO_ALL_MATMUL, sizes)
    s, g = ctx.dims
    shape, world = ctx.shape, ctx.world          # shape: a's
    last = len(shape) - 1
    need_a, need_b = ctx.needs_input_grad[:2]
    da = db = None
    dy = dy.contiguous()
    if need_a:                       # the other op, overlapped
        da = torch.ops.ficco.matmul_all_to_all(
            dy, b.t().contiguous(), ctx.group, g, s, None, _rule(shape[s], world), shape[g],
            GRAD_OF[ALL_TO_ALL_MATMUL], world=world)[0]
    if need_b:
        # x = all_to_all(a): this rank's chunk along s, every rank's length along g
        mine = b.shape[0] if s == last else dy.shape[s]
        total = b.shape[0] if g == last else dy.shape[g]
        x = all_to_all(a.contiguous(), ctx.group, world, s, g, mine, _rule(total, world))
        db = _flat(x).t() @ _flat(dy)
    return da, db, None, None, None, None, None, None, None, None


matmul_all_to_all_op.register_autograd(
    autograd.first_order_only(_matmul_all_to_all_backward),
    setup_context=_setup(MATMUL_ALL_TO_ALL))
all_to_all_matmul_op.register_autograd(
    autograd.first_order_only(_all_to_all_matmul_backward),
    setup_context=_setup(ALL_TO_ALL_MATMUL))
autograd.register_autocast(matmul_all_to_all_op, all_to_all_matmul_op)
_OPS = {MATMUL_ALL_TO_ALL: torch.ops.ficco.matmul_all_to_all,
        ALL_TO_ALL_MATMUL: torch.ops.ficco.all_to_all_matmul}


# -- the public functions' front end -------------------------------------------------------------
def front(op: str, a, b, group, scatter_dim, gather_dim, schedule=None):
    """``ficco.<op>`` (``matmul_all_to_all`` or ``all_to_all_matmul``): the eager path when no
    autograd, autocast, tracing or tensor subclass is involved, else the op."""
    f = plain_front(a, [b], group)
    if type(scatter_dim) is not int or type(gather_dim) is not int or eager_path(f, schedule):
        return run_eager(op, a, b, group, scatter_dim, gather_dim, schedule)[0]
    name, rank, world = groups.name_rank_world(group)
    lengths = chunk = None
    if world > 1 and torch.compiler.is_compiling():
        lengths, chunk = _traced_lengths(op, a, b, scatter_dim, gather_dim, rank, world)
    return _OPS[op](a, b, name, scatter_dim, gather_dim, schedule, lengths, chunk,
                    world=world)[0]


def _traced_lengths(op, a, b, scatter_dim, gather_dim, rank: int, world: int):
    """``(every rank's length along gather_dim, this rank's chunk along scatter_dim)`` of a
    call torch.compile traces, every rank's length taken as this rank's; ``(None, None)``
    where the dims are not dims of the tensor that travels (the fake kernel names it)."""
    nd = a.dim()
    if not (-nd <= scatter_dim < nd and -nd <= gather_dim < nd) or b.dim() != 2:
        return None, None
    s, g = scatter_dim % nd, gather_dim % nd
    shape = (*a.shape[:-1], b.shape[1]) if op == MATMUL_ALL_TO_ALL else tuple(a.shape)
    return [shape[g]] * world, library.scattered_rows(shape[s], rank, world)
