"""The all-to-all of Ulysses sequence parallelism, as one rank sees it.

``all_to_all(t)`` on a group of W ranks splits ``t`` into W chunks along ``scatter_dim``
(:func:`~ficco.plan.problem.even_split`: longer chunks first when W does not divide it),
sends chunk j to rank j and concatenates what arrives along ``gather_dim`` in rank order
(DeepSpeed-Ulysses' sequence all-to-all). The ranks' tensors agree in every dim but
``gather_dim``, whose length may differ per rank (``sizes``: every rank's, agreed).

:class:`UlyssesProblem` is what schedules, selectors and the simulator see: the shape of the
tensor that travels (``a`` for ``all_to_all_matmul``, ``a @ b`` for ``matmul_all_to_all``), its
two dims, the GEMM's ``k`` and ``n`` and every rank's length along ``gather_dim``. Plans name
work by peer only (the sizes are resolved by the host tasks at launch), so a plan never
depends on ``sizes``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...errors import InvalidArgumentError
from ...plan.problem import ITEMSIZE, DtypeFields, even_split

MATMUL_ALL_TO_ALL = "matmul_all_to_all"
ALL_TO_ALL_MATMUL = "all_to_all_matmul"
ULYSSES_OPS = (MATMUL_ALL_TO_ALL, ALL_TO_ALL_MATMUL)


def check_op(op: str, what: str) -> None:
    if op not in ULYSSES_OPS:
        raise InvalidArgumentError(f"{what} needs op in {ULYSSES_OPS}; got {op!r}")


def with_dim(shape: tuple, dim: int, length: int) -> tuple:
    """``shape`` with ``shape[dim]`` set to ``length``."""
    return (*shape[:dim], length, *shape[dim + 1:])


def numel(shape: tuple) -> int:
    return math.prod(shape)


@dataclass(frozen=True)
class UlyssesProblem(DtypeFields):
    """One rank's view of an Ulysses call. ``shape``: this rank's tensor that travels (``a``
    for ``all_to_all_matmul``, the product ``a @ b`` for ``matmul_all_to_all``); ``scatter``
    and ``gather``: its dims (non-negative, different); ``k`` and ``n``: the GEMM's inner and
    output widths; ``sizes``: every rank's length along ``gather`` (empty until agreed: plans
    never read it).

    >>> p = UlyssesProblem((6, 4, 8), 1, 0, 8, 16, "float32", 2, sizes=(6, 5))
    >>> p.chunk(1), p.recv_shape(1), p.out_shape
    ((2, 2), (5, 2, 8), (11, 2, 16))
    """

    shape: tuple
    scatter: int
    gather: int
    k: int
    n: int
    dtype: str
    world: int
    rank: int = 0
    op: str = ALL_TO_ALL_MATMUL
    sizes: tuple = field(default=(), compare=False, hash=False)

    def __post_init__(self):
        check_op(self.op, "UlyssesProblem")
        nd = len(self.shape)
        if not (0 <= self.scatter < nd and 0 <= self.gather < nd) or self.scatter == self.gather:
            raise InvalidArgumentError(f"UlyssesProblem needs two different dims of {self.shape};"
                                       f" got scatter={self.scatter}, gather={self.gather}")
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise InvalidArgumentError(f"UlyssesProblem needs 0 <= rank < world; got "
                                       f"rank={self.rank}, world={self.world}")
        if self.dtype not in ITEMSIZE:
            raise InvalidArgumentError(f"dtype {self.dtype!r} is not supported; use one of "
                                       f"{sorted(ITEMSIZE)}")
        if self.sizes and len(self.sizes) != self.world:
            raise InvalidArgumentError(f"UlyssesProblem.sizes needs {self.world} lengths")

    # -- the layout ------------------------------------------------------------------------
    @property
    def all_sizes(self) -> tuple:
        """Every rank's length along ``gather`` (this rank's for all when not agreed)."""
        return self.sizes or (self.shape[self.gather],) * self.world

    def chunk(self, j: int) -> tuple[int, int]:
        """(start, length) along ``scatter`` of the chunk every rank sends rank ``j``."""
        return even_split(self.shape[self.scatter], self.world)[j]

    def shape_of(self, q: int) -> tuple:
        """Rank ``q``'s tensor shape (its own length along ``gather``)."""
        return with_dim(self.shape, self.gather, self.all_sizes[q])

    def send_shape(self, j: int, q: int | None = None) -> tuple:
        """The shape of the chunk rank ``q`` (default: this rank) sends rank ``j``."""
        return with_dim(self.shape_of(self.rank if q is None else q), self.scatter,
                        self.chunk(j)[1])

    def recv_shape(self, q: int) -> tuple:
        """The shape of what this rank receives from rank ``q``."""
        return self.send_shape(self.rank, q)

    def send_offset(self, j: int, q: int | None = None) -> int:
        """Element offset of rank ``q``'s chunk for rank ``j`` in its staging buffer (chunks
        packed in destination order)."""
        return sum(numel(self.send_shape(i, q)) for i in range(j))

    def send_numel(self, q: int | None = None) -> int:
        return self.send_offset(self.world, q)

    def recv_offset(self, q: int) -> int:
        """Element offset of rank ``q``'s chunk in this rank's landing buffer (source order)."""
        return sum(numel(self.recv_shape(i)) for i in range(q))

    def gather_offset(self, q: int) -> int:
        """Where rank ``q``'s chunk starts along ``gather`` in the gathered tensor."""
        return sum(self.all_sizes[:q])

    @property
    def gathered_shape(self) -> tuple:
        """The all-to-all's result on this rank."""
        return with_dim(with_dim(self.shape, self.scatter, self.chunk(self.rank)[1]),
                        self.gather, sum(self.all_sizes))

    @property
    def out_shape(self) -> tuple:
        """The op's output: the gathered product (``matmul_all_to_all``), or the gathered
        tensor times ``b`` (``all_to_all_matmul``: its last dim ``n``)."""
        if self.op == MATMUL_ALL_TO_ALL:
            return self.gathered_shape
        return (*self.gathered_shape[:-1], self.n)

    @property
    def accumulates(self) -> bool:
        """``all_to_all_matmul`` gathering along K (the last dim): the GEMM adds one product
        per source rank (``C += a_j @ b[K_j]``)."""
        return self.op == ALL_TO_ALL_MATMUL and self.gather == len(self.shape) - 1

    @property
    def columns_scattered(self) -> bool:
        """``matmul_all_to_all`` scattering the product's columns: each destination's chunk
        is a column piece ``a @ b[:, n_j]`` (else a row piece ``a[rows_j] @ b``)."""
        return self.op == MATMUL_ALL_TO_ALL and self.scatter == len(self.shape) - 1

    def max_send_numel(self) -> int:
        """The largest staging buffer of any rank (the symmetric buffer is this size)."""
        return max(self.send_numel(q) for q in range(self.world))

    # -- what selectors, decisions and the simulator read ----------------------------------
    reduces = all_reduces = False

    @property
    def ns(self) -> tuple[int, ...]:
        return (self.n,)

    @property
    def n_total(self) -> int:
        return self.n

    @property
    def m(self) -> int:
        """Rows of this rank's GEMM (all of them: one GEMM per piece adds up to these)."""
        rows = numel(self.shape[:-1]) if self.op == MATMUL_ALL_TO_ALL else \
            numel(self.gathered_shape[:-1])
        return rows

    big_m = m

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    @property
    def gemm_bytes(self) -> int:
        return (self.m * self.k + self.k * self.n + self.m * self.n) * self.itemsize

    @property
    def otb(self) -> float:
        return self.flops / max(self.gemm_bytes, 1)

    @property
    def output_elements(self) -> int:
        return numel(self.out_shape)

    @property
    def gather_bytes(self) -> int:
        """Bytes this rank receives from its peers."""
        return sum(numel(self.recv_shape(q)) for q in range(self.world) if q != self.rank) \
            * self.itemsize

    def piece_rows(self, q: int) -> int:
        """Rows of the GEMM piece of peer ``q``'s chunk (its destination's, for
        ``matmul_all_to_all``; its source's, for ``all_to_all_matmul``)."""
        if self.op == MATMUL_ALL_TO_ALL:
            if self.columns_scattered:
                return numel(self.shape[:-1])
            return numel(self.send_shape(q)[:-1])
        if self.accumulates:
            return numel(self.gathered_shape[:-1])
        return numel(self.recv_shape(q)[:-1])

    def piece_cols(self, q: int) -> tuple[int, int]:
        """(k, n) of the GEMM piece of peer ``q``'s chunk."""
        if self.columns_scattered:
            return self.k, self.chunk(q)[1]
        if self.accumulates:
            return self.all_sizes[q], self.n
        return self.k, self.n

    def key(self) -> tuple:
        """What a decision may depend on (rank excluded: every rank decides alike)."""
        return (self.op, with_dim(self.shape, self.gather, 0), self.scatter, self.gather,
                self.k, self.n, self.dtype, self.world, self.all_sizes)
