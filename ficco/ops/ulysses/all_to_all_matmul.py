"""``all_to_all(a) @ b``: the op spec (before the output projection, head shards back to
sequence shards). ``scatter_dim`` and ``gather_dim`` are dims of ``a``."""
from __future__ import annotations

from ..examples import Example, generator, randn
from .layout import ALL_TO_ALL_MATMUL
from .schedules import SCHEDULES
from .spec import UlyssesSpec, all_to_all


class AllToAllMatmul(UlyssesSpec):
    name = ALL_TO_ALL_MATMUL
    schedules = SCHEDULES[ALL_TO_ALL_MATMUL]

    def example(self, rank, world, shape, rounding, seed) -> Example:
        """The output projection's input: every rank's ``(W*m, k)`` head shard, its rows
        scattered and its columns gathered as the GEMM's K (``W*k``), times the shared
        ``(W*k, n)`` weight; ``inputs``: (every shard, b) in float64."""
        m, k, n = shape
        gen = generator(seed)
        cast = [rounding.cast(randn(gen, world * m, k)) for _ in range(world)]
        b_low, b64, _ = rounding.weight(randn(gen, world * k, n))
        return Example(rank, world, (cast[rank][0], b_low), {"scatter_dim": 0, "gather_dim": 1},
                       ([c[1] for c in cast], b64))

    def reference(self, example: Example):
        """Row chunk ``rank`` of every rank's shard, side by side in rank order, times b."""
        shards, b = example.inputs
        gathered = all_to_all(shards, 0, 1, example.rank)
        return gathered @ b, gathered.abs() @ b.abs()


SPEC = AllToAllMatmul()
