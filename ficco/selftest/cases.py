"""What ``selftest`` feeds each op and what it expects back: every rank makes every rank's
inputs from one seed (so it knows the whole problem), casts its own to the dtype under test,
and computes its own block of the result in float64 from the *rounded* inputs, with the
rounding scale ``|a| @ |b|`` the error is measured against (as tests/reference.py does).

One builder per op, keyed by the op's name; an op that ficco registers and no builder knows
is reported as a failed check ("no selftest case"), never skipped silently.

``shape`` is ``(m, k, n)``: rows per rank (the all-gather's shard, the reduce-scatter's block,
the expert ops' tokens per rank), the contraction, the output columns.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: worst row error over its rounding scale accepted per dtype (tests/reference.py's ROW_TOL;
#: fp8 outputs are bf16, and their inputs are rounded before the reference is computed)
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 6e-3, "float8": 3e-2}
#: local experts per rank in the expert ops' cases
EXPERTS = 2


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


class _Rounding:
    """Casts float64 values to the dtype under test and back, with fp8's tensor-wise scale."""

    def __init__(self, dtype_name: str, fp8_dtype, device):
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
        return {} if not self.fp8 else {"a_scale": a_scale, "b_scale": b_scale,
                                        "out_dtype": torch.bfloat16}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _all_gather_matmul(rank, world, shape, rounding, seed) -> Case:
    m, k, n = shape
    gen = _gen(seed)
    shards = [torch.randn(m, k, generator=gen, dtype=torch.float64) for _ in range(world)]
    b = torch.randn(k, n, generator=gen, dtype=torch.float64)
    if rounding.fp8:    # one tensor-wise a_scale on every rank: over all shards
        shared = rounding.scale_of(torch.cat(shards))
        cast = [rounding.cast(s, shared) for s in shards]
    else:
        cast = [rounding.cast(s) for s in shards]
    b_low, b64, b_scale = rounding.weight(b)
    full = torch.cat([c[1] for c in cast])
    return Case((cast[rank][0], b_low), rounding.epilogue(cast[rank][2], b_scale), full @ b64,
                full.abs() @ b64.abs())


def _reduced(scatter: bool, rank, world, shape, rounding, seed) -> Case:
    """matmul_reduce_scatter (``scatter``: rank r gets rows block r) or matmul_all_reduce:
    every rank holds a (W*m, k) slice and b (k, n); the result is the sum of a_r @ b_r."""
    from ..plan.problem import even_split

    m, k, n = shape
    gen = _gen(seed)
    parts = [(torch.randn(world * m, k, generator=gen, dtype=torch.float64),
              torch.randn(k, n, generator=gen, dtype=torch.float64)) for _ in range(world)]
    cast = [(rounding.cast(a), rounding.weight(b)) for a, b in parts]
    ref = sum(a[1] @ b[1] for a, b in cast)
    scale = sum(a[1].abs() @ b[1].abs() for a, b in cast)
    if scatter:
        start, rows = even_split(world * m, world)[rank]
        ref, scale = ref[start:start + rows], scale[start:start + rows]
    (a_low, _, a_scale), (b_low, _, b_scale) = cast[rank]
    return Case((a_low, b_low), rounding.epilogue(a_scale, b_scale), ref, scale)


def _routing(world, m, seed):
    """Every rank's rows per global expert (some zero), about ``m`` rows per rank."""
    gen = _gen(seed)
    counts = []
    for _ in range(world):
        rows = int(torch.randint(max(0, m - 2), m + 3, (1,), generator=gen))
        picks = torch.randint(0, world * EXPERTS, (rows,), generator=gen)
        counts.append(torch.bincount(picks, minlength=world * EXPERTS).tolist())
    return counts


def _dispatch(rank, world, shape, rounding, seed) -> Case:
    from ..ops.expert.problem import Layout

    m, k, n = shape
    counts = _routing(world, m, seed)
    gen = _gen(seed + 1)
    xs = [rounding.cast(torch.randn(sum(c), k, generator=gen, dtype=torch.float64))
          for c in counts]
    ws = [[rounding.cast(torch.randn(k, n, generator=gen, dtype=torch.float64) / k ** 0.5)
           for _ in range(EXPERTS)] for _ in range(world)]
    lay = Layout(tuple(tuple(c) for c in counts), experts=EXPERTS)
    blocks, scales = [], []
    for local in range(EXPERTS):
        w64 = ws[rank][local][1]
        for s in range(world):
            at = lay.send_offset(s, rank * EXPERTS + local)
            rows = xs[s][1][at: at + counts[s][rank * EXPERTS + local]]
            blocks.append(rows @ w64)
            scales.append(rows.abs() @ w64.abs())
    w_low = torch.stack([w[0] for w in ws[rank]])
    ref = torch.cat(blocks) if blocks else torch.zeros(0, n, dtype=torch.float64)
    return Case((xs[rank][0], torch.tensor(counts[rank]), w_low), {}, ref,
                torch.cat(scales) if scales else ref)


def _combine(rank, world, shape, rounding, seed) -> Case:
    from ..ops.expert.problem import Layout

    m, k, n = shape
    counts = _routing(world, m, seed)
    lay = Layout(tuple(tuple(c) for c in counts), experts=EXPERTS)
    gen = _gen(seed + 2)
    hs = [rounding.cast(torch.randn(lay.recv_rows(r), k, generator=gen, dtype=torch.float64))
          for r in range(world)]
    ws = [[rounding.cast(torch.randn(k, n, generator=gen, dtype=torch.float64) / k ** 0.5)
           for _ in range(EXPERTS)] for _ in range(world)]
    parts, scales = [], []
    for e, rows in enumerate(counts[rank]):      # this rank's rows, in its own order
        owner, local = divmod(e, EXPERTS)
        at = lay.block_offset(owner, local, rank)
        h = hs[owner][1][at: at + rows]
        parts.append(h @ ws[owner][local][1])
        scales.append(h.abs() @ ws[owner][local][1].abs())
    w_low = torch.stack([w[0] for w in ws[rank]])
    recv = torch.tensor(lay.recv_counts(rank))
    ref = torch.cat(parts)
    return Case((hs[rank][0], recv, w_low), {}, ref, torch.cat(scales))


def _matmul_all_to_all(rank, world, shape, rounding, seed) -> Case:
    """Ulysses' QKV projection: every rank's (m, k) sequence shard times the shared (k, n)
    weight; rank r gets column chunk r of every rank's product, stacked in rank order."""
    from ..plan.problem import even_split

    m, k, n = shape
    gen = _gen(seed)
    cast = [rounding.cast(torch.randn(m, k, generator=gen, dtype=torch.float64))
            for _ in range(world)]
    b_low, b64, _ = rounding.weight(torch.randn(k, n, generator=gen, dtype=torch.float64))
    start, cols = even_split(n, world)[rank]
    ref = torch.cat([c[1] @ b64[:, start:start + cols] for c in cast])
    scale = torch.cat([c[1].abs() @ b64[:, start:start + cols].abs() for c in cast])
    return Case((cast[rank][0], b_low), {"scatter_dim": 1, "gather_dim": 0}, ref, scale)


def _all_to_all_matmul(rank, world, shape, rounding, seed) -> Case:
    """Ulysses' output projection: every rank's (W*m, k) head shard; rank r gets row chunk r
    of every rank's, side by side in rank order (K = W*k), times the shared (W*k, n) weight."""
    from ..plan.problem import even_split

    m, k, n = shape
    gen = _gen(seed)
    cast = [rounding.cast(torch.randn(world * m, k, generator=gen, dtype=torch.float64))
            for _ in range(world)]
    b_low, b64, _ = rounding.weight(torch.randn(world * k, n, generator=gen,
                                                dtype=torch.float64))
    start, rows = even_split(world * m, world)[rank]
    gathered = torch.cat([c[1][start:start + rows] for c in cast], dim=1)
    return Case((cast[rank][0], b_low), {"scatter_dim": 0, "gather_dim": 1}, gathered @ b64,
                gathered.abs() @ b64.abs())


#: op name -> builder(rank, world, shape, rounding, seed) -> Case
BUILDERS: dict[str, Callable[..., Case]] = {
    "all_gather_matmul": _all_gather_matmul,
    "matmul_reduce_scatter": functools.partial(_reduced, True),
    "matmul_all_reduce": functools.partial(_reduced, False),
    "all_to_all_grouped_mm": _dispatch,
    "grouped_mm_all_to_all": _combine,
    "matmul_all_to_all": _matmul_all_to_all,
    "all_to_all_matmul": _all_to_all_matmul,
}
#: ops whose cases take fp8 operands with tensor-wise scales
SCALED = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


def build(op: str, rank: int, world: int, shape, dtype_name: str, seed: int, device,
          fp8_dtype=None) -> Case:
    """The case of ``op`` for this rank (KeyError: no builder knows ``op``)."""
    return BUILDERS[op](rank, world, tuple(shape), _Rounding(dtype_name, fp8_dtype, device),
                        seed)


def op_function(op: str):
    """The public function that runs ``op`` (``ficco.<op>``)."""
    import ficco

    return getattr(ficco, op)
