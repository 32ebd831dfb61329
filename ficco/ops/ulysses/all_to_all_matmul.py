"""``all_to_all(a) @ b``: the op spec (before the output projection, head shards back to
sequence shards). ``scatter_dim`` and ``gather_dim`` are dims of ``a``."""
from __future__ import annotations

from .layout import ALL_TO_ALL_MATMUL
from .schedules import SCHEDULES
from .spec import UlyssesSpec


class AllToAllMatmul(UlyssesSpec):
    name = ALL_TO_ALL_MATMUL
    schedules = SCHEDULES[ALL_TO_ALL_MATMUL]


SPEC = AllToAllMatmul()
