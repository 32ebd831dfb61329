"""Schedules of ``matmul_reduce_scatter``: the same names as the all-gather's, run backwards
(the GEMM produces partials, the transport moves them to their owners, ``Reduce`` ops sum)."""
from __future__ import annotations

from .baselines import Ring, Serial
from .ficco import Ficco

SCHEDULES = (Serial(), Ring(), Ring(bidirectional=True),
             *(Ficco(u, f, t) for t in (False, True) for u in (True, False) for f in (True, False)))

__all__ = ["SCHEDULES", "Serial", "Ring", "Ficco"]
