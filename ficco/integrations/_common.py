"""What the client integrations share: the version check that names the tested range, and the
column-parallel linear of a replicated input (no sequence parallelism), whose input gradient is
all-reduced inside ``ficco.matmul_all_reduce``."""
from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from ..errors import BackendUnavailableError


def installed_version(distribution: str, module: str) -> str | None:
    """The installed ``distribution``'s version (``module`` is what it imports as), None when it
    is not installed, "unknown" for a source checkout on ``sys.path``."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return None
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def _release(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
        if not part.isdigit():
            break
    return tuple(out)


def check_version(what: str, distribution: str, module: str, tested: str,
                  supported: tuple[str, str], extra: str) -> str:
    """The installed version of ``distribution`` when it lies in ``supported`` (``[low,
    high)``), else a :class:`~ficco.errors.BackendUnavailableError` naming the tested release
    and the range."""
    low, high = supported
    version = installed_version(distribution, module)
    where = (f"{what} is tested with {distribution} {tested} (supported: >={low},<{high}; pip "
             f"install 'ficco[{extra}]')")
    if version is None:
        raise BackendUnavailableError(f"{where}; {distribution} is not installed")
    if version == "unknown" or not _release(low) <= _release(version) < _release(high):
        raise BackendUnavailableError(f"{where}; {distribution} {version} is installed")
    return version


class _ColumnLinear(torch.autograd.Function):
    """``x @ w.T + b`` of a replicated ``x`` and this rank's output rows ``w`` of the weight:
    nothing to communicate forward; the input gradient is the sum over the ranks of
    ``dy_r @ w_r``, one ``ficco.matmul_all_reduce`` (Megatron's all-reduce of the input
    gradient, hidden here behind the GEMM that produces it)."""

    @staticmethod
    def forward(ctx, x, w, b, group):
        ctx.save_for_backward(x, w)
        ctx.group, ctx.has_bias = group, b is not None
        y = torch.matmul(x, w.t())
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, dy):
        from .. import matmul_all_reduce

        x, w = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = matmul_all_reduce(dy.contiguous(), w, ctx.group)
        rows_dy = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = rows_dy.t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = rows_dy.sum(0)
        return dx, dw, db, None


def column_linear(x: Tensor, w: Tensor, b: Tensor | None, group) -> Tensor:
    """This rank's output features of a linear whose input ``x`` every rank holds whole."""
    return _ColumnLinear.apply(x, w, b, group)
