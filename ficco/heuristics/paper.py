"""The ``paper`` selector: the FiCCO paper's rule (§V-C, Fig. 12a), under one stated reading.

The rule: when M <= K, cut by columns (``uniform-fused-2d``), because row chunks of a short,
deep GEMM lose the most to decomposition. Otherwise rank the GEMM by a "combined OTB and MT"
score against the machine's own combined OTB and MT: below ``low`` (1x) pick
``uniform-fused-1d`` (low DIL, high CIL: suits small, low-intensity GEMMs), above ``high``
(5x) pick ``hetero-unfused-1d`` (low CIL), in between ``hetero-fused-1d``.

The paper leaves the normalisation loose. **Our reading:**

- The GEMM's combined OTB·MT is the product of its op-to-byte ratio and its memory traffic,
  which is exactly its FLOP count: ``OTB x MT = 2 M n K``.
- The machine's combined OTB·MT is the paper's "op-to-byte x memory bandwidth = FLOPs", i.e.
  the ridge-point op-to-byte (peak FLOP/s / HBM bytes/s) times the bytes the HBM streams in a
  fixed window of :data:`MACHINE_WINDOW_S` (1 ms): the FLOPs the GPU can do at peak in 1 ms.
- score = GEMM FLOPs / (peak FLOP/s x 1 ms): the GEMM's ideal compute time in milliseconds.
  The thresholds (``FICCO_PAPER_LOW``, ``FICCO_PAPER_HIGH``) are therefore in milliseconds of
  ideal GEMM time.

Worked example, Table I g6 = (262144, 8192, 8192) at TP = 8 on MI300X in bf16: the local GEMM
is M = 262144, n = 8192 / 8 = 1024, K = 8192, so OTB·MT = 2·262144·1024·8192 = 4.40e12 FLOP.
MI300X: 1.3074e15 FLOP/s x 1 ms = 1.31e12 FLOP. score = 3.36: between 1 and 5, so
``hetero-fused-1d``. On H100 (9.894e14 FLOP/s) the same GEMM scores 4.45: also
``hetero-fused-1d``; g14 (3.3 ms on MI300X) likewise, while g2 (6.7) goes to
``hetero-unfused-1d``.

Example::

    >>> from ficco.heuristics import profiles
    >>> from ficco.heuristics.scenarios import table_i_problem
    >>> paper_choice(table_i_problem("g6"), profiles.load("mi300x"))[0]
    'hetero-fused-1d'
"""
from __future__ import annotations

from ..plan.problem import Problem
from .profiles import Profile

#: The window that turns the machine's FLOP/s into a FLOP count comparable with a GEMM's.
MACHINE_WINDOW_S = 1e-3


def combined_score(problem: Problem, profile: Profile) -> float:
    """The GEMM's OTB·MT over the machine's (see module doc): ideal GEMM milliseconds."""
    machine = profile.ridge_flops_per_byte(problem.dtype) * profile.hbm_bytes_per_s \
        * MACHINE_WINDOW_S
    return problem.otb * problem.gemm_bytes / machine


def paper_choice(problem: Problem, profile: Profile, low: float = 1.0,
                 high: float = 5.0) -> tuple[str, float, str]:
    """(schedule, score, reason) of the paper's rule with thresholds ``low`` < ``high``."""
    if problem.world == 1:
        return "serial", 0.0, "one rank: nothing to gather, a plain GEMM"
    score = combined_score(problem, profile)
    big_m, k = problem.big_m, problem.k
    if big_m <= k:
        return ("uniform-fused-2d", score,
                f"M={big_m} <= K={k}: column chunks (2D) lose less to decomposition")
    where = f"OTB*MT = {score:.2f}x the machine's ({profile.name}, 1 ms at peak)"
    if score < low:
        return "uniform-fused-1d", score, f"{where} < {low:g}: low-DIL schedule"
    if score > high:
        return "hetero-unfused-1d", score, f"{where} > {high:g}: low-CIL schedule"
    return "hetero-fused-1d", score, f"{where} within [{low:g}, {high:g}]"
