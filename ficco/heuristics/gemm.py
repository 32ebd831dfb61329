"""GEMM time on a device profile, priced the way vendor GEMM libraries run a GEMM.

cuBLAS and hipBLASLt do not use one tile for every shape: for each call their heuristics pick
a kernel (output tile ``tile_m x tile_n``, and split-K when the output alone cannot fill the
machine). This model does the same, cheaply:

- **Tiles.** ``dil["tiles"]`` lists the tile shapes the library has, each with the fraction of
  the compute unit's peak it sustains (small tiles reuse operands less, so run slower). The
  model prices every tile and keeps the fastest, as a library's heuristic would.
- **Waves, with a fractional last wave.** Output tiles are dealt to ``compute_units`` in waves.
  A full machine runs at ``gemm_efficiency`` of peak (clocks drop under full load, memory is
  shared); a partial wave runs its fewer tiles faster, up to ``partial_wave_speedup`` times.
  So 2.05 waves cost max(2.05, 3 / speedup) wave-times rather than 3.
- **Split-K, only where the library would.** When the tiles fill less than
  ``split_k_below_waves`` of one wave and K is long (each part keeps at least
  ``split_k_min_k``), K is cut in 2 to ``split_k_max`` (at most 64) parts, paying the float32
  partial sums' reduction through HBM, or through the last-level cache for the part that fits
  (``llc_bytes`` at ``llc_bytes_per_s``; the library's workspace is reused call after call). With ``split_k_rule: "hipblaslt_auto"`` the split is
  the one hipBLASLt's standard libraries compute (``ContractionSolution::calculateAutoGSU``):
  ``min(CUs // tiles, K // (3 * depth_u))``, cut to what ``split_k_workspace_bytes`` holds
  of float32 partial outputs, instead of the best one.
- **Per tile and per launch.** Each tile pays ``tile_k_overhead`` extra K steps (prologue,
  epilogue); each launch pays ``launch_s``.
- **Roofline.** Never faster than its memory traffic (A, B, and C, read too when the GEMM
  accumulates) at ``gemm_memory_efficiency`` of HBM bandwidth (GEMM epilogues stream C
  slower than a copy kernel moves memory; ``memory_efficiency`` when not given).
- **Chunking a GEMM that feeds a collective** (a schedule's per-step or per-peer GEMMs) costs
  what the pieces above add up to, nothing else: each chunk is a launch of its own (its
  ``launch_s``), its own waves (a chunk's last wave is as quantized as a whole GEMM's, so
  ``W`` chunks of ``tiles / W`` tiles can take ``W`` partial waves where the whole took one
  full one) and its own roofline (every chunk reads all of B again: ``W`` chunks move
  ``W x K x N`` weight bytes).
- **The kernel library** (``library``): ``None`` prices the profile's vendor library (the tile
  menu above, cuBLAS's or hipBLASLt's); ``"deepgemm"`` prices DeepGEMM's persistent SM90 bf16
  kernels (:func:`deepgemm_tiles`): a grid of one block per SM, block sizes from 64 rows and
  16 columns up (its candidate list), no split-K.
- **Concurrency.** :func:`gemm_cost` also says how much of the machine the launch holds
  (``units``: the fraction of compute units its first wave covers) and how much of its time
  is spent waiting on HBM (``hbm``: memory time over total): two GEMMs on two streams share
  the machine by these (:mod:`ficco.heuristics.simulator`).

Example::

    >>> from ficco.heuristics import profiles
    >>> p = profiles.load("h100")
    >>> whole = gemm_seconds(p, "bfloat16", [8192], 8192, 8192, 2)
    >>> 8 * gemm_seconds(p, "bfloat16", [1024], 8192, 8192, 2) > whole
    True
"""
from __future__ import annotations

import math
from typing import NamedTuple

#: Split-K factors a library considers, as hipBLASLt's GSU and cuBLAS's split-K kernels do.
SPLITS = (2, 4, 8, 16, 32, 64)


class GemmCost(NamedTuple):
    """One GEMM launch: ``seconds`` in all (launch included), its ``compute_s`` and
    ``memory_s`` sides, the fraction of compute units its first wave holds (``units``) and the
    fraction of its time HBM is the bottleneck (:attr:`hbm`)."""

    seconds: float
    compute_s: float
    memory_s: float
    units: float

    @property
    def hbm(self) -> float:
        busy = max(self.compute_s, self.memory_s)
        return self.memory_s / busy if busy else 0.0


def gemm_seconds(profile, dtype: str, block_rows: list[int], n: int, k: int, itemsize: int,
                 accumulate: bool = False, out_itemsize: int | None = None,
                 library: str | None = None) -> float:
    """Seconds of ONE GEMM launch computing ``block_rows`` row blocks (a strided batch, all
    with the same ``n`` columns and ``k`` inner extent) on ``profile``.

    >>> from ficco.heuristics import profiles
    >>> round(gemm_seconds(profiles.load("mi300x"), "bfloat16", [0], 128, 128, 2), 9)
    0.0
    """
    return gemm_cost(profile, dtype, block_rows, n, k, itemsize, accumulate, out_itemsize,
                     library).seconds


def gemm_cost(profile, dtype: str, block_rows: list[int], n: int, k: int, itemsize: int,
              accumulate: bool = False, out_itemsize: int | None = None,
              library: str | None = None) -> GemmCost:
    """:func:`gemm_seconds` with its parts (:class:`GemmCost`)."""
    rows = sum(block_rows)
    if rows == 0 or n == 0 or k == 0:
        return GemmCost(0.0, 0.0, 0.0, 0.0)
    menu = deepgemm_tiles(profile, dtype, itemsize) if library == "deepgemm" else tiles(profile)
    splits = library != "deepgemm"
    compute_s, units = min(_tile_seconds(profile, dtype, block_rows, n, k, tile, splits)
                           for tile in menu)
    memory_s = memory_seconds(profile, rows, n, k, itemsize, accumulate, out_itemsize)
    return GemmCost(profile.dil["launch_s"] + max(compute_s, memory_s), compute_s, memory_s,
                    units)


def memory_seconds(profile, rows: int, n: int, k: int, itemsize: int,
                   accumulate: bool = False, out_itemsize: int | None = None) -> float:
    """The roofline's memory side: A, B and C (twice when accumulating) once through HBM."""
    dil = profile.dil
    efficiency = dil.get("gemm_memory_efficiency") or dil["memory_efficiency"]
    return traffic_bytes(rows, n, k, itemsize, accumulate, out_itemsize) / (
        profile.hbm_bytes_per_s * efficiency)


def traffic_bytes(rows: int, n: int, k: int, itemsize: int, accumulate: bool = False,
                  out_itemsize: int | None = None) -> int:
    """The GEMM's static memory traffic MT = (MK + KN + MN) x itemsize (paper §IV-D), with C
    read as well when it accumulates; ``out_itemsize`` when C is wider than A and B (a float32
    output that low-precision partial sums accumulate into)."""
    out_itemsize = itemsize if out_itemsize is None else out_itemsize
    return (rows * k + k * n) * itemsize + rows * n * (2 if accumulate else 1) * out_itemsize


def tiles(profile) -> list[tuple[int, int, float]]:
    """The profile's tile menu as (tile_m, tile_n, sustained fraction) triples; a profile that
    names one tile (``tile_m``/``tile_n``) has a menu of one."""
    dil = profile.dil
    menu = dil.get("tiles")
    if not menu:
        return [(int(dil["tile_m"]), int(dil["tile_n"]), 1.0)]
    return [(int(tm), int(tn), float(eff)) for tm, tn, eff in menu]


def deepgemm_tiles(profile, dtype: str, itemsize: int) -> list[tuple[int, int, float]]:
    """DeepGEMM's SM90 block candidates for a bf16 GEMM with a bf16 output
    (``csrc/jit_kernels/heuristics/sm90.hpp``, ``get_layout_candidates``): ``block_m`` 64, 128
    or 256, ``block_n`` 16 to 256 in steps of 16, not both above 128, and at least 3 pipeline
    stages of ``(block_m + block_n) x block_k`` operands (4 below ``128 x 192``) beside the
    ``block_m x block_n`` output in its 232,448 B of shared memory (``block_k`` = 128 B of
    elements). Each block's sustained fraction is what its operand feed allows
    (:func:`feed_fraction`).

    >>> from ficco.heuristics import profiles
    >>> menu = deepgemm_tiles(profiles.load("h20"), "bfloat16", 2)
    >>> (64, 32, 1.0) in menu, any(m > 128 and n > 128 for m, n, _ in menu)
    (True, False)
    """
    smem, block_k = 232448, 128 // itemsize
    menu = []
    for tm in (64, 128, 256):
        for tn in range(16, 257, 16):
            if tm > 128 and tn > 128:
                continue
            out = -(-tm * tn * itemsize // 1024) * 1024
            stages = (smem - out - 16 * 8 * 2) // ((tm + tn) * block_k * itemsize)
            if stages < 3 or (tm * tn < 128 * 192 and stages < 4):
                continue
            menu.append((tm, tn, feed_fraction(profile, dtype, tm, tn, itemsize)))
    return menu


def feed_fraction(profile, dtype: str, tile_m: int, tile_n: int, itemsize: int) -> float:
    """The fraction of a compute unit's peak a ``tile_m x tile_n`` block sustains when its
    operands come from L2 at ``l2_bytes_per_s_per_unit`` (profile ``dil``; DeepGEMM's SM90
    heuristic models 64 B per cycle per SM): each K step loads ``(tile_m + tile_n) x itemsize``
    bytes for ``2 x tile_m x tile_n`` FLOPs. 1.0 where the profile gives no L2 bandwidth.

    >>> from ficco.heuristics import profiles
    >>> h20 = profiles.load("h20")
    >>> feed_fraction(h20, "bfloat16", 64, 64, 2), round(feed_fraction(h20, "bfloat16", 64, 16, 2), 2)
    (1.0, 0.85)
    """
    feed = profile.dil.get("l2_bytes_per_s_per_unit")
    if not feed:
        return 1.0
    unit_flops = profile.flops(dtype) / profile.compute_units
    intensity = 2 * tile_m * tile_n / ((tile_m + tile_n) * itemsize)
    return min(1.0, feed * intensity / unit_flops)


def _tile_seconds(profile, dtype, block_rows, n, k, tile, splits=True) -> tuple[float, float]:
    """(seconds, fraction of compute units held) of the GEMM with ``tile``, its best split."""
    tile_m, tile_n, tile_eff = tile
    dil, units = profile.dil, profile.compute_units
    count = sum(math.ceil(r / tile_m) for r in block_rows if r) * math.ceil(n / tile_n)
    # One compute unit's sustained FLOP/s with this tile when the whole machine is busy.
    unit_flops = profile.flops(dtype) * dil["gemm_efficiency"] * tile_eff / units
    best, held = math.inf, 1.0
    candidates: tuple[int, ...]
    if not splits:
        candidates = (1,)
    elif dil.get("split_k_rule") == "hipblaslt_auto":
        candidates = (auto_gsu(profile, count, k, tile_m * tile_n),)
    else:
        candidates = (1,) + tuple(s for s in SPLITS if _library_splits(profile, count, k, s))
    for split in candidates:
        tile_s = 2 * tile_m * tile_n * (k / split + dil["tile_k_overhead"]) / unit_flops
        waves = count * split / units
        wave_s = tile_s * max(waves, math.ceil(waves) / dil["partial_wave_speedup"])
        reduce_s = 0.0
        if split > 1:   # float32 partial sums written and read back once
            reduce_s = partials_seconds(profile, split * sum(block_rows) * n * 4)
        if wave_s + reduce_s < best:
            best, held = wave_s + reduce_s, min(1.0, waves)
    return best, held


def partials_seconds(profile, nbytes: float) -> float:
    """Writing split-K's ``nbytes`` of float32 partial sums and reading them back once. The
    part that fits in the last-level cache (``llc_bytes``, e.g. MI300X's 256 MB Infinity
    Cache) moves at its bandwidth (``llc_bytes_per_s``): the library's workspace is reused call
    after call, so its partial sums stay there; the rest goes through HBM.

    >>> from ficco.heuristics import profiles
    >>> mi = profiles.load("mi300x")
    >>> partials_seconds(mi, 64e6) < partials_seconds(profiles.load("h100"), 64e6)
    True
    """
    efficiency = profile.dil["memory_efficiency"]
    cached = min(nbytes, profile.llc_bytes) if profile.llc_bytes_per_s else 0.0
    seconds = 2 * (nbytes - cached) / (profile.hbm_bytes_per_s * efficiency)
    if cached:
        seconds += 2 * cached / (profile.llc_bytes_per_s * efficiency)
    return seconds


def auto_gsu(profile, tile_count: int, k: int, tile_area: int) -> int:
    """hipBLASLt's automatic split (GlobalSplitU) for a kernel of ``tile_count`` output tiles:
    as many K parts as leave every tile's parts one compute unit each, keeping 3 unrolled
    K steps (``depth_u``) per part, and no more than the workspace holds in float32 partial
    outputs (PyTorch hands hipBLASLt 76 MiB).

    >>> from ficco.heuristics import profiles
    >>> auto_gsu(profiles.load("mi300x"), 56, 131072, 256 * 256)
    5
    """
    dil = profile.dil
    split = min(max(1, profile.compute_units // tile_count),
                max(1, int(k // dil.get("depth_u", 64) // 3)))
    if split > 1:
        workspace = dil.get("split_k_workspace_bytes", 76 * 2 ** 20)
        split = min(split, int(workspace // (tile_count * tile_area * 4)))
    return max(1, split)


def _library_splits(profile, tile_count: int, k: int, split: int) -> bool:
    """Split-K is a library's answer to too few output tiles and a long K, nothing else."""
    dil = profile.dil
    return (tile_count < dil["split_k_below_waves"] * profile.compute_units
            and k / split >= dil["split_k_min_k"]
            and split <= dil["split_k_max"]
            and tile_count * split <= 2 * profile.compute_units)
