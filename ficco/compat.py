"""Drop-in twins of ``torch.ops.symm_mem.fused_all_gather_matmul`` and
``fused_matmul_reduce_scatter`` (the latter in ``ficco/ops/matmul_reduce_scatter.py``).

Same signature, return values, shapes and strides, so swapping one line is enough::

    A, (C,) = torch.ops.symm_mem.fused_all_gather_matmul(A_shard, [B], 0, group_name)
    A, (C,) = ficco.compat.fused_all_gather_matmul(A_shard, [B], 0, group_name)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import api
from .call import resolve_group
from .errors import InvalidArgumentError
from .ops.all_gather_matmul import all_gather_flat
from .ops.matmul_reduce_scatter import fused_matmul_reduce_scatter  # noqa: F401 (H2's op)


def fused_all_gather_matmul(A_shard: torch.Tensor, Bs: list[torch.Tensor], gather_dim: int,
                            group_name: str, *, return_A: bool = True):
    """``(all_gather(A_shard, gather_dim) if return_A else None, [A @ B for B in Bs])``.

    ``gather_dim`` may be the last dimension, as in torch's op: then the shards are
    concatenated along K, which no overlapped schedule can split, and ficco runs the plain
    all-gather + matmul.
    """
    if not isinstance(Bs, (list, tuple)) or not Bs:
        raise InvalidArgumentError("Bs must be a non-empty list of (K, n) tensors")
    nd = A_shard.dim()
    if isinstance(gather_dim, int) and gather_dim % max(nd, 1) == nd - 1 and nd >= 2:
        return _gather_last_dim(A_shard, list(Bs), group_name, return_A)
    if return_A:
        A, outs = api.all_gather_matmul(A_shard, list(Bs), group_name, gather_dim=gather_dim,
                                        return_gathered=True)
        return A, outs
    return None, api.all_gather_matmul(A_shard, list(Bs), group_name, gather_dim=gather_dim)


def _gather_last_dim(A_shard, Bs, group_name, return_A):
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    flat = torch.empty((world * A_shard.shape[0], *A_shard.shape[1:]), dtype=A_shard.dtype,
                       device=A_shard.device)
    all_gather_flat(flat, A_shard.contiguous(), group)
    A = torch.cat(flat.view(world, *A_shard.shape).unbind(0), dim=-1)
    outs = [torch.matmul(A, B) for B in Bs]
    return (A if return_A else None), outs
