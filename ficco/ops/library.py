"""ficco's two ops as torch custom ops: ``torch.ops.ficco.all_gather_matmul`` and
``torch.ops.ficco.matmul_reduce_scatter``, with fake kernels; their autograd and autocast are
in :mod:`ficco.ops.autograd`.

Why custom ops: the dispatcher then treats a ficco call as one opaque op. Autograd records it
(the backward of each op is the other op, overlapped too), ``torch.compile(fullgraph=True)``
and ``torch.export`` put it in the graph as one node whose shapes come from the fake kernel,
and the host work a call does (validation, cross-rank agreement, schedule selection, plan
execution on worker threads) runs only in the op's real kernel, at run time, never traced.

The ops take a group *name* (a string), so a traced graph carries no ProcessGroup object;
:func:`ficco.group.name_rank_world` turns what the public functions accept (None, a name, a
ProcessGroup, a 1-D DeviceMesh) into it, with the sizes that depend on the rank or the group:
``world`` (the group's size, as torch's functional collectives take ``group_size``) and, for
the reduce-scatter, ``out_rows`` (this rank's rows of the output: blocks of uneven rows differ
by rank, as torch's ``all_to_all_single`` takes its output sizes). The public functions read
them where torch.compile traces them, so they are constants of the graph; the fake kernels and
backward formulas read only these arguments, never the process. torch.compile caches what it
compiles on disk under a key made of the graph and its inputs, shared by every process of a
machine: a size read from the process while tracing would reach another rank (rank 1 loading
rank 0's 3 rows of 5) or another job (W=3 loading a W=2 graph). So a graph that depends on the
rank differs by rank, and each rank compiles its own.

Backward of ``c_j = all_gather(a) @ b_j`` needs the gathered ``a`` for ``grad_b_j``. Two ways,
chosen by ``FICCO_BACKWARD_GATHER`` (see :mod:`ficco.config`):

- ``save`` (default): the forward keeps its gathered ``a`` (``W*m x K`` per call, the same
  activation a plain non-sequence-parallel linear keeps); the backward moves no extra bytes.
- ``regather``: the forward keeps only the local shard (W times less activation memory); the
  backward gathers ``a`` again, launched before the input-gradient reduce-scatter and waited
  for only after it, so the two overlap (Megatron's choice for sequence parallelism).
"""
from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import config
from ..errors import FiccoError, InvalidArgumentError
from ..group import by_name, name_rank_world, rank_world, world_arg, wrong_world
from ..plan.epilogue import activation_fn
from ..runtime import path as runtime
from ..runtime.call import FORWARD, check_flag
from . import autograd
from .all_gather_matmul.spec import SPEC as ALL_GATHER_MATMUL
from .all_gather_matmul.spec import check_arguments as check_all_gather_matmul
from .all_gather_matmul.spec import check_epilogue as check_all_gather_epilogue
from .front import eager_suffices, front_end
from .matmul_reduce_scatter.spec import SPEC as MATMUL_REDUCE_SCATTER
from .matmul_reduce_scatter.spec import check_arguments as check_matmul_reduce_scatter
from .matmul_reduce_scatter.spec import check_epilogue as check_reduce_scatter_epilogue


# -- layouts -----------------------------------------------------------------------------------
def restored_layout(moved_shape: Sequence[int], dim: int, rows: int,
                    cols: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, stride) of a canonical contiguous ``(rows * prod(moved_shape[1:-1]), cols)``
    matrix viewed as ``(rows, *moved_shape[1:-1], cols)`` with dim 0 moved to ``dim``: the
    layout both ops return (the fake kernels promise it; the real ones are held to it)."""
    shape = [rows, *moved_shape[1:-1], cols]
    stride = [0] * len(shape)
    step = 1
    for i in range(len(shape) - 1, -1, -1):
        stride[i] = step
        step *= max(shape[i], 1)
    order = list(range(1, len(shape)))
    order.insert(dim, 0)
    return tuple([shape[i] for i in order]), tuple([stride[i] for i in order])


def _moved_shape(a: Tensor, dim: int) -> tuple:
    shape = tuple(a.shape)
    return (shape[dim], *shape[:dim], *shape[dim + 1:])


#: restored_layout of the real kernels, whose shapes are ints: once per shape
cached_layout = functools.lru_cache(maxsize=256)(restored_layout)


def fresh_outputs(ts: Sequence[Tensor], layouts, inputs: Sequence[Tensor]) -> list[Tensor]:
    """Each of ``ts`` in exactly its ``(shape, stride)`` of ``layouts``, sharing no memory
    with ``inputs`` or with an earlier one of ``ts`` (custom ops must return fresh tensors);
    copies only those that are not already so."""
    taken = {x.untyped_storage().data_ptr() for x in inputs}
    held = []
    for t, (shape, stride) in zip(ts, layouts):
        if (t.untyped_storage().data_ptr() in taken or tuple(t.shape) != tuple(shape)
                or (t.numel() and tuple(t.stride()) != tuple(stride))):
            t = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).copy_(t)
        taken.add(t.untyped_storage().data_ptr())
        held.append(t)
    return held


# -- the real kernels: host work, run at call time -----------------------------------------------
def _run_all_gather_matmul(a, b, group, gather_dim, schedule, return_gathered, role=FORWARD,
                           world=None, **epilogue):
    """The eager implementation: the real kernel of ``ficco::all_gather_matmul`` and the public
    function's path when the dispatcher adds nothing. Straight to the runtime (``api`` sits
    above this module). ``epilogue``: fp8 scales, out_dtype, bias, activation; ``role``:
    FORWARD, or the backward pass the call belongs to; ``world``: the op's argument, checked."""
    return runtime.run(prepared(ALL_GATHER_MATMUL, group, a, b, group, gather_dim,
                                return_gathered, role=role, world=world, **epilogue), schedule)


def _run_matmul_reduce_scatter(a, b, group, scatter_dim, reduce_op, schedule, role=FORWARD,
                               world=None, out_rows=None, **epilogue):
    def check_out_rows(call) -> None:
        rows = scattered_rows(a.shape[scatter_dim], call.rank, call.world)
        if out_rows != rows:
            raise InvalidArgumentError(
                f"torch.ops.ficco.matmul_reduce_scatter: out_rows={out_rows}, but rank "
                f"{call.rank} of {call.world} gets {rows} of the {a.shape[scatter_dim]} "
                f"rows along scatter_dim (longer blocks first); pass ficco.ops.library."
                f"scattered_rows(rows, rank, world) or call ficco.matmul_reduce_scatter")

    return runtime.run(prepared(MATMUL_REDUCE_SCATTER, group, a, b, group, scatter_dim,
                                reduce_op, role=role, world=world,
                                then=None if out_rows is None else check_out_rows, **epilogue),
                       schedule)


def prepared(spec, group, *args, role: str = FORWARD, world: int | None = None, then=None,
             **kwargs):
    """``spec.prepare(*args, **kwargs)``: every op's Call, made for the pass ``role`` (FORWARD,
    or the backward it belongs to), with an op's ``world`` argument checked against
    ``group``'s size and ``then(call)`` (a check of the op's own, or None) run. A call refused
    here still takes its place in the group's sequence, so its peers' same call never pairs
    with this rank's next one (runtime.abandoned)."""
    try:
        call = spec.prepare(*args, **kwargs)
        call.role = role
        if world is not None and world != call.world:
            raise wrong_world(spec.name, group, world, call.world)
        if then is not None:
            then(call)
        return call
    except Exception:
        runtime.abandoned(group)
        raise


def epilogue_kwargs(a_scale, b_scales, biases, out_dtype, activation=None) -> dict:
    """The ops' optional fp8/bias/activation arguments as the op specs' keywords."""
    return {"a_scale": a_scale, "b_scale": None if b_scales is None else list(b_scales),
            "bias": None if biases is None else list(biases), "out_dtype": out_dtype,
            **({"activation": activation} if activation else {})}


# -- the ops ------------------------------------------------------------------------------------
# Explicit schemas: the epilogue's optional lists ("Tensor[]?", "Tensor?[]?") have defaults, so
# calls written before they existed keep working. ``role`` ("forward" by default): the
# backward pass a call belongs to, which the ranks agree on (ficco.ops.autograd passes it).
# ``world`` and ``out_rows`` (last, see the module docstring): None only in calls written
# before they existed, which run eagerly as before and are refused by the fake kernels.
EPILOGUE_SCHEMA = ("Tensor? a_scale=None, Tensor[]? b_scales=None, Tensor?[]? biases=None, "
                    "ScalarType? out_dtype=None")


@torch.library.custom_op(
    "ficco::all_gather_matmul", mutates_args=(),
    schema="(Tensor a, Tensor[] bs, str group, int gather_dim, str? schedule, "
           f"bool return_gathered, {EPILOGUE_SCHEMA}, str? activation=None, "
           f"str role=\"{FORWARD}\", int? world=None) -> (Tensor, Tensor[])")
def all_gather_matmul_op(a: Tensor, bs: list[Tensor], group: str, gather_dim: int,
                         schedule: str | None, return_gathered: bool,
                         a_scale: Tensor | None = None, b_scales=None, biases=None,
                         out_dtype: torch.dtype | None = None,
                         activation: str | None = None, role: str = FORWARD,
                         world: int | None = None) -> tuple[Tensor, list[Tensor]]:
    """``(all_gather(a, gather_dim) or an empty tensor, [gathered @ b for b in bs])``, with
    fp8 scales, output dtype, bias per b and an activation (:mod:`ficco.plan.epilogue`); ``world``:
    the group's size."""
    pg = by_name(group)
    epilogue = {} if (a_scale is None and b_scales is None and biases is None
                      and out_dtype is None and activation is None) else \
        epilogue_kwargs(a_scale, b_scales, biases, out_dtype, activation)
    out = _run_all_gather_matmul(a, list(bs), pg, gather_dim, schedule, return_gathered, role,
                                 world, **epilogue)
    gathered, outs = out if return_gathered else (None, out)
    gather_dim %= a.dim()
    if world is None:   # a call written before the argument existed
        _, world = rank_world(pg)
    moved = _moved_shape(a, gather_dim)
    rows = world * moved[0]
    layouts = [cached_layout(moved, gather_dim, rows, b.shape[1]) for b in bs]
    if not return_gathered:
        return a.new_empty(0), fresh_outputs(outs, layouts, [a, *bs])
    assert gathered is not None   # the runtime returned (gathered, outs)
    *outs, gathered = fresh_outputs([*outs, gathered],
                             [*layouts, cached_layout(moved, gather_dim, rows, a.shape[-1])], [a, *bs])
    return gathered, outs


# -- the fake kernels: shapes only, and the eager path's argument errors -------------------------
def errors_reach_the_caller(fake):
    """A fake kernel whose ficco errors reach the caller as ficco errors under torch.compile,
    and whose refusal takes its call's number when torch.compile will not run the call.

    Dynamo runs fake kernels while it traces, and re-raises what they raise as its own
    TorchRuntimeError, which ``except FiccoError`` misses. The one kind it passes on untouched
    is its graph-break signal, ``Unsupported``: with ``fullgraph=True`` it reaches the caller as
    is, otherwise dynamo runs the call eagerly, whose validation raises the same error. So the
    error raised here is the same ficco class, made an ``Unsupported`` too.

    A refused call takes its number in the group's sequence of calls, in compiled code as in
    eager (:func:`ficco.runtime.path.abandoned`): when dynamo graph-breaks, the eager run of the call
    is refused and takes it there; when the refusal ends the trace (``fullgraph=True``,
    ``error_on_graph_break``), the graph runs on the peers but not here, so the refusal takes
    a number for the refused call and for every ficco call the trace had reached before it
    (on each one's group): no call of the peers' graph can pair with this rank's next call.
    ``torch.export`` and fake tensors outside torch.compile run no call: nothing is taken."""
    group_at = list(inspect.signature(fake).parameters).index("group")

    @functools.wraps(fake)
    def checked(*args, **kwargs):
        tracer = _tracer()
        try:
            out = fake(*args, **kwargs)
        except FiccoError as exc:
            if tracer is not None and _ends_the_trace(tracer):
                group = kwargs["group"] if "group" in kwargs else args[group_at]
                for name in (*_TRACED.pop(tracer, ()), group):
                    runtime.abandoned(name)
            raise _through_dynamo(exc) from None
        if tracer is not None:
            _TRACED.setdefault(tracer, []).append(
                kwargs["group"] if "group" in kwargs else args[group_at])
        return out
    return checked


#: the groups of the ficco calls each live dynamo trace has met, in order (a trace that ends
#: refused takes their numbers: errors_reach_the_caller)
_TRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tracer():
    """The dynamo trace running now (its root instruction translator; a new one per restart of
    the analysis), or None outside torch.compile's trace."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - no trace (unset), or a torch without dynamo
        return None


def _ends_the_trace(tracer) -> bool:
    """Whether a graph break now ends the trace with its error (``fullgraph=True``, or
    ``torch._dynamo.error_on_graph_break(True)`` where the call is) instead of dynamo running
    the call eagerly; never while exporting (an exported program runs no call now)."""
    if getattr(tracer, "export", False):
        return False
    if getattr(tracer, "one_graph", True):
        return True
    try:
        from torch._dynamo.utils import _get_error_on_graph_break

        return bool(_get_error_on_graph_break())
    except Exception:  # noqa: BLE001 - a torch without the setting: the translator's copy
        return bool(getattr(tracer, "error_on_graph_break", False))


@functools.cache
def _unsupported_twin(cls: type, unsupported: type) -> type:
    """``cls`` made an ``Unsupported`` too (once per class)."""
    def init(self, message):
        unsupported.__init__(self, message)

    return type(cls.__name__, (cls, unsupported),
                {"__init__": init, "__module__": cls.__module__,
                 "__doc__": f"{cls.__doc__} (raised while torch.compile traces)"})


def _through_dynamo(exc: FiccoError) -> FiccoError:
    try:
        from torch._dynamo.exc import Unsupported
    except ImportError:           # a torch without dynamo: nothing wraps it
        return exc
    kind: Any = type(exc)     # (a class hashes; typeshed's Hashable says otherwise)
    raised = _unsupported_twin(kind, Unsupported)(str(exc))
    raised.__dict__.update({k: v for k, v in vars(exc).items() if k not in vars(raised)})
    return raised


@all_gather_matmul_op.register_fake
@errors_reach_the_caller
def _(a, bs, group, gather_dim, schedule, return_gathered, a_scale=None, b_scales=None,
      biases=None, out_dtype=None, activation=None, role=FORWARD, world=None):
    gather_dim, bs, b_is_list = check_all_gather_matmul(a, bs, gather_dim)   # eager's words
    check_all_gather_epilogue(a, bs, b_is_list, gather_dim,
                              **epilogue_kwargs(a_scale, b_scales, biases, out_dtype, activation))
    world = world_arg("all_gather_matmul", group, world)
    moved = _moved_shape(a, gather_dim)
    rows = world * moved[0]

    def new(cols, dtype):
        shape, stride = restored_layout(moved, gather_dim, rows, cols)
        return a.new_empty_strided(shape, stride, dtype=dtype)

    gathered = new(a.shape[-1], a.dtype) if return_gathered else a.new_empty(0)
    return gathered, [new(b.shape[1], out_dtype or a.dtype) for b in bs]


@torch.library.custom_op(
    "ficco::matmul_reduce_scatter", mutates_args=(),
    schema="(Tensor a, Tensor[] bs, str group, int scatter_dim, str reduce_op, str? schedule, "
           f"{EPILOGUE_SCHEMA}, str role=\"{FORWARD}\", int? world=None, "
           "SymInt? out_rows=None) -> Tensor[]")
def matmul_reduce_scatter_op(a: Tensor, bs: list[Tensor], group: str, scatter_dim: int,
                             reduce_op: str, schedule: str | None,
                             a_scale: Tensor | None = None, b_scales=None, biases=None,
                             out_dtype: torch.dtype | None = None, role: str = FORWARD,
                             world: int | None = None, out_rows: int | None = None
                             ) -> list[Tensor]:
    """``[reduce_scatter(a @ b, scatter_dim, reduce_op) (+ bias) for b in bs]``; ``world``: the
    group's size, ``out_rows``: this rank's rows of the output along ``scatter_dim``."""
    pg = by_name(group)
    epilogue = {} if (a_scale is None and b_scales is None and biases is None
                      and out_dtype is None) else epilogue_kwargs(a_scale, b_scales, biases, out_dtype)
    outs = _run_matmul_reduce_scatter(a, list(bs), pg, scatter_dim, reduce_op, schedule, role,
                                      world, out_rows, **epilogue)
    scatter_dim %= a.dim()
    moved = _moved_shape(a, scatter_dim)
    rows = out_rows if out_rows is not None else scattered_rows(moved[0], *rank_world(pg))
    return fresh_outputs(outs, [cached_layout(moved, scatter_dim, rows, b.shape[1]) for b in bs], [a, *bs])


@matmul_reduce_scatter_op.register_fake
@errors_reach_the_caller
def _(a, bs, group, scatter_dim, reduce_op, schedule, a_scale=None, b_scales=None, biases=None,
      out_dtype=None, role=FORWARD, world=None, out_rows=None):
    scatter_dim, bs, b_is_list = check_matmul_reduce_scatter(a, bs, scatter_dim, reduce_op)
    check_reduce_scatter_epilogue(a, bs, b_is_list, scatter_dim,
                                  **epilogue_kwargs(a_scale, b_scales, biases, out_dtype))
    moved = _moved_shape(a, scatter_dim)
    if world_arg("matmul_reduce_scatter", group, world) == 1:
        rows = moved[0]       # a world of one keeps every row
    elif out_rows is None:
        raise InvalidArgumentError(
            f"torch.ops.ficco.matmul_reduce_scatter on group {group!r} was traced without "
            f"out_rows (this rank's rows of the output): its fake kernel reads sizes only from "
            f"its arguments; call ficco.matmul_reduce_scatter, which passes them, or pass "
            f"out_rows=ficco.ops.library.scattered_rows(rows, rank, world)")
    else:
        rows = out_rows
    return [a.new_empty_strided(*restored_layout(moved, scatter_dim, rows, b.shape[1]),
                                dtype=out_dtype or a.dtype) for b in bs]


def scattered_rows(total, rank: int, world: int):
    """This rank's rows of ``total`` rows scattered over ``world`` ranks: the chunk rule both
    ops share (longer blocks first). Branch-free, so a symbolic (dynamic-shape) ``total``
    gives an expression and no guard.

    >>> [scattered_rows(5, rank, 2) for rank in range(2)]
    [3, 2]
    """
    return (total - rank + world - 1) // world


# -- the public functions' front end -------------------------------------------------------------
def all_gather_matmul(a_shard, b, group=None, *, gather_dim=0, schedule=None,
                      return_gathered=False, a_scale=None, b_scale=None, out_dtype=None,
                      bias=None, activation=None):
    """``ficco.all_gather_matmul`` through the ``ficco::all_gather_matmul`` op (see that
    function for the arguments). DTensor operands placed as the op needs them (``a_shard``
    ``Shard(gather_dim)``; ``b`` ``Replicate()`` or ``Shard(1)``) are used through their local
    tensors on their 1-D mesh (ficco/ops/dtensor.py)."""
    if return_gathered is not False and return_gathered is not True:
        return_gathered = check_flag(return_gathered, "return_gathered")   # or raise
    a_shard, b, bs, b_is_list, group, plain, extra, tensors, dim = front_end(
        "all_gather_matmul", a_shard, b, group, gather_dim, a_scale, b_scale, bias, out_dtype)
    # len(tensors) == len(bs): no epilogue tensor to look at (not `tensors is bs`: torch
    # 2.11's dynamo cannot trace `is` between two lists under fullgraph)
    if (dim is None or not (schedule is None or isinstance(schedule, str)) or extra is None
            or not (activation is None or isinstance(activation, str)) or activation == ""
            or eager_suffices(a_shard, tensors, plain and len(tensors) == len(bs))):
        # No autograd, autocast, tracing or tensor subclass involved: the dispatcher would
        # add ~100 us of Python per call and change nothing.
        return _run_all_gather_matmul(a_shard, b, group, gather_dim, schedule, return_gathered,
                                      a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype,
                                      bias=bias,
                                      **({} if activation is None else
                                         {"activation": activation}))
    name, _, world = name_rank_world(group)
    wants_grad = any([x.requires_grad for x in bs])  # noqa: C419 - see ficco.ops.front._PLAIN
    grads = torch.is_grad_enabled() and (wants_grad or a_shard.requires_grad or (
        len(tensors) > len(bs) and any([x.requires_grad for x in tensors])))  # noqa: C419
    if grads and a_scale is not None:   # before any communication
        autograd.refuse_fp8_gradients(a_shard, bs, a_scale, b_scale=b_scale)
    keep = return_gathered or (grads and wants_grad and _backward_gather() == "save")
    # The activation runs inside the op only without a gradient to carry: its backward needs
    # the pre-activation values, which the op does not keep (torch's keeps them, as unfused).
    inside = None if grads else activation
    gathered, outs = torch.ops.ficco.all_gather_matmul(a_shard, bs, name, dim, schedule, keep,
                                                       *extra, inside, world=world)
    if activation and not inside:
        outs = [activation_fn(activation)(o) for o in outs]
    out = outs if b_is_list else outs[0]
    return (gathered, out) if return_gathered else out


def matmul_reduce_scatter(a, b, group=None, *, scatter_dim=0, reduce_op="sum", schedule=None,
                          a_scale=None, b_scale=None, out_dtype=None, bias=None,
                          activation=None):
    """``ficco.matmul_reduce_scatter`` through the ``ficco::matmul_reduce_scatter`` op."""
    if activation is not None:   # the eager path's validation refuses it, naming why
        return _run_matmul_reduce_scatter(a, b, group, scatter_dim, reduce_op, schedule,
                                          activation=activation)
    a, b, bs, b_is_list, group, plain, extra, tensors, dim = front_end(
        "matmul_reduce_scatter", a, b, group, scatter_dim, a_scale, b_scale, bias, out_dtype)
    if (dim is None or not isinstance(reduce_op, str) or extra is None
            or not (schedule is None or isinstance(schedule, str))
            or eager_suffices(a, tensors, plain and len(tensors) == len(bs))):
        return _run_matmul_reduce_scatter(a, b, group, scatter_dim, reduce_op, schedule,
                                          a_scale=a_scale, b_scale=b_scale,
                                          out_dtype=out_dtype, bias=bias)
    if a_scale is not None and torch.is_grad_enabled():   # before any communication
        autograd.refuse_fp8_gradients(a, bs, a_scale, b_scale=b_scale)
    name, rank, world = name_rank_world(group)
    # (a dim out of range: no out_rows, and the op's validation names the problem)
    out_rows = scattered_rows(a.shape[dim], rank, world) if -a.dim() <= dim < a.dim() else None
    outs = torch.ops.ficco.matmul_reduce_scatter(a, bs, name, dim, reduce_op, schedule, *extra,
                                                 world=world, out_rows=out_rows)
    return outs if b_is_list else outs[0]


@torch.compiler.assume_constant_result
def _backward_gather() -> str:
    """FICCO_BACKWARD_GATHER, read when a graph is traced (a compiled graph keeps its value)."""
    return config.backward_gather()


autograd.register(all_gather_matmul_op, matmul_reduce_scatter_op)
