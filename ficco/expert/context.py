"""The rows of one expert-parallel call that its host tasks read (``Buffers.expert``).

An expert-parallel plan names work by (source rank, chunk), never by rows: the rows are data
(the routing counts), resolved here at launch from the call's agreed
:class:`~ficco.expert.problem.Layout`. A chunk is a row chunk (``1d``) or a column chunk
(``2d``) of every block, :func:`~ficco.expert.problem.piece_of`; the columns a ``2d`` chunk
cuts are those that cross the links (dispatch: K, combine: n).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .problem import DISPATCH, Layout, piece_of


@dataclass
class ExpertContext:
    """What the host tasks of one call read besides the rest of its
    :class:`~ficco.buffers.Buffers` (its ``group``, and its ``symm`` through ``Buffers.peer``).
    Dispatch: ``inp`` is x (T, K), ``out`` is y (R, n) (float32 when a ``2d`` plan
    accumulates bf16/fp16 products into it), ``landing`` receives the peers' rows in y's order
    (R, K), ``shared`` is this rank's symmetric copy of x (dma; peers pull from theirs).
    Combine: ``inp`` is h (R, K2), ``out`` is z (T, n2), ``shared`` holds this rank's products
    in h's order (symmetric with dma, peers pull their rows from it)."""

    kind: str
    layout: Layout
    rank: int
    inp: torch.Tensor
    weights: list
    out: torch.Tensor
    shared: torch.Tensor | None = None
    landing: torch.Tensor | None = None
    stacked: torch.Tensor | None = None     # (L, K, n) when torch._grouped_mm runs

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def experts(self) -> int:
        return self.layout.experts

    @property
    def shared_name(self) -> str:
        """The name ``Buffers.peer`` knows ``shared`` by."""
        return "gathered" if self.kind == DISPATCH else "partial"

    @property
    def moved_cols(self) -> int:
        return self.inp.shape[1] if self.kind == DISPATCH else self.out.shape[1]

    # landing (dispatch) and shared (combine; dma: dispatch too) exist wherever rows travel:
    # None only in a world of one with ccl, whose plans have no piece that reads them.
    def landed(self) -> torch.Tensor:
        """``landing``, where a peer's rows are read or written."""
        assert self.landing is not None, "dispatch lands its peers' rows in landing"
        return self.landing

    def staged(self) -> torch.Tensor:
        """``shared``, where a peer's rows are read or written."""
        assert self.shared is not None, "rows that travel are staged in shared"
        return self.shared

    def _piece(self, rows: int, chunk, two_d: bool) -> tuple[int, int, slice]:
        r0, rn, c0, cn = piece_of(rows, self.moved_cols, self.world, chunk, two_d)
        return r0, (rn if cn else 0), slice(c0, c0 + cn)

    # -- the rows of one piece of work -------------------------------------------------------
    def local_experts(self, experts: tuple[int, ...] | None) -> range | tuple[int, ...]:
        """The local experts an op covers: ``experts``, or every one (None)."""
        return range(self.experts) if experts is None else experts

    def pulls(self, peer: int, chunk: int | None, two_d: bool, src_buf: torch.Tensor,
              experts: tuple[int, ...] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) blocks ``peer`` contributes to this rank in ``chunk``, for
        ``experts`` (None: all; ``src_buf``: ``peer``'s copy of the symmetric buffer; 2d:
        strided column blocks)."""
        lay, r, big_l, out = self.layout, self.rank, self.experts, []
        for l in self.local_experts(experts):
            if self.kind == DISPATCH:   # peer's rows for my expert l -> block (l, peer)
                rows = lay.block_rows(r, l, peer)
                src0, dst0, dst = lay.send_offset(peer, r * big_l + l), \
                    lay.block_offset(r, l, peer), self.landed()
            else:                       # my rows back from peer's expert l -> where they were
                rows = lay.block_rows(peer, l, r)
                src0, dst0, dst = lay.block_offset(peer, l, r), \
                    lay.send_offset(r, peer * big_l + l), self.out
            c0, cn, cols = self._piece(rows, chunk, two_d)
            if cn:
                out.append((dst[dst0 + c0: dst0 + c0 + cn, cols],
                            src_buf[src0 + c0: src0 + c0 + cn, cols]))
        return out

    def gemm_pieces(self, sources, chunk, two_d: bool,
                    experts: tuple[int, ...] | None = None) -> list[tuple]:
        """(local expert, rows in, weight, rows out) of blocks ``(l, s)`` for s in
        ``sources`` and l in ``experts`` (None: all): 2d dispatch multiplies K columns ``c``
        by weight rows ``c`` (partial products, accumulated), 2d combine makes output
        columns ``c``."""
        lay, r, big_l, out = self.layout, self.rank, self.experts, []
        for l in self.local_experts(experts):
            for s in sources:
                c0, cn, cols = self._piece(lay.block_rows(r, l, s), chunk, two_d)
                if not cn:
                    continue
                at = lay.block_offset(r, l, s) + c0
                home = lay.send_offset(r, r * big_l + l) + c0   # the own block in x / z
                if self.kind == DISPATCH:
                    a = self.inp[home: home + cn] if s == r else self.landed()[at: at + cn]
                    out.append((l, a[:, cols], self.weights[l][cols], self.out[at: at + cn]))
                else:
                    dst = self.out[home: home + cn] if s == r else self.staged()[at: at + cn]
                    out.append((l, self.inp[at: at + cn], self.weights[l][:, cols],
                                dst[:, cols]))
        return out

    def stacked_piece(self, chunk, two_d: bool) -> torch.Tensor | None:
        """The (L, K, n) weights cut like :meth:`gemm_pieces` cuts each one (None without)."""
        if self.stacked is None or not two_d:
            return self.stacked
        _, _, cols = self._piece(1, chunk, True)
        return self.stacked[:, cols] if self.kind == DISPATCH else self.stacked[:, :, cols]

    def exchange_pieces(self, chunk, two_d: bool, send_to: int | None = None,
                        recv_from: int | None = None, experts: tuple[int, ...] | None = None
                        ) -> tuple[list[list], list[list]]:
        """Per peer, the blocks this rank sends it and those it receives from it in ``chunk``
        (the own rank's lists stay empty: its block never travels), for ``experts`` (None:
        all). ``send_to``/``recv_from`` (ring): only that peer's blocks, every other list
        empty."""
        lay, r, big_l, w = self.layout, self.rank, self.experts, self.world
        sends: list[list[torch.Tensor]] = [[] for _ in range(w)]
        recvs: list[list[torch.Tensor]] = [[] for _ in range(w)]
        for q in range(w):
            if q == r:
                continue
            for l in self.local_experts(experts):
                if self.kind == DISPATCH:
                    send_rows, send0 = lay.counts[r][q * big_l + l], \
                        lay.send_offset(r, q * big_l + l)
                    recv_rows, recv0 = lay.block_rows(r, l, q), lay.block_offset(r, l, q)
                    src, dst = self.inp, self.landed()
                else:
                    send_rows, send0 = lay.block_rows(r, l, q), lay.block_offset(r, l, q)
                    recv_rows, recv0 = lay.counts[r][q * big_l + l], \
                        lay.send_offset(r, q * big_l + l)
                    src, dst = self.staged(), self.out
                c0, cn, cols = self._piece(send_rows, chunk, two_d)
                if cn and send_to in (None, q):
                    sends[q].append(src[send0 + c0: send0 + c0 + cn, cols])
                c0, cn, cols = self._piece(recv_rows, chunk, two_d)
                if cn and recv_from in (None, q):
                    recvs[q].append(dst[recv0 + c0: recv0 + c0 + cn, cols])
        return sends, recvs
