"""torch's tensor-parallel styles, with the linears run on ficco's overlapped ops.

A plan written for ``torch.distributed.tensor.parallel`` runs on ficco by changing the import::

    from ficco.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    parallelize_module(model, tp_mesh, {"attention.wq": ColwiseParallel(), ...})

Each style takes torch's constructor arguments (``input_layouts``, ``output_layouts``,
``use_local_output``; ``sequence_dim``) and leaves the parameters as torch's style would: DTensors
with torch's placements, so optimizers, ``state_dict`` and ``clip_grad_norm_`` see exactly what
they see with torch's styles. Only the ``nn.Linear`` GEMM changes:

- ``ColwiseParallel`` whose input arrives sharded along a row dimension (the sequence, e.g.
  ``input_layouts=Shard(1)`` or a ``SequenceParallel`` norm's output) runs
  ``ficco.all_gather_matmul``: the gather is hidden behind the GEMM.
- ``RowwiseParallel`` whose output is sharded along a row dimension (``output_layouts=Shard(1)``)
  runs ``ficco.matmul_reduce_scatter``: the reduce-scatter is hidden behind the GEMM.
- ``RowwiseParallel`` with a replicated output (its default: tensor parallelism without
  sequence parallelism, as in TP inference) runs ``ficco.matmul_all_reduce``.
- ``UlyssesHeadsParallel`` and ``UlyssesSequenceParallel``, a pair for an attention block
  under Ulysses sequence parallelism (each rank a sequence shard, replicated weights): the Q/K/V
  linears run ``ficco.matmul_all_to_all`` (sequence shards in, every position of this rank's
  heads out), the output linear ``ficco.all_to_all_matmul`` (back to sequence shards); the
  attention between them runs on whole sequences of local heads (docs/ulysses.md).
- Everything else runs torch's own path unchanged: a replicated input (nothing to gather), a
  sequence that does not split evenly over the mesh, ``nn.Embedding``, an ``nn.Linear``
  subclass with its own forward.

Why the GEMM is swapped and not the collective: torch's styles hand DTensors to ``F.linear`` and
let sharding propagation issue the all-gather or reduce-scatter as a separate step; ficco needs
the gather and the GEMM in one call to overlap them, so the style's forward takes the local
shards, calls the op, and wraps the result back into the DTensor torch's style would return.

``PrepareModuleInput`` is torch's, except that an input declared ``Shard(d)`` with a desired
``Replicate()`` stays sharded (the same global value, still a DTensor), so the ``ColwiseParallel``
linears inside gather it overlapped. torch's usual sequence-parallel plan gathers the attention
input there, before Q/K/V; with torch's ``PrepareModuleInput`` Q/K/V get a replicated input and
run plain GEMMs (see docs/training.md, "Which linears overlap").

>>> from torch.distributed.tensor import Shard
>>> ColwiseParallel(input_layouts=Shard(1))
ColwiseParallel(input_layouts=(Shard(dim=1),), output_layouts=(Shard(dim=-1),), use_local_output=True)
"""
from __future__ import annotations

import types
import warnings
from functools import partial
from typing import cast

import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import style as _torch

from . import group as groups
from .errors import InvalidArgumentError
from .nn import replicated
from .ops.all_gather_matmul import torch_op as all_gather_op
from .ops.matmul_all_reduce import torch_op as all_reduce_op
from .ops.matmul_reduce_scatter import torch_op as reduce_scatter_op
from .ops.ulysses import torch_op as ulysses_op
from .plan.problem import even_split

__all__ = [
    "ColwiseParallel",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "UlyssesHeadsParallel",
    "UlyssesSequenceParallel",
]

#: torch's, unchanged: norms and dropout compute on their shard; nothing to overlap there.
SequenceParallel = _torch.SequenceParallel
PrepareModuleOutput = _torch.PrepareModuleOutput


class ColwiseParallel(_torch.ColwiseParallel):
    """torch's ``ColwiseParallel``; an ``nn.Linear`` whose input arrives sharded along a row
    dimension gathers it inside ``ficco.all_gather_matmul``. Output: ``Shard(-1)`` (or
    ``output_layouts``), a local tensor when ``use_local_output``.

    >>> style = ColwiseParallel(use_local_output=False)   # as for torch's
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not _runs_on_ficco(module, "ColwiseParallel", device_mesh):
            return super()._apply(module, device_mesh)
        distribute_module(module, device_mesh, self._partition_linear_fn,
                          partial(_as_dtensor, self.input_layouts),
                          partial(self._prepare_output_fn, self.output_layouts,
                                  self.use_local_output))
        object.__setattr__(module, "_ficco_layouts",
                           (self.input_layouts, self.desired_input_layouts))
        module.forward = types.MethodType(_colwise_forward, module)
        return module


class RowwiseParallel(_torch.RowwiseParallel):
    """torch's ``RowwiseParallel``; an ``nn.Linear`` whose output is sharded along a row
    dimension (``output_layouts=Shard(1)``, sequence parallelism) reduce-scatters inside
    ``ficco.matmul_reduce_scatter``, one with a replicated output (the default) all-reduces
    inside ``ficco.matmul_all_reduce``. The bias stays replicated and is added once, after
    the reduction.

    >>> from torch.distributed.tensor import Shard
    >>> style = RowwiseParallel(output_layouts=Shard(1))
    >>> style = RowwiseParallel()        # replicated output: ficco.matmul_all_reduce
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not _runs_on_ficco(module, "RowwiseParallel", device_mesh):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        distribute_module(module, device_mesh, self._partition_linear_fn,
                          partial(_as_dtensor, self.input_layouts),
                          partial(self._prepare_output_fn, self.output_layouts,
                                  self.use_local_output))
        object.__setattr__(module, "_ficco_layouts", (self.input_layouts, self.output_layouts[0]))
        module.forward = types.MethodType(_rowwise_forward, module)
        return module


class PrepareModuleInput(_torch.PrepareModuleInput):
    """torch's ``PrepareModuleInput``, except that an input declared ``Shard(d)`` whose desired
    layout is ``Replicate()`` is handed on still sharded (a DTensor with the same global value),
    so ficco's ``ColwiseParallel`` linears that read it gather it behind their GEMM. With
    ``use_local_output=True`` the module gets plain tensors, so it is gathered here, as torch does.

    >>> from torch.distributed.tensor import Replicate, Shard
    >>> style = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    """

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
        if (not self.use_local_output and isinstance(input_layout, Shard)
                and isinstance(desired_layout, Replicate)):
            desired_layout = None
        return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)


class PrepareModuleInputOutput(_torch.PrepareModuleInputOutput):
    """torch's ``PrepareModuleInputOutput`` with ficco's :class:`PrepareModuleInput` inside."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        # torch's constructor built its own PrepareModuleInput; ficco's has the same state
        self.prepare_module_input.__class__ = PrepareModuleInput
        return super()._apply(module, device_mesh)


class _UlyssesStyle(_torch.ParallelStyle):
    """What both Ulysses styles share: the sequence dim, and :func:`_ulysses_forward` put on
    the linear; ``heads`` says which of the pair it runs (the subclasses set it)."""

    heads: bool

    def __init__(self, *, sequence_dim: int = 1):
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return _ulysses(module, device_mesh, type(self).__name__, self.sequence_dim,
                        self.heads)


class UlyssesHeadsParallel(_UlyssesStyle):
    """Ulysses' Q/K/V projection: an ``nn.Linear`` whose input is this rank's sequence shard
    (along ``sequence_dim``; the shards' lengths are the chunk rule's, ``even_split``, for a
    gradient) returns every position of this rank's chunk of its output features, through
    ``ficco.matmul_all_to_all`` (output features head-major: whole heads per rank when the
    heads divide by the mesh). The weight and bias stay replicated (``Replicate()``
    DTensors), their gradients summed over the mesh, as a replicated parameter's are. The
    output is a local tensor (``(..., S, out_features / W)``).

    >>> style = UlyssesHeadsParallel(sequence_dim=1)
    """

    heads = True


class UlyssesSequenceParallel(_UlyssesStyle):
    """Ulysses' output projection, :class:`UlyssesHeadsParallel`'s inverse: an ``nn.Linear``
    whose input holds every position of this rank's heads (``(..., S, in_features / W)``,
    the chunk of the input features :class:`UlyssesHeadsParallel` gave the rank) returns this
    rank's sequence shard of the output, through ``ficco.all_to_all_matmul`` (the heads
    gathered as the GEMM's K). Weight and bias replicated as there; the bias is added once,
    to this rank's rows.

    >>> style = UlyssesSequenceParallel(sequence_dim=1)
    """

    heads = False


# -- what runs ------------------------------------------------------------------------------------
def _runs_on_ficco(module: nn.Module, style: str, mesh) -> bool:
    """Whether ``module`` gets ficco's forward: an ``nn.Linear`` with nn.Linear's own forward."""
    if not isinstance(module, nn.Linear):
        return False            # nn.Embedding: torch's sharding (docs/training.md)
    if type(module).forward is not nn.Linear.forward:
        warnings.warn(f"ficco.parallel.{style}: {type(module).__name__} overrides "
                      f"nn.Linear.forward, so it keeps its forward and runs torch's {style} "
                      f"(no overlap)", stacklevel=3)
        return False
    if mesh.ndim != 1:
        raise InvalidArgumentError(f"ficco.parallel.{style} takes a 1-D DeviceMesh; got a {mesh.ndim}-D "
                         f"mesh {tuple(mesh.shape)}: pass the tensor-parallel dimension, e.g. "
                         f"mesh['tp']")
    return True


def _as_dtensor(input_layouts, module, inputs, mesh):
    """The forward pre-hook: a plain input becomes a DTensor with the declared layout (what
    torch's styles do first); nothing is moved yet."""
    x = inputs[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, input_layouts, run_check=False)
    return (x, *inputs[1:])


def _row_shard_dim(placement, x: DTensor) -> int | None:
    """The dimension ``placement`` shards, if ficco's ops can work along it for ``x``: a row
    dimension (not the last, K) of a tensor whose length there splits evenly over the mesh
    (DTensor's and ficco's chunk rules agree only then)."""
    if not isinstance(placement, Shard) or x.dim() < 2:
        return None
    dim = placement.dim % x.dim()
    if dim == x.dim() - 1 or x.shape[dim] % x.device_mesh.size():
        return None
    return dim


def _distributed(linear: nn.Linear) -> tuple[DTensor, DTensor | None]:
    """The weight and bias of a linear the style distributed: DTensors since its partition fn
    ran (nn.Linear declares plain tensors)."""
    weight, bias = linear.weight, linear.bias
    assert isinstance(weight, DTensor) and (bias is None or isinstance(bias, DTensor))
    return weight, bias


# The forwards are methods bound to the module (a deep copy rebinds them to the copy) reading
# the style's layouts from it: torch.compile (2.14) reads a bound method's ``__name__``, which a
# bound ``functools.partial`` lacks.
def _colwise_forward(self: nn.Linear, x: DTensor):
    input_layouts, desired_input_layouts = cast(tuple, self._ficco_layouts)
    weight, bias = _distributed(self)
    mesh = weight.device_mesh
    dim = _row_shard_dim(x.placements[0], x) if x.device_mesh == mesh else None
    if dim is None or self.out_features % mesh.size():
        # torch's path: its input hook's redistribution, then DTensor's linear
        x = _torch.ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, self,
                                                     (x,), mesh)
        if x.device_mesh == mesh and tuple(x.placements) != tuple(desired_input_layouts):
            # a DTensor placed otherwise than declared (torch's hook moves only what it
            # declared): torch >= 2.13's linear redistributes it inside, 2.11's refuses to
            # flatten a sharded row dim, so it moves here, for every torch alike
            # (contiguous: 2.11's gather of uneven shards leaves strides its linear cannot view)
            x = x.redistribute(placements=desired_input_layouts)
            x = DTensor.from_local(x.to_local().contiguous(), mesh, x.placements,
                                   run_check=False)
        return F.linear(x, self.weight, self.bias)
    out = all_gather_op.all_gather_matmul(x.to_local(), weight.to_local().t(), mesh, gather_dim=dim)
    if bias is not None:
        # cast as F.linear does under autocast (the bias joins the GEMM's dtype)
        out = out + bias.to_local().to(out.dtype)
    return DTensor.from_local(out, mesh, (Shard(out.dim() - 1),), run_check=False)


def _rowwise_forward(self: nn.Linear, x: DTensor):
    input_layouts, output_layout = cast(tuple, self._ficco_layouts)
    weight, bias = _distributed(self)
    mesh = weight.device_mesh
    x = _torch.RowwiseParallel._prepare_input_fn(input_layouts, (Shard(-1),), self, (x,), mesh)
    placement = x.placements[0]
    dim = _row_shard_dim(output_layout, x) if x.device_mesh == mesh else None
    k_sharded = isinstance(placement, Shard) and placement.dim % x.dim() == x.dim() - 1
    if isinstance(output_layout, Replicate) and k_sharded and x.device_mesh == mesh:
        # No sequence parallelism: every rank gets the whole sum. The bias is added once,
        # inside the op; its gradient is the replicated output's, whole on every rank (as
        # with torch's style), so it is not summed over the ranks.
        out = all_reduce_op.matmul_all_reduce(
            x.to_local(), weight.to_local().t(), mesh,
            bias=None if bias is None else bias.to_local())
        return DTensor.from_local(out, mesh, (Replicate(),), run_check=False)
    if dim is None or not k_sharded:
        return F.linear(x, self.weight, self.bias)      # torch's path
    out = reduce_scatter_op.matmul_reduce_scatter(x.to_local(), weight.to_local().t(), mesh,
                                        scatter_dim=dim)
    if bias is not None:
        # Each rank adds the replicated bias to its own rows once; the gradient of the bias is
        # summed over the ranks' rows, so it stays a full Replicate() gradient as with torch.
        out = out + replicated(bias.to_local(), mesh).to(out.dtype)
    return DTensor.from_local(out, mesh, (Shard(dim),), run_check=False)


# -- the Ulysses pair ---------------------------------------------------------------------------
def _ulysses(module: nn.Module, mesh, style: str, sequence_dim: int, heads: bool) -> nn.Module:
    """``module`` with replicated parameters and :func:`_ulysses_forward` bound (``style``,
    ``sequence_dim`` and ``heads`` kept on the module); torch's path has no such style, so a module ficco cannot run is refused."""
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        raise InvalidArgumentError(f"ficco.parallel.{style} takes an nn.Linear with "
                                   f"nn.Linear's forward; got {type(module).__name__}")
    if mesh.ndim != 1:
        raise InvalidArgumentError(f"ficco.parallel.{style} takes a 1-D DeviceMesh; got a "
                                   f"{mesh.ndim}-D mesh {tuple(mesh.shape)}")
    if not isinstance(sequence_dim, int) or isinstance(sequence_dim, bool):
        raise InvalidArgumentError(f"ficco.parallel.{style}: sequence_dim must be an int; got "
                                   f"{sequence_dim!r}")
    linear: nn.Module = module
    distribute_module(linear, mesh)          # every parameter Replicate()
    object.__setattr__(linear, "_ficco_ulysses", (style, sequence_dim, heads))
    linear.forward = types.MethodType(_ulysses_forward, linear)
    return linear


def _local(x):
    """This rank's tensor of ``x`` (a DTensor's local shard)."""
    return x.to_local() if isinstance(x, DTensor) else x


def _ulysses_forward(self: nn.Linear, x):
    """The style's op on this rank's ``x`` and the replicated weight: heads,
    ``matmul_all_to_all`` (features scattered, sequence gathered; the bias's chunk of this
    rank's features); else ``all_to_all_matmul`` (sequence scattered, heads gathered as K)."""
    style, sequence_dim, heads = cast(tuple, self._ficco_ulysses)
    weight, bias = _distributed(self)
    mesh = weight.device_mesh
    x = _local(x)
    if x.dim() < 2:
        raise InvalidArgumentError(f"{style} needs an input with a sequence dim; got shape "
                                   f"{tuple(x.shape)}")
    w = replicated(weight.to_local(), mesh)
    if heads:
        out = ulysses_op.front("matmul_all_to_all", x, w.t(), mesh, -1, sequence_dim)
    else:
        out = ulysses_op.front("all_to_all_matmul", x, w.t(), mesh, sequence_dim, -1)
    if bias is not None:
        b = replicated(bias.to_local(), mesh)
        if heads:
            _, rank, world = groups.name_rank_world(mesh)
            start, cols = even_split(self.out_features, world)[rank]
            b = b[start:start + cols]
        out = out + b.to(out.dtype)
    return out
