"""The canonical form of one expert-parallel call: who sends how many rows to which expert.

W ranks, L local experts per rank, E = W*L global experts; global expert ``e`` lives on rank
``e // L`` as local expert ``e % L``. ``counts[s][e]`` is how many of rank s's rows go to global
expert e (rank s's rows are sorted by global expert, so they are ``E`` consecutive runs).

- **Dispatch** (``all_to_all_grouped_mm``): rank r receives the rows of its L experts from
  every rank, laid out *by local expert, then source rank* (torch's ``all_to_all_vdev_2d``
  layout): block ``(l, s)`` holds ``counts[s][r*L + l]`` rows, and every block is multiplied by
  ``w[l]``.
- **Combine** (``grouped_mm_all_to_all``): the exact inverse: block ``(l, s)`` of rank r's
  rows, times ``w2[l]``, goes back to rank s, into the rows it came from.

Two objects, on purpose:

- :class:`Layout` is the exact routing of one call (the agreed matrix): every offset the host
  tasks need. Execution reads it per call, so a plan never depends on the counts.
- :class:`ExpertProblem` is what selectors, the simulator and plan caches see. Its identity
  (``==``, ``hash``) leaves the counts out: one plan serves every routing. Its ``counts`` are a
  *representative* matrix built from a bucketed summary of the real one (:func:`summary`), so
  a decision depends only on the bucket, identically on every rank.

>>> lay = Layout(((1, 2, 0, 3), (4, 0, 1, 1)), experts=2)
>>> lay.recv_rows(0), lay.block_offset(0, 0, 1), lay.send_offset(1, 2)
(7, 1, 4)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from ...errors import InvalidArgumentError
from ...plan.problem import ITEMSIZE, DtypeFields, bucket, even_split

DISPATCH = "all_to_all_grouped_mm"
COMBINE = "grouped_mm_all_to_all"


def chunk_of(rows: int, world: int, chunk: int | None) -> tuple[int, int]:
    """(start, rows) of chunk ``chunk`` of a block of ``rows`` rows cut in ``world`` pieces
    (the FiCCO chunk rule, longer pieces first); ``None`` is the whole block.

    >>> chunk_of(10, 4, 2), chunk_of(10, 4, None)
    ((6, 2), (0, 10))
    """
    if chunk is None:
        return 0, rows
    return even_split(rows, world)[chunk]


def piece_of(rows: int, cols: int, world: int, chunk: int | None,
             two_d: bool) -> tuple[int, int, int, int]:
    """(first row, rows, first column, columns) of chunk ``chunk`` of a ``rows x cols`` block:
    a row chunk (1d) or a column chunk (2d), the other extent whole.

    >>> piece_of(10, 8, 4, 1, False), piece_of(10, 8, 4, 1, True)
    ((3, 3, 0, 8), (0, 10, 2, 2))
    """
    if two_d:
        return (0, rows, *chunk_of(cols, world, chunk))
    return (*chunk_of(rows, world, chunk), 0, cols)


@dataclass(frozen=True)
class Layout:
    """The agreed routing of one call: ``counts`` is the W x E matrix (rank s's row gives how
    many of its rows go to each global expert); ``experts`` is L."""

    counts: tuple[tuple[int, ...], ...]
    experts: int

    @property
    def world(self) -> int:
        return len(self.counts)

    @cached_property
    def _send_starts(self) -> tuple[tuple[int, ...], ...]:
        out = []
        for row in self.counts:
            starts, at = [], 0
            for c in row:
                starts.append(at)
                at += c
            out.append(tuple(starts + [at]))
        return tuple(out)

    @cached_property
    def _recv_starts(self) -> tuple[tuple[tuple[tuple[int, ...], ...], int], ...]:
        """Per receiving rank q: per local expert l, per source s, the block's first row in
        q's dispatch output (grouped by local expert, then source); plus q's total rows."""
        out: list[tuple[tuple[tuple[int, ...], ...], int]] = []
        big_l = self.experts
        for q in range(self.world):
            at, blocks = 0, []
            for l in range(big_l):
                starts = []
                for s in range(self.world):
                    starts.append(at)
                    at += self.counts[s][q * big_l + l]
                blocks.append(tuple(starts))
            out.append((tuple(blocks), at))
        return tuple(out)

    def send_rows(self, rank: int) -> int:
        """Rows rank ``rank`` sends (its T)."""
        return self._send_starts[rank][-1]

    def send_offset(self, rank: int, expert: int) -> int:
        """First row of global expert ``expert``'s run in rank ``rank``'s input."""
        return self._send_starts[rank][expert]

    def recv_rows(self, rank: int) -> int:
        """Rows rank ``rank`` receives and multiplies (its R)."""
        return self._recv_starts[rank][1]

    def block_rows(self, rank: int, local: int, source: int) -> int:
        """Rows of block ``(local, source)`` on rank ``rank``."""
        return self.counts[source][rank * self.experts + local]

    def block_offset(self, rank: int, local: int, source: int) -> int:
        """First row of block ``(local, source)`` in rank ``rank``'s dispatch output."""
        return self._recv_starts[rank][0][local][source]

    def expert_rows(self, rank: int, local: int) -> tuple[int, int]:
        """(first row, rows) of local expert ``local`` in rank ``rank``'s dispatch output."""
        start = self.block_offset(rank, local, 0)
        return start, sum(self.block_rows(rank, local, s) for s in range(self.world))

    def recv_counts(self, rank: int) -> list[list[int]]:
        """The (L, W) ``recv_counts`` rank ``rank`` returns."""
        return [[self.block_rows(rank, l, s) for s in range(self.world)]
                for l in range(self.experts)]

    @property
    def max_send_rows(self) -> int:
        return max(self.send_rows(s) for s in range(self.world))

    @property
    def max_recv_rows(self) -> int:
        return max(self.recv_rows(q) for q in range(self.world))


# -- the problem selectors see -------------------------------------------------------------
def ratio_bucket(ratio: float) -> float:
    """Round an imbalance ratio (max over mean, >= 1) up to a half octave: 1, 1.5, 2, 3, 4, 6 …"""
    if ratio <= 1:
        return 1.0
    level = math.ceil(2 * math.log2(ratio) - 1e-9)
    return float(2 ** (level // 2) * (1.5 if level % 2 else 1.0))


def summary(counts) -> tuple[int, float]:
    """The bucketed summary decisions depend on: (rows per (source, expert) entry on average,
    bucketed; the largest entry over that mean, bucketed)."""
    flat = [c for row in counts for c in row]
    mean = sum(flat) / max(len(flat), 1)
    if mean <= 0:
        return 0, 1.0
    return bucket(mean), ratio_bucket(max(flat) / mean)


def representative(world: int, experts: int, mean_rows: int, ratio: float):
    """A W x E matrix with ``summary`` ``(mean_rows, ratio)``: every entry ``mean_rows``, and
    global expert 0 (rank 0's first) ``ratio`` times that from every source: the slow rank a
    skewed router makes."""
    hot = round(mean_rows * ratio)
    return tuple(tuple(hot if e == 0 else mean_rows for e in range(world * experts))
                 for _ in range(world))


def check_op(op, owner: str) -> None:
    """``op`` must name an expert op (``owner``: what takes it, for the message)."""
    if op not in (DISPATCH, COMBINE):
        raise InvalidArgumentError(f"{owner}.op must be one of {(DISPATCH, COMBINE)}; got "
                                   f"{op!r}")


@dataclass(frozen=True)
class ExpertProblem(DtypeFields):
    """One rank's view of an expert-parallel call, as schedules, selectors and the simulator
    see it. ``k``: columns of the rows moved and multiplied; ``n``: columns of each weight;
    ``experts``: L; ``counts``: a W x E matrix (excluded from ``==`` and ``hash``, see the
    module docstring).

    >>> p = ExpertProblem(8, 4, 2, "float32", 2, counts=((1, 2, 0, 3), (4, 0, 1, 1)))
    >>> p == ExpertProblem(8, 4, 2, "float32", 2), p.big_m, p.ns
    (True, 7, (4, 4))
    """

    k: int
    n: int
    experts: int
    dtype: str
    world: int
    rank: int = 0
    op: str = DISPATCH
    counts: tuple = field(default=(), compare=False, hash=False)

    def __post_init__(self):
        check_op(self.op, "ExpertProblem")
        if self.k <= 0 or self.n <= 0 or self.experts <= 0:
            raise InvalidArgumentError(f"ExpertProblem needs k, n and experts > 0; got "
                                       f"k={self.k}, n={self.n}, experts={self.experts}")
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise InvalidArgumentError(f"ExpertProblem needs 0 <= rank < world; got "
                                       f"rank={self.rank}, world={self.world}")
        if self.dtype not in ITEMSIZE:
            raise InvalidArgumentError(f"dtype {self.dtype!r} is not supported; use one of "
                                       f"{sorted(ITEMSIZE)}")
        if self.counts and (len(self.counts) != self.world or any(
                len(row) != self.world * self.experts for row in self.counts)):
            raise InvalidArgumentError(
                f"ExpertProblem.counts must be {self.world} x {self.world * self.experts}")

    @classmethod
    def for_call(cls, k: int, n: int, layout: Layout, dtype: str, rank: int, op: str):
        """The problem a call with ``layout`` is decided and planned by: the representative
        of the layout's bucketed summary."""
        mean_rows, ratio = summary(layout.counts)
        counts = representative(layout.world, layout.experts, mean_rows, ratio)
        return cls(k, n, layout.experts, dtype, layout.world, rank, op, counts)

    @cached_property
    def layout(self) -> Layout:
        counts = self.counts or tuple((0,) * (self.world * self.experts)
                                      for _ in range(self.world))
        return Layout(counts, self.experts)

    # -- what selectors, decisions and the simulator read ----------------------------------
    @property
    def reduces(self) -> bool:
        return False

    @property
    def all_reduces(self) -> bool:
        return False

    @property
    def ns(self) -> tuple[int, ...]:
        """One weight per local expert, all ``n`` wide."""
        return (self.n,) * self.experts

    @property
    def n_total(self) -> int:
        """Columns each row is multiplied into (one expert per row)."""
        return self.n

    @property
    def output_elements(self) -> int:
        """Elements of y (R, n) or z (T, n): one output for all experts."""
        return self.big_m * self.n if self.op == DISPATCH else \
            self.layout.send_rows(self.rank) * self.n

    @property
    def moved_cols(self) -> int:
        """Columns of the rows that cross the links: dispatch moves x (K), combine the
        products (n). ``2d`` schedules cut these columns."""
        return self.k if self.op == DISPATCH else self.n

    @property
    def m(self) -> int:
        """Rows this rank sends (dispatch) or multiplies (combine)."""
        return self.layout.send_rows(self.rank) if self.op == DISPATCH else \
            self.layout.recv_rows(self.rank)

    @property
    def big_m(self) -> int:
        """Rows this rank multiplies: the rows it received (dispatch) or holds (combine)."""
        return self.layout.recv_rows(self.rank)

    @property
    def flops(self) -> int:
        return 2 * self.big_m * self.k * self.n

    @property
    def gemm_bytes(self) -> int:
        """MT of the grouped GEMM: its rows, every expert's weight and its output, once."""
        return (self.big_m * self.k + self.experts * self.k * self.n + self.big_m * self.n) \
            * self.itemsize

    @property
    def otb(self) -> float:
        return self.flops / max(self.gemm_bytes, 1)

    @property
    def gather_bytes(self) -> int:
        """Bytes this rank receives from its peers."""
        lay, r = self.layout, self.rank
        if self.op == DISPATCH:
            rows = lay.recv_rows(r) - sum(lay.block_rows(r, l, r) for l in range(self.experts))
            return rows * self.k * self.itemsize
        rows = lay.send_rows(r) - sum(lay.counts[r][r * self.experts + l]
                                      for l in range(self.experts))
        return rows * self.n * self.itemsize

    def key(self) -> tuple:
        """What a decision may depend on: the shapes and the bucketed routing summary (rank
        excluded: every rank reaches the same decision)."""
        return (self.op, self.k, self.n, self.experts, self.dtype, self.world,
                summary(self.counts) if self.counts else (0, 1.0))
