"""Dispatch: ``y, recv_counts = all_to_all_grouped_mm(x, counts, w)``, the op spec.

Rank r's ``x`` (T, K) holds its rows sorted by global expert, ``counts[e]`` of them for global
expert e (E = W*L entries, sum T). Rank r receives the rows of its L experts from every rank,
grouped by local expert, then source rank (torch's ``all_to_all_vdev_2d`` layout), and returns
each block times ``w[l]``: ``y`` (R, n) and ``recv_counts`` (L, W). The ``dma`` workspace holds
x (every rank's copy addressable by its peers, who pull their rows from it).
"""
from __future__ import annotations

import torch

from ..examples import Example, generator, randn
from . import routing
from .problem import DISPATCH
from .schedules.all_to_all import schedules_of
from .spec import EXAMPLE_EXPERTS, ExpertCall, ExpertSpec, example_routing
from .tasks import ExpertContext


class AllToAllGroupedMm(ExpertSpec):
    name = DISPATCH
    schedules = schedules_of(DISPATCH)

    def check_part(self, counts, rows: int, world: int, big_l: int, rank: int) -> list:
        row = routing.as_int_list(counts, "counts", (None,))
        return routing.check_counts(row, rows=rows, experts_total=world * big_l,
                                    name=f"counts (world {world} x {big_l} local experts)")

    def assemble(self, parts: list, call: ExpertCall) -> list:
        return parts

    def shared_shape(self, call: ExpertCall) -> tuple[int, int]:
        return call.agreed_layout().max_send_rows, call.problem.k

    def context(self, call: ExpertCall, symm, wide: bool = False) -> ExpertContext:
        lay, r, x = call.agreed_layout(), call.rank, call.inp
        rows = lay.recv_rows(r)
        shared = None
        if symm is not None:
            shared = symm.get_buffer(r, self.shared_shape(call), x.dtype)
        landing = x.new_empty(rows, x.shape[1]) if call.world > 1 else None
        out = x.new_empty(rows, call.n, dtype=torch.float32 if wide else x.dtype)
        return ExpertContext(DISPATCH, lay, r, x, call.weights, out, shared, landing, call.stacked)

    def finish(self, call: ExpertCall, ctx: ExpertContext):
        """``(y, recv_counts, received or None, routing)``: ``received`` (with
        ``return_received``) is the rows y was made from, in y's order (for the weight
        gradient); ``routing`` the agreed W x E matrix (the handle combine may take)."""
        lay, r = ctx.layout, ctx.rank
        received = None
        if call.return_received:
            received = ctx.landing if ctx.landing is not None else ctx.inp
            if ctx.landing is not None:   # the own blocks never travelled: put them in place
                for l in range(lay.experts):
                    rows, at = lay.block_rows(r, l, r), lay.block_offset(r, l, r)
                    home = lay.send_offset(r, r * lay.experts + l)
                    received[at: at + rows].copy_(ctx.inp[home: home + rows])
        recv_counts = torch.tensor(lay.recv_counts(r), dtype=torch.int64)
        y = ctx.out if ctx.out.dtype == ctx.inp.dtype else ctx.out.to(ctx.inp.dtype)
        return y, recv_counts, received, torch.tensor(lay.counts, dtype=torch.int64)

    # -- the oracle ---------------------------------------------------------------------------
    def example(self, rank, world, shape, rounding, seed) -> Example:
        """Every rank's tokens ``x`` (about ``m`` rows, routed to the W*L experts by
        :func:`example_routing`) and ``L`` experts' ``(k, n)`` weights per rank; ``inputs``:
        (the routing, every rank's x, every rank's weights) in float64."""
        m, k, n = shape
        counts = example_routing(world, m, seed)
        gen = generator(seed + 1)
        xs = [rounding.cast(randn(gen, sum(c), k)) for c in counts]
        ws = [[rounding.cast(randn(gen, k, n) / k ** 0.5) for _ in range(EXAMPLE_EXPERTS)]
              for _ in range(world)]
        return Example(rank, world, (xs[rank][0], torch.tensor(counts[rank]),
                                     torch.stack([w[0] for w in ws[rank]])), {},
                       (counts, [x[1] for x in xs], [[w[1] for w in r] for r in ws]))

    def reference(self, example: Example):
        """For each of this rank's experts, then each source rank: the rows that rank sent
        it (its x in expert order) times the expert's weight."""
        counts, xs, ws = example.inputs
        rank, world = example.rank, example.world
        n = ws[rank][0].shape[1]
        blocks, scales = [], []
        for local, w in enumerate(ws[rank]):
            e = rank * len(ws[rank]) + local
            for s in range(world):
                at = sum(counts[s][:e])          # x's rows are in global-expert order
                rows = xs[s][at: at + counts[s][e]]
                blocks.append(rows @ w)
                scales.append(rows.abs() @ w.abs())
        if not blocks:
            empty = torch.zeros(0, n, dtype=torch.float64)
            return empty, empty
        return torch.cat(blocks), torch.cat(scales)


SPEC = AllToAllGroupedMm()
