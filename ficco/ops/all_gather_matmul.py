"""``all_gather(a_shard, gather_dim) @ b``: the op spec.

Canonical form: rank r's shard with ``gather_dim`` moved first and leading dims flattened,
``m x K``; the gathered matrix ``M x K`` (M = W*m); each ``b_j`` is ``(K, n_j)``. The dma
workspace holds the gathered matrix (every rank's copy addressable by its peers).

Only rows of A travel, so ``n_j`` may differ across ranks (a column-parallel weight whose
features do not divide by W, split longer pieces first: 64 over 3 ranks is 22/21/21, and a
rank may have none); the ranks agree on everything else and decide on the widest ``n_j``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..agreement import PER_RANK
from ..call import Call, backend_for, check_flag, check_tensor, check_weights, row_dim
from ..buffers import Buffers
from ..group import rank_world, resolve
from ..problem import Problem, dtype_name
from .base import OpSpec


@dataclass
class AllGatherMatmulCall(Call):
    a: torch.Tensor = None                  # m x K, this rank's shard with gather_dim first
    bs: list = None
    b_is_list: bool = False
    moved_shape: tuple = ()                 # a_shard.movedim(gather_dim, 0).shape
    ns: tuple = ()                          # the caller's n_j (0 allowed: an empty result)
    gather_dim: int = 0
    return_gathered: bool = False


def check_arguments(a_shard, b, gather_dim) -> tuple[int, list, bool]:
    """The one check of the op's tensors and ``gather_dim``, for the eager path (:meth:`prepare`)
    and the fake kernel (:mod:`ficco.library`) alike, so both say the same: ``(gather_dim in
    [0, a_shard.dim() - 1), the weights as a list, whether b was a list)``.

    >>> import torch
    >>> check_arguments(torch.randn(4, 8), torch.randn(8, 3), -2)[0]
    0
    """
    check_tensor(a_shard, "a_shard")
    gather_dim = row_dim(gather_dim, a_shard, "gather_dim", "a_shard", "gathers along")
    bs, b_is_list = check_weights(b, a_shard, "a_shard")
    return gather_dim, bs, b_is_list


class AllGatherMatmul(OpSpec):
    name = "all_gather_matmul"

    def prepare(self, a_shard, b, group=None, gather_dim=0, return_gathered=False
                ) -> AllGatherMatmulCall:
        gather_dim, bs, b_is_list = check_arguments(a_shard, b, gather_dim)
        k = a_shard.shape[-1]
        backend = backend_for(a_shard, "a_shard")
        group = resolve(group)
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
        problem = Problem(m=m, k=k, ns=ns if min(ns) > 0 else tuple([max(n, 1) for n in ns]),
                          dtype=dtype_name(a_shard.dtype), world=world, rank=rank)
        return AllGatherMatmulCall(self, problem, group, backend, m == 0,
                                   a=moved.reshape(m, k), bs=bs,
                                   b_is_list=b_is_list, moved_shape=tuple(moved.shape),
                                   gather_dim=gather_dim,
                                   return_gathered=check_flag(return_gathered, "return_gathered"),
                                   ns=ns)

    def signature(self, call: AllGatherMatmulCall) -> dict:
        p = call.problem
        return {**super().signature(call), "problem": (p.m, p.k, len(p.ns), p.dtype, p.world),
                "gather_dim": call.gather_dim, "shard_shape": call.moved_shape,
                PER_RANK: {"ns": list(call.ns)}}

    def agreed_problem(self, call: AllGatherMatmulCall, per_rank: tuple) -> Problem:
        widest = [max(max(n, 1) for n in ns) for ns in zip(*(r["ns"] for r in per_rank))]
        return dataclasses.replace(call.problem, ns=tuple(widest))

    # -- running ------------------------------------------------------------------------------
    def plain(self, call: AllGatherMatmulCall):
        p = call.problem
        gathered = torch.empty(p.big_m, p.k, dtype=call.a.dtype, device=call.a.device)
        if p.world > 1:
            all_gather_flat(gathered, call.a.contiguous(), call.group)
        else:
            gathered.copy_(call.a)
        outs = [gathered @ bj for bj in call.bs]
        return self._finish(call, outs, gathered, owned=True)

    def workspace_bytes(self, call: AllGatherMatmulCall) -> int:
        p = call.problem
        return p.big_m * p.k * p.itemsize

    def buffers(self, call: AllGatherMatmulCall, transport: str, symm, *,
                wide: bool = False) -> Buffers:
        p = call.problem
        dev = call.a.device
        out_dtype = torch.float32 if wide else call.a.dtype
        outs = [torch.empty(p.big_m, n, dtype=out_dtype, device=dev) for n in p.ns]
        if symm is not None:
            gathered = symm.get_buffer(p.rank, (p.big_m, p.k), call.a.dtype)
        else:
            gathered = torch.empty(p.big_m, p.k, dtype=call.a.dtype, device=dev)
        return Buffers(call.a, call.bs, outs, gathered, symm, call.group)

    def result(self, call: AllGatherMatmulCall, buffers: Buffers, transport: str):
        # The symmetric workspace is reused by the next call: the caller gets its own copy.
        outs = [o if o.dtype == call.a.dtype else o.to(call.a.dtype) for o in buffers.outs]
        return self._finish(call, outs, buffers.gathered, owned=buffers.symm is None)

    def _finish(self, call: AllGatherMatmulCall, outs, gathered, owned: bool):
        results = [_restore(call, o[:, :n]) for o, n in zip(outs, call.ns)]
        out = results if call.b_is_list else results[0]
        if not call.return_gathered:
            return out
        if call.problem.world == 1:
            return call.a.view(call.moved_shape).movedim(0, call.gather_dim), out
        return _restore(call, gathered if owned else gathered.clone()), out


def _restore(call: AllGatherMatmulCall, canon: torch.Tensor) -> torch.Tensor:
    """Canonical ``(M, x)`` back to the caller's layout: gathered dim at ``gather_dim``."""
    lead = (call.problem.world * call.moved_shape[0], *call.moved_shape[1:-1])
    return canon.view(*lead, canon.shape[-1]).movedim(0, call.gather_dim)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``out`` (W*rows, ...) <- every rank's ``inp`` (rows, ...), stacked along dim 0."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


SPEC = AllGatherMatmul()
