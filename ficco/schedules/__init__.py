"""Schedules: small frozen descriptions whose ``plan(problem, transport, copy_engines)``
returns a :class:`~ficco.plan.Plan`. ``names()`` lists every schedule ficco knows."""
from __future__ import annotations

from ..errors import InvalidArgumentError
from .ficco import FICCO_SCHEDULES, Ficco
from .ring import Ring
from .serial import Serial

_REGISTRY = {s.name: s for s in (Serial(), Ring(), Ring(bidirectional=True), *FICCO_SCHEDULES)}


def names() -> list[str]:
    """Every schedule name, baselines first: ``serial``, ``ring``, ``ring-bidir``, then the
    eight FiCCO schedules ``{uniform|hetero}-{fused|unfused}-{1d|2d}``."""
    return list(_REGISTRY)


def get(name: str):
    """The schedule called ``name``; an unknown name raises with the list of valid ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown schedule {name!r}; valid schedules: {', '.join(_REGISTRY)}") from None


__all__ = ["names", "get", "Serial", "Ring", "Ficco"]
