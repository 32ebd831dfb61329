"""``all_to_all(a @ b)``: the op spec (the QKV projection's output, sequence shards to head
shards). ``scatter_dim`` and ``gather_dim`` are dims of the product."""
from __future__ import annotations

from ..examples import Example, generator, randn
from .layout import MATMUL_ALL_TO_ALL
from .schedules import SCHEDULES
from .spec import UlyssesSpec, all_to_all


class MatmulAllToAll(UlyssesSpec):
    name = MATMUL_ALL_TO_ALL
    schedules = SCHEDULES[MATMUL_ALL_TO_ALL]

    def example(self, rank, world, shape, rounding, seed) -> Example:
        """The QKV projection: every rank's ``(m, k)`` sequence shard and the shared ``(k, n)``
        weight, the product's columns scattered and its rows gathered; ``inputs``: (every
        shard, b) in float64."""
        m, k, n = shape
        gen = generator(seed)
        cast = [rounding.cast(randn(gen, m, k)) for _ in range(world)]
        b_low, b64, _ = rounding.weight(randn(gen, k, n))
        return Example(rank, world, (cast[rank][0], b_low), {"scatter_dim": 1, "gather_dim": 0},
                       ([c[1] for c in cast], b64))

    def reference(self, example: Example):
        """Column chunk ``rank`` of every rank's product, stacked in rank order."""
        shards, b = example.inputs
        return (all_to_all([s @ b for s in shards], 1, 0, example.rank),
                all_to_all([s.abs() @ b.abs() for s in shards], 1, 0, example.rank))


SPEC = MatmulAllToAll()
