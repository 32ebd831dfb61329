"""Schedules of ``matmul_reduce_scatter``: the same names as the all-gather's, run backwards
(the GEMM produces partials, the transport moves them to their owners, ``Reduce`` ops sum)."""
from __future__ import annotations

from ....schedules.common import Schedule
from .baselines import Ring, Serial
from .ficco import Ficco

# Reductions per step or once at the end, whichever the simulator predicts faster (see
# docs/reduce_scatter.md): per step for ring and the fused 1d points (up to 10 % on H100/MI300X
# graph replays, where they beat serial), at the end for the unfused and 2d points (never
# slower there, 1-4 % faster: fewer ops beside the copies).
SCHEDULES: tuple[Schedule, ...] = (
    Serial(), Ring(), Ring(bidirectional=True),
    *(Ficco(u, f, t, reduce_each_step=f and not t)
      for t in (False, True) for u in (True, False) for f in (True, False)))

__all__ = ["SCHEDULES", "Ficco", "Ring", "Serial"]
