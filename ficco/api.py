"""The public entry points: ``all_gather_matmul``, ``explain`` and ``shutdown``.

Data flows one way: arguments -> op spec (``ficco/ops/``: validated, canonical Call) ->
runtime (``ficco/runtime.py``: agreement, Decision, Plan, executor) -> the caller's layout.
"""
from __future__ import annotations

import atexit

from . import library, runtime
from .errors import InvalidArgumentError
from .ops.all_gather_matmul import SPEC as _ALL_GATHER_MATMUL
from .ops.matmul_reduce_scatter import SPEC as _MATMUL_REDUCE_SCATTER

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


def matmul_reduce_scatter(a, b, group=None, *, scatter_dim=0, reduce_op="sum", schedule=None):
    """``reduce_scatter(a @ b, scatter_dim)`` with the reduce-scatter hidden behind the GEMM:
    the row-parallel half of a TP/SP layer (attention out-projection, MLP down-projection).

    Every rank holds the full-row ``a`` (rows..., K) and its K-row shard of the weight ``b``
    ``(K, n)`` (or a list of them: one output each); rank r receives block r of the rows along
    ``scatter_dim`` of ``sum over ranks of a @ b``. Blocks follow ``all_gather_matmul``'s
    chunk rule (``even_split``: whole indices of ``scatter_dim``, longer blocks first), so
    the two ops are exact inverses of each other's layout. ``reduce_op`` is ``"sum"`` or
    ``"avg"``; ``schedule`` forces one of ``ficco.schedules.names(op="matmul_reduce_scatter")``.

    >>> import torch, ficco
    >>> a = torch.randn(4, 8); w = torch.randn(8, 3)
    >>> torch.allclose(ficco.matmul_reduce_scatter(a, w), a @ w)   # one rank: a plain matmul
    True
    """
    # Through the torch custom op (autograd, autocast, torch.compile); ficco/library.py.
    return library.matmul_reduce_scatter(a, b, group, scatter_dim=scatter_dim,
                                         reduce_op=reduce_op, schedule=schedule)


def _prepare(op, a, b, group, dim, reduce_op):
    if op == _ALL_GATHER_MATMUL.name:
        return _ALL_GATHER_MATMUL.prepare(a, b, group, dim)
    if op == _MATMUL_REDUCE_SCATTER.name:
        return _MATMUL_REDUCE_SCATTER.prepare(a, b, group, dim, reduce_op)
    raise InvalidArgumentError(f"op={op!r} is not a ficco op; use all_gather_matmul or "
                               f"matmul_reduce_scatter")


def explain(a_shard, b, group=None, *, gather_dim=0, schedule=None, op="all_gather_matmul",
            scatter_dim=0, reduce_op="sum"):
    """The Decision ``op`` (``all_gather_matmul``, or ``matmul_reduce_scatter`` with
    ``scatter_dim``/``reduce_op``; then ``a_shard`` is the full-row ``a``) would take for these
    arguments: schedule, transport, the selector that chose, its inputs and every candidate's
    score. Local: it never communicates, so one rank may call it alone (``if rank == 0:
    print(ficco.explain(...))``). Before the ranks agreed on this call, ``auto`` transport
    assumes they share a host; before ``tune`` measured it, the decision is the model's
    prediction and its reason says "not tuned yet" (the first real call measures).

    >>> import torch, ficco
    >>> print(ficco.explain(torch.randn(4, 8), torch.randn(8, 3)).schedule)
    serial
    >>> ficco.explain(torch.randn(4, 8), torch.randn(8, 3), op="matmul_reduce_scatter").schedule
    'serial'
    """
    dim = scatter_dim if op == _MATMUL_REDUCE_SCATTER.name else gather_dim
    return runtime.explain(_prepare(op, a_shard, b, group, dim, reduce_op), schedule)


def traced_all_gather_matmul(a_shard, b, group=None, *, schedule, transport=None,
                             gather_dim=0):
    """Run one call with a forced schedule and return ``(output, plan, rows)``, rows being this
    rank's measured per-op ``{op_index, queue, kind, label, start_s, end_s}`` (for timelines)."""
    call = _ALL_GATHER_MATMUL.prepare(a_shard, b, group, gather_dim)
    return runtime.traced(call, schedule, transport)


def traced_matmul_reduce_scatter(a, b, group=None, *, schedule, transport=None, scatter_dim=0,
                                 reduce_op="sum"):
    """``traced_all_gather_matmul`` for ``matmul_reduce_scatter``: ``(output, plan, rows)``."""
    call = _MATMUL_REDUCE_SCATTER.prepare(a, b, group, scatter_dim, reduce_op)
    return runtime.traced(call, schedule, transport)


def shutdown() -> None:
    """Release workspaces, symmetric allocations, queues and cached plans. Safe to call twice;
    runs at interpreter exit.

    >>> import ficco
    >>> ficco.shutdown()
    """
    runtime.shutdown()


atexit.register(shutdown)
