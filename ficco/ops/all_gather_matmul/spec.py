"""``all_gather(a_shard, gather_dim) @ b``: the op spec.

Canonical form: rank r's shard with ``gather_dim`` moved first and leading dims flattened,
``m x K``; the gathered matrix ``M x K`` (M = W*m); each ``b_j`` is ``(K, n_j)``. The dma
workspace holds the gathered matrix (every rank's copy addressable by its peers), followed by
the float32 scale of each of its rows when fp8 operands are scaled row-wise (they travel with
their rows: :func:`ficco.plan.scale_companion`).

Only rows of A travel, so ``n_j`` may differ across ranks (a column-parallel weight whose
features do not divide by W, split longer pieces first: 64 over 3 ranks is 22/21/21, and a
rank may have none); the ranks agree on everything else and decide on the widest ``n_j``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...backends import get_backend
from ...backends.gpu.vendor import pitched
from ...group import rank_world, resolve
from ...plan.buffers import Buffers
from ...plan.epilogue import Operands, finish, gemm_into, operands, wide_dtype
from ...plan.problem import ALL_GATHER, Problem, dtype_name
from ...runtime.agreement import PER_RANK
from ...runtime.call import (
    Call,
    backend_for,
    check_fits,
    check_flag,
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
from .schedules import OPTIONAL, SCHEDULES


@dataclass(kw_only=True)     # (its tensors follow Call's defaulted fields and have none)
class AllGatherMatmulCall(Call[Problem]):
    a: torch.Tensor                         # m x K, this rank's shard with gather_dim first
    bs: list
    b_is_list: bool = False
    moved_shape: tuple = ()                 # a_shard.movedim(gather_dim, 0).shape
    ns: tuple = ()                          # the caller's n_j (0 allowed: an empty result)
    gather_dim: int = 0
    return_gathered: bool = False
    ops: Operands                           # fp8 scales, out_dtype, bias, activation


def check_arguments(a_shard, b, gather_dim) -> tuple[int, list, bool]:
    """The one check of the op's tensors and ``gather_dim``, for the eager path (:meth:`prepare`)
    and the fake kernel (:mod:`ficco.ops.library`) alike, so both say the same: ``(gather_dim in
    [0, a_shard.dim() - 1), the weights as a list, whether b was a list)``.

    >>> import torch
    >>> check_arguments(torch.randn(4, 8), torch.randn(8, 3), -2)[0]
    0
    """
    check_tensor(a_shard, "a_shard", fp8=True)
    gather_dim = row_dim(gather_dim, a_shard, "gather_dim", "a_shard", "gathers along")
    bs, b_is_list = check_weights(b, a_shard, "a_shard")
    return gather_dim, bs, b_is_list


def _rows_of(gather_dim: int):
    """Tensors shaped like a_shard's rows as canonical rows: gather_dim first, leading dims
    flattened, as the op spec does with a_shard."""
    return lambda t: t.movedim(gather_dim, 0).flatten(0, -2)


def check_epilogue(a_shard, bs, b_is_list, gather_dim, **epilogue) -> Operands:
    """The one check of the fp8 scales, out_dtype, bias and activation (:mod:`ficco.plan.epilogue`),
    for the eager path and the fake kernel alike; ``gather_dim`` as :func:`check_arguments`
    returns it."""
    return operands(a_shard, bs, rows_of=_rows_of(gather_dim), a_name="a_shard",
                    b_is_list=b_is_list, **epilogue)


class AllGatherMatmul(OpSpec[AllGatherMatmulCall]):
    name = "all_gather_matmul"
    collective = ALL_GATHER
    first_arg = "a_shard"
    placements = Placements(a=(None,), a_words="Shard({dim}), the gathered dimension", b=(1,),
                            b_words="Replicate() or Shard(1) (this rank's columns)",
                            b_replicate=True)
    schedules = SCHEDULES
    optional_schedules = OPTIONAL

    def explained(self, a, b, group, *, gather_dim, scatter_dim, reduce_op, counts, epilogue):
        return self.prepare(a, b, group, gather_dim, **epilogue)

    def prepare(self, a_shard, b, group=None, gather_dim=0, return_gathered=False, *,
                a_scale=None, b_scale=None, out_dtype=None, bias=None, activation=None
                ) -> AllGatherMatmulCall:
        backend = key = None
        if type(gather_dim) is int and (return_gathered is True or return_gathered is False):
            group, backend = resolve(group), get_backend()
            epilogue = () if (a_scale is None and b_scale is None and out_dtype is None
                              and bias is None and activation is None) else \
                (a_scale, b_scale, out_dtype, bias, activation)
            key = key_of(self.name, a_shard, b, group, backend, (gather_dim, return_gathered),
                         epilogue)
            # A warm call: checked and derived when the key was new (the key names the op, so
            # what is known for it is this op's call, or None).
            seen = known(key, group, backend)
            if isinstance(seen, AllGatherMatmulCall):
                return warm_call(seen, group, a_shard, b, epilogue, seen.gather_dim,
                                 _rows_of)
        gather_dim, bs, b_is_list = check_arguments(a_shard, b, gather_dim)
        ops = check_epilogue(a_shard, bs, b_is_list, gather_dim, a_scale=a_scale,
                             b_scale=b_scale, out_dtype=out_dtype, bias=bias,
                             activation=activation)
        k = a_shard.shape[-1]
        backend = backend_for(a_shard, "a_shard", backend)
        group = resolve(group)   # (already, on a call that may become warm)
        rank, world = rank_world(group)
        moved = a_shard.movedim(gather_dim, 0)
        m = moved.numel() // k
        ns = tuple([int(bj.shape[1]) for bj in bs])
        # torch accepts shards with no rows (an empty result); no plan has work then, and a
        # plan without a barrier cannot carry the dma call check: the plain path (after the
        # agreement and the call check) returns the empty result. A b with no columns (this
        # rank's share of fewer features than ranks) still takes part in the gather: its GEMM
        # runs on one zero column, cut off again by result().
        bs = [bj if bj.shape[1] else bj.new_zeros(k, 1) for bj in bs]
        if world > 1:
            # A tensor-wise scale is this rank's: each rank may quantize its shard with its own
            # (amax(shard) / fp8 max), so it travels with the shard's rows like row-wise ones.
            ops = ops.tensor_as_rows(m, ns)
        if min(ns) == 0:
            ops = ops.one_column(ns)
        problem = Problem(m=m, k=k, ns=ns if min(ns) > 0 else tuple([max(n, 1) for n in ns]),
                          dtype=dtype_name(a_shard.dtype), world=world, rank=rank,
                          **ops.problem_fields(a_shard.dtype))
        check_fits(problem.big_m * (k + sum(ns)) * problem.itemsize, a_shard.device,
                   "all_gather_matmul")
        call = AllGatherMatmulCall(self, problem, group, backend, m == 0,
                                   a=moved.reshape(m, k), bs=bs,
                                   b_is_list=b_is_list, moved_shape=tuple(moved.shape),
                                   gather_dim=gather_dim,
                                   return_gathered=check_flag(return_gathered, "return_gathered"),
                                   ns=ns, ops=ops)
        if key is not None and min(ns) > 0:   # (a warm call takes the caller's bs as they are)
            remember(key, call, a=None, bs=None, ops=ops.without_tensors())
        return call

    def signature(self, call: AllGatherMatmulCall) -> dict:
        sig = {**super().signature(call), "gather_dim": call.gather_dim,
               "shard_shape": call.moved_shape, **call.ops.signature()}
        del sig["ns"]         # this rank's output widths: only rows travel (PER_RANK)
        return {**sig, "outputs": len(call.ns), PER_RANK: {"ns": list(call.ns)}}

    def agreed_problem(self, call: AllGatherMatmulCall, per_rank: tuple) -> Problem:
        widest = [max(max(n, 1) for n in ns) for ns in zip(*(r["ns"] for r in per_rank))]
        return dataclasses.replace(call.problem, ns=tuple(widest))

    # -- running ------------------------------------------------------------------------------
    def plain(self, call: AllGatherMatmulCall):
        p, ops = call.problem, call.ops
        gathered = torch.empty(p.big_m, p.k, dtype=call.a.dtype, device=call.a.device)
        a_scale = ops.a_scale
        if p.world > 1:
            all_gather_flat(gathered, call.a.contiguous(), call.group)
            if p.scaling == "row":   # the rows' scales, gathered alike
                assert ops.a_scale is not None   # scaled operands always carry one (operands())
                a_scale = ops.a_scale.new_empty(p.big_m, 1)
                all_gather_flat(a_scale, ops.a_scale, call.group)
        else:
            gathered.copy_(call.a)
        outs = []
        for j, bj in enumerate(call.bs):
            out = torch.empty(p.big_m, bj.shape[1], dtype=ops.out_dtype, device=call.a.device)
            gemm_into(gathered, bj, out, False, a_scale, ops.b_scales[j] if ops.b_scales
                      else None, ops.biases[j], ops.activation)
            outs.append(out)
        return self._finish(call, outs, gathered, owned=True)

    def workspace_bytes(self, call: AllGatherMatmulCall) -> int:
        p = call.problem
        return self._scale_offset(p) + (p.big_m * 4 if p.scaling == "row" else 0)

    @staticmethod
    def _scale_offset(p: Problem) -> int:
        """Byte offset of the gathered rows' scales in the workspace (after the rows)."""
        return aligned(p.big_m * p.k * p.itemsize)

    def buffers(self, call: AllGatherMatmulCall, transport: str, symm, *,
                wide: bool = False, plan=None) -> Buffers:
        p, ops = call.problem, call.ops
        dev = call.a.device
        out_dtype = wide_dtype(ops.out_dtype) if wide else ops.out_dtype
        outs = [torch.empty(p.big_m, n, dtype=out_dtype, device=dev) for n in p.ns]
        row = p.scaling == "row"
        scales = None
        if symm is not None:
            gathered = symm.get_buffer(p.rank, (p.big_m, p.k), call.a.dtype)
            if row:
                scales = symm.get_buffer(p.rank, (p.big_m, 1), torch.float32,
                                         self._scale_offset(p))
        else:
            gathered = torch.empty(p.big_m, p.k, dtype=call.a.dtype, device=dev)
            if row:
                scales = torch.empty(p.big_m, 1, dtype=torch.float32, device=dev)
        a = call.a
        if call.backend.prepares_copies and not pitched(a):
            # Copy engines read rows of unit-stride columns: a transposed or expanded shard is
            # published from a row-major copy (one local copy, only for such layouts).
            a = a.contiguous()
        return Buffers(a, call.bs, outs, gathered, symm, call.group, a_scale=ops.a_scale,
                       gathered_scale=scales,
                       gathered_scale_offset=self._scale_offset(p) if row else 0,
                       b_scales=ops.b_scales, biases=ops.biases, wide=wide)

    def poison(self, buffers: Buffers) -> None:
        super().poison(buffers)
        if buffers.gathered_scale is not None:
            buffers.gathered_scale.fill_(float("nan"))

    def result(self, call: AllGatherMatmulCall, buffers: Buffers, transport: str):
        # The symmetric workspace is reused by the next call: the caller gets its own copy.
        ops = call.ops
        if buffers.wide:   # float32 partial sums: bias, activation and the one rounding now
            outs = [finish(o, ops.out_dtype, bias, ops.activation)
                    for o, bias in zip(buffers.outs, ops.biases)]
        else:
            outs = [o if o.dtype == ops.out_dtype else o.to(ops.out_dtype) for o in buffers.outs]
        return self._finish(call, outs, buffers.gathered, owned=buffers.symm is None)

    # -- the oracle ---------------------------------------------------------------------------
    fp8_examples = True

    def example(self, rank, world, shape, rounding, seed) -> Example:
        """Every rank's ``(m, k)`` shard and the shared ``(k, n)`` weight (fp8: one tensor-wise
        ``a_scale`` over all shards, on every rank); ``inputs``: (every shard, b) in float64."""
        m, k, n = shape
        gen = generator(seed)
        shards = [randn(gen, m, k) for _ in range(world)]
        b = randn(gen, k, n)
        shared = rounding.scale_of(torch.cat(shards)) if rounding.fp8 else None
        cast = [rounding.cast(s, shared) for s in shards]
        b_low, b64, b_scale = rounding.weight(b)
        return Example(rank, world, (cast[rank][0], b_low),
                       rounding.epilogue(cast[rank][2], b_scale), ([c[1] for c in cast], b64))

    def reference(self, example: Example):
        """``cat(every shard) @ b``."""
        shards, b = example.inputs
        full = torch.cat(shards)
        return full @ b, full.abs() @ b.abs()

    def _finish(self, call: AllGatherMatmulCall, outs, gathered, owned: bool):
        # Canonical (M, x) back to the caller's layout: gathered dim at gather_dim (each output
        # cut back to this rank's width: a b with no columns ran as one).
        moved, dim = call.moved_shape, call.gather_dim
        lead = (call.problem.world * moved[0], *moved[1:-1])
        results = [o[:, :n].view(*lead, n).movedim(0, dim) for o, n in zip(outs, call.ns)]
        out = results if call.b_is_list else results[0]
        if not call.return_gathered:
            return out
        if call.problem.world == 1:
            return call.a.view(moved).movedim(0, dim), out
        if not owned:
            gathered = gathered.clone()
        return gathered.view(*lead, gathered.shape[-1]).movedim(0, dim), out


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``out`` (W*rows, ...) <- every rank's ``inp`` (rows, ...), stacked along dim 0 (fp8 as
    its bytes: process groups have no fp8 type)."""
    if out.element_size() == 1 and out.is_floating_point():
        out, inp = out.view(torch.uint8), inp.view(torch.uint8)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


SPEC = AllGatherMatmul()
