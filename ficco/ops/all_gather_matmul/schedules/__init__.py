"""The all-gather's schedules: serial, ring, ring-bidir, the FiCCO family; gated (Triton's,
optional)."""
from __future__ import annotations

from ....schedules.common import OptionalSchedule, Schedule
from .ficco import FICCO_SCHEDULES
from .gated import GATED_SCHEDULES
from .ring import Ring
from .serial import Serial

SCHEDULES: tuple[Schedule, ...] = (Serial(), Ring(), Ring(bidirectional=True), *FICCO_SCHEDULES)
#: need Triton: get() knows them, names() leaves them out (see ficco.schedules)
OPTIONAL: tuple[OptionalSchedule, ...] = GATED_SCHEDULES

__all__ = ["OPTIONAL", "SCHEDULES"]
