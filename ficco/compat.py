"""Drop-in twins of ``torch.ops.symm_mem.fused_all_gather_matmul`` and
``fused_matmul_reduce_scatter`` (the latter in ``ficco/ops/matmul_reduce_scatter.py``), and of
their fp8 forms ``fused_all_gather_scaled_matmul`` and ``fused_scaled_matmul_reduce_scatter``
(``ficco/compat_scaled.py``).

Same signature, return values, shapes and strides, so swapping one line is enough::

    A, (C,) = torch.ops.symm_mem.fused_all_gather_matmul(A_shard, [B], 0, group_name)
    A, (C,) = ficco.compat.fused_all_gather_matmul(A_shard, [B], 0, group_name)
"""
from __future__ import annotations

import torch

from . import agreement, api
from .call import backend_for, check_tensor, check_weights, normalize_dim
from .errors import InvalidArgumentError
from .group import rank_world, resolve
from .compat_scaled import (fused_all_gather_scaled_matmul,  # noqa: F401 (re-exported)
                            fused_scaled_matmul_reduce_scatter)
from .ops.all_gather_matmul import all_gather_flat
from .ops.matmul_reduce_scatter import fused_matmul_reduce_scatter  # noqa: F401 (re-exported)


def fused_all_gather_matmul(A_shard: torch.Tensor, Bs: list[torch.Tensor], gather_dim: int,
                            group_name: str, *, return_A: bool = True):
    """``(all_gather(A_shard, gather_dim) if return_A else None, [A @ B for B in Bs])``.

    ``gather_dim`` may be the last dimension, as in torch's op: then the shards are
    concatenated along K, which no overlapped schedule can split, and ficco runs the plain
    all-gather + matmul.
    """
    if not isinstance(Bs, (list, tuple)) or not Bs:
        raise InvalidArgumentError("Bs must be a non-empty list of (K, n) tensors")
    check_tensor(A_shard, "A_shard")
    nd = A_shard.dim()
    if normalize_dim(gather_dim, nd, "gather_dim") == nd - 1:
        return _gather_last_dim(A_shard, list(Bs), group_name, return_A)
    if return_A:
        A, outs = api.all_gather_matmul(A_shard, list(Bs), group_name, gather_dim=gather_dim,
                                        return_gathered=True)
        return A, outs
    return None, api.all_gather_matmul(A_shard, list(Bs), group_name, gather_dim=gather_dim)


def _gather_last_dim(A_shard, Bs, group_name, return_A):
    """Shards concatenated along K: validated and agreed like every other path (bounded by
    FICCO_TIMEOUT), then the plain all-gather + matmul."""
    check_tensor(A_shard, "A_shard")
    group = resolve(group_name)
    rank, world = rank_world(group)
    k = world * A_shard.shape[-1]
    check_weights(Bs, A_shard, "A_shard", k=k, list_name="Bs",
                  k_from=f"gathering A_shard along its last dim over {world} ranks gives K={k}")
    backend_for(A_shard, "A_shard")
    signature = {"op": "fused_all_gather_matmul(gather_dim=last)",
                 "shard_shape": tuple(A_shard.shape), "dtype": str(A_shard.dtype),
                 "ns": [int(B.shape[1]) for B in Bs], "return_A": bool(return_A)}
    agreement.confirm_same_call(group, rank, world, signature, "fused_all_gather_matmul")
    flat = torch.empty((world * A_shard.shape[0], *A_shard.shape[1:]), dtype=A_shard.dtype,
                       device=A_shard.device)
    if world > 1:
        all_gather_flat(flat, A_shard.contiguous(), group)
    else:
        flat.copy_(A_shard)
    A = torch.cat(flat.view(world, *A_shard.shape).unbind(0), dim=-1)
    outs = [torch.matmul(A, B) for B in Bs]
    return (A if return_A else None), outs
