"""ficco: all-gather + matmul with the all-gather hidden behind the GEMM, on NVIDIA, AMD and CPU.

>>> import ficco
>>> c = ficco.all_gather_matmul(a_shard, w)          # doctest: +SKIP
>>> print(ficco.explain(a_shard, w))                 # doctest: +SKIP
"""
from __future__ import annotations

from . import compat, config, errors, schedules, symm_mem
from .api import (all_gather_matmul, all_to_all_grouped_mm, explain, grouped_mm_all_to_all,
                  matmul_reduce_scatter, shutdown)

__version__ = "0.1.0"

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "all_to_all_grouped_mm",
           "grouped_mm_all_to_all", "explain", "shutdown", "schedules", "compat", "config",
           "errors", "symm_mem", "__version__"]
