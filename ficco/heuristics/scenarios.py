"""The GEMMs of the FiCCO paper's Table I, for selectors, the simulator and docs.

Each entry is the layer's whole GEMM ``(M, N, K)``: M tokens gathered over the group, a
weight of ``K x N``. Under sequence + tensor parallelism of degree W (the paper's setting),
rank r holds ``M / W`` rows of the activations and the column slice ``N / W`` of the weight,
so its local GEMM is ``(M x N/W x K)`` after the all-gather. That is the reading
:func:`table_i_problem` uses.

Example::

    >>> p = table_i_problem("g2", world=8)
    >>> p.m, p.k, p.ns, p.world
    (16384, 16384, (2048,), 8)
"""
from __future__ import annotations

from ..errors import InvalidArgumentError
from ..plan.problem import Problem

#: name -> (M, N, K), FiCCO paper Table I ("GEMMs occurring in real world scenarios").
PAPER_TABLE_I: dict[str, tuple[int, int, int]] = {
    "g1": (16384, 16384, 131072),     # SP+TP llama-3-405b
    "g2": (131072, 16384, 16384),     # SP+TP llama-3-405b
    "g3": (53248, 16384, 131072),     # SP+TP llama-3-405b
    "g4": (131072, 53248, 16384),     # SP+TP llama-3-405b
    "g5": (8192, 8192, 262144),       # SP+TP llama-2-70b
    "g6": (262144, 8192, 8192),       # SP+TP llama-2-70b
    "g7": (28672, 8192, 262144),      # SP+TP llama-2-70b
    "g8": (262144, 28672, 8192),      # SP+TP llama-2-70b
    "g9": (196608, 18432, 16384),     # SP+TP llama-3-405b
    "g10": (196608, 106496, 16384),   # SP+TP llama-3-405b
    "g11": (1048576, 10240, 8192),    # SP+TP llama-2-70b
    "g12": (1048576, 57344, 8192),    # SP+TP llama-2-70b
    "g13": (1607680, 57344, 8192),    # EP DeepSeek
    "g14": (147456, 28672, 4096),     # EP Mixtral
    "g15": (327680, 28672, 4096),     # EP Mixtral
    "g16": (229376, 28672, 4096),     # EP Mixtral
}


def gemm_problem(big_m: int, n: int, k: int, world: int, dtype: str = "bfloat16",
                 rank: int = 0) -> Problem:
    """The Problem of one rank for a layer GEMM ``(M, N, K)`` split over ``world`` ranks:
    ``m = M // world`` rows per shard and ``N // world`` weight columns per rank.

    >>> p = gemm_problem(1024, 512, 256, world=4)
    >>> p.m, p.k, p.ns
    (256, 256, (128,))
    """
    if big_m < world or n < world:
        raise InvalidArgumentError(
            f"GEMM (M={big_m}, N={n}, K={k}) cannot be split over world={world}: M and N must "
            f"be at least the world size")
    return Problem(big_m // world, k, (n // world,), dtype, world, rank)


def table_i_problem(name: str, world: int = 8, dtype: str = "bfloat16", scale: int = 1) -> Problem:
    """The Problem for Table I entry ``name`` (``"g1"`` … ``"g16"``); ``scale`` divides M."""
    if name not in PAPER_TABLE_I:
        raise InvalidArgumentError(f"unknown Table I scenario {name!r}; use one of "
                                   f"{', '.join(PAPER_TABLE_I)}")
    big_m, n, k = PAPER_TABLE_I[name]
    return gemm_problem(max(big_m // scale, world), n, k, world, dtype)
