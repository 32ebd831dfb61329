"""The canonical form of one all-gather + matmul call.

Every call is reduced to one shape: rank ``r`` holds ``m`` rows of ``K`` columns (its shard
with ``gather_dim`` moved to the front and leading dims flattened); the gathered matrix has
``M = W * m`` rows, rank ``r``'s rows at ``[r*m, (r+1)*m)``; each ``b_j`` is ``(K, n_j)``.
Schedules, selectors and the simulator see only this :class:`Problem`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidArgumentError

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


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


@dataclass(frozen=True)
class Problem:
    """One rank's view of ``all_gather(A, dim=0) @ b_j`` for every ``j``.

    ``m``: rows of each rank's shard; ``k``: inner dimension; ``ns``: columns of each ``b``;
    ``world``: group size W; ``rank``: this rank; ``dtype``: torch dtype name.
    """

    m: int
    k: int
    ns: tuple[int, ...]
    dtype: str
    world: int
    rank: int = 0

    def __post_init__(self):
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

    @property
    def big_m(self) -> int:
        """Rows of the gathered matrix, M = W * m."""
        return self.world * self.m

    @property
    def n_total(self) -> int:
        return sum(self.ns)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def shard_row0(self, rank: int) -> int:
        """First row of ``rank``'s shard in the gathered matrix."""
        return rank * self.m

    def row_chunks(self) -> list[tuple[int, int]]:
        """The W row chunks (start, rows) of one shard, relative to the shard (1D FiCCO)."""
        return even_split(self.m, self.world)

    def col_chunks(self) -> list[tuple[int, int]]:
        """The W column chunks (start, cols) of K (2D FiCCO)."""
        return even_split(self.k, self.world)

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
        """Bytes each rank receives in the all-gather: (W - 1) * m * K * itemsize."""
        return (self.world - 1) * self.m * self.k * self.itemsize

    def key(self) -> tuple:
        """The part of the problem a decision may depend on (rank excluded on purpose: every
        rank must reach the same decision)."""
        return (self.m, self.k, self.ns, self.dtype, self.world)
