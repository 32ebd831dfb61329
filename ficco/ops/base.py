"""What an op is to the shared runtime: the op spec contract.

An op (``all_gather_matmul``, ``matmul_reduce_scatter``) is one small object that knows its
own arguments and layouts; everything else (agreement across ranks, choosing a schedule,
plans, workspaces, executing, measuring) is shared and lives in :mod:`ficco.runtime.path`::

    call = spec.prepare(*args, **kwargs)        # validate -> canonical Call, no communication
    spec.signature(call)                        # fields every rank must share
    spec.agreed_problem(call, per_rank)         # the Problem every rank decides on
    spec.plain(call)                            # FICCO_DISABLE and a world of one
    spec.workspace_bytes(call)                  # symmetric bytes a dma plan needs
    buffers = spec.buffers(call, transport, symm, wide=..., plan=...)   # the plan's tensors
    spec.result(call, buffers, transport)       # canonical outputs -> the caller's layout

and, for tests, selftest and the demo, the one float64 oracle of the op::

    ex = spec.example(rank, world, (m, k, n), rounding, seed)   # fresh inputs of one rank
    ref, scale = spec.reference(ex)             # this rank's output in float64, |a| @ |b|

Adding an op adds one package to ``ficco/ops/`` whose ``spec`` module defines ``SPEC`` (see
``ops/__init__.py``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from .. import schedules
from ..errors import InvalidArgumentError
from ..plan.epilogue import rebound
from ..plan.problem import register_collective
from ..runtime.call import Call
from ..schedules.common import OptionalSchedule, Schedule
from .examples import Example, Rounding

#: the op's own Call subclass, which its methods take (each op reads its own fields)
C = TypeVar("C", bound=Call)


@dataclass(frozen=True)
class Placements:
    """The DTensor placements an op takes on a 1-D mesh (its spec's ``placements``), for ``a``
    and for each weight of ``b``: the ``Shard`` dims (``None``: the op's gather dimension;
    negative: from the last), whether ``Replicate()`` does for ``b``, and the words an error
    says them in (``{dim}``: the gather dimension)."""

    a: tuple[int | None, ...]
    a_words: str
    b: tuple[int | None, ...]
    b_words: str
    b_replicate: bool = False


class OpSpec(ABC, Generic[C]):
    #: the op's public name, also the ``op`` of its Problems and cache keys
    name: ClassVar[str]
    #: the public function's first argument, as errors name it
    first_arg: ClassVar[str] = "a"
    #: the DTensor placements its operands may come in (None: plain tensors only)
    placements: ClassVar[Placements | None] = None
    #: whether :meth:`exchange` has data to exchange (the runtime calls it only then)
    exchanges: ClassVar[bool] = False
    #: the op's schedules, baselines first (``ficco.schedules.names(op=name)``)
    schedules: ClassVar[tuple[Schedule, ...]]
    #: schedules that need an optional extra (Triton): known by name, offered only where they
    #: run (``ficco.schedules.offered``)
    optional_schedules: ClassVar[tuple[OptionalSchedule, ...]] = ()
    #: the collective its GEMM meets, for an op whose calls are engine Problems
    #: (:data:`ficco.plan.problem.COLLECTIVES`; "": its calls have a problem of their own)
    collective: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("collective"):
            register_collective(cls.name, cls.collective)

    # -- schedules ----------------------------------------------------------------------------
    def schedule(self, name: str):
        """The schedule called ``name``; an unknown name raises with the valid list."""
        return schedules.get(name, op=self.name)

    # -- the call -----------------------------------------------------------------------------
    def explained(self, a, b, group, *, gather_dim: int, scatter_dim: int, reduce_op: str,
                  counts, epilogue: dict) -> C:
        """The Call ``ficco.explain(op=name, ...)`` decides on, from explain's arguments (the op
        reads those it takes). Never communicates."""
        raise InvalidArgumentError(f"ficco.explain cannot explain op {self.name!r}")

    @abstractmethod
    def prepare(self, *args, **kwargs) -> C:
        """Validate the caller's arguments and return the canonical Call. Never communicates."""

    def exchange(self, call: C, word: int) -> tuple[C, int]:
        """Data every rank must learn from the others before a plan can be chosen, agreed
        once per call right after the agreement (expert parallelism's routing counts):
        returns the completed call and the call's digest ``word`` with that data folded in.
        Default: nothing to exchange."""
        return call, word

    def signature(self, call: C) -> dict:
        """Small, comparable fields every rank must pass alike (shapes, dtypes, layout), and
        under ``PER_RANK`` those that may differ (a width that never travels: the op moves it
        there). The runtime adds the settings; a difference raises MismatchError on every
        rank."""
        p = call.problem
        epilogue = (p.out_dtype, p.scaling, p.bias, p.activation)    # fp8, bias, activation
        # Named fields, not problem.key()'s tuple: a MismatchError prints them by name.
        return {"op": self.name, "role": call.role, "rows m": p.m, "K": p.k, "ns": p.ns,
                "dtype": p.dtype, "world": p.world, "unit": p.unit, "reduce_op": p.reduce_op,
                "backend": call.target, **({"epilogue": epilogue} if any(epilogue) else {})}

    #: what :meth:`values_word` digests, for messages ("" when the op digests nothing)
    values_what: ClassVar[str] = ""

    def values_word(self, call: C) -> int:
        """A 63-bit digest of values every rank must pass alike that no signature holds (the
        all-reduce's bias: every rank adds its own, so different values would leave the ranks
        with different outputs), mixed into the call's per-call check and barrier flag, so
        ranks whose values differ raise MismatchError before any output; 0: none."""
        return 0

    def agreed_problem(self, call: C, per_rank: tuple):
        """The Problem every rank decides on (selector, simulator, tune cache): this call's,
        with each per-rank width replaced by the widest rank's (``per_rank``: every rank's
        ``PER_RANK`` fields, as agreed), so no decision depends on which rank decides."""
        return call.problem

    @abstractmethod
    def plain(self, call: C) -> Any:
        """The unoverlapped result (collective + matmul, or a plain matmul for one rank)."""

    @abstractmethod
    def workspace_bytes(self, call: C) -> int:
        """Bytes of symmetric memory per rank a ``dma`` plan needs."""

    @abstractmethod
    def buffers(self, call: C, transport: str, symm, *, wide: bool = False,
                plan=None) -> Any:
        """The executor's Buffers for one run; ``symm`` is the workspace handle (dma) or None.
        ``wide``: the plan accumulates partial sums into a bf16/fp16 output, so make the
        outputs float32 (rounded once by :meth:`result`), never rounded per partial sum.
        ``plan``: the Plan that will run (a buffer whose layout is the schedule's is sized
        from it: the all-reduce's landing rows, :meth:`~ficco.plan.Plan.rows_of`)."""

    def annotate(self, decision, problem):
        """``decision`` (what ``explain`` shows for ``problem``) with what this op adds to it:
        the all-reduce names the kernel its pick runs and the published time that kernel is
        priced against. By default unchanged."""
        return decision

    def poison(self, buffers) -> None:
        """FICCO_POISON: fill what the plan must write with NaN so unwritten values show."""
        for t in (*buffers.outs, buffers.gathered):
            t.fill_(float("nan"))

    @abstractmethod
    def result(self, call: C, buffers, transport: str) -> Any:
        """The caller's result from the canonical buffers of a finished run."""

    # -- the oracle ---------------------------------------------------------------------------
    #: whether :meth:`example` makes fp8 operands with tensor-wise scales (``float8``)
    fp8_examples: ClassVar[bool] = False

    @abstractmethod
    def example(self, rank: int, world: int, shape: tuple, rounding: Rounding,
                seed: int) -> Example:
        """Fresh random inputs of the problem ``shape`` (``(m, k, n)``: rows per rank, the
        contraction, the output columns, as the op reads them) for ``rank`` of ``world``:
        every rank's made from ``seed`` (so each knows the whole problem), cast by
        ``rounding``. Never communicates."""

    @abstractmethod
    def reference(self, example: Example) -> tuple[Any, Any]:
        """``(this rank's output, its rounding scale |a| @ |b|)`` in float64 (the first
        output where the op returns several), from every rank's inputs of ``example``: plain
        torch on the gathered tensors, none of ficco's path (differentiable, so a test can
        take gradients through it)."""

    def __repr__(self) -> str:
        return f"<op {self.name}>"


def warm_call(seen: Any, group, a, b, epilogue: tuple, dim: int, rows_of) -> Any:
    """A call of a known key (:func:`ficco.runtime.call.known`) of an op on ``a`` and weights ``b``
    (``all_gather_matmul``, ``matmul_reduce_scatter``): ``seen``'s checked and derived fields
    with this call's group, weights, canonical A (``dim`` first, leading dims flattened) and
    epilogue tensors (``epilogue``: ``(a_scale, b_scale, out_dtype, bias, activation)`` or
    empty), put in the canonical form the first call of the key had (:func:`rebound`, with
    ``rows_of(dim)``, the op's canonical rows of a tensor shaped like A's)."""
    p = seen.problem
    bs = list(b) if seen.b_is_list else [b]
    ops = seen.ops
    if epilogue:
        a_scale, b_scale, _, bias, _ = epilogue
        ops = rebound(ops, bs, rows_of=rows_of(dim), a_scale=a_scale, b_scale=b_scale, bias=bias,
                      b_is_list=seen.b_is_list, rows=p.m)
    return seen.clone(group=group, bs=bs, ops=ops, a=a.movedim(dim, 0).reshape(p.m, p.k))
