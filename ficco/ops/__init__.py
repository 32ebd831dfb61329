"""The ops: one package per op family, each with a ``spec`` module defining ``SPEC`` (an
:class:`~ficco.ops.base.OpSpec`); a family of several ops names its spec modules in its
``SPEC_MODULES``. Packages here are found by name::

    >>> from ficco import ops
    >>> ops.get("all_gather_matmul").name
    'all_gather_matmul'
"""
from __future__ import annotations

import importlib
import pkgutil

from ..errors import InvalidArgumentError
from .base import OpSpec

_specs: dict[str, OpSpec] = {}


def _discover() -> dict[str, OpSpec]:
    if not _specs:
        for info in pkgutil.iter_modules(__path__):
            if not info.ispkg or info.name.startswith("_"):
                continue
            package = importlib.import_module(f"{__name__}.{info.name}")
            for module in getattr(package, "SPEC_MODULES", ("spec",)):
                spec = getattr(importlib.import_module(f"{package.__name__}.{module}"), "SPEC",
                               None)
                if isinstance(spec, OpSpec):
                    _specs[spec.name] = spec
    return _specs


def names() -> list[str]:
    """Every op ficco runs."""
    return sorted(_discover())


def of_collective(*collectives: str) -> tuple[str, ...]:
    """The ops whose GEMM meets one of ``collectives`` (``ficco.plan.problem.ALL_GATHER``,
    ...; their calls are engine Problems), in the order of ``collectives``.

    >>> from ficco.plan.problem import REDUCE_SCATTER
    >>> of_collective(REDUCE_SCATTER)
    ('matmul_reduce_scatter',)
    """
    specs = _discover()
    return tuple(name for kind in collectives for name in sorted(specs)
                 if specs[name].collective == kind)


def get(name: str) -> OpSpec:
    """The op spec called ``name``; an unknown name raises with the valid list."""
    specs = _discover()
    if name not in specs:
        raise InvalidArgumentError(f"unknown op {name!r}; ficco runs: {', '.join(sorted(specs))}")
    return specs[name]


__all__ = ["OpSpec", "get", "names", "of_collective"]
