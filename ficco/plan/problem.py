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

``matmul_all_reduce``: as the reduce-scatter (all ``m = M`` rows of ``a``, this rank's
``K``-row shard of each ``b_j``), but every rank receives all ``M`` rows of the sum. Its
:meth:`Problem.block` are the reduce-scatter's (``unit`` 1): the rows each rank reduces in the
schedules that all-reduce as a reduce-scatter followed by an all-gather.

Schedules, selectors and the simulator see only this :class:`Problem`.
"""
from __future__ import annotations

import abc
import bisect
import math
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from ..errors import InvalidArgumentError

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
             # fp8 operands (torch._scaled_mm): OCP forms (H100/H200/B200, MI355X) and the
             # fnuz forms of MI300X/MI325X
             "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}
#: how A's fp8 operands are scaled (``Problem.scaling``): none, one scale for the whole
#: matrix, or one per row of A and per column of B (torch._scaled_mm's two recipes)
SCALINGS = ("", "tensor", "row")
#: activation epilogues ``all_gather_matmul`` applies per output piece (``Problem.activation``)
ACTIVATIONS = ("", "gelu", "gelu_tanh", "silu", "relu")
#: the collectives a Problem's GEMM meets: its rows gathered before it, its partial sums
#: reduce-scattered or all-reduced after it
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all_gather", "reduce_scatter", "all_reduce"
#: op name -> its collective, for every op whose calls are Problems: each op spec registers its
#: own (``OpSpec.collective``), so the engine names no op
COLLECTIVES: dict[str, str] = {}
#: the op a Problem is of when none is named (the first one ficco ran)
DEFAULT_OP = "all_gather_matmul"


def register_collective(op: str, collective: str) -> None:
    """Make ``op`` a Problem's op, whose GEMM meets ``collective``."""
    if collective not in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE):
        raise InvalidArgumentError(f"unknown collective {collective!r} of op {op!r}")
    COLLECTIVES[op] = collective
REDUCE_OPS = ("sum", "avg")
#: fp8 column chunks are cut in whole multiples of this many columns (see Problem.col_chunks)
FP8_ALIGN = 16


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


def bucket(rows: float) -> int:
    """Round a row count up to three significant bits (at most 25 % more): 0-8 stay, then
    10, 12, 14, 16, 20, 24, 28, 32, 40, …

    >>> [bucket(x) for x in (0, 3, 9, 17, 100)]
    [0, 3, 10, 20, 112]
    """
    rows = math.ceil(rows)
    if rows <= 8:
        return max(rows, 0)
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


class DtypeFields(abc.ABC):
    """``itemsize`` and ``torch_dtype`` of a problem whose ``dtype`` is a torch dtype name, and
    its epilogue (:mod:`ficco.plan.epilogue`): none unless the problem's own fields say otherwise
    (:class:`Problem` has them; the expert ops have no epilogue)."""

    dtype: str
    out_dtype, scaling, bias, activation = "", "", False, ""
    #: what the engine reads off any op's problem (a frozen dataclass): its op, world, rank
    op: str
    world: int
    rank: int

    @abc.abstractmethod
    def key(self) -> tuple:
        """The fields a decision depends on (each problem class says which)."""

    @cached_property      # read per op by the simulator: once per problem
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def out_itemsize(self) -> int:
        """Bytes of one output element (``out_dtype``, else ``dtype``)."""
        return ITEMSIZE[self.out_dtype or self.dtype]

    @property
    def partial_itemsize(self) -> int:
        """Bytes of one reduce-scatter partial product as it travels: the output's dtype, or
        float32 for an fp8 output (partials are summed in float32 and rounded once)."""
        return self.out_itemsize if self.out_itemsize >= 2 else 4


#: rows decided exactly; above, the bucket steps per octave (see Problem.decided_as)
EXACT_ROWS, BUCKETS_PER_OCTAVE = 64, 8
_ROW_STEPS = sorted({math.ceil(EXACT_ROWS * 2 ** (j / BUCKETS_PER_OCTAVE))
                     for j in range(BUCKETS_PER_OCTAVE * 40)})


def decision_rows(rows: int, unit: int = 1) -> int:
    """``rows`` rounded up to its decision bucket (see :meth:`Problem.decided_as`), in whole
    ``unit`` s.

    >>> [decision_rows(r) for r in (64, 65, 70, 71, 1000)]
    [64, 70, 70, 77, 1024]
    """
    if rows <= EXACT_ROWS:
        return rows
    step = _ROW_STEPS[bisect.bisect_left(_ROW_STEPS, rows)]
    return -(-step // unit) * unit


@dataclass(frozen=True)
class Problem(DtypeFields):
    """One rank's view of one call: ``all_gather(A, dim=0) @ b_j`` for every ``j``
    (``op="all_gather_matmul"``), ``reduce_scatter(a @ b_j)`` (``op="matmul_reduce_scatter"``)
    or ``all_reduce(a @ b_j)`` (``op="matmul_all_reduce"``).

    ``m``: rows of this rank's A operand (the shard for all-gather, all of ``a`` for
    reduce-scatter and all-reduce); ``k``: the local inner dimension; ``ns``: columns of each ``b``;
    ``world``: group size W; ``rank``: this rank; ``dtype``: torch dtype name.
    Reduce-scatter only: ``unit`` rows make one index of the scattered dimension (blocks are
    whole units). Reduce-scatter and all-reduce: ``reduce_op`` is ``"sum"`` or ``"avg"``.
    The epilogue (:mod:`ficco.plan.epilogue`): ``out_dtype`` of the outputs ("" = ``dtype``),
    ``scaling`` of fp8 operands ("tensor" or "row"; "" unscaled), whether a ``bias`` is added
    and which ``activation`` follows it (all-gather only).

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
    op: str = DEFAULT_OP
    unit: int = 1
    reduce_op: str = "sum"
    out_dtype: str = ""
    scaling: str = ""
    bias: bool = False
    activation: str = ""

    def __post_init__(self):
        if self.op not in COLLECTIVES:
            raise InvalidArgumentError(
                f"Problem.op must be one of {tuple(COLLECTIVES)}; got {self.op!r}")
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
        for name, value in (("dtype", self.dtype), ("out_dtype", self.out_dtype or "float32")):
            if value not in ITEMSIZE:
                raise InvalidArgumentError(
                    f"{name} {value!r} is not supported; use one of {sorted(ITEMSIZE)}")
        if self.scaling not in SCALINGS or (self.scaling and self.itemsize != 1):
            # (an fp8 Problem without scaling prices like one: calls always set it)
            raise InvalidArgumentError(
                f"Problem.scaling must be 'tensor' or 'row' (fp8 only) or ''; got "
                f"scaling={self.scaling!r} with dtype={self.dtype!r}")
        if self.activation not in ACTIVATIONS or (self.activation and self.reduces):
            raise InvalidArgumentError(
                f"Problem.activation must be one of {ACTIVATIONS[1:]} (all_gather_matmul "
                f"only) or ''; got {self.activation!r} for op {self.op!r}")

    # The properties a call reads repeatedly are cached on the (frozen) instance.
    @cached_property
    def reduces(self) -> bool:
        """True for the ops that sum partial products over ranks: ``matmul_reduce_scatter``
        and ``matmul_all_reduce``."""
        return COLLECTIVES[self.op] != ALL_GATHER

    @cached_property
    def all_reduces(self) -> bool:
        """True for ``matmul_all_reduce``: every rank receives all ``M`` rows of the sum."""
        return COLLECTIVES[self.op] == ALL_REDUCE

    @property
    def partial_itemsize(self) -> int:
        """Bytes of one partial product as it travels: the output's dtype, float32 for an fp8
        output, and float32 for the all-reduce's fp8 operands (docs/all_reduce.md: their
        partials are summed in float32 and rounded once, on every path)."""
        if self.all_reduces and self.scaling:
            return max(self.out_itemsize, 4)
        return self.out_itemsize if self.out_itemsize >= 2 else 4

    @cached_property
    def big_m(self) -> int:
        """Rows M of the local GEMM: the gathered matrix (W * m) or all of ``a`` (m)."""
        return self.m if self.reduces else self.world * self.m

    @cached_property
    def n_total(self) -> int:
        return sum(self.ns)

    @property
    def output_elements(self) -> int:
        """Elements of this rank's outputs (what a float32 output's rounding pass reads)."""
        rows = self.block_rows if self.reduces and not self.all_reduces else self.big_m
        return rows * self.n_total

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

    @property
    def flops(self) -> int:
        """Floating-point operations of the whole local GEMM(s): 2 * M * K * sum(n)."""
        return 2 * self.big_m * self.k * self.n_total

    @property
    def gemm_bytes(self) -> int:
        """MT: bytes of the GEMM(s) read and written once, (M*K + K*n) * itemsize +
        M*n * out_itemsize."""
        return (self.big_m * self.k + self.k * self.n_total) * self.itemsize \
            + self.big_m * self.n_total * self.out_itemsize

    @property
    def otb(self) -> float:
        """OTB: op-to-byte ratio of the GEMM(s), flops / MT."""
        return self.flops / max(self.gemm_bytes, 1)

    @property
    def gather_bytes(self) -> int:
        """Bytes each rank receives: the all-gather's (W - 1) * m * K * itemsize, the
        reduce-scatter's W - 1 partial blocks, (W - 1) * rows * sum(n) * partial_itemsize, or
        the all-reduce's twice that (a bandwidth-optimal all-reduce is a reduce-scatter and an
        all-gather of the reduced blocks: 2 (W - 1) / W of the output, as NCCL's bus bandwidth
        counts it)."""
        if self.reduces:
            blocks = 2 if self.all_reduces else 1
            return blocks * (self.world - 1) * self.block_rows * self.n_total \
                * self.partial_itemsize
        return (self.world - 1) * self.m * self.k * self.itemsize

    def key(self) -> tuple:
        """The part of the problem a decision may depend on (rank excluded on purpose: every
        rank must reach the same decision). The reduce-scatter's and all-reduce's start with
        their op name; the all-gather's keeps its original 5-tuple (caches and tests key on it). An epilogue
        (out_dtype, fp8 scaling, bias, activation) adds one tuple at the end."""
        extra = (self.out_dtype, self.scaling, self.bias, self.activation)
        tail = (extra,) if any(extra) else ()
        if self.reduces:
            return (self.op, self.m, self.k, self.ns, self.dtype, self.world, self.unit,
                    self.reduce_op) + tail
        return (self.m, self.k, self.ns, self.dtype, self.world) + tail

    def decided_as(self) -> Problem:
        """The problem whose decision this one takes (ficco.runtime.path): itself up to
        :data:`EXACT_ROWS` rows; above, its rows rounded up to the next of
        :data:`BUCKETS_PER_OCTAVE` steps per octave (and to whole units), so a new sequence
        length mostly finds its decision made (a decision simulates every schedule).

        >>> Problem(m=100, k=8, ns=(8,), dtype="float32", world=2).decided_as().m
        108
        >>> Problem(m=48, k=8, ns=(8,), dtype="float32", world=2).decided_as().m
        48
        """
        rows = decision_rows(self.m, self.unit)
        return self if rows == self.m else replace(self, m=rows)

    def col_chunks(self, cols: int | None = None) -> list[tuple[int, int]]:
        """The W column chunks (start, cols) of K (2D all-gather) or of ``cols`` output
        columns (2D reduce-scatter). fp8 chunks are whole multiples of 16 columns (but the
        last): ``torch._scaled_mm`` on GPUs takes only such K and n, and every backend cuts
        alike so the CPU tests run the GPUs' pieces."""
        total = self.k if cols is None else cols
        align = FP8_ALIGN if self.itemsize == 1 else 1
        units = -(-total // align)
        return [(min(start * align, total), max(min(length * align, total - start * align), 0))
                for start, length in even_split(units, self.world)]
