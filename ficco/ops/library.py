"""What every op's torch custom op shares (each op's ``torch_op`` module registers its own:
``torch.ops.ficco.all_gather_matmul`` in :mod:`ficco.ops.all_gather_matmul.torch_op`, and so
on): the layouts the GEMM ops return, the epilogue's schema, the prepared Call of a real kernel,
and the fake kernels' error path through torch.compile.

Why custom ops: the dispatcher then treats a ficco call as one opaque op. Autograd records it
(the backward of each op is another op, overlapped too), ``torch.compile(fullgraph=True)``
and ``torch.export`` put it in the graph as one node whose shapes come from the fake kernel,
and the host work a call does (validation, cross-rank agreement, schedule selection, plan
execution on worker threads) runs only in the op's real kernel, at run time, never traced.

The ops take a group *name* (a string), so a traced graph carries no ProcessGroup object;
:func:`ficco.group.name_rank_world` turns what the public functions accept (None, a name, a
ProcessGroup, a 1-D DeviceMesh) into it, with the sizes that depend on the rank or the group:
``world`` (the group's size, as torch's functional collectives take ``group_size``) and, where
an output's length differs by rank, that length (the reduce-scatter's ``out_rows``: blocks of
uneven rows differ by rank, as torch's ``all_to_all_single`` takes its output sizes). The
public functions read them where torch.compile traces them, so they are constants of the
graph; the fake kernels and backward formulas read only these arguments, never the process.
torch.compile caches what it compiles on disk under a key made of the graph and its inputs,
shared by every process of a machine: a size read from the process while tracing would reach
another rank (rank 1 loading rank 0's 3 rows of 5) or another job (W=3 loading a W=2 graph).
So a graph that depends on the rank differs by rank, and each rank compiles its own.
"""
from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import FiccoError
from ..group import wrong_world
from ..runtime import path as runtime
from ..runtime.call import FORWARD


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


def moved_shape(a: Tensor, dim: int) -> tuple:
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


# -- the real kernels: host work, run at call time ---------------------------------------------
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


# Explicit schemas: the epilogue's optional lists ("Tensor[]?", "Tensor?[]?") have defaults, so
# calls written before they existed keep working. ``role`` ("forward" by default): the
# backward pass a call belongs to, which the ranks agree on (ficco.ops.autograd passes it).
# ``world`` and ``out_rows`` (last, see the module docstring): None only in calls written
# before they existed, which run eagerly as before and are refused by the fake kernels.
EPILOGUE_SCHEMA = ("Tensor? a_scale=None, Tensor[]? b_scales=None, Tensor?[]? biases=None, "
                    "ScalarType? out_dtype=None")


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


def scattered_rows(total, rank: int, world: int):
    """This rank's rows of ``total`` rows scattered over ``world`` ranks: the chunk rule both
    ops share (longer blocks first). Branch-free, so a symbolic (dynamic-shape) ``total``
    gives an expression and no guard.

    >>> [scattered_rows(5, rank, 2) for rank in range(2)]
    [3, 2]
    """
    return (total - rank + world - 1) // world


