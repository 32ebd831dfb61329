"""``chunked-{2,4,8}`` for ``matmul_all_reduce``: the GEMM cut into row chunks, each chunk
all-reduced while the next is computed. FlashOverlap's idea (its §3.2: signal a group of
finished GEMM waves and send it while the GEMM goes on) at the grain a library GEMM allows:
a chunk is one GEMM launch, and how many chunks is the model's choice among the three
registered counts (the paper's wave-group size is tuned by a predictor the same way: small
groups start sending early, large ones keep the links efficient).

Chunks are ``even_split(M, C)`` row ranges, the same on every rank; empty ones (M < C) are
skipped on every rank alike. Each chunk's all-reduce is ``two-shot``'s (:mod:`.shots`) over its
rows: over ``dma`` a barrier once every rank computed the chunk, the pulls of this rank's piece
of it and their sum, a barrier, the pulls of the peers' sums; over ``ccl`` one all-reduce
collective per chunk (NCCL's, in place in ``out`` when nothing else is added there)::

    for c:  G(c+1)  ||  all-reduce(c)            the host issues G(c+1) before chunk c's moves

    copy0..   |    |b|P0|  |b|Q0 |b|P1|  |b|Q1 |b|P2| …
    compute   |G0|G1 |R0|G2    |R1|G3 …                      (C = 4, dma)
    comm      |    |AR0 |AR1 |AR2 |AR3|                       (ccl)

Each chunk's reduction lands in its own rows of ``recv`` (no chunk overwrites another's
landing rows while it may still be read).
"""
from __future__ import annotations

from dataclasses import dataclass

from ....plan import COMM, AllReduce, Plan
from ....plan.problem import Problem, even_split
from ....schedules.common import avg_scale, pad_barriers
from . import common
from .shots import two_shot_rows

#: the chunk counts registered (``chunked-2`` …): the model picks among them per GEMM
CHUNK_COUNTS = (2, 4, 8)


@dataclass(frozen=True)
class Chunked:
    chunks: int = 4
    op = "matmul_all_reduce"

    @property
    def name(self) -> str:
        return f"chunked-{self.chunks}"

    def plan(self, problem: Problem, transport: str = "dma",
             copy_engines: int | None = None) -> Plan:
        builder, whole = common.begin(self.name, problem, transport, copy_engines)
        if whole:
            return builder.build()
        p = problem
        ranges = [(start, count) for start, count in even_split(p.m, self.chunks) if count]
        dma = transport == "dma"
        target = "partial" if dma or not common.straight_to_out(p) else "out"
        if dma:
            pad_barriers(builder, 2 * len(ranges) + 1)
        engines = copy_engines or p.world - 1
        reads, recv_row0 = [], 0
        gemms = common.gemms(builder, *ranges[0], target, step=0) if ranges else []
        for c, (start, count) in enumerate(ranges):
            # The next chunk's GEMMs first: the compute queue never waits for the host to
            # issue this chunk's copies.
            ahead = common.gemms(builder, *ranges[c + 1], target, step=c + 1) \
                if c + 1 < len(ranges) else []
            if dma:
                more, used = two_shot_rows(builder, start, count, gemms, engines=engines,
                                           recv_row0=recv_row0, step=c)
                reads += more
                recv_row0 += used
            else:
                for j in range(len(p.ns)):
                    builder.add(AllReduce(COMM, common.rows(p, target, j, (start, count)),
                                          common.rows(p, "out", j, (start, count)), step=c,
                                          scale=avg_scale(p)), after=gemms)
            gemms = ahead
        if dma:
            common.close(builder, transport, reads)
        return builder.build()
