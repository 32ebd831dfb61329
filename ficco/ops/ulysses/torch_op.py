"""The Ulysses pair's eager path and autograd.

Each op is the other's backward: the all-to-all's inverse is the all-to-all with the dims
swapped (when every rank's length along ``gather_dim`` is the chunk rule's, ``even_split`` of
their sum: longer first), so

- ``matmul_all_to_all``: ``da = all_to_all_matmul(dy, b^T, scatter_dim=gather_dim,
  gather_dim=scatter_dim)``; with ``db`` wanted too, the all-to-all'd ``dy`` (``z``) is made
  once and ``da = z @ b^T``, ``db = a^T z`` are local;
- ``all_to_all_matmul``: ``da = matmul_all_to_all(dy, b^T, scatter_dim=gather_dim,
  gather_dim=scatter_dim)``; ``db = x^T dy`` with ``x = all_to_all(a)`` made again.

Gradients through lengths that do not follow the chunk rule raise (on every rank alike: the
lengths are agreed) instead of returning a wrong gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ... import group as groups
from ...errors import InvalidArgumentError
from ...plan.problem import even_split
from ...runtime import path as runtime
from ...runtime.call import FORWARD
from .all_to_all_matmul import SPEC as ALL_TO_ALL_MATMUL_SPEC
from .layout import ALL_TO_ALL_MATMUL, MATMUL_ALL_TO_ALL, with_dim
from .matmul_all_to_all import SPEC as MATMUL_ALL_TO_ALL_SPEC

SPECS = {s.name: s for s in (MATMUL_ALL_TO_ALL_SPEC, ALL_TO_ALL_MATMUL_SPEC)}


def run_eager(op: str, a, b, group, scatter_dim, gather_dim, schedule=None, role=FORWARD):
    """``op`` on this rank's tensors, validated before any communication (a refused call
    still takes its place in the group's sequence of calls). With a gradient to make, through
    :class:`_MatmulAllToAll` / :class:`_AllToAllMatmul`."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        fn = _MatmulAllToAll if op == MATMUL_ALL_TO_ALL else _AllToAllMatmul
        return fn.apply(a, b, group, scatter_dim, gather_dim, schedule)
    return _run(op, a, b, group, scatter_dim, gather_dim, schedule, role)[0]


def _run(op, a, b, group, scatter_dim, gather_dim, schedule, role):
    """``(the op's output, its normalised (scatter, gather) dims, every rank's length along
    gather_dim)``."""
    group = groups.resolve(group)
    try:
        call = SPECS[op].prepare(a, b, group, scatter_dim=scatter_dim, gather_dim=gather_dim,
                                 role=role)
    except BaseException:
        runtime.abandoned(group)
        raise
    out = runtime.run(call, schedule=schedule)
    p = call.problem
    return out, (p.scatter, p.gather), p.all_sizes


def _check_chunk_rule(op: str, sizes: tuple) -> None:
    rule = tuple(length for _, length in even_split(sum(sizes), len(sizes)))
    if tuple(sizes) != rule:
        raise InvalidArgumentError(
            f"{op}'s gradient needs every rank's length along gather_dim to be the chunk rule's "
            f"(even_split of {sum(sizes)}: {list(rule)}); got {list(sizes)}")


def all_to_all(t: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    """The all-to-all alone (the gradients' helper): chunk j of ``t`` along ``scatter``
    (``even_split``) to rank j, what arrives concatenated along ``gather`` in rank order;
    every rank's length along ``gather`` is the chunk rule's of the sum of theirs, which the
    backward checked."""
    group = groups.resolve(group)
    rank, world = groups.rank_world(group)
    if world == 1:
        return t
    mine = torch.tensor([t.shape[gather]], dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    sizes = [int(x) for x in every]
    length = even_split(t.shape[scatter], world)[rank][1]
    sends = [t.narrow(scatter, s, n).contiguous().reshape(-1)
             for s, n in even_split(t.shape[scatter], world)]
    shapes = [with_dim(with_dim(tuple(t.shape), scatter, length), gather, sizes[q])
              for q in range(world)]
    recv_sizes = [_numel(s) for s in shapes]
    got = t.new_empty(sum(recv_sizes))
    dist.all_to_all_single(got, torch.cat(sends), recv_sizes, [x.numel() for x in sends],
                           group=group)
    pieces = list(got.split(recv_sizes))
    return torch.cat([x.view(s) for x, s in zip(pieces, shapes)], dim=gather)


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _MatmulAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group, scatter_dim, gather_dim, schedule):
        out, (s, g), sizes = _run(MATMUL_ALL_TO_ALL, a.detach(), b.detach(), group,
                                  scatter_dim, gather_dim, schedule, FORWARD)
        ctx.save_for_backward(a, b)
        ctx.dims, ctx.sizes, ctx.group, ctx.schedule = (s, g), sizes, group, schedule
        return out

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        s, g = ctx.dims
        _check_chunk_rule(MATMUL_ALL_TO_ALL, ctx.sizes)
        need_a, need_b = ctx.needs_input_grad[:2]
        da = db = None
        if need_a and not need_b:       # the other op, overlapped
            da = _run(ALL_TO_ALL_MATMUL, dy.contiguous(), b.t().contiguous(), ctx.group, g, s,
                      None, f"backward of {MATMUL_ALL_TO_ALL} (a)")[0]
        elif need_a or need_b:
            z = all_to_all(dy.contiguous(), ctx.group, g, s)        # d(a @ b)
            if need_a:
                da = z @ b.t()
            db = _flat(a).t() @ _flat(z)
        return da, db, None, None, None, None


class _AllToAllMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group, scatter_dim, gather_dim, schedule):
        out, (s, g), sizes = _run(ALL_TO_ALL_MATMUL, a.detach(), b.detach(), group,
                                  scatter_dim, gather_dim, schedule, FORWARD)
        ctx.save_for_backward(a, b)
        ctx.dims, ctx.sizes, ctx.group = (s, g), sizes, group
        return out

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        s, g = ctx.dims
        _check_chunk_rule(ALL_TO_ALL_MATMUL, ctx.sizes)
        need_a, need_b = ctx.needs_input_grad[:2]
        da = db = None
        if need_a:                       # the other op, overlapped
            da = _run(MATMUL_ALL_TO_ALL, dy.contiguous(), b.t().contiguous(), ctx.group, g, s,
                      None, f"backward of {ALL_TO_ALL_MATMUL} (a)")[0]
        if need_b:
            x = all_to_all(a.detach(), ctx.group, s, g)
            db = _flat(x).t() @ _flat(dy)
        return da, db, None, None, None, None
