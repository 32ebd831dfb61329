"""Schedules: small frozen descriptions whose ``plan(problem, transport, copy_engines)``
returns a :class:`~ficco.plan.Plan`. Each op has its own registry: ``names()`` lists the
all-gather's, ``names(op="matmul_reduce_scatter")`` the reduce-scatter's (the same names),
``names(op="matmul_all_reduce")`` the all-reduce's (ops/matmul_all_reduce/schedules/).

>>> names(op="matmul_reduce_scatter")[:3]
['serial', 'ring', 'ring-bidir']
"""
from __future__ import annotations

from ..errors import InvalidArgumentError
from ..ops.all_gather_matmul.schedules.ficco import FICCO_SCHEDULES, Ficco
from ..ops.all_gather_matmul.schedules.gated import GATED_SCHEDULES, Gated
from ..ops.all_gather_matmul.schedules.ring import Ring
from ..ops.all_gather_matmul.schedules.serial import Serial
from ..ops.expert.schedules import all_to_all
from ..ops.matmul_all_reduce import schedules as all_reduce
from ..ops.matmul_all_reduce.schedules.kernel import KERNEL_SCHEDULES, ShotKernel
from ..ops.matmul_all_reduce.schedules.torch_kernels import TORCH_SCHEDULES, TorchShot
from ..ops.matmul_reduce_scatter import schedules as reduce_scatter
from ..plan.problem import ALL_GATHER_MATMUL, MATMUL_ALL_REDUCE, MATMUL_REDUCE_SCATTER
from .common import Schedule

_ALL_GATHER: tuple[Schedule, ...] = (Serial(), Ring(), Ring(bidirectional=True),
                                     *FICCO_SCHEDULES)
_REGISTRY: dict[str, dict[str, Schedule]] = {
    ALL_GATHER_MATMUL: {s.name: s for s in _ALL_GATHER},
    MATMUL_REDUCE_SCATTER: {s.name: s for s in reduce_scatter.SCHEDULES},
    MATMUL_ALL_REDUCE: {s.name: s for s in all_reduce.SCHEDULES},
    # expert parallelism (all_to_all_grouped_mm, grouped_mm_all_to_all):
    # ops/expert/schedules/all_to_all.py
    **{op: {s.name: s for s in family} for op, family in all_to_all.SCHEDULES.items()},
}
#: Schedules that need an optional extra (Triton), per op: get() knows them and they plan and
#: simulate anywhere, but names() leaves them out and selectors see them only where they run
#: (offered()).
_OPTIONAL: dict[str, dict[str, Gated | ShotKernel | TorchShot]] = {
    ALL_GATHER_MATMUL: {s.name: s for s in GATED_SCHEDULES}, MATMUL_REDUCE_SCATTER: {},
    MATMUL_ALL_REDUCE: {**{s.name: s for s in KERNEL_SCHEDULES},
                        **{s.name: s for s in TORCH_SCHEDULES}},
    **{op: {} for op in all_to_all.SCHEDULES}}


def _registry(op: str) -> dict:
    try:
        return _REGISTRY[op]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown op {op!r}; ops with schedules: {', '.join(_REGISTRY)}") from None


def names(op: str = ALL_GATHER_MATMUL) -> list[str]:
    """Every schedule name of ``op``, baselines first: ``serial``, ``ring``, ``ring-bidir``,
    then the eight FiCCO schedules ``{uniform|hetero}-{fused|unfused}-{1d|2d}`` (the
    all-reduce's: ``serial``, ``rs-ag-*``, ``chunked-*``, ``one-shot``, ``two-shot``, …).

    >>> names(op="matmul_all_reduce")[0]
    'serial'
    """
    return list(_registry(op))


def ops() -> list[str]:
    """Every op that has schedules.

    >>> ops()[0]
    'all_gather_matmul'
    """
    return list(_REGISTRY)


def ops_with(name: str) -> list[str]:
    """The ops that have a schedule called ``name`` (Triton's optional ones included).

    >>> ops_with("ring-bidir")
    ['all_gather_matmul', 'matmul_reduce_scatter']
    """
    return [op for op in _REGISTRY if name in _REGISTRY[op] or name in _OPTIONAL[op]]


def get(name: str, op: str = ALL_GATHER_MATMUL):
    """The schedule of ``op`` called ``name``; an unknown name raises with the valid ones."""
    registry = _registry(op)
    optional = _OPTIONAL[op]
    try:
        return registry[name] if name in registry else optional[name]
    except KeyError:
        extra = f" (with Triton also {', '.join(optional)})" if optional else ""
        raise InvalidArgumentError(
            f"unknown {op} schedule {name!r}; valid schedules: {', '.join(registry)}"
            f"{extra}") from None


def optional_names(op: str = ALL_GATHER_MATMUL) -> list[str]:
    """Schedules of ``op`` that need an optional extra: ``gated-1d``, ``gated-2d`` (Triton)."""
    _registry(op)
    return list(_OPTIONAL[op])


def unavailable(target: str, transport: str = "dma", op: str = ALL_GATHER_MATMUL,
                problem=None) -> dict[str, str]:
    """Optional schedule name -> why selectors do not offer it on backend ``target`` over
    ``transport`` (for ``problem``, when given); names that are offered are absent.

    >>> sorted(unavailable("cpu"))      # CPU runs Triton only in its interpreter
    ['gated-1d', 'gated-2d']
    """
    _registry(op)
    out = {}
    for name, schedule in _OPTIONAL[op].items():
        reason = schedule.selectable_reason(target, transport)
        if reason is None and problem is not None:
            reason = epilogue_reason(name, problem)
        if reason is not None:
            out[name] = reason
    return out


def why_not_here(name: str, target: str, transport: str = "dma",
                 op: str = ALL_GATHER_MATMUL) -> str | None:
    """Why schedule ``name`` of ``op`` cannot run on backend ``target`` over ``transport``, or
    None when it can: only optional schedules (Triton's ``gated-*``) may be unable to.

    >>> why_not_here("ring", "cpu") is None
    True
    """
    optional = _OPTIONAL[op].get(name) if op in _OPTIONAL else None
    return None if optional is None else optional.unavailable_reason(target, transport)


def epilogue_reason(name: str, problem) -> str | None:
    """Why schedule ``name`` cannot run ``problem``'s epilogue (fp8 scales, out_dtype, bias,
    activation), or None: the optional gated kernel multiplies plain operands only (the
    one-kernel all-reduce sums what a library GEMM made, epilogue included)."""
    extra = problem.scaling or problem.out_dtype or problem.bias or problem.activation
    if extra and isinstance(_OPTIONAL.get(problem.op, {}).get(name), Gated):
        return (f"{name}'s gated GEMM kernel multiplies plain operands: no fp8 scales, "
                f"out_dtype, bias or activation")
    return None


def offered(target: str, transport: str = "dma", op: str = ALL_GATHER_MATMUL,
            problem=None) -> list[str]:
    """The schedules a selector may pick for ``op`` (and ``problem``, when given) on backend
    ``target`` over ``transport``: :func:`names` plus the optional ones that run there (e.g.
    ``gated-1d`` on "cuda:sm_90" with Triton installed)."""
    missing = unavailable(target, transport, op, problem)
    return names(op) + [name for name in _OPTIONAL[op] if name not in missing]


__all__ = [
    "Ficco",
    "Gated",
    "Ring",
    "Serial",
    "get",
    "names",
    "offered",
    "optional_names",
    "unavailable",
    "why_not_here",
]
