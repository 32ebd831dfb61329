"""The public entry points: ``all_gather_matmul``, ``matmul_reduce_scatter``,
``matmul_all_reduce``, the expert-parallel pair, the Ulysses pair, ``explain``, ``warmup``
and ``shutdown``.

Data flows one way: arguments -> op spec (``ficco/ops/``: validated, canonical Call) ->
runtime (``ficco/runtime/path.py``: agreement, Decision, Plan, executor) -> the caller's layout.
"""
from __future__ import annotations

import atexit
from collections.abc import Callable

import torch

from . import config
from .errors import InvalidArgumentError
from .ops import get as op_spec
from .ops.all_gather_matmul import torch_op as all_gather_op
from .ops.all_gather_matmul.spec import SPEC as _ALL_GATHER_MATMUL
from .ops.matmul_all_reduce import torch_op as all_reduce_op
from .ops.matmul_all_reduce.spec import SPEC as _MATMUL_ALL_REDUCE
from .ops.matmul_reduce_scatter import torch_op as reduce_scatter_op
from .ops.matmul_reduce_scatter.spec import SPEC as _MATMUL_REDUCE_SCATTER
from .ops.ulysses import torch_op as ulysses
from .runtime import path as runtime

last_run = runtime.last_run    # (schedule, transport) of a group's last call: session_of().last


def all_gather_matmul(a_shard, b, group=None, *, gather_dim=0, schedule=None,
                      return_gathered=False, a_scale=None, b_scale=None, out_dtype=None,
                      bias=None, activation=None):
    """``all_gather(a_shard, gather_dim) @ b``, with the all-gather hidden behind the GEMM.

    ``b`` is a ``(K, n)`` tensor or a list of them (one gather feeds several GEMMs); the output
    has the shape of the plain expression (a list when ``b`` is a list). ``group`` is a
    ProcessGroup, a group name, a 1-D DeviceMesh or None (the default group). ``schedule``
    forces a schedule by name (see ``ficco.schedules.names()``); None lets the selector choose.
    ``return_gathered=True`` returns ``(gathered_a, outputs)``.

    fp8 (``float8_e4m3fn``/``float8_e5m2``; ``*_fnuz`` on MI300X): ``a_scale`` and ``b_scale``
    as ``torch._scaled_mm`` takes them, tensor-wise (one float32 each; ``a_scale`` the same on
    every rank) or row-wise (``a_scale`` shaped like ``a_shard``'s rows with a last dim of 1,
    gathered with its rows; ``b_scale`` ``(1, n)``), a list of ``b_scale`` when ``b`` is a
    list. ``out_dtype``: the outputs' dtype (fp8: default A's, as torch's; others: A's or
    float32). ``bias`` ``(n,)`` (a list per b) is added to every row; ``activation`` (``gelu``,
    ``gelu_tanh``, ``silu``, ``relu``) follows it, applied per output piece as the pieces
    complete. See docs/fp8.md.

    >>> import torch, ficco
    >>> a = torch.randn(4, 8); w = torch.randn(8, 3)
    >>> torch.allclose(ficco.all_gather_matmul(a, w), a @ w)   # world size 1: a plain matmul
    True
    >>> e4m3, one = torch.float8_e4m3fn, torch.tensor(1.0)
    >>> a8, w8 = torch.randn(4, 32).to(e4m3), torch.randn(32, 16).to(e4m3)
    >>> c = ficco.all_gather_matmul(a8, w8, a_scale=one, b_scale=one, out_dtype=torch.bfloat16,
    ...                             bias=torch.zeros(16))
    >>> c.dtype, tuple(c.shape)
    (torch.bfloat16, (4, 16))
    """
    # Through the torch custom op (autograd, autocast, torch.compile); ficco/ops/<op>/torch_op.py.
    return all_gather_op.all_gather_matmul(a_shard, b, group, gather_dim=gather_dim,
                                     schedule=schedule, return_gathered=return_gathered,
                                     a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype,
                                     bias=bias, activation=activation)


def matmul_reduce_scatter(a, b, group=None, *, scatter_dim=0, reduce_op="sum", schedule=None,
                          a_scale=None, b_scale=None, out_dtype=None, bias=None,
                          activation=None):
    """``reduce_scatter(a @ b, scatter_dim)`` with the reduce-scatter hidden behind the GEMM:
    the row-parallel half of a TP/SP layer (attention out-projection, MLP down-projection).

    Every rank holds the full-row ``a`` (rows..., K) and its K-row shard of the weight ``b``
    ``(K, n)`` (or a list of them: one output each); rank r receives block r of the rows along
    ``scatter_dim`` of ``sum over ranks of a @ b``. Blocks follow ``all_gather_matmul``'s
    chunk rule (``even_split``: whole indices of ``scatter_dim``, longer blocks first), so
    the two ops are exact inverses of each other's layout. ``reduce_op`` is ``"sum"`` or
    ``"avg"``; ``schedule`` forces one of ``ficco.schedules.names(op="matmul_reduce_scatter")``.

    fp8 scales and ``out_dtype`` as in :func:`all_gather_matmul` (a row-wise ``a_scale`` is
    shaped like ``a``'s rows); partial products are summed in float32 and rounded once.
    ``bias`` ``(n,)`` is added once, to the reduced block (torch's scaled op adds it in every
    rank's GEMM: ``ficco.compat.fused_scaled_matmul_reduce_scatter`` does as torch). An
    ``activation`` is refused (InvalidArgumentError, before any communication): the output is
    a sum over ranks, complete only after the last reduction.

    >>> import torch, ficco
    >>> a = torch.randn(4, 8); w = torch.randn(8, 3)
    >>> torch.allclose(ficco.matmul_reduce_scatter(a, w), a @ w)   # one rank: a plain matmul
    True
    """
    # Through the torch custom op (autograd, autocast, torch.compile); ficco/ops/<op>/torch_op.py.
    return reduce_scatter_op.matmul_reduce_scatter(a, b, group, scatter_dim=scatter_dim,
                                         reduce_op=reduce_op, schedule=schedule,
                                         a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype,
                                         bias=bias, activation=activation)


def matmul_all_reduce(a, b, group=None, *, reduce_op="sum", schedule=None, a_scale=None,
                      b_scale=None, out_dtype=None, bias=None):
    """``all_reduce(a @ b)`` with the all-reduce hidden behind the GEMM (or, for the small
    GEMMs of decode, done in one round over symmetric memory): the row-parallel half of tensor
    parallelism without sequence parallelism (attention out-projection, MLP down-projection in
    TP inference).

    Every rank holds its K-slice of the activation ``a`` (..., K_r) and its K-row shard of the
    weight ``b`` (K_r, n) (or a list of them: one output each; widths may differ by rank, a
    rank may hold none); every rank receives all of ``sum over ranks of a @ b``, shaped
    (..., n), the same values on every rank. ``reduce_op`` is ``"sum"`` or ``"avg"``;
    ``schedule`` forces one of ``ficco.schedules.names(op="matmul_all_reduce")``. fp8 scales
    and ``out_dtype`` as in :func:`all_gather_matmul` (partial products summed in float32 and
    rounded once, except where the process group sums them: ``serial``, ``chunked-*`` and
    ``two-shot`` over ccl, as NCCL does); ``bias`` (n,) is added once, to the sum. See
    docs/all_reduce.md.

    >>> import torch, ficco
    >>> a = torch.randn(2, 3, 8); w = torch.randn(8, 5)
    >>> torch.allclose(ficco.matmul_all_reduce(a, w), a @ w)   # one rank: a plain matmul
    True
    """
    return all_reduce_op.matmul_all_reduce(a, b, group, reduce_op=reduce_op,
                                                schedule=schedule, a_scale=a_scale,
                                                b_scale=b_scale, out_dtype=out_dtype, bias=bias)


def warmup(op, shapes, group=None, *, dtype=torch.bfloat16, **kwargs) -> list:
    """Make the first sight of each problem now: one call of ``op`` (``"all_gather_matmul"``,
    ``"matmul_reduce_scatter"`` or ``"matmul_all_reduce"``: the ops of (rows, K, n) GEMMs) per ``(rows, K, n)`` in
    ``shapes``, on random operands of ``dtype`` on this process's device, so the ``auto``
    selector measures its shortlist for each of them here, up front whatever ``FICCO_AUTO``
    says (a serving process that knows its
    buckets calls it at start) and later calls of those keys find the decision cached. Rows
    and K are the op's own: the all-gather's rows per rank and K; the reduce-scatter's and
    all-reduce's rows and this rank's K. ``kwargs`` go to every call (``schedule``,
    ``reduce_op``, ``out_dtype``, ...). Every rank of ``group`` must call it with the same
    list, as any ficco call. Returns ``(schedule, transport)`` per shape as the calls ran.

    >>> import ficco
    >>> ficco.warmup("matmul_all_reduce", [(4, 8, 5)], dtype=torch.float32)  # one rank
    [None]
    """
    from .backends import get_backend
    from .ops import of_collective
    from .plan.problem import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

    # the ops whose calls are (rows, K, n) GEMMs: those of the engine's Problems
    calls: dict[str, Callable[..., object]] = {
        name: globals()[name] for name in of_collective(ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)}
    if op not in calls:
        raise InvalidArgumentError(f"warmup takes {', '.join(calls)}; got op={op!r}")
    shapes = [tuple(shape) for shape in shapes]
    if any(len(shape) != 3 or not all(isinstance(x, int) and x > 0 for x in shape)
           for shape in shapes):
        raise InvalidArgumentError(f"warmup shapes are (rows, K, n) of positive ints; got "
                                   f"{shapes}")
    device = get_backend().device()
    ran = []
    # (measured up front: a warm-up's point is a decision made before the real calls)
    with config.scope(auto="upfront"):
        for rows, k, n in shapes:
            a = torch.randn(rows, k, device=device).to(dtype)
            b = torch.randn(k, n, device=device).to(dtype)
            calls[op](a, b, group, **kwargs)
            ran.append(last_run(group))
    return ran


def explain(a_shard, b, group=None, *, gather_dim=0, schedule=None, op="all_gather_matmul",
            scatter_dim=0, reduce_op="sum", counts=None, **epilogue):
    """The Decision ``op`` (``all_gather_matmul``; ``matmul_reduce_scatter`` with
    ``scatter_dim``/``reduce_op``, or ``matmul_all_reduce`` with ``reduce_op``: then
    ``a_shard`` is the full-row ``a``) would take for these
    arguments: schedule, transport, the selector that chose, its inputs and every candidate's
    score. Local: it never communicates, so one rank may call it alone (``if rank == 0:
    print(ficco.explain(...))``). Before the ranks agreed on this call, ``auto`` transport
    assumes they share a host; before a measuring selector (``auto``, the default, or
    ``tune``) measured it, the decision is the model's prediction and says so ("not measured
    yet", "not tuned yet": the first real call measures); after, the measured times beside
    the predicted ones.
    Expert parallelism: ``op="all_to_all_grouped_mm"`` (``a_shard`` is x, ``b`` is w,
    ``counts=`` its counts) or ``"grouped_mm_all_to_all"`` (h, w2, ``counts=`` recv_counts);
    without communication it assumes every rank routes like this one. ``epilogue``: the op's
    ``a_scale``, ``b_scale``, ``out_dtype``, ``bias`` (and ``activation``), so fp8 calls are
    priced as fp8.

    >>> import torch, ficco
    >>> print(ficco.explain(torch.randn(4, 8), torch.randn(8, 3)).schedule)
    serial
    >>> ficco.explain(torch.randn(4, 8), torch.randn(8, 3), op="matmul_reduce_scatter").schedule
    'serial'
    >>> ficco.explain(torch.randn(4, 8), torch.randn(8, 3), op="matmul_all_reduce").schedule
    'serial'
    """
    call = op_spec(op).explained(a_shard, b, group, gather_dim=gather_dim,
                                 scatter_dim=scatter_dim, reduce_op=reduce_op, counts=counts,
                                 epilogue=epilogue)
    return runtime.explain(call, schedule)


def traced_all_gather_matmul(a_shard, b, group=None, *, schedule, transport=None,
                             gather_dim=0):
    """Run one call with a forced schedule and return ``(output, plan, rows)``, rows being this
    rank's measured per-op ``{op_index, queue, kind, label, start_s, end_s}`` (for timelines)."""
    call = _ALL_GATHER_MATMUL.prepare(a_shard, b, group, gather_dim)
    return runtime.traced(call, schedule, transport)


def traced_matmul_all_reduce(a, b, group=None, *, schedule, transport=None, reduce_op="sum"):
    """``traced_all_gather_matmul`` for ``matmul_all_reduce``: ``(output, plan, rows)``."""
    return runtime.traced(_MATMUL_ALL_REDUCE.prepare(a, b, group, reduce_op), schedule,
                          transport)


def traced_matmul_reduce_scatter(a, b, group=None, *, schedule, transport=None, scatter_dim=0,
                                 reduce_op="sum"):
    """``traced_all_gather_matmul`` for ``matmul_reduce_scatter``: ``(output, plan, rows)``."""
    call = _MATMUL_REDUCE_SCATTER.prepare(a, b, group, scatter_dim, reduce_op)
    return runtime.traced(call, schedule, transport)


# -- expert parallelism (ops/expert/torch_op.py) ----------------------------------------------------
def all_to_all_grouped_mm(x, counts, w, group=None, *, schedule=None):
    """Expert-parallel dispatch: the all-to-all of tokens to their experts, then every
    expert's GEMM, with the all-to-all hidden behind the grouped GEMM. Returns
    ``(y, recv_counts)``.

    ``x`` (T, K): this rank's rows sorted by global expert; ``counts`` (E,) int64: rows per
    global expert (E = W*L; sum T; zeros allowed); ``w`` (L, K, n) or a list of L (K, n): this
    rank's local experts (global expert e lives on rank e // L as local expert e % L). ``y``
    (R, n) holds local expert 0's rows from rank 0, then from rank 1, …, then local expert 1's,
    each block times ``w[l]`` (torch's ``all_to_all_vdev_2d`` layout); ``recv_counts`` (L, W)
    counts them. ``schedule``: one of ``ficco.schedules.names(op="all_to_all_grouped_mm")``.

    >>> import torch, ficco
    >>> x = torch.randn(5, 8); w = torch.randn(2, 8, 3)
    >>> y, rc = ficco.all_to_all_grouped_mm(x, torch.tensor([2, 3]), w)   # one rank
    >>> torch.allclose(y, torch.cat([x[:2] @ w[0], x[2:] @ w[1]])), rc.tolist()
    (True, [[2], [3]])
    """
    from .ops.expert import torch_op as expert_op

    return expert_op.all_to_all_grouped_mm(x, counts, w, group, schedule=schedule)


def grouped_mm_all_to_all(h, recv_counts, w2, group=None, *, schedule=None, send_counts=None):
    """Expert-parallel combine, the exact inverse of :func:`all_to_all_grouped_mm`: every
    block ``(l, s)`` of ``h`` (R, K2, in dispatch's ``y`` order; ``recv_counts`` as dispatch
    returned it) times ``w2[l]`` goes back to rank s, which returns ``z`` (T, n2) in its
    original row order. Learning what comes back costs one bounded exchange of counts;
    ``send_counts=`` (the counts dispatch took, on every rank) skips it.

    >>> import torch, ficco
    >>> x = torch.randn(5, 8); w = torch.randn(2, 8, 3); w2 = torch.randn(2, 3, 4)
    >>> y, rc = ficco.all_to_all_grouped_mm(x, [2, 3], w)
    >>> z = ficco.grouped_mm_all_to_all(y, rc, w2)
    >>> torch.allclose(z, torch.cat([x[:2] @ w[0] @ w2[0], x[2:] @ w[1] @ w2[1]]), atol=1e-5)
    True
    """
    from .ops.expert import torch_op as expert_op

    return expert_op.grouped_mm_all_to_all(h, recv_counts, w2, group, schedule=schedule,
                                                send_counts=send_counts)


def matmul_all_to_all(a, b, group=None, *, scatter_dim, gather_dim, schedule=None):
    """``all_to_all(a @ b)``: Ulysses sequence parallelism's QKV projection, its output moved
    from sequence shards to head shards, the all-to-all hidden behind the GEMM's pieces.

    ``all_to_all(t)`` splits ``t`` into W chunks along ``scatter_dim`` (longer chunks first
    when W does not divide it), sends chunk j to rank j and concatenates what arrives along
    ``gather_dim`` in rank order; both are dims of the product (negative dims count from its
    end). The ranks' products may differ in their length along ``gather_dim`` only.
    ``schedule``: one of ``ficco.schedules.names(op="matmul_all_to_all")``. docs/ulysses.md.

    >>> import torch, ficco
    >>> a, w = torch.randn(2, 6, 8), torch.randn(8, 4)
    >>> torch.allclose(ficco.matmul_all_to_all(a, w, scatter_dim=-1, gather_dim=1), a @ w)
    True
    """
    return ulysses.front("matmul_all_to_all", a, b, group, scatter_dim, gather_dim, schedule)


def all_to_all_matmul(a, b, group=None, *, scatter_dim, gather_dim, schedule=None):
    """``all_to_all(a) @ b``: before Ulysses' output projection, head shards back to sequence
    shards, the GEMM started on each rank's chunk as it lands (``C += a_j @ b[K_j]`` when
    ``gather_dim`` is ``a``'s last dim).

    The all-to-all as in :func:`matmul_all_to_all`, on dims of ``a``; the ranks' ``a`` may
    differ in their length along ``gather_dim`` only. ``schedule``: one of
    ``ficco.schedules.names(op="all_to_all_matmul")``. docs/ulysses.md.

    >>> import torch, ficco
    >>> a, w = torch.randn(2, 6, 8), torch.randn(8, 4)
    >>> torch.allclose(ficco.all_to_all_matmul(a, w, scatter_dim=0, gather_dim=1), a @ w)
    True
    """
    return ulysses.front("all_to_all_matmul", a, b, group, scatter_dim, gather_dim, schedule)


def session_of(group=None):
    """The :class:`~ficco.runtime.session.Session` of ``group`` (a ProcessGroup, a group name, a 1-D
    DeviceMesh or None: the default group, or no group) with the active backend in this
    process, made at first use: what ficco keeps about the group between calls. Read it,
    don't change it: ``last`` (the Decision of its last multi-rank call), ``poisoned`` (None,
    or why it refuses calls and whether only destroying the group ends it), ``channel.number``
    (calls made on the group since the last ``shutdown``), ``channel.sequence`` (exchanges
    through its store), ``workspace`` (its symmetric workspace, or None).

    >>> import ficco
    >>> ficco.session_of().poisoned is None
    True
    """
    from .backends import get_backend
    from .group import resolve
    from .runtime.session import of

    return of(resolve(group), get_backend())


def shutdown() -> None:
    """Drop what ficco keeps about every group in this process (workspaces, queues, calls,
    plans, decisions, agreements; ficco.runtime.session): the one recovery after an error, run on every
    rank (it is local: a group is in step again once every rank called it). Safe to call
    twice; runs at interpreter exit.

    >>> import ficco
    >>> ficco.shutdown()
    """
    runtime.shutdown()


atexit.register(shutdown)
