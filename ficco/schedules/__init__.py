"""Schedules: small frozen descriptions whose ``plan(problem, transport, copy_engines)``
returns a :class:`~ficco.plan.Plan`. Each op has its own registry under the same names:
``names()`` lists the all-gather's, ``names(op="matmul_reduce_scatter")`` the other op's.

>>> names(op="matmul_reduce_scatter")[:3]
['serial', 'ring', 'ring-bidir']
"""
from __future__ import annotations

from ..errors import InvalidArgumentError
from ..problem import ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER
from . import reduce_scatter
from .ficco import FICCO_SCHEDULES, Ficco
from .ring import Ring
from .serial import Serial

_REGISTRY = {
    ALL_GATHER_MATMUL: {s.name: s for s in (Serial(), Ring(), Ring(bidirectional=True),
                                            *FICCO_SCHEDULES)},
    MATMUL_REDUCE_SCATTER: {s.name: s for s in reduce_scatter.SCHEDULES},
}


def _registry(op: str) -> dict:
    try:
        return _REGISTRY[op]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown op {op!r}; ops with schedules: {', '.join(_REGISTRY)}") from None


def names(op: str = ALL_GATHER_MATMUL) -> list[str]:
    """Every schedule name of ``op``, baselines first: ``serial``, ``ring``, ``ring-bidir``,
    then the eight FiCCO schedules ``{uniform|hetero}-{fused|unfused}-{1d|2d}``."""
    return list(_registry(op))


def get(name: str, op: str = ALL_GATHER_MATMUL):
    """The schedule of ``op`` called ``name``; an unknown name raises with the valid ones."""
    registry = _registry(op)
    try:
        return registry[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown {op} schedule {name!r}; valid schedules: {', '.join(registry)}") from None


__all__ = ["names", "get", "Serial", "Ring", "Ficco"]
