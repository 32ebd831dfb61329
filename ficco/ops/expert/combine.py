"""Combine: ``z = grouped_mm_all_to_all(h, recv_counts, w2)``, the op spec: dispatch's exact
inverse.

Rank r's ``h`` (R, K2) is in dispatch's ``y`` order (by local expert, then source rank;
``recv_counts`` (L, W) as dispatch returned it). Block (l, s) times ``w2[l]`` goes back to
rank s, which receives ``z`` (T, n2) in its original row order. The ``dma`` workspace holds the
products (every rank's copy addressable by its peers, who pull their rows back from it).
Learning what comes back takes one bounded exchange, unless the caller passes
``send_counts=`` (dispatch's counts, whose routing a dispatch here agreed) or the routing.
"""
from __future__ import annotations

import torch

from ...errors import InvalidArgumentError
from ..examples import Example, generator, randn
from . import routing
from .problem import COMBINE
from .schedules.all_to_all import schedules_of
from .spec import EXAMPLE_EXPERTS, ExpertCall, ExpertSpec, example_routing
from .tasks import ExpertContext


class GroupedMmAllToAll(ExpertSpec):
    name = COMBINE
    schedules = schedules_of(COMBINE)

    def check_part(self, counts, rows: int, world: int, big_l: int, rank: int) -> list:
        part = routing.as_int_list(counts, "recv_counts", (big_l, world))
        if min(min(row) for row in part) < 0:
            raise InvalidArgumentError(f"recv_counts has negative entries ({part}); pass the "
                                       f"recv_counts dispatch returned")
        if sum(map(sum, part)) != rows:
            raise InvalidArgumentError(f"recv_counts sums to {sum(map(sum, part))} but h has "
                                       f"{rows} rows; h must be in dispatch's y order, with "
                                       f"the recv_counts dispatch returned")
        return part

    def check_send_counts(self, send_counts, call: ExpertCall) -> list:
        row = routing.as_int_list(send_counts, "send_counts", (None,))
        if len(row) != call.world * len(call.weights) or min(row, default=0) < 0:
            raise InvalidArgumentError(
                f"send_counts must be the counts dispatch took: {call.world * len(call.weights)} "
                f"non-negative entries; got {row}")
        if call.routing is None and call.world > 1:   # one rank knows its routing already
            rows = routing.recall(call.session, row, call.part)
            if rows is routing.MISSING:
                raise InvalidArgumentError(
                    f"send_counts={row} with recv_counts={call.part} is not the routing of a "
                    f"dispatch on this group in this process (or it was forgotten); drop "
                    f"send_counts= and combine learns the routing with one exchange")
            if rows is not None:   # None: a rank cannot tell two dispatches apart: exchange
                call.routing = [list(r) for r in rows]
        return row

    def assemble(self, parts: list, call: ExpertCall) -> list:
        world, big_l = call.world, len(call.weights)
        return [[parts[q][l][s] for q in range(world) for l in range(big_l)]
                for s in range(world)]

    def shared_shape(self, call: ExpertCall) -> tuple[int, int]:
        return call.agreed_layout().max_recv_rows, call.n

    def context(self, call: ExpertCall, symm, wide: bool = False) -> ExpertContext:
        lay, r, h = call.agreed_layout(), call.rank, call.inp
        if symm is not None:
            shared = symm.get_buffer(r, self.shared_shape(call), h.dtype)
        else:
            shared = h.new_empty(h.shape[0], call.n) if call.world > 1 else None
        return ExpertContext(COMBINE, lay, r, h, call.weights, h.new_empty(lay.send_rows(r), call.n),
                             shared, None, call.stacked)

    def finish(self, call: ExpertCall, ctx: ExpertContext):
        """``(z, routing)``: the rows back in this rank's order, and the agreed matrix."""
        return ctx.out, torch.tensor(ctx.layout.counts, dtype=torch.int64)

    # -- the oracle ---------------------------------------------------------------------------
    def example(self, rank, world, shape, rounding, seed) -> Example:
        """Every rank's ``h`` (the rows a dispatch of :func:`example_routing` delivered it, in
        its y order: by local expert, then source rank) and ``L`` experts' ``(k, n)`` weights
        per rank; ``inputs``: (the routing, every rank's h, every rank's weights) in
        float64."""
        m, k, n = shape
        counts = example_routing(world, m, seed)
        gen = generator(seed + 2)
        big_l = EXAMPLE_EXPERTS
        hs = [rounding.cast(randn(gen, sum(counts[s][r * big_l + l] for s in range(world)
                                           for l in range(big_l)), k)) for r in range(world)]
        ws = [[rounding.cast(randn(gen, k, n) / k ** 0.5) for _ in range(big_l)]
              for _ in range(world)]
        recv = torch.tensor([[counts[s][rank * big_l + l] for s in range(world)]
                             for l in range(big_l)])
        return Example(rank, world, (hs[rank][0], recv, torch.stack([w[0] for w in ws[rank]])),
                       {}, (counts, [h[1] for h in hs], [[w[1] for w in r] for r in ws]))

    def reference(self, example: Example):
        """This rank's rows back, in its own order (by global expert): each one's expert's
        output, ``h`` of the owner's block for this rank times the expert's weight."""
        counts, hs, ws = example.inputs
        rank, world = example.rank, example.world
        big_l = len(ws[0])
        parts, scales = [], []
        for e, rows in enumerate(counts[rank]):
            owner, local = divmod(e, big_l)
            # the owner's h: its local experts in turn, each one's source ranks in turn
            at = sum(counts[s][owner * big_l + l] for l in range(local) for s in range(world))
            at += sum(counts[s][e] for s in range(rank))
            h = hs[owner][at: at + rows]
            parts.append(h @ ws[owner][local])
            scales.append(h.abs() @ ws[owner][local].abs())
        return torch.cat(parts), torch.cat(scales)


SPEC = GroupedMmAllToAll()
