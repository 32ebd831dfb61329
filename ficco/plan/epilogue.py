"""fp8 operands, output dtypes, bias and activation: what both ops add around their GEMMs.

A call may carry, besides A and B:

- fp8 operands (``float8_e4m3fn``, ``float8_e5m2``; MI300X's ``float8_e4m3fnuz`` /
  ``float8_e5m2fnuz``) with ``a_scale`` and ``b_scale``: tensor-wise (one float32 each) or
  row-wise (one per row of A, ``(..., 1)`` like A's rows, and one per column of B, ``(1, n)``),
  the two recipes of ``torch._scaled_mm``, which runs every fp8 GEMM piece;
- ``out_dtype`` (fp8: any float type ``torch._scaled_mm`` writes, default A's dtype as torch's;
  otherwise A's dtype or float32);
- ``bias`` ``(n,)`` per b, added once to every output row;
- ``activation`` (all-gather only): ``gelu``, ``gelu_tanh``, ``silu`` or ``relu`` after the bias.

Rounding (DESIGN §7, torch's fallback): every piece computes in float32 and is rounded once.
A schedule whose pieces add up (2-D, K-split, or the reduce-scatter's partial sums) keeps
float32 outputs and rounds them once at the end, where the bias and the activation are
applied too (:func:`finish`); otherwise each GEMM piece applies them as it writes its rows
(:func:`gemm_into`), so the activation costs no pass of its own and overlaps communication.

On CPU ``torch._scaled_mm`` (torch 2.13) runs every dtype and both recipes (it computes
``(a.float() * scale_a) @ (b.float() * scale_b)`` in float32): nothing is emulated. On GPUs
it writes row-wise results in bfloat16 only on some builds, so there row-wise pieces with a
float32 or fp8 result multiply unit-scaled float32 products by the scales instead.

>>> import torch
>>> a = torch.randn(4, 32).to(torch.float8_e4m3fn); b = torch.randn(32, 16).to(torch.float8_e4m3fn)
>>> out = torch.empty(4, 16, dtype=torch.bfloat16)
>>> gemm_into(a, b, out, False, torch.tensor(0.5), torch.tensor(2.0))
>>> torch.allclose(out.float(), (a.float() @ b.float()), rtol=1e-2, atol=1e-2)
True
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from .problem import ACTIVATIONS, FP8_ALIGN, dtype_name

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
              torch.float8_e5m2fnuz)
FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
#: output dtypes torch._scaled_mm writes
SCALED_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32) + FP8_DTYPES
BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


@dataclass
class Operands:
    """The epilogue arguments of one call, validated and in canonical form: ``a_scale``
    ``(rows, 1)`` (row-wise, rows of the canonical A) or a one-element tensor (tensor-wise),
    ``b_scales[j]`` ``(1, n_j)`` or one element, ``biases[j]`` ``(1, n_j)`` or None."""

    out_dtype: torch.dtype
    scaling: str = ""                 # "", "tensor", "row"
    a_scale: torch.Tensor | None = None
    b_scales: tuple = ()
    biases: tuple = ()
    activation: str = ""
    #: the caller's scales were tensor-wise, held row-wise (:meth:`tensor_as_rows`)
    tensor_wise: bool = False

    @property
    def bias(self) -> bool:
        return self.biases.count(None) < len(self.biases)   # (no Python call per bias)

    def without_tensors(self) -> Operands:
        """This epilogue with no tensors: what a call key keeps (:func:`rebound` puts a warm
        call's in)."""
        return dataclasses.replace(self, a_scale=None, b_scales=(),
                                   biases=(None,) * len(self.biases))

    def tensor_as_rows(self, rows: int, ns) -> Operands:
        """This tensor-wise epilogue held row-wise: A's one scale repeated for each of its
        ``rows`` canonical rows, each b's for each of its ``ns[j]`` columns. The all-gather's
        shards
        then carry their own rank's scale as they travel (each rank may quantize its shard
        with its own dynamic scale); the products are the same numbers, the scale applied
        per row instead of once.

        >>> ops = Operands(torch.bfloat16, "tensor", torch.tensor(2.0), (torch.tensor(3.0),))
        >>> held = ops.tensor_as_rows(4, (5,))
        >>> held.scaling, tuple(held.a_scale.shape), tuple(held.b_scales[0].shape)
        ('row', (4, 1), (1, 5))
        """
        if self.scaling != "tensor" or self.a_scale is None:
            return self
        return dataclasses.replace(self, scaling="row", tensor_wise=True,
                                   a_scale=_repeated(self.a_scale, rows, 1),
                                   b_scales=tuple([_repeated(sb, 1, n)
                                                   for sb, n in zip(self.b_scales, ns)]))

    def one_column(self, ns) -> Operands:
        """This epilogue for a call whose b_j with no columns (``ns[j] == 0``) runs as one zero
        column: that column's bias a zero and its row-wise scale a one, so the GEMM and its
        epilogue see matching widths (the column is cut off again with the output).

        >>> ops = Operands(torch.float32, biases=(torch.ones(1, 0),))
        >>> ops.one_column((0,)).biases[0].shape
        torch.Size([1, 1])
        """
        def widen(t, fill):
            return t if t is None or t.numel() else t.new_full((1, 1), fill)

        biases = tuple(widen(b, 0.0) if n == 0 else b for b, n in zip(self.biases, ns))
        scales = tuple(widen(s, 1.0) if n == 0 else s for s, n in zip(self.b_scales, ns))
        return dataclasses.replace(self, biases=biases, b_scales=scales)

    def problem_fields(self, a_dtype: torch.dtype) -> dict:
        """The :class:`~ficco.plan.problem.Problem` fields of this epilogue."""
        out = "" if self.out_dtype == a_dtype else dtype_name(self.out_dtype)
        return {"out_dtype": out, "scaling": self.scaling, "bias": self.bias,
                "activation": self.activation}

    def signature(self) -> dict:
        """What ranks must share beyond the Problem: the biases' dtypes (hashable, so a warm
        call's digest is a lookup; nothing without a bias)."""
        if not self.bias:
            return {}
        return {"bias_dtypes": tuple(None if b is None else str(b.dtype) for b in self.biases)}


def operands(a: torch.Tensor, bs: list, *, rows_of, a_name: str, a_scale=None, b_scale=None,
             out_dtype=None, bias=None, activation=None, b_is_list: bool = False,
             allow_activation: bool = True) -> Operands:
    """Validate the epilogue arguments of one call (no communication) and put them in
    canonical form. ``rows_of(t)`` turns a tensor shaped like A's rows (``a.shape[:-1]``
    leading) into the canonical ``(rows, x)`` matrix, as the op spec does with A."""
    if (a_scale is None and b_scale is None and out_dtype is None and bias is None
            and activation is None and a.dtype not in FP8_DTYPES
            and not any([b.dtype in FP8_DTYPES for b in bs])):  # noqa: C419 - one call
        return Operands(a.dtype, biases=(None,) * len(bs))   # the common call: no epilogue
    fp8 = is_fp8(a.dtype)
    for j, b in enumerate(bs):
        if is_fp8(b.dtype) != fp8:
            name = f"b[{j}]" if b_is_list else "b"
            raise InvalidArgumentError(
                f"{a_name} is {a.dtype} but {name} is {b.dtype}; fp8 operands go together "
                f"(both fp8 with a_scale and b_scale, or neither)")
    if not fp8:
        if a_scale is not None or b_scale is not None:
            raise InvalidArgumentError(
                f"a_scale/b_scale scale fp8 operands, but {a_name} is {a.dtype}; drop them, or "
                f"pass float8_e4m3fn / float8_e5m2 tensors")
        out = _out_dtype(out_dtype, a.dtype, (a.dtype, torch.float32),
                         f"{a.dtype} operands")
        scaling, sa, sbs = "", None, ()
    else:
        out = _out_dtype(out_dtype, a.dtype, SCALED_OUT_DTYPES, "fp8 operands")
        scaling, sa, sbs = _scales(a, bs, a_scale, b_scale, rows_of, a_name, b_is_list)
    biases = _biases(a, bs, bias, b_is_list, BIAS_DTYPES + (() if fp8 else (torch.float64,)))
    act = activation or ""
    if activation is not None and (activation == "" or activation not in ACTIVATIONS
                                   or not allow_activation):
        where = "" if allow_activation else " (all_gather_matmul only: the reduce-scatter's " \
                                            "output is a sum, nothing to fuse it into)"
        raise InvalidArgumentError(f"activation={activation!r} is not supported{where}; use "
                                   f"one of {', '.join(ACTIVATIONS[1:])} or None")
    ops = Operands(out, scaling, sa, sbs, biases, act)
    if fp8 and device_side(a):
        check_gpu(a, bs, ops, a_name)
    return ops


def _out_dtype(out_dtype, a_dtype, allowed, what) -> torch.dtype:
    if out_dtype is None:
        return a_dtype
    if out_dtype not in allowed:
        raise InvalidArgumentError(
            f"out_dtype={out_dtype} is not supported for {what}; use one of "
            f"{[dtype_name(d) for d in allowed]}")
    return out_dtype


def _as_list(value, count: int, b_is_list: bool, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise InvalidArgumentError(f"{name} has {len(value)} entries but b has {count}; "
                                       f"give one per b")
        return list(value)
    if b_is_list and value is not None and count > 1:
        raise InvalidArgumentError(f"b is a list of {count} weights, so {name} must be a list "
                                   f"of {count} (one per b); got one tensor")
    return [value] * count


def _check_scale_tensor(t, name: str, a: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a float32 tensor; got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise InvalidArgumentError(f"{name} is {t.dtype}; torch._scaled_mm takes float32 scales "
                                   f"(cast it with .float())")
    if t.device != a.device:
        raise InvalidArgumentError(f"{name} is on {t.device} but A is on {a.device}; move it")


def _scales(a, bs, a_scale, b_scale, rows_of, a_name, b_is_list):
    """(scaling, canonical a_scale, canonical b_scales): torch's rule for A (row-wise when
    a_scale is shaped like A's rows with a last dim of 1, else tensor-wise when it has one
    element); B's scales must follow the same recipe."""
    if a_scale is None or b_scale is None:
        raise InvalidArgumentError(
            f"fp8 operands need a_scale and b_scale (float32: one element each, or one per "
            f"row of {a_name} and per column of b); got a_scale={_shape(a_scale)}, "
            f"b_scale={_shape(b_scale)}")
    _check_scale_tensor(a_scale, "a_scale", a)
    rows_shape = tuple(a.shape[:-1]) + (1,)
    if tuple(a_scale.shape) == rows_shape:
        scaling = "row"
    elif a_scale.numel() == 1:
        scaling = "tensor"
    else:
        raise InvalidArgumentError(
            f"a_scale has shape {tuple(a_scale.shape)}; use one element (tensor-wise) or "
            f"{rows_shape} (row-wise: one per row of {a_name} {tuple(a.shape)})")
    sbs = []
    for j, (bj, sb) in enumerate(zip(bs, _as_list(b_scale, len(bs), b_is_list, "b_scale"))):
        name = f"b_scale[{j}]" if b_is_list else "b_scale"
        _check_scale_tensor(sb, name, a)
        n = bj.shape[1]
        if scaling == "row" and tuple(sb.shape) not in ((1, n),):
            raise InvalidArgumentError(
                f"{name} has shape {tuple(sb.shape)} but a_scale is row-wise; give b's "
                f"columns their scales as (1, {n}) (torch._scaled_mm pairs row-wise with "
                f"row-wise)")
        if scaling == "tensor" and sb.numel() != 1:
            raise InvalidArgumentError(
                f"{name} has shape {tuple(sb.shape)} but a_scale is tensor-wise (one "
                f"element); give b one scale too, or a_scale one per row {rows_shape}")
        sbs.append(sb)
    return (scaling, _canonical_a_scale(scaling, a_scale, rows_of),
            _canonical_b_scales(scaling, bs, sbs))


def _canonical_a_scale(scaling: str, a_scale, rows_of):
    """``a_scale`` as :class:`Operands` holds it: ``(rows, 1)`` float32 (row-wise, in the
    canonical A's row order), one element (tensor-wise), None (no scaling)."""
    if scaling == "row":
        return rows_of(a_scale).float().contiguous()
    return a_scale.reshape(()) if scaling else None


def _canonical_b_scales(scaling: str, bs, scales) -> tuple:
    if scaling == "row":
        return tuple([sb.reshape(1, bj.shape[1]).contiguous() for bj, sb in zip(bs, scales)])
    return tuple([sb.reshape(()) for sb in scales])


def _repeated(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """One scale as a ``(rows, cols)`` float32 tensor of it (its own memory: it travels)."""
    return scale.reshape(1, 1).expand(rows, cols).contiguous()


def rebound(ops: Operands, bs: list, *, rows_of, a_scale=None, b_scale=None, bias=None,
            b_is_list: bool = False, rows: int = 0, **_) -> Operands:
    """``ops``, made by :func:`operands` for a call whose epilogue arguments had the types,
    shapes, dtypes and devices of these (a warm call: ``ficco.runtime.call.key_of``), now
    holding this call's tensors in the same canonical form (``rows``: the canonical A's, for
    scales held as rows: :meth:`Operands.tensor_as_rows`); nothing is checked again."""
    count = len(bs)
    scales = _as_list(b_scale, count, b_is_list, "b_scale") if ops.scaling else ()
    biases = tuple([None if v is None else v.view(1, bj.shape[1])
                    for bj, v in zip(bs, _as_list(bias, count, b_is_list, "bias"))])
    if ops.tensor_wise:
        return Operands(ops.out_dtype, "tensor", a_scale.reshape(()),
                        tuple([sb.reshape(()) for sb in scales]), biases, ops.activation
                        ).tensor_as_rows(rows, [bj.shape[1] for bj in bs])
    return Operands(ops.out_dtype, ops.scaling, _canonical_a_scale(ops.scaling, a_scale, rows_of),
                    _canonical_b_scales(ops.scaling, bs, scales), biases, ops.activation)


def _biases(a, bs, bias, b_is_list, dtypes) -> tuple:
    out: list[torch.Tensor | None] = []     # None: no bias for that weight
    for j, (bj, v) in enumerate(zip(bs, _as_list(bias, len(bs), b_is_list, "bias"))):
        if v is None:
            out.append(None)
            continue
        name = f"bias[{j}]" if b_is_list else "bias"
        n = bj.shape[1]
        if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.shape[0] != n:
            raise InvalidArgumentError(
                f"{name} must be a ({n},) tensor (one value per output column); got "
                f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
        if v.dtype not in dtypes:
            raise InvalidArgumentError(f"{name} is {v.dtype}; use one of "
                                       f"{[dtype_name(d) for d in dtypes]}")
        if v.device != a.device:
            raise InvalidArgumentError(f"{name} is on {v.device} but A is on {a.device}; "
                                       f"move it")
        out.append(v.view(1, n))
    return tuple(out)


def _shape(t) -> str:
    return "None" if t is None else (str(tuple(t.shape)) if isinstance(t, torch.Tensor)
                                     else type(t).__name__)


def device_side(t: torch.Tensor) -> bool:
    """Whether ``t`` meets a GPU's own argument checks and code paths (a device tensor). The
    fake GPU of the tests (tests/fake_gpu.py), whose tensors live on the host, answers True
    for every tensor, so a CPU rehearsal reaches what only a device would refuse."""
    return t.device.type != "cpu"


def check_gpu(a: torch.Tensor, bs: list, ops: Operands, a_name: str) -> None:
    """What ``torch._scaled_mm`` refuses on GPUs, refused here before any communication (so
    it cannot fail mid-plan): the dtypes the device's matrix units take, K and n multiples of
    16, and B column-major."""
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(a.device).gcnArchName
        fnuz = arch.startswith("gfx94")   # MI300X / MI325X (CDNA3) have only the fnuz forms
        for t, name in [(a, a_name)] + [(b, f"b[{j}]") for j, b in enumerate(bs)]:
            if (t.dtype in FNUZ) != fnuz:
                want = "float8_e4m3fnuz / float8_e5m2fnuz" if fnuz else \
                    "float8_e4m3fn / float8_e5m2"
                raise InvalidArgumentError(f"{name} is {t.dtype} but {arch} multiplies {want}")
    else:
        for t, name in [(a, a_name)] + [(b, f"b[{j}]") for j, b in enumerate(bs)]:
            if t.dtype in FNUZ:
                raise InvalidArgumentError(f"{name} is {t.dtype}, an AMD MI300 format; NVIDIA "
                                           f"GPUs take float8_e4m3fn / float8_e5m2")
        if a.dtype == torch.float8_e5m2 and any(b.dtype == torch.float8_e5m2 for b in bs):
            raise InvalidArgumentError("float8_e5m2 x float8_e5m2 does not run on NVIDIA GPUs "
                                       "(torch._scaled_mm); make A or b float8_e4m3fn")
    k = a.shape[-1]
    for j, b in enumerate(bs):
        if k % FP8_ALIGN or b.shape[1] % FP8_ALIGN:
            raise InvalidArgumentError(
                f"fp8 GEMMs on GPUs need K and n multiples of {FP8_ALIGN}; got K={k}, "
                f"n={b.shape[1]} (b[{j}]); pad them")
        if b.stride(0) != 1:
            raise InvalidArgumentError(
                f"b[{j}] must be column-major on GPUs (torch._scaled_mm): pass w.t() of a "
                f"row-major (n, K) weight; got strides {b.stride()}")


# -- running ---------------------------------------------------------------------------------------
_ACTIVATE = {
    "gelu": lambda t: torch.ops.aten.gelu_(t),
    "gelu_tanh": lambda t: torch.ops.aten.gelu_(t, approximate="tanh"),
    "silu": lambda t: torch.ops.aten.silu_(t),
    "relu": lambda t: torch.ops.aten.relu_(t),
}


def activation_fn(activation: str):
    """The out-of-place torch function of ``activation`` (autograd records it), e.g.
    ``activation_fn("silu")(x)``."""
    import torch.nn.functional as F

    return {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
            "silu": F.silu, "relu": F.relu}[activation]


def activate(t: torch.Tensor, activation: str) -> torch.Tensor:
    """``t`` with ``activation`` applied in place (no-op for "")."""
    if activation:
        _ACTIVATE[activation](t)
    return t


def gemm_into(a, b, out, accumulate: bool, a_scale=None, b_scale=None, bias=None,
              activation: str = "") -> None:
    """``out (+)= activation(a @ b + bias)``, scaled by ``a_scale``/``b_scale`` when given (fp8,
    ``torch._scaled_mm``), computed in float32 and rounded once into ``out``. ``a``/``out`` may
    be 3-D (equally spaced row blocks; ``a_scale`` then 3-D too when row-wise): one GEMM per
    block for fp8 (torch has no batched scaled GEMM), one strided-batched GEMM otherwise. An
    accumulating GEMM takes no bias or activation (they follow the last partial sum)."""
    if out.numel() == 0:
        return
    if activation and out.element_size() == 1:   # no fp8 activations: in float32, then round
        wide = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        gemm_into(a, b, wide, False, a_scale, b_scale, bias, activation)
        out.copy_(wide)
        return
    if a_scale is None:
        gemm_into_view(a, b, out, accumulate, bias)
    elif a.dim() == 3:
        row = a_scale.dim() == 3
        for i in range(a.shape[0]):
            _scaled(a[i], b, a_scale[i] if row else a_scale, b_scale, bias, out[i], accumulate)
    else:
        _scaled(a, b, a_scale, b_scale, bias, out, accumulate)
    if activation and not accumulate:
        activate(out, activation)


def gemm_into_view(a, b, out, accumulate: bool = False, bias=None) -> None:
    """``out (+)= a @ b`` (``+ bias`` when not accumulating), written into ``out`` in place:
    the one plain GEMM of ficco's host-side work (the CPU backend's GEMMs, the epilogue and
    expert host tasks). ``a`` and ``out`` are 2-D, or 3-D views of equally spaced row blocks
    (``b`` broadcast over the batch, nothing copied). A wider ``out`` (float32 for bf16/fp16
    operands) takes the product unrounded: partial sums add up in float32, the caller rounds
    once.

    >>> a, b, out = torch.ones(2, 3), torch.ones(3, 4), torch.zeros(2, 4)
    >>> gemm_into_view(a, b, out); gemm_into_view(a, b, out, accumulate=True); out[0, 0].item()
    6.0
    """
    if out.dtype != a.dtype:
        if a.device.type == "cuda" and a.dim() == 2 and bias is None:
            # (ROCm too) the low-precision GEMM with a float32 result: no float32 copies
            product = torch.mm(a, b, out_dtype=out.dtype)
            out.add_(product) if accumulate else out.copy_(product)
            return
        a, b = a.to(out.dtype), b.to(out.dtype)
    if a.dim() == 3:
        b = b.expand(a.shape[0], *b.shape)
        if accumulate:
            out.baddbmm_(a, b)
        elif bias is not None:
            torch.baddbmm(bias.to(out.dtype).expand_as(out), a, b, out=out)
        else:
            torch.bmm(a, b, out=out)
    elif accumulate:
        out.addmm_(a, b)
    elif bias is not None:
        torch.addmm(bias.to(out.dtype), a, b, out=out)
    else:
        torch.mm(a, b, out=out)


def _scaled(a, b, sa, sb, bias, out, accumulate):
    bias = None if bias is None else bias.reshape(-1)
    row = sa.numel() > 1 or sb.numel() > 1
    if row:
        sa, sb = sa.reshape(-1, 1), sb.reshape(1, -1)
    cpu = not device_side(out)
    if not accumulate and (cpu or not row or out.dtype == torch.bfloat16) and \
            not (cpu and row and not cpu_rowwise_scaled_mm()):
        sa, bias = _aligned(sa), _bias_for(bias, out)
        # Only a contiguous out= is written in place, on every device (torch's CPU kernel
        # writes a strided view's values elsewhere and leaves the view unwritten)
        if out.is_contiguous():
            torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out.dtype, out=out)
        else:
            out.copy_(torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out.dtype))
        return
    prod = scaled_product(a, b, sa, sb, portable=not cpu)
    if accumulate:
        out.add_(prod)
        return
    if bias is not None:
        prod.add_(bias)
    out.copy_(prod)


def scaled_product(a, b, sa, sb, *, portable: bool = False) -> torch.Tensor:
    """``(a * sa) @ (b * sb)`` in float32. ``portable``: row-wise scales multiply a unit-scaled
    float32 product (GPUs whose row-wise ``torch._scaled_mm`` writes bfloat16 only)."""
    row = sa.numel() > 1 or sb.numel() > 1
    portable = portable or (row and not device_side(a) and not cpu_rowwise_scaled_mm())
    if not (row and portable):
        return torch._scaled_mm(a, b, _aligned(sa), sb, out_dtype=torch.float32)
    one = torch.ones((), dtype=torch.float32, device=a.device)
    prod = torch._scaled_mm(a, b, one, one, out_dtype=torch.float32)
    return prod.mul_(sa.reshape(-1, 1)).mul_(sb.reshape(1, -1))


@functools.cache
def cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU ``torch._scaled_mm`` takes row-wise scales (torch 2.11's takes
    tensor-wise ones only: ficco then multiplies a unit-scaled float32 product by them)."""
    fp8 = torch.float8_e4m3fn
    a, b = torch.zeros(16, 16).to(fp8), torch.zeros(16, 16).to(fp8).t()
    try:
        torch._scaled_mm(a, b, torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def _aligned(scale):
    # cuBLAS's row-wise kernels want 16-byte aligned scales; a slice of the gathered ones
    # may start anywhere.
    if scale.numel() > 1 and scale.data_ptr() % 16 and device_side(scale):
        return scale.clone()
    return scale


def _bias_for(bias, out):
    # GPU kernels add a bias of the output's own 16-bit type; the CPU any float type.
    if bias is None or not device_side(out) or out.dtype not in (torch.bfloat16,
                                                                     torch.float16):
        return bias
    return bias.to(out.dtype)


def wide_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The dtype partial sums of an ``out_dtype`` output add up in: float32, float64 for
    float64 (references and tests)."""
    return torch.float64 if out_dtype == torch.float64 else torch.float32


def finish(out: torch.Tensor, out_dtype: torch.dtype, bias=None, activation: str = ""
           ) -> torch.Tensor:
    """The one rounding of a float32 (float64) output whose partial sums are all in: add the
    bias, apply the activation, cast to ``out_dtype`` (in place when it is the same)."""
    if bias is not None:
        out.add_(bias.reshape(1, -1))
    activate(out, activation)
    return out if out.dtype == out_dtype else out.to(out_dtype)
