"""ficco: collectives hidden behind the GEMMs of parallel models (all-gather + matmul, matmul +
reduce-scatter or all-reduce, all-to-all + grouped GEMMs), on NVIDIA, AMD and CPU.

>>> import ficco
>>> c = ficco.all_gather_matmul(a_shard, w)          # doctest: +SKIP
>>> print(ficco.explain(a_shard, w))                 # doctest: +SKIP

Submodules load when first used, so ``import ficco`` stays cheap and ``ficco.float8``,
``ficco.rng.ShardRNG``, ``ficco.parallel`` or ``ficco.bench`` work without importing them:

>>> ficco.rng.ShardRNG.__name__
'ShardRNG'
"""
from __future__ import annotations

import importlib
import importlib.util

from . import compat, config, errors, schedules, symm_mem
from .api import (
                  all_gather_matmul,
                  all_to_all_grouped_mm,
                  all_to_all_matmul,
                  explain,
                  grouped_mm_all_to_all,
                  matmul_all_reduce,
                  matmul_all_to_all,
                  matmul_reduce_scatter,
                  session_of,
                  shutdown,
                  warmup,
)

__version__ = "0.1.0"

__all__ = [
                  "__version__",
                  "all_gather_matmul",
                  "all_to_all_grouped_mm",
                  "all_to_all_matmul",
                  "compat",
                  "config",
                  "errors",
                  "explain",
                  "grouped_mm_all_to_all",
                  "matmul_all_reduce",
                  "matmul_all_to_all",
                  "matmul_reduce_scatter",
                  "schedules",
                  "session_of",
                  "shutdown",
                  "symm_mem",
                  "warmup",
]


def __getattr__(name: str):
    """``ficco.<submodule>`` imported on first use (PEP 562)."""
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
