"""``reduce_scatter(a @ b, scatter_dim)``: the op spec.

Canonical form: ``a`` with ``scatter_dim`` moved first and leading dims flattened, ``M x K``
(every rank holds all M rows and its own K columns); each ``b_j`` is this rank's ``(K, n_j)``
shard of the weight. Rank r receives rows :meth:`Problem.block` ``(r)`` of
``sum over ranks of a_q @ b_j``: whole indices of ``scatter_dim``, split by the all-gather's
chunk rule (``even_split``, longer blocks first), so with W dividing that dimension
``all_gather_matmul`` undoes the layout exactly. The ``dma`` workspace holds the partial
products ``a @ b_j`` (every rank's addressable by its peers, who pull their blocks).

Only rows of the partial products travel, so K may differ across ranks (a row-parallel weight
whose input features do not divide by W: 64 over 3 ranks is 22/21/21; a rank with none adds a
zero partial); the ranks agree on everything else and decide on the widest K.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...backends import get_backend
from ...errors import InvalidArgumentError
from ...group import rank_world, resolve
from ...plan.buffers import Buffers
from ...plan.epilogue import Operands, finish, gemm_into, operands, wide_dtype
from ...plan.problem import REDUCE_OPS, REDUCE_SCATTER, Problem, dtype_name, even_split
from ...runtime.agreement import PER_RANK
from ...runtime.call import (
    Call,
    backend_for,
    check_fits,
    check_tensor,
    check_weights,
    key_of,
    known,
    remember,
    row_dim,
)
from ...symm_mem import aligned
from ..base import OpSpec, Placements, warm_call
from ..examples import Example, generator, randn
from .schedules import SCHEDULES

MATMUL_REDUCE_SCATTER = "matmul_reduce_scatter"


@dataclass(kw_only=True)     # (its tensors follow Call's defaulted fields and have none)
class MatmulReduceScatterCall(Call[Problem]):
    a: torch.Tensor                 # M x K, scatter_dim moved first, leading dims flattened
    bs: list
    b_is_list: bool = False
    moved_shape: tuple = ()         # a.movedim(scatter_dim, 0).shape
    scatter_dim: int = 0
    ns: tuple = ()                  # the caller's n_j (0 allowed: an empty result)
    ops: Operands                   # fp8 scales, out_dtype, bias
    #: the dtype partial products travel in: the output's, float32 for an fp8 output
    partial_dtype: torch.dtype = torch.float32


def check_arguments(a, b, scatter_dim, reduce_op) -> tuple[int, list, bool]:
    """The one check of the op's tensors, ``scatter_dim`` and ``reduce_op``, for the eager path
    (:meth:`prepare`) and the fake kernel (:mod:`ficco.ops.library`) alike: ``(scatter_dim in [0,
    a.dim() - 1), the weights as a list, whether b was a list)``.

    >>> import torch
    >>> check_arguments(torch.randn(4, 8), [torch.randn(8, 3)], -2, "sum")[0]
    0
    """
    check_tensor(a, "a", fp8=True)
    scatter_dim = row_dim(scatter_dim, a, "scatter_dim", "a", "scatters the rows of a @ b along")
    if reduce_op not in REDUCE_OPS:
        raise InvalidArgumentError(f"reduce_op={reduce_op!r} is not supported; use one of "
                                   f"{', '.join(REDUCE_OPS)}")
    bs, b_is_list = check_weights(b, a, "a", role=" (this rank's K rows of the weight)",
                                  k_may_be_zero=True)
    return scatter_dim, bs, b_is_list


def _rows_of(scatter_dim: int):
    """Tensors shaped like a's rows as canonical rows: scatter_dim first, leading dims
    flattened, as the op spec does with a."""
    return lambda t: t.movedim(scatter_dim, 0).flatten(0, -2)


def check_epilogue(a, bs, b_is_list, scatter_dim, **epilogue) -> Operands:
    """The one check of the fp8 scales, out_dtype and bias (:mod:`ficco.plan.epilogue`), for the eager
    path and the fake kernel alike; ``scatter_dim`` as :func:`check_arguments` returns it."""
    return operands(a, bs, rows_of=_rows_of(scatter_dim), a_name="a", b_is_list=b_is_list,
                    allow_activation=False, **epilogue)


class MatmulReduceScatter(OpSpec[MatmulReduceScatterCall]):
    name = MATMUL_REDUCE_SCATTER
    collective = REDUCE_SCATTER
    placements = Placements(a=(-1,), a_words="Shard(-1) (this rank's slice of K)", b=(0,),
                            b_words="Shard(0) (this rank's rows of K)")
    schedules = SCHEDULES

    def explained(self, a, b, group, *, gather_dim, scatter_dim, reduce_op, counts, epilogue):
        return self.prepare(a, b, group, scatter_dim, reduce_op, **epilogue)

    def prepare(self, a, b, group=None, scatter_dim=0, reduce_op="sum", *, a_scale=None,
                b_scale=None, out_dtype=None, bias=None,
                activation=None) -> MatmulReduceScatterCall:
        return self._prepare(a, b, group, scatter_dim, reduce_op, a_scale=a_scale,
                             b_scale=b_scale, out_dtype=out_dtype, bias=bias,
                             activation=activation)

    #: the Call this op makes (the all-reduce's spec makes its own)
    call_class: type[MatmulReduceScatterCall] = MatmulReduceScatterCall

    def unit(self, moved_shape) -> int:
        """Rows of ``a`` (``scatter_dim`` first, leading dims flattened) per index of the
        scattered dimension: blocks are whole units."""
        return math.prod(moved_shape[1:-1])

    def _prepare(self, a, b, group, scatter_dim, reduce_op, *, a_scale, b_scale, out_dtype,
                 bias, activation=None) -> MatmulReduceScatterCall:
        backend = key = None
        # (an activation is refused by check_epilogue: the output is a sum over ranks)
        if type(scatter_dim) is int and type(reduce_op) is str and activation is None:
            group, backend = resolve(group), get_backend()
            epilogue = () if (a_scale is None and b_scale is None and out_dtype is None
                              and bias is None) else (a_scale, b_scale, out_dtype, bias, None)
            key = key_of(self.name, a, b, group, backend, (scatter_dim, reduce_op), epilogue)
            # A warm call: checked and derived when the key was new (the key names the op, so
            # what is known for it is this op's call, or None).
            seen = known(key, group, backend)
            if isinstance(seen, self.call_class):
                return warm_call(seen, group, a, b, epilogue, seen.scatter_dim,
                                 _rows_of)
        scatter_dim, bs, b_is_list = check_arguments(a, b, scatter_dim, reduce_op)
        ops = check_epilogue(a, bs, b_is_list, scatter_dim, a_scale=a_scale, b_scale=b_scale,
                             out_dtype=out_dtype, bias=bias, activation=activation)
        k = a.shape[-1]
        backend = backend_for(a, "a", backend)
        group = resolve(group)   # (already, on a call that may become warm)
        rank, world = rank_world(group)
        moved = a.movedim(scatter_dim, 0)
        unit = self.unit(moved.shape)
        m = math.prod(moved.shape[:-1])
        ns = tuple([int(bj.shape[1]) for bj in bs])
        canon = moved.reshape(m, k)
        if k == 0:
            # This rank holds none of the weight's rows (fewer input features than ranks): its
            # partial products are zero, from one zero column, and it still scatters them.
            canon, bs = canon.new_zeros(m, 1), [bj.new_zeros(1, bj.shape[1]) for bj in bs]
        problem = Problem(m=m, k=max(k, 1),
                          ns=ns if min(ns) > 0 else tuple([max(n, 1) for n in ns]),
                          dtype=dtype_name(a.dtype),
                          world=world, rank=rank, op=self.name, unit=max(unit, 1),
                          reduce_op=reduce_op, **ops.problem_fields(a.dtype))
        check_fits(2 * m * sum(ns) * max(problem.partial_itemsize, problem.itemsize),
                   a.device, "matmul_reduce_scatter")   # partial products, what lands
        # Nothing to overlap without rows or columns: agreed, then the plain path.
        call = self.call_class(self, problem, group, backend, m == 0 or min(ns) == 0,
                               a=canon, bs=bs, b_is_list=b_is_list,
                               moved_shape=tuple(moved.shape), scatter_dim=scatter_dim,
                               ns=ns, ops=ops, partial_dtype=ops.out_dtype
                               if problem.partial_itemsize == ops.out_dtype.itemsize
                               else torch.float32)
        if key is not None and k > 0:   # (a warm call takes the caller's a and bs as they are)
            remember(key, call, a=None, bs=None, ops=ops.without_tensors())
        return call

    def signature(self, call: MatmulReduceScatterCall) -> dict:
        sig = {**super().signature(call), "scatter_dim": call.scatter_dim,
               "a_shape": call.moved_shape[:-1], "ns": call.ns, **call.ops.signature()}
        del sig["K"]          # this rank's K: only rows of the products travel (PER_RANK)
        return {**sig, PER_RANK: {"k": call.moved_shape[-1]}}

    def agreed_problem(self, call: MatmulReduceScatterCall, per_rank: tuple) -> Problem:
        return dataclasses.replace(call.problem, k=max(max(r["k"], 1) for r in per_rank))

    # -- running ------------------------------------------------------------------------------
    def plain(self, call: MatmulReduceScatterCall):
        """matmul, then one reduce-scatter of the whole product (FICCO_DISABLE, one rank);
        the bias is added once, to the reduced block."""
        p, ops = call.problem, call.ops
        outs = []
        for j, bj in enumerate(call.bs):
            sb = ops.b_scales[j] if ops.b_scales else None
            if p.world == 1:
                out = call.a.new_empty(p.m, bj.shape[1], dtype=ops.out_dtype)
                gemm_into(call.a, bj, out, False, ops.a_scale, sb, ops.biases[j])
                outs.append(out)
                continue
            full = call.a.new_empty(p.m, bj.shape[1], dtype=call.partial_dtype)
            gemm_into(call.a, bj, full, False, ops.a_scale, sb)
            out = self.plain_collective(call, full)
            if p.reduce_op == "avg":
                out.div_(p.world)
            bias = ops.biases[j]
            wide = out if bias is None else out.to(wide_dtype(ops.out_dtype))
            outs.append(finish(wide, ops.out_dtype, bias))
        return self._finish(call, outs)

    def plain_collective(self, call: MatmulReduceScatterCall, full):
        """The plain path's collective of one whole product ``full``: this rank's block of the
        sum (the all-reduce's spec: all of it)."""
        p = call.problem
        pieces = [full[r0: r0 + n].contiguous() for r0, n in map(p.block, range(p.world))]
        out = full.new_empty(p.block_rows, full.shape[1])
        dist.reduce_scatter(out, pieces, op=dist.ReduceOp.SUM, group=call.group)
        return out

    def offsets(self, call: MatmulReduceScatterCall) -> tuple[int, ...]:
        """Byte offset of each partial buffer in the workspace (aligned), then its size: once
        per call key."""
        offsets = call.reuse.offsets
        if offsets is None:
            p, out, at = call.problem, [], 0
            for n in p.ns:
                out.append(at)
                at += aligned(p.m * n * p.partial_itemsize)
            offsets = call.reuse.offsets = (*out, at)
        return offsets

    def workspace_bytes(self, call: MatmulReduceScatterCall) -> int:
        return self.offsets(call)[-1]

    def buffers(self, call: MatmulReduceScatterCall, transport: str, symm, *,
                wide: bool = False, plan=None) -> Buffers:
        p, ops = call.problem, call.ops
        dtype, dev = call.partial_dtype, call.a.device
        rows = p.block_rows
        # wide: partial sums land in a float32 output, rounded once by result()
        out_dtype = wide_dtype(ops.out_dtype) if wide else ops.out_dtype
        offsets = self.offsets(call)[:-1]
        outs, recvs, partials = [], [], []
        for n, off in zip(p.ns, offsets):   # one loop, no comprehension: the warm path
            outs.append(torch.empty(rows, n, dtype=out_dtype, device=dev))
            recvs.append(torch.empty(p.world * rows, n, dtype=dtype, device=dev))
            partials.append(torch.empty(p.m, n, dtype=dtype, device=dev) if symm is None
                            else symm.get_buffer(p.rank, (p.m, n), dtype, off))
        return Buffers(call.a, call.bs, outs, None, symm, call.group, partials=partials,
                       recvs=recvs, partial_offsets=tuple(offsets), a_scale=ops.a_scale,
                       b_scales=ops.b_scales, biases=ops.biases, wide=wide)

    def poison(self, buffers: Buffers) -> None:
        for t in (*buffers.outs, *buffers.recvs, *buffers.partials):
            t.fill_(float("nan"))

    def result(self, call: MatmulReduceScatterCall, buffers: Buffers, transport: str):
        ops = call.ops
        if buffers.wide:   # the float32 sums: the bias once, then the one rounding
            return self._finish(call, [finish(o, ops.out_dtype, bias)
                                       for o, bias in zip(buffers.outs, ops.biases)])
        dtype, outs = ops.out_dtype, buffers.outs
        for o in outs:
            if o.dtype != dtype:
                outs = [o.to(dtype) for o in outs]
                break
        return self._finish(call, outs)

    # -- the oracle ---------------------------------------------------------------------------
    fp8_examples = True

    def example(self, rank, world, shape, rounding, seed) -> Example:
        """Every rank's ``(W*m, k)`` slice of the activation and ``(k, n)`` shard of the
        weight; ``inputs``: every rank's (a, b) in float64."""
        m, k, n = shape
        gen = generator(seed)
        parts = [(randn(gen, world * m, k), randn(gen, k, n)) for _ in range(world)]
        cast = [(rounding.cast(a), rounding.weight(b)) for a, b in parts]
        (a_low, _, a_scale), (b_low, _, b_scale) = cast[rank]
        return Example(rank, world, (a_low, b_low), rounding.epilogue(a_scale, b_scale),
                       [(a[1], b[1]) for a, b in cast])

    def reference(self, example: Example):
        """Block ``rank`` (``even_split`` of the rows) of ``sum over ranks of a_r @ b_r``."""
        out, scale = _summed(example.inputs)
        start, rows = even_split(out.shape[0], example.world)[example.rank]
        return out[start:start + rows], scale[start:start + rows]

    def _finish(self, call: MatmulReduceScatterCall, outs):
        p = call.problem
        units = p.block_rows // p.unit
        if not p.m:
            # No rows at all, maybe from an empty inner dimension (unit 0): this rank's size
            # along scatter_dim is its block of that dimension, not a count of canonical rows.
            units = even_split(call.moved_shape[0], p.world)[p.rank][1]
        results = []
        for canon, n in zip(outs, call.ns):
            canon = canon[:, :n]   # b with no columns ran as one column: cut it back off
            shaped = canon.reshape(units, *call.moved_shape[1:-1], n)
            results.append(shaped.movedim(0, call.scatter_dim))
        return results if call.b_is_list else results[0]


def _summed(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of a_r @ b_r, sum of |a_r| @ |b_r|)`` over every rank's ``(a_r, b_r)``."""
    out = sum(a @ b for a, b in parts)
    scale = sum(a.abs() @ b.abs() for a, b in parts)
    assert isinstance(out, torch.Tensor) and isinstance(scale, torch.Tensor)
    return out, scale


SPEC = MatmulReduceScatter()
