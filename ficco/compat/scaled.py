"""Drop-in twins of torch's scaled fused ops, ``torch.ops.symm_mem.fused_all_gather_scaled_matmul``
and ``fused_scaled_matmul_reduce_scatter``: the same signatures, return values, shapes and
strides, run by ficco's overlapped ops (``ficco.compat`` exports them)::

    A, outs = torch.ops.symm_mem.fused_all_gather_scaled_matmul(A_shard, Bs, A_scale, B_scales,
                                                                 0, group_name, biases, ...)
    A, outs = ficco.compat.fused_all_gather_scaled_matmul(A_shard, Bs, A_scale, B_scales,
                                                          0, group_name, biases, ...)

Their oracles in the tests are torch's ``_fused_all_gather_scaled_matmul_fallback`` and
``_fused_scaled_matmul_reduce_scatter_fallback``. Where they differ from ficco's own ops:

- the reduce-scatter adds each rank's own ``bias`` in its GEMM, as torch's does (the reduced
  rows carry the sum of the ranks' biases under ``"sum"``, their mean under ``"avg"``: one
  small extra reduce-scatter); ``ficco.matmul_reduce_scatter(..., bias=)`` adds one bias once;
- ``use_fast_accum`` is accepted and has no effect: ficco accumulates in float32 always;
- ``result_scales`` / ``result_scale`` (an fp8 output's scale) are refused with an error:
  ficco rounds its float32 sums once in its own epilogue, which has no such scale.
"""
from __future__ import annotations

import torch

from .. import api
from ..errors import InvalidArgumentError
from ..group import rank_world, resolve
from ..plan.epilogue import finish
from ..plan.problem import REDUCE_OPS
from ..runtime.call import normalize_dim


def fused_all_gather_scaled_matmul(A_shard, Bs, A_scale, B_scales, gather_dim, group_name,
                                   biases, result_scales, out_dtypes, use_fast_accum):
    """``(A, [_scaled_mm(A, B, A_scale, B_scale, bias, out_dtype=...) for each B])`` with
    ``A = all_gather(A_shard, gather_dim)``. ``A_scale`` is tensor-wise (one element), row-wise
    sharded (shaped like ``A_shard``'s rows, last dim 1: gathered with its rows) or row-wise
    replicated (shaped like the gathered rows), as torch's op tells them apart.

    >>> # A, (C,) = ficco.compat.fused_all_gather_scaled_matmul(A8, [B8], sa, [sb], 0, name,
    >>> #     [None], [None], [torch.bfloat16], [False])
    """
    if not isinstance(Bs, (list, tuple)) or not Bs:
        raise InvalidArgumentError("Bs must be a non-empty list of (K, n) fp8 tensors")
    Bs = list(Bs)
    lists = {"B_scales": B_scales, "biases": biases, "result_scales": result_scales,
             "out_dtypes": out_dtypes, "use_fast_accum": use_fast_accum}
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)) or len(value) != len(Bs):
            raise InvalidArgumentError(f"{name} must be a list of {len(Bs)} entries (one per B), "
                                       f"as torch's op takes it; got {value!r}")
    _refuse_result_scales(result_scales)
    if not isinstance(A_shard, torch.Tensor) or A_shard.dim() < 2:
        raise InvalidArgumentError("A_shard must be a tensor of at least 2 dims")
    nd = A_shard.dim()
    gather_dim = normalize_dim(gather_dim, nd, "gather_dim")
    if gather_dim == nd - 1:
        raise InvalidArgumentError(
            "fused_all_gather_scaled_matmul gathers a row dimension of A_shard; gather_dim is "
            "its last (K) dimension, which torch's op cannot scale either")
    rank, world = rank_world(resolve(group_name))
    A_scale = _sharded_scale(A_shard, A_scale, gather_dim, rank, world)
    dtypes = _dtypes(out_dtypes, A_shard.dtype)
    # One call for every B; with several output dtypes its outputs are float32 and each is
    # cast once, as torch._scaled_mm casts its float32 result.
    common = dtypes[0] if len(set(dtypes)) == 1 else torch.float32
    A, outs = api.all_gather_matmul(A_shard, Bs, group_name, gather_dim=gather_dim,
                                    return_gathered=True, a_scale=A_scale,
                                    b_scale=list(B_scales), out_dtype=common,
                                    bias=list(biases))
    return A, [o if o.dtype == d else o.to(d) for o, d in zip(outs, dtypes)]


def fused_scaled_matmul_reduce_scatter(A, B, A_scale, B_scale, reduce_op, orig_scatter_dim,
                                       scatter_dim_after_maybe_reshape, group_name, output_shape,
                                       bias=None, result_scale=None, out_dtype=None,
                                       use_fast_accum=False):
    """``reduce_scatter(_scaled_mm(A, B, A_scale, B_scale, bias).view(output_shape),
    reduce_op, orig_scatter_dim)``, contiguous, as torch's op: ``A`` may be flattened to 2-D
    (then ``output_shape`` gives the leading dims and ``orig_scatter_dim`` the one scattered);
    the world size must divide that dimension.

    >>> # D = ficco.compat.fused_scaled_matmul_reduce_scatter(A8, B8, sa, sb, "avg", 0, 0,
    >>> #     name, [*A8.shape[:-1], B8.shape[1]], out_dtype=torch.bfloat16)
    """
    _refuse_result_scales([result_scale])
    if reduce_op not in REDUCE_OPS:
        raise InvalidArgumentError(f"reduce_op={reduce_op!r} is not supported; use one of "
                                   f"{', '.join(REDUCE_OPS)}")
    if not isinstance(A, torch.Tensor) or A.dim() < 2 or not isinstance(B, torch.Tensor) \
            or B.dim() != 2:
        raise InvalidArgumentError("A must be a tensor of at least 2 dims and B a (K, n) matrix")
    shape = [int(s) for s in output_shape]
    rows = A.shape[:-1].numel()
    if len(shape) < 2 or shape[-1] != B.shape[1] or torch.Size(shape[:-1]).numel() != rows:
        raise InvalidArgumentError(
            f"output_shape {shape} must be A's rows ({tuple(A.shape[:-1])}, {rows} in all) "
            f"followed by B's {B.shape[1]} columns")
    dim = normalize_dim(orig_scatter_dim, len(shape), "orig_scatter_dim")
    _, world = rank_world(resolve(group_name))
    if shape[dim] % world:
        raise InvalidArgumentError(
            f"fused_scaled_matmul_reduce_scatter needs the world size ({world}) to divide dim "
            f"{dim} of the output {shape}, as torch's op does; ficco.matmul_reduce_scatter "
            f"takes uneven sizes")
    if dim == len(shape) - 1:
        raise InvalidArgumentError(
            "orig_scatter_dim is the output's last (column) dimension: ficco scatters rows; "
            "use torch's op for a column scatter")
    if isinstance(A_scale, torch.Tensor) and A_scale.numel() > 1:
        if tuple(A_scale.shape[:-1]) != tuple(A.shape[:-1]):
            raise InvalidArgumentError(
                f"a row-wise A_scale is shaped like A's rows: A {tuple(A.shape)}, A_scale "
                f"{tuple(A_scale.shape)}")
        A_scale = A_scale.reshape(*shape[:-1], 1)
    A = A.reshape(*shape[:-1], A.shape[-1])
    if bias is None:
        out = api.matmul_reduce_scatter(A, B, group_name, scatter_dim=dim, reduce_op=reduce_op,
                                        a_scale=A_scale, b_scale=B_scale, out_dtype=out_dtype)
        return out.contiguous()
    _check_bias(bias, B, A)
    # torch's op adds each rank's own bias in its GEMM, so the reduced rows carry the sum (the
    # mean under "avg") of every rank's bias: the products reduced in float32, then that
    # reduction of the biases (one small op: ones(W, 1) @ bias_r, reduced the same way),
    # added and rounded once.
    wide = api.matmul_reduce_scatter(A, B, group_name, scatter_dim=dim, reduce_op=reduce_op,
                                     a_scale=A_scale, b_scale=B_scale, out_dtype=torch.float32)
    biases = api.matmul_reduce_scatter(bias.new_ones(world, 1, dtype=torch.float32),
                                       bias.float().reshape(1, -1), group_name,
                                       reduce_op=reduce_op)
    return finish(wide, out_dtype or A.dtype, biases.reshape(-1)).contiguous()


def _check_bias(bias, B, A) -> None:
    if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.numel() != B.shape[1] \
            or not bias.is_floating_point() or bias.device != A.device:
        raise InvalidArgumentError(
            f"bias must be a 1-D floating tensor of B's {B.shape[1]} columns on A's device "
            f"({A.device}); got " + (f"{tuple(bias.shape)} {bias.dtype} on {bias.device}"
                                     if isinstance(bias, torch.Tensor) else repr(bias)))


def _refuse_result_scales(result_scales) -> None:
    if any(r is not None for r in result_scales):
        raise InvalidArgumentError(
            "result_scales / result_scale are not supported by ficco.compat: ficco rounds its "
            "float32 sums once in its own epilogue, which has no output scale; pass None (or "
            "call torch's op)")


def _dtypes(out_dtypes, a_dtype) -> list:
    """torch's out_dtypes (dtypes, or ScalarType numbers through the dispatcher; None: A's)."""
    from torch.distributed._symmetric_memory import _maybe_convert_scalar_types_to_dtypes

    return [a_dtype if d is None else d
            for d in _maybe_convert_scalar_types_to_dtypes(list(out_dtypes))]


def _sharded_scale(A_shard, A_scale, gather_dim, rank, world):
    """torch's three A_scale modes as ficco's two: a row-wise replicated scale (every
    gathered row's) becomes this rank's rows, which ficco gathers with them."""
    if not isinstance(A_scale, torch.Tensor):
        raise InvalidArgumentError(f"A_scale must be a float32 tensor; got "
                                   f"{type(A_scale).__name__}")
    shard_rows = tuple(A_shard.shape[:-1])
    full_rows = list(shard_rows)
    full_rows[gather_dim] *= world
    if tuple(A_scale.shape[:-1]) == shard_rows and A_scale.shape[-1] == 1:
        return A_scale   # row-wise sharded (torch checks this first, as here)
    if A_scale.numel() == 1:
        return A_scale
    if list(A_scale.shape[:-1]) == full_rows and A_scale.shape[-1] == 1:
        size = shard_rows[gather_dim]
        return A_scale.narrow(gather_dim, rank * size, size)
    raise InvalidArgumentError(
        f"A_scale {tuple(A_scale.shape)} is none of torch's modes for A_shard "
        f"{tuple(A_shard.shape)}: one element, {shard_rows + (1,)} (row-wise, this rank's "
        f"rows) or {tuple(full_rows) + (1,)} (row-wise, every gathered row)")
