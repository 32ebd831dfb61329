"""The canonical form of one call of either op.

``all_gather_matmul``: rank ``r`` holds ``m`` rows of ``K`` columns (its shard with
``gather_dim`` moved to the front and leading dims flattened); the gathered matrix has
``M = W * m`` rows, rank ``r``'s rows at ``[r*m, (r+1)*m)``; each ``b_j`` is ``(K, n_j)``.

``matmul_reduce_scatter``: every rank holds all ``m = M`` rows of ``a`` (``scatter_dim``
moved to the front, leading dims flattened) but only its ``K``-row shard of each ``b_j``; rank
``r`` receives rows :meth:`Problem.block` ``(r)`` of ``sum over ranks of a_r @ b_j``. Blocks
follow the all-gather's chunk rule (:func:`even_split` over the ``M / unit`` slices of the
scattered dimension, longer pieces first), so when W divides the scattered dimension the
two ops are exact inverses of each other's layout.

Schedules, selectors and the simulator see only this :class:`Problem`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .errors import InvalidArgumentError

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
ALL_GATHER_MATMUL = "all_gather_matmul"
MATMUL_REDUCE_SCATTER = "matmul_reduce_scatter"
OPS = (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER)
REDUCE_OPS = ("sum", "avg")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def even_split(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous (start, length) pieces of ``range(total)``, lengths differing by at
    most one, longer pieces first. Pieces may be empty when ``total < parts``.

    >>> even_split(10, 4)
    [(0, 3), (3, 3), (6, 2), (8, 2)]
    """
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        length = base + (1 if i < extra else 0)
        out.append((start, length))
        start += length
    return out


class DtypeFields:
    """``itemsize`` and ``torch_dtype`` of a problem whose ``dtype`` is a torch dtype name."""

    dtype: str

    @cached_property      # read per op by the simulator: once per problem
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class Problem(DtypeFields):
    """One rank's view of one call: ``all_gather(A, dim=0) @ b_j`` for every ``j``
    (``op="all_gather_matmul"``), or ``reduce_scatter(a @ b_j)`` (``op="matmul_reduce_scatter"``).

    ``m``: rows of this rank's A operand (the shard for all-gather, all of ``a`` for
    reduce-scatter); ``k``: the local inner dimension; ``ns``: columns of each ``b``;
    ``world``: group size W; ``rank``: this rank; ``dtype``: torch dtype name.
    Reduce-scatter only: ``unit`` rows make one index of the scattered dimension (blocks are
    whole units), ``reduce_op`` is ``"sum"`` or ``"avg"``.

    >>> p = Problem(m=10, k=4, ns=(3,), dtype="float32", world=4, op="matmul_reduce_scatter")
    >>> [p.block(r) for r in range(4)]
    [(0, 3), (3, 3), (6, 2), (8, 2)]
    """

    m: int
    k: int
    ns: tuple[int, ...]
    dtype: str
    world: int
    rank: int = 0
    op: str = ALL_GATHER_MATMUL
    unit: int = 1
    reduce_op: str = "sum"

    def __post_init__(self):
        if self.op not in OPS:
            raise InvalidArgumentError(f"Problem.op must be one of {OPS}; got {self.op!r}")
        if self.reduce_op not in REDUCE_OPS:
            raise InvalidArgumentError(
                f"reduce_op must be one of {REDUCE_OPS}; got {self.reduce_op!r}")
        if self.unit < 1 or self.m % self.unit:
            raise InvalidArgumentError(
                f"Problem.unit must be >= 1 and divide m; got unit={self.unit}, m={self.m}")
        if self.m < 0 or self.k <= 0 or not self.ns or min(self.ns) <= 0:
            raise InvalidArgumentError(
                f"Problem needs m >= 0, k > 0 and every n > 0; got m={self.m}, k={self.k}, "
                f"ns={self.ns}")
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise InvalidArgumentError(
                f"Problem needs 0 <= rank < world; got rank={self.rank}, world={self.world}")
        if self.dtype not in _ITEMSIZE:
            raise InvalidArgumentError(
                f"dtype {self.dtype!r} is not supported; use one of {sorted(_ITEMSIZE)}")

    # The properties a call reads repeatedly are cached on the (frozen) instance.
    @cached_property
    def reduces(self) -> bool:
        """True for ``matmul_reduce_scatter``."""
        return self.op == MATMUL_REDUCE_SCATTER

    @cached_property
    def big_m(self) -> int:
        """Rows M of the local GEMM: the gathered matrix (W * m) or all of ``a`` (m)."""
        return self.m if self.reduces else self.world * self.m

    @cached_property
    def n_total(self) -> int:
        return sum(self.ns)

    def block(self, rank: int) -> tuple[int, int]:
        """(first row, rows) of ``rank``'s rows of the M-row matrix: its shard (all-gather) or
        the block it receives (reduce-scatter, whole ``unit`` s, longer blocks first)."""
        if not self.reduces:
            return rank * self.m, self.m
        start, length = even_split(self.m // self.unit, self.world)[rank]
        return start * self.unit, length * self.unit

    def shard_row0(self, rank: int) -> int:
        """First row of ``rank``'s shard in the gathered matrix."""
        return self.block(rank)[0]

    @cached_property
    def block_rows(self) -> int:
        """Rows of this rank's block (reduce-scatter output rows; the shard for all-gather)."""
        return self.block(self.rank)[1]

    def row_chunks(self, rows: int | None = None) -> list[tuple[int, int]]:
        """The W row chunks (start, rows) of one shard or block (``rows``, default m),
        relative to it (1D FiCCO)."""
        return even_split(self.m if rows is None else rows, self.world)

    def col_chunks(self, cols: int | None = None) -> list[tuple[int, int]]:
        """The W column chunks (start, cols) of K (2D all-gather) or of ``cols`` output
        columns (2D reduce-scatter)."""
        return even_split(self.k if cols is None else cols, self.world)

    @property
    def flops(self) -> int:
        """Floating-point operations of the whole local GEMM(s): 2 * M * K * sum(n)."""
        return 2 * self.big_m * self.k * self.n_total

    @property
    def gemm_bytes(self) -> int:
        """MT: bytes of the GEMM(s) read and written once, (M*K + K*n + M*n) * itemsize."""
        return (self.big_m * self.k + self.k * self.n_total + self.big_m * self.n_total) \
            * self.itemsize

    @property
    def otb(self) -> float:
        """OTB: op-to-byte ratio of the GEMM(s), flops / MT."""
        return self.flops / max(self.gemm_bytes, 1)

    @property
    def gather_bytes(self) -> int:
        """Bytes each rank receives: the all-gather's (W - 1) * m * K * itemsize, or the
        reduce-scatter's W - 1 partial blocks, (W - 1) * rows * sum(n) * itemsize."""
        if self.reduces:
            return (self.world - 1) * self.block_rows * self.n_total * self.itemsize
        return (self.world - 1) * self.m * self.k * self.itemsize

    def key(self) -> tuple:
        """The part of the problem a decision may depend on (rank excluded on purpose: every
        rank must reach the same decision). The reduce-scatter's starts with its op name; the
        all-gather's keeps its original 5-tuple (caches and tests key on it)."""
        if self.reduces:
            return (self.op, self.m, self.k, self.ns, self.dtype, self.world, self.unit,
                    self.reduce_op)
        return (self.m, self.k, self.ns, self.dtype, self.world)
