"""The public functions' argument handling, before an op's dispatcher is reached: ``b`` as a
list, DTensor operands to their local tensors and mesh (:mod:`ficco.ops.dtensor`), the
epilogue as the ops' schema takes it (:func:`front_end`, a :class:`Front`), and whether the
call goes to the op's eager path instead of its torch custom op (:func:`eager_path`, the one
predicate every op's front function asks). Shared by every op's ``torch_op`` module; what
cannot go through an op goes to the eager path, whose validation names the problem."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import InvalidArgumentError
from ..group import name_of
from . import dtensor

_NO_EPILOGUE = (None, None, None, None)


@dataclass(frozen=True, slots=True)
class Front:
    """A public function's arguments as its op's dispatcher takes them (:func:`front_end`)."""

    #: the first operand, a DTensor's local tensor
    a: Any
    #: the weights as passed (one tensor or a list), local tensors
    b: Any
    #: the weights as a list
    bs: list
    b_is_list: bool
    #: the group, a DTensor operand's mesh where it had one
    group: Any
    #: ``a`` and every weight are plain tensors (no subclass, no DTensor)
    plain: bool
    #: the epilogue as the ops' schema takes it ``(a_scale, b_scales, biases, out_dtype)``,
    #: None where it does not fit the schema
    extra: tuple | None
    #: every tensor the dispatcher must look at: the weights, then the epilogue's tensors
    tensors: list
    #: the op's dim as a plain int, None where it is not one
    dim: int | None
    #: every argument fits the op's schema (``dim`` and ``extra`` are not None)
    fits: bool


def front_end(op: str, a, b, group, dim, a_scale, b_scale, bias, out_dtype) -> Front:
    """What every GEMM op's public front function does first: ``b`` as a list, DTensor
    operands to their local tensors and mesh (plain tensors skip that: the hot path), the op's
    epilogue arguments and ``dim`` as a plain int."""
    b_is_list = isinstance(b, (list, tuple))
    bs = list(b) if b_is_list else [b]
    plain = type(a) in _PLAIN and not any([type(x) not in _PLAIN for x in bs])  # noqa: C419
    if not plain:
        a, bs, group = _local_operands(op, a, bs, group, dim)
        b = bs if b_is_list else bs[0]
    if a_scale is None and b_scale is None and bias is None and out_dtype is None:
        extra, tensors = _NO_EPILOGUE, bs   # the common call: nothing more to look at
    else:
        extra, tensors = _epilogue_of(bs, b_is_list, a_scale, b_scale, bias, out_dtype)
    dim = dim if type(dim) is int else _plain_int(dim)
    return Front(a, b, bs, b_is_list, group, plain, extra, tensors, dim,
                 dim is not None and extra is not None)


def _epilogue_of(bs, b_is_list, a_scale, b_scale, bias, out_dtype) -> tuple:
    """``(the epilogue as the ops' schema takes it (see _op_epilogue), the weights and the
    epilogue's tensors)``."""
    extra = _op_epilogue(bs, b_is_list, a_scale, b_scale, bias, out_dtype)
    return extra, [*bs, *_tensors(extra)] if extra is not None else [*bs]


def _op_epilogue(bs, b_is_list, a_scale, b_scale, bias, out_dtype):
    """(a_scale, b_scales, biases, out_dtype) as the ops' schema takes them (lists, one entry
    per b), or None when they do not fit it (the eager path's validation then names what is
    wrong)."""
    def as_list(value, optional):
        if value is None:
            return None
        values = list(value) if isinstance(value, (list, tuple)) else (
            None if b_is_list and len(bs) > 1 else [value])
        if values is None or len(values) != len(bs) or not all(
                isinstance(v, Tensor) or (optional and v is None) for v in values):
            raise _NotForTheOp
        return values
    try:
        if not (a_scale is None or isinstance(a_scale, Tensor)) or not (
                out_dtype is None or isinstance(out_dtype, torch.dtype)):
            return None
        return a_scale, as_list(b_scale, False), _no_none(as_list(bias, True), bs), out_dtype
    except _NotForTheOp:
        return None


def _no_none(biases, bs):
    """``biases`` with a zero bias for each b without one, when some other one needs its
    gradient: torch's autograd of a custom op flattens a ``Tensor?[]`` input that holds a None
    as one leaf but the backward's gradients of it as a list, and refuses the mismatch. Adding
    zero changes no output."""
    if biases is None or all(b is not None for b in biases) or not (
            torch.is_grad_enabled() and any(b is not None and b.requires_grad for b in biases)):
        return biases
    like = next(b for b in biases if b is not None)
    return [b if b is not None else like.new_zeros(w.shape[1]) for b, w in zip(biases, bs)]


class _NotForTheOp(Exception):
    pass


def _tensors(extra) -> list:
    """The tensors among the ops' epilogue arguments (scales and biases). (Never asked of
    _NO_EPILOGUE: torch 2.11's dynamo cannot trace ``is`` against that tuple.)"""
    a_scale, b_scales, biases, _ = extra
    return [t for t in [a_scale, *(b_scales or ()), *(biases or ())] if t is not None]


# The per-tensor checks here are list comprehensions inside any(): one Python call per warm
# call where a generator makes one per tensor, and plain enough for torch.compile to trace
# (map with operator.attrgetter is not).
_PLAIN = (Tensor, torch.nn.Parameter)


def _plain_int(value):
    """``value`` as an int for the op's schema (NumPy integers too), or None: arguments the op
    cannot take go to the eager path, whose validation names the problem."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        return None
    return int(value)


def eager_path(front: Front, schedule, reduce_op: str = "sum", activation=None) -> bool:
    """Whether an op's public function runs the call on the op's eager path instead of
    through its torch custom op: where the op's schema cannot take an argument, or where the
    dispatcher would add nothing (no autograd, autocast, tracing or tensor subclass: it would
    cost ~100 us of Python per call and change nothing). ``reduce_op`` and ``activation``:
    the op's own, for the ops that take them."""
    # A dim that is no int or an epilogue off the schema (front_end found it): the eager
    # path's validation names it.
    if not front.fits:
        return True
    # A schedule, reduce_op or activation the schema cannot hold (``str?``, ``str``, a
    # non-empty ``str?``): the same.
    if not (schedule is None or type(schedule) is str) or type(reduce_op) is not str or (
            activation is not None and (type(activation) is not str or not activation)):
        return True
    # Under torch.compile the op is what the graph holds.
    if torch.compiler.is_compiling():
        return False
    a, bs = front.a, front.tensors
    # Tensor subclasses (FakeTensor, FunctionalTensor, ...) need the op; non-tensors get the
    # eager path's argument errors (front_end found plain operands; epilogue tensors: here).
    if not (front.plain and len(bs) == len(front.bs)) and (
            type(a) not in _PLAIN or any([type(x) not in _PLAIN for x in bs])):  # noqa: C419
        return not isinstance(a, Tensor) or not all(isinstance(x, Tensor) for x in bs)
    # A gradient to make: autograd records the op.
    if torch.is_grad_enabled() and (
            a.requires_grad or any([x.requires_grad for x in bs])):  # noqa: C419 - see _PLAIN
        return False
    # Shapes only: the op's fake kernel answers, as torch's own ops do on meta tensors.
    if a.device.type == "meta":
        return False
    # Autocast, a dispatch mode or a torch function mode: the op's registrations run them.
    return not (torch.is_autocast_enabled(a.device.type)
                or torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled())


def plain_front(a, ws, group) -> Front:
    """The :class:`Front` of an op with no epilogue and no dim among its schema's checked
    arguments (the expert ops): ``ws`` its weights; it fits the schema where ``a`` is a
    tensor and ``ws`` a list or tuple."""
    fits = isinstance(a, Tensor) and isinstance(ws, (list, tuple))
    bs = list(ws) if fits else []
    return Front(a, ws, bs, True, group, False, _NO_EPILOGUE, bs, 0, fits)


def _local_operands(op: str, a, bs, group, dim):
    """(a, bs, group) with DTensor operands replaced by their local tensors (ficco/ops/dtensor.py)
    and their mesh as the group."""
    from . import get

    a_local, mesh = dtensor.operands(op, get(op).first_arg, a, dim, None)
    bs_local = []
    for j, b in enumerate(bs):
        local, mesh = dtensor.operands(op, "b" if len(bs) == 1 else f"b[{j}]", b, dim, mesh)
        bs_local.append(b if local is None else local)
    if mesh is not None and group is not None and name_of(group) != name_of(mesh):
        raise InvalidArgumentError(
            f"the DTensor operands are on mesh {mesh} but group names another group; leave "
            f"group as None to use the mesh's")
    return (a if a_local is None else a_local), bs_local, (group if mesh is None else mesh)
