"""The public entry points: ``all_gather_matmul``, ``explain`` and ``shutdown``.

Data flows one way: arguments -> op spec (``ficco/ops/``: validated, canonical Call) ->
runtime (``ficco/runtime.py``: agreement, Decision, Plan, executor) -> the caller's layout.
"""
from __future__ import annotations

import atexit

from . import library, runtime
from .ops.all_gather_matmul import SPEC as _ALL_GATHER_MATMUL

last_run = runtime.last_run


def all_gather_matmul(a_shard, b, group=None, *, gather_dim=0, schedule=None,
                      return_gathered=False):
    """``all_gather(a_shard, gather_dim) @ b``, with the all-gather hidden behind the GEMM.

    ``b`` is a ``(K, n)`` tensor or a list of them (one gather feeds several GEMMs); the output
    has the shape of the plain expression (a list when ``b`` is a list). ``group`` is a
    ProcessGroup, a group name, a 1-D DeviceMesh or None (the default group). ``schedule``
    forces a schedule by name (see ``ficco.schedules.names()``); None lets the selector choose.
    ``return_gathered=True`` returns ``(gathered_a, outputs)``.

    >>> import torch, ficco
    >>> a = torch.randn(4, 8); w = torch.randn(8, 3)
    >>> torch.allclose(ficco.all_gather_matmul(a, w), a @ w)   # world size 1: a plain matmul
    True
    """
    # Through the torch custom op (autograd, autocast, torch.compile); ficco/library.py.
    return library.all_gather_matmul(a_shard, b, group, gather_dim=gather_dim,
                                     schedule=schedule, return_gathered=return_gathered)


def all_gather_matmul_eager(a_shard, b, group=None, *, gather_dim=0, schedule=None,
                            return_gathered=False):
    """``all_gather_matmul`` run directly, without the dispatcher: the real kernel of
    ``torch.ops.ficco.all_gather_matmul`` (no autograd, autocast or tracing)."""
    call = _ALL_GATHER_MATMUL.prepare(a_shard, b, group, gather_dim, return_gathered)
    return runtime.run(call, schedule)


def explain(a_shard, b, group=None, *, gather_dim=0, schedule=None):
    """The Decision ``all_gather_matmul`` would take for these arguments: schedule, transport,
    the selector that chose, its inputs and every candidate's score. Moves no tensor data
    (the ``tune`` selector measures on first sight of a problem, as the real call would).

    >>> import torch, ficco
    >>> print(ficco.explain(torch.randn(4, 8), torch.randn(8, 3)).schedule)
    serial
    """
    call = _ALL_GATHER_MATMUL.prepare(a_shard, b, group, gather_dim)
    return runtime.explain(call, schedule)


def traced_all_gather_matmul(a_shard, b, group=None, *, schedule, transport=None,
                             gather_dim=0):
    """Run one call with a forced schedule and return ``(output, plan, rows)``, rows being this
    rank's measured per-op ``{op_index, queue, kind, label, start_s, end_s}`` (for timelines)."""
    call = _ALL_GATHER_MATMUL.prepare(a_shard, b, group, gather_dim)
    return runtime.traced(call, schedule, transport)


def shutdown() -> None:
    """Release workspaces, symmetric allocations, queues and cached plans. Safe to call twice;
    runs at interpreter exit.

    >>> import ficco
    >>> ficco.shutdown()
    """
    runtime.shutdown()


atexit.register(shutdown)
