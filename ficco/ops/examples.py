"""What every op's :meth:`~ficco.ops.base.OpSpec.example` makes its random inputs with: a seeded
generator (every rank makes every rank's inputs from one seed, so it knows the whole problem)
and :class:`Rounding`, which casts float64 values to the dtype under test and back, so the
float64 reference (:meth:`~ficco.ops.base.OpSpec.reference`) is exact for the operands the
op sees.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Example:
    """One rank's call of an op on fresh random inputs (:meth:`OpSpec.example`):
    ``ficco.<op>(*args, group=..., schedule=..., **kwargs)``, and every rank's operands in
    float64 as the call sees them (``inputs``, laid out as the op's :meth:`OpSpec.reference`
    reads them)."""

    rank: int
    world: int
    args: tuple
    kwargs: dict
    inputs: Any


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


class Rounding:
    """Casts float64 values to the dtype under test (``"float32"``, ``"bfloat16"``,
    ``"float16"``, ``"float64"`` or ``"float8"``: ``fp8_dtype`` with a tensor-wise scale) on
    ``device``, and back."""

    def __init__(self, dtype_name: str = "float64", fp8_dtype=None, device="cpu"):
        self.name, self.device = dtype_name, device
        self.fp8 = dtype_name == "float8"
        self.dtype = fp8_dtype if self.fp8 else getattr(torch, dtype_name)

    @staticmethod
    def scale_of(t: torch.Tensor) -> torch.Tensor:
        """A tensor-wise fp8 scale for ``t``: its largest value lands at 224 (e4m3's 448 and
        the fnuz variants' 240 both hold it)."""
        return (t.abs().max().clamp_min(1e-12) / 224.0).to(torch.float32)

    def cast(self, t: torch.Tensor, scale: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(this dtype's tensor on the device, its float64 value, its fp8 scale or None)."""
        if not self.fp8:
            low = t.to(self.dtype)
            return low.to(self.device), low.to(torch.float64), None
        scale = self.scale_of(t) if scale is None else scale
        low = (t / scale.double()).to(self.dtype)
        return low.to(self.device), low.to(torch.float64) * scale.double(), \
            scale.to(self.device)

    def weight(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`cast` of a (K, n) weight; fp8 ones column-major (``w.t()`` of a row-major
        (n, K) weight: the layout a GPU's ``torch._scaled_mm`` multiplies)."""
        low, value, scale = self.cast(t)
        return (low.t().contiguous().t() if self.fp8 else low), value, scale

    def epilogue(self, a_scale, b_scale) -> dict:
        """The op's fp8 keywords (none for other dtypes)."""
        return {} if not self.fp8 else {"a_scale": a_scale, "b_scale": b_scale,
                                        "out_dtype": torch.bfloat16}


def first(out: Any) -> torch.Tensor:
    """An op's first output (the expert ops return ``(y, counts)``)."""
    return out[0] if isinstance(out, (tuple, list)) else out
