"""Schedules: small frozen descriptions whose ``plan(problem, transport, copy_engines)``
returns a :class:`~ficco.plan.Plan`. Each op has its own registry: ``names()`` lists the
all-gather's, ``names(op="matmul_reduce_scatter")`` the reduce-scatter's (the same names),
``names(op="matmul_all_reduce")`` the all-reduce's (ops/matmul_all_reduce/schedules/).

>>> names(op="matmul_reduce_scatter")[:3]
['serial', 'ring', 'ring-bidir']
"""
from __future__ import annotations

import functools
import importlib

from ..errors import InvalidArgumentError
from ..plan.problem import DEFAULT_OP
from .common import OptionalSchedule, Schedule


#: op -> name -> schedule, and the optional ones (Triton's): each op's spec carries its own
#: (``OpSpec.schedules``, ``OpSpec.optional_schedules``); filled on first use from the ops
#: found by name (:mod:`ficco.ops`, which sits above the schedules). get() knows the optional
#: ones and they plan and simulate anywhere, but names() leaves them out and selectors see them
#: only where they run (offered()).
@functools.cache
def _tables() -> tuple[dict[str, dict[str, Schedule]], dict[str, dict[str, OptionalSchedule]]]:
    """(op -> name -> schedule, op -> name -> optional schedule), made once."""
    ops = importlib.import_module("ficco.ops")
    specs = [ops.get(name) for name in ops.names()]
    return ({s.name: {x.name: x for x in s.schedules} for s in specs},
            {s.name: {x.name: x for x in s.optional_schedules} for s in specs})


def _registry(op: str) -> dict:
    try:
        return _tables()[0][op]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown op {op!r}; ops with schedules: {', '.join(_tables()[0])}") from None


def names(op: str = DEFAULT_OP) -> list[str]:
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
    return list(_tables()[0])


def ops_with(name: str) -> list[str]:
    """The ops that have a schedule called ``name`` (Triton's optional ones included).

    >>> ops_with("ring-bidir")
    ['all_gather_matmul', 'matmul_reduce_scatter']
    """
    registry, optional = _tables()
    return [op for op in registry if name in registry[op] or name in optional[op]]


def get(name: str, op: str = DEFAULT_OP):
    """The schedule of ``op`` called ``name``; an unknown name raises with the valid ones."""
    registry = _registry(op)
    optional = _tables()[1][op]
    try:
        return registry[name] if name in registry else optional[name]
    except KeyError:
        extra = f" (with Triton also {', '.join(optional)})" if optional else ""
        raise InvalidArgumentError(
            f"unknown {op} schedule {name!r}; valid schedules: {', '.join(registry)}"
            f"{extra}") from None


def optional_names(op: str = DEFAULT_OP) -> list[str]:
    """Schedules of ``op`` that need an optional extra: ``gated-1d``, ``gated-2d`` (Triton)."""
    _registry(op)
    return list(_tables()[1][op])


def unavailable(target: str, transport: str = "dma", op: str = DEFAULT_OP,
                problem=None) -> dict[str, str]:
    """Optional schedule name -> why selectors do not offer it on backend ``target`` over
    ``transport`` (for ``problem``, when given); names that are offered are absent.

    >>> sorted(unavailable("cpu"))      # CPU runs Triton only in its interpreter
    ['gated-1d', 'gated-2d']
    """
    _registry(op)
    out = {}
    for name, schedule in _tables()[1][op].items():
        reason = schedule.selectable_reason(target, transport)
        if reason is None and problem is not None:
            reason = epilogue_reason(name, problem)
        if reason is not None:
            out[name] = reason
    return out


def why_not_here(name: str, target: str, transport: str = "dma",
                 op: str = DEFAULT_OP) -> str | None:
    """Why schedule ``name`` of ``op`` cannot run on backend ``target`` over ``transport``, or
    None when it can: only optional schedules (Triton's ``gated-*``) may be unable to.

    >>> why_not_here("ring", "cpu") is None
    True
    """
    optional = _tables()[1].get(op, {}).get(name)
    return None if optional is None else optional.unavailable_reason(target, transport)


def epilogue_reason(name: str, problem) -> str | None:
    """Why schedule ``name`` cannot run ``problem``'s epilogue (fp8 scales, out_dtype, bias,
    activation), or None: the optional gated kernel multiplies plain operands only (the
    one-kernel all-reduce sums what a library GEMM made, epilogue included)."""
    extra = problem.scaling or problem.out_dtype or problem.bias or problem.activation
    if not extra:
        return None
    optional = _tables()[1].get(problem.op, {}).get(name)
    if optional is not None and optional.plain_operands_only:
        return (f"{name}'s gated GEMM kernel multiplies plain operands: no fp8 scales, "
                f"out_dtype, bias or activation")
    return None


def offered(target: str, transport: str = "dma", op: str = DEFAULT_OP,
            problem=None) -> list[str]:
    """The schedules a selector may pick for ``op`` (and ``problem``, when given) on backend
    ``target`` over ``transport``: :func:`names` plus the optional ones that run there (e.g.
    ``gated-1d`` on "cuda:sm_90" with Triton installed)."""
    missing = unavailable(target, transport, op, problem)
    return names(op) + [name for name in _tables()[1][op] if name not in missing]


__all__ = [
    "Schedule",
    "get",
    "names",
    "offered",
    "ops_with",
    "optional_names",
    "unavailable",
    "why_not_here",
]
