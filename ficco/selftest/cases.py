"""What ``selftest`` feeds each op and what it expects back: the op's own example and float64
oracle (:meth:`~ficco.ops.base.OpSpec.example`, :meth:`~ficco.ops.base.OpSpec.reference`).
Every rank makes every rank's inputs from one seed (so it knows the whole problem), casts its
own to the dtype under test, and computes its own block of the result in float64 from the
*rounded* inputs, with the rounding scale ``|a| @ |b|`` the error is measured against (as
tests/reference.py does). Every op ficco registers has them: the op contract requires them.

``shape`` is ``(m, k, n)``: rows per rank (the all-gather's shard, the reduce-scatter's block,
the expert ops' tokens per rank), the contraction, the output columns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..ops.examples import Rounding

#: worst row error over its rounding scale accepted per dtype (tests/reference.py's ROW_TOL;
#: fp8 outputs are bf16, and their inputs are rounded before the reference is computed)
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 6e-3, "float8": 3e-2}


@dataclass
class Case:
    """One call: ``fn(*args, group=..., schedule=..., **kwargs)``, the float64 ``ref`` of this
    rank's output (the first output where the op returns several) and its rounding scale."""

    args: tuple
    kwargs: dict
    ref: torch.Tensor
    scale: torch.Tensor


def row_error(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    """Worst row's error over its rounding scale; a NaN or a wrong shape is infinite.

    >>> ref = torch.ones(2, 3, dtype=torch.float64)
    >>> row_error(ref.float(), ref, ref), row_error(torch.full((2, 3), float("nan")), ref, ref)
    (0.0, inf)
    """
    if tuple(out.shape) != tuple(ref.shape):
        return float("inf")
    out64 = out.detach().to(torch.float64).reshape(-1, max(1, ref.shape[-1]))
    if out64.numel() == 0:
        return 0.0
    if torch.isnan(out64).any():
        return float("inf")
    ref64 = ref.reshape(out64.shape).to(out64.device)
    den = scale.reshape(out64.shape).to(out64.device).norm(dim=1).clamp_min(1e-30)
    return float(((out64 - ref64).norm(dim=1) / den).max().cpu())


def build(op: str, rank: int, world: int, shape, dtype_name: str, seed: int, device,
          fp8_dtype=None) -> Case:
    """The case of ``op`` for this rank: its spec's example and reference."""
    spec = ops.get(op)
    example = spec.example(rank, world, tuple(shape), Rounding(dtype_name, fp8_dtype, device),
                           seed)
    ref, scale = spec.reference(example)
    return Case(example.args, example.kwargs, ref, scale)


def scaled(op: str) -> bool:
    """Whether ``op``'s cases take fp8 operands with tensor-wise scales."""
    return ops.get(op).fp8_examples


def op_function(op: str):
    """The public function that runs ``op`` (``ficco.<op>``)."""
    import ficco

    return getattr(ficco, op)
