"""Contention (the paper's CIL, §IV-D): how much a GEMM and the copies beside it slow each other.

These are *rates*: the speed of each op while both run, over its speed alone. The simulator
applies them only while the ops overlap, so an op overlapped for part of its life is slowed for
that part. The constants (``cil`` in a profile) are calibrated by replaying the paper's Fig. 8
experiments as they ran (one step's GEMM and one step's all-gather started together, each op's
whole time over its time alone; ``ficco.bench.predictors.fig8_cil``), not by equating the
published whole-op ratios with the rates: on compute-heavy shapes the all-gather covers a small
part of the GEMM, so the published 1.11x is a diluted rate.

Example::

    >>> from ficco.heuristics import profiles
    >>> prof = profiles.load("mi300x")
    >>> gemm_side, copy_side = dma_contention(prof, 0.9, prof.copy_engines)
    >>> gemm_side > 1 and copy_side > 1
    True
"""
from __future__ import annotations

from . import gemm as gemm_cost


def mt_factor(profile, traffic_bytes: float) -> float:
    """s(MT) in [0, 1): how exposed a GEMM of this memory traffic is to contention; it rises
    steeply (``cil.mt_exp``) around ``cil.mt_half_bytes``, about the last-level cache size.

    >>> from ficco.heuristics import profiles
    >>> prof = profiles.load("mi300x")
    >>> mt_factor(prof, prof.cil["mt_half_bytes"])
    0.5
    """
    cil = profile.cil
    e = cil["mt_exp"]
    return traffic_bytes ** e / (traffic_bytes ** e + cil["mt_half_bytes"] ** e)


def shard_mt_factor(profile, problem, n: int) -> float:
    """s(MT) of every GEMM of ``problem`` with ``n`` columns: the MT of one shard's rows,
    ``(M / W) x n x K``, the GEMM the paper's Fig. 8 measured contention on (8-way M-sharded)
    and correlated with its MT. A piece of the same GEMM, 64-way or a fused step, streams its
    operands at the same rate per FLOP, so it is priced as exposed as the shard's GEMM; s(MT)
    of the piece's own bytes would call small pieces nearly immune and large steps fully
    exposed.

    >>> from ficco.heuristics import profiles
    >>> from ficco.heuristics.scenarios import table_i_problem
    >>> 0 < shard_mt_factor(profiles.load("mi300x"), table_i_problem("g6"), 1024) < 1
    True
    """
    rows = max(problem.big_m // max(problem.world, 1), 1)
    return mt_factor(profile, gemm_cost.traffic_bytes(rows, n, problem.k, problem.itemsize))


def dma_contention(profile, gemm_mt_factor: float, copies: int) -> tuple[float, float]:
    """(GEMM slowdown, copy slowdown) while a GEMM of contention factor ``gemm_mt_factor``
    (:func:`mt_factor`) runs beside ``copies`` DMA copies (paper §IV-D, Fig. 8): rates while
    both run. The GEMM's grows with the copies' traffic, ``(copies / copy_engines) **
    cil.gemm_copies_exp``; each copy's with the GEMM's, ``s(MT) ** cil.copy_mt_power``, and
    only weakly with the number of copies (``cil.copy_copies_exp``).

    >>> from ficco.heuristics import profiles
    >>> prof = profiles.load("mi300x")
    >>> one, seven = dma_contention(prof, 0.8, 1), dma_contention(prof, 0.8, 7)
    >>> 1 < one[0] < seven[0] and 1 < one[1] <= seven[1]
    True
    """
    if copies <= 0:
        return 1.0, 1.0
    cil = profile.cil
    streams = min(copies, profile.copy_engines) / profile.copy_engines
    copy_side = gemm_mt_factor ** cil["copy_mt_power"]
    return (1 + cil["dma_gemm"] * gemm_mt_factor * streams ** cil["gemm_copies_exp"],
            1 + cil["dma_copy"] * copy_side * streams ** cil["copy_copies_exp"])
