"""ficco: all-gather + matmul with the all-gather hidden behind the GEMM, on NVIDIA, AMD and CPU.

>>> import ficco
>>> c = ficco.all_gather_matmul(a_shard, w)          # doctest: +SKIP
>>> print(ficco.explain(a_shard, w))                 # doctest: +SKIP
"""
from __future__ import annotations

from . import compat, config, errors, schedules, symm_mem
from .api import (
                  all_gather_matmul,
                  all_to_all_grouped_mm,
                  explain,
                  grouped_mm_all_to_all,
                  matmul_reduce_scatter,
                  session_of,
                  shutdown,
)

__version__ = "0.1.0"

__all__ = [
                  "__version__",
                  "all_gather_matmul",
                  "all_to_all_grouped_mm",
                  "compat",
                  "config",
                  "errors",
                  "explain",
                  "grouped_mm_all_to_all",
                  "matmul_reduce_scatter",
                  "schedules",
                  "session_of",
                  "shutdown",
                  "symm_mem",
]
