"""``all_to_all(a @ b)``: the op spec (the QKV projection's output, sequence shards to head
shards). ``scatter_dim`` and ``gather_dim`` are dims of the product."""
from __future__ import annotations

from .layout import MATMUL_ALL_TO_ALL
from .schedules import SCHEDULES
from .spec import UlyssesSpec


class MatmulAllToAll(UlyssesSpec):
    name = MATMUL_ALL_TO_ALL
    schedules = SCHEDULES[MATMUL_ALL_TO_ALL]


SPEC = MatmulAllToAll()
