"""Tensor/sequence-parallel linear layers built on ficco's ops.

A sequence-parallel (SP) + tensor-parallel (TP) block keeps activations sharded along the
sequence between blocks. Its column-parallel layers gather the sequence in front of their GEMM
(:class:`ColumnParallelLinear`, ``ficco.all_gather_matmul``); its row-parallel layers
reduce-scatter back to sequence shards after theirs (:class:`RowParallelLinear`,
``ficco.matmul_reduce_scatter``). Parameters in the SP region (norm weights, the row layer's
bias) see only this rank's rows, so their gradient is summed over the group by
:func:`replicated`. Without sequence parallelism (TP inference) a row-parallel layer
all-reduces instead: ``RowParallelLinear(..., sequence_parallel=False)``
(``ficco.matmul_all_reduce``).

These modules hold plain local shards (any optimizer, ``torch.compile(fullgraph=True)`` and
state dicts work unchanged; ``from_linear`` shards an existing ``nn.Linear``). For a model
parallelized with torch's ``parallelize_module`` and DTensor parameters, use the styles of
:mod:`ficco.parallel` instead.

``seq_dim`` names the sequence dimension of the input: 1 for batch-first ``(batch, seq,
hidden)`` as torch models are, 0 for Megatron's ``(seq, batch, hidden)``. It has no default
for inputs of more than two dimensions: a wrong guess gathers the batch and silently runs
attention within each rank's chunk of the sequence. Dropout in the sequence-parallel region
needs a random stream per rank: :class:`ficco.rng.ShardRNG`.

Under torchrun each rank passes its sequence shard ``(batch, seq / W, hidden)``; without a
process group (as here) the layers are the plain linears:

>>> up = ColumnParallelLinear.from_linear(nn.Linear(512, 2048), seq_dim=1)
>>> down = RowParallelLinear.from_linear(nn.Linear(2048, 512), seq_dim=1)
>>> x_shard = torch.randn(2, 16, 512)
>>> down(torch.relu(up(x_shard))).shape                           # (batch, seq / W, hidden)
torch.Size([2, 16, 512])
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .errors import InvalidArgumentError
from .group import NO_GROUP, name_of, rank_world, resolve
from .ops.all_gather_matmul import torch_op as all_gather_op
from .ops.matmul_all_reduce import torch_op as all_reduce_op
from .ops.matmul_reduce_scatter import torch_op as reduce_scatter_op
from .ops.ulysses.attention import UlyssesAttention
from .plan.problem import even_split
from .runtime.call import check_flag


def _check_features(in_features, out_features: list) -> None:
    """What ``nn.Linear`` takes (no negative sizes), and at least one input feature (the
    initialisation's bound is 1/sqrt(in_features))."""
    if type(in_features) is not int or in_features < 1 or not out_features or any(
            type(n) is not int or n < 0 for n in out_features):
        raise InvalidArgumentError(
            f"in_features must be a positive int and out_features non-negative ints; got "
            f"{in_features!r} and {out_features if len(out_features) > 1 else out_features[0]!r}")


def _uninitialised(cls, *args, device, **kwargs):
    """A layer whose parameters ``from_linear`` fills: made on the meta device, so its
    initialisation draws nothing from the global RNG (ranks of uneven widths would draw
    different amounts, and every random number a user draws afterwards would differ)."""
    return cls(*args, device="meta", **kwargs).to_empty(device=device)


def _uniform_shard(param: Tensor, full: int, dim: int, bound: float, group) -> None:
    """``param`` (this rank's piece along ``dim`` of a tensor ``full`` long there) from
    ``uniform(-bound, bound)`` draws of every rank's piece in rank order: the same draws on
    every rank, so the global RNG stays in step across ranks of uneven widths."""
    rank, world = rank_world(resolve(group))
    shape = list(param.shape)
    with torch.no_grad():
        for r, (_, length) in enumerate(even_split(full, world)):
            if r == rank:
                param.uniform_(-bound, bound)
            else:
                shape[dim] = length
                torch.empty(shape, device=param.device, dtype=param.dtype).uniform_(
                    -bound, bound)


class ColumnParallelLinear(nn.Module):
    """``y = all_gather(x_shard, seq_dim) @ W_r^T + b_r``: this rank's output features of one or
    several linears (one gather feeds them all, e.g. Q/K/V or SwiGLU's gate and up).

    ``out_features`` is the full (unsharded) size or a list of them; each is split over the
    group's ranks (longer pieces first). With a list, ``forward`` returns a tuple.
    """

    def __init__(self, in_features: int, out_features: int | Sequence[int], bias: bool = True,
                 *, group=None, seq_dim: int | None = None, device=None, dtype=None):
        super().__init__()
        self.group, self.seq_dim = group, seq_dim
        self.fused = not isinstance(out_features, int)
        rank, world = rank_world(resolve(group))
        sizes = [out_features] if isinstance(out_features, int) else list(out_features)
        _check_features(in_features, sizes)
        self.in_features, self.out_features = in_features, tuple(sizes)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.empty(even_split(n, world)[rank][1], in_features, device=device,
                                     dtype=dtype)) for n in sizes)
        self.biases = nn.ParameterList(
            nn.Parameter(torch.empty(w.shape[0], device=device, dtype=dtype))
            for w in self.weights) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation of the whole layer, this rank's rows kept; every
        rank draws the same amount from the global RNG (:func:`_uniform_shard`)."""
        bound = 1 / self.in_features ** 0.5
        for j, (w, n) in enumerate(zip(self.weights, self.out_features)):
            _uniform_shard(w, n, 0, bound, self.group)
            if self.biases is not None:
                _uniform_shard(self.biases[j], n, 0, bound, self.group)

    @classmethod
    def from_linear(cls, linears: nn.Linear | Sequence[nn.Linear], *, group=None,
                    seq_dim: int | None = None) -> ColumnParallelLinear:
        """This rank's shard of ``linears`` (an ``nn.Linear`` or several with one input), in
        new parameters: a weight tied to another module's (an embedding's) stops being tied,
        so that case warns (see :func:`_warn_if_tied`)."""
        many = not isinstance(linears, nn.Linear)
        linears = [_linear(lin, f"linears[{j}]") for j, lin in enumerate(linears)] if many \
            and isinstance(linears, (list, tuple)) else [_linear(linears, "linears")]
        for lin in linears:
            _warn_if_tied(lin, cls.__name__)
        first = linears[0]
        if len({lin.in_features for lin in linears}) > 1:
            raise InvalidArgumentError(
                f"linears share one input, so one in_features; got "
                f"{[lin.in_features for lin in linears]}")
        sizes = [lin.out_features for lin in linears]
        layer = _uninitialised(cls, first.in_features, sizes if many else sizes[0],
                               first.bias is not None, group=group, seq_dim=seq_dim,
                               device=first.weight.device, dtype=first.weight.dtype)
        rank, world = rank_world(resolve(group))
        with torch.no_grad():
            for j, lin in enumerate(linears):
                start, rows = even_split(lin.out_features, world)[rank]
                layer.weights[j].copy_(lin.weight[start:start + rows])
                if layer.biases is not None:
                    layer.biases[j].copy_(lin.bias[start:start + rows])
        return layer

    def forward(self, x_shard: Tensor):
        outs = all_gather_op.all_gather_matmul(x_shard, [w.t() for w in self.weights], self.group,
                                         gather_dim=_seq_dim(self.seq_dim, x_shard, "x_shard"))
        if self.biases is not None:
            outs = [o + b for o, b in zip(outs, self.biases)]
        return tuple(outs) if self.fused else outs[0]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (sharded), "
                f"seq_dim={self.seq_dim}, bias={self.biases is not None}")


class RowParallelLinear(nn.Module):
    """``y_shard = reduce_scatter(x @ W_r^T, seq_dim) + b``: ``x`` holds this rank's input
    features (a column-parallel layer's output) for the full sequence; the result is this
    rank's sequence shard of the full linear's output. The bias is replicated and added after
    the reduction (once, not once per rank).

    ``sequence_parallel=False``: ``y = all_reduce(x @ W_r^T) + b`` (``ficco.matmul_all_reduce``),
    every rank gets the whole output (tensor parallelism without sequence parallelism, as in
    TP inference; ``seq_dim`` is not needed). The bias is added once, inside the op; it is in
    the replicated region, so its gradient is not summed over the ranks.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 seq_dim: int | None = None, sequence_parallel: bool = True, device=None,
                 dtype=None):
        super().__init__()
        self.group, self.seq_dim = group, seq_dim
        self.sequence_parallel = check_flag(sequence_parallel, "sequence_parallel")
        rank, world = rank_world(resolve(group))
        _check_features(in_features, [out_features])
        self.in_features, self.out_features = in_features, out_features
        local_in = even_split(in_features, world)[rank][1]
        self.weight = nn.Parameter(torch.empty(out_features, local_in, device=device,
                                               dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) \
            if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation (bound ``1/sqrt(in_features)`` of the whole layer),
        this rank's input features kept; the same draws on every rank."""
        bound = 1 / self.in_features ** 0.5
        _uniform_shard(self.weight, self.in_features, 1, bound, self.group)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group=None, seq_dim: int | None = None,
                    sequence_parallel: bool = True) -> RowParallelLinear:
        """This rank's shard of ``linear``: its slice of input features, the whole bias (new
        parameters; a tied weight warns, as for ``ColumnParallelLinear.from_linear``)."""
        linear = _linear(linear, "linear")
        _warn_if_tied(linear, cls.__name__)
        layer = _uninitialised(cls, linear.in_features, linear.out_features,
                               linear.bias is not None, group=group, seq_dim=seq_dim,
                               sequence_parallel=sequence_parallel,
                               device=linear.weight.device, dtype=linear.weight.dtype)
        rank, world = rank_world(resolve(group))
        start, cols = even_split(linear.in_features, world)[rank]
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, start:start + cols])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        if not self.sequence_parallel:
            return all_reduce_op.matmul_all_reduce(x, self.weight.t(), self.group,
                                                        bias=self.bias)
        # The bias enters the graph first, so the backward runs the (checked) all_gather_matmul
        # before the bias gradient's all-reduce: a rank that skipped this backward makes the
        # peers raise before that unchecked collective is in flight (autograd runs the later
        # node first).
        bias = None if self.bias is None else replicated(self.bias, self.group)
        y = reduce_scatter_op.matmul_reduce_scatter(x, self.weight.t(), self.group,
                                          scatter_dim=_seq_dim(self.seq_dim, x, "x"))
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        form = f"seq_dim={self.seq_dim}" if self.sequence_parallel else "all-reduce"
        return (f"in_features={self.in_features} (sharded), out_features={self.out_features}, "
                f"{form}, bias={self.bias is not None}")


def _linear(layer, name: str) -> nn.Linear:
    if not isinstance(layer, nn.Linear):
        raise InvalidArgumentError(
            f"{name} is a {type(layer).__name__}, not an nn.Linear: from_linear shards a linear "
            f"layer's (out_features, in_features) weight; construct the parallel layer directly "
            f"and load the weights yourself for other modules")
    return layer


def _seq_dim(seq_dim, x: Tensor, name: str) -> int:
    """The sequence dimension of ``x``. Unset, it is 0 only where no other row dimension
    exists: torch models are batch-first (batch, seq, hidden), Megatron's are (seq, batch,
    hidden), and guessing wrong gathers the batch and silently runs attention within each
    rank's chunk of the sequence."""
    if seq_dim is not None:
        return seq_dim
    if isinstance(x, Tensor) and x.dim() > 2:
        raise InvalidArgumentError(
            f"{name} has shape {tuple(x.shape)} and the layer has no seq_dim: say which "
            f"dimension holds the sequence, seq_dim=1 for batch-first (batch, seq, hidden) as "
            f"torch models are, seq_dim=0 for Megatron's (seq, batch, hidden)")
    return 0


def _warn_if_tied(linear: nn.Linear, layer: str) -> None:
    """Warn when ``linear.weight`` is also a parameter of another module (a head tied to its
    embedding): ``from_linear`` copies this rank's shard into a new parameter, so the two stop
    sharing updates and drift apart. Found through the garbage collector's referrers of the
    weight: the ``_parameters`` dicts that hold it (once per from_linear call)."""
    import gc

    weight = linear.weight
    owners: list[nn.Module | str] = []    # "a module": its __dict__ found, the module not
    for holder in gc.get_referrers(weight):
        if not isinstance(holder, dict) or holder is linear._parameters:
            continue
        for ref in gc.get_referrers(holder):
            if isinstance(ref, nn.Module) and ref._parameters is holder:
                owners.append(ref)
            elif isinstance(ref, dict) and ref.get("_parameters") is holder:   # a __dict__
                owners += [m for m in gc.get_referrers(ref)
                           if isinstance(m, nn.Module) and m.__dict__ is ref] or ["a module"]
    if owners:
        other = owners[0]
        what = type(other).__name__ if isinstance(other, nn.Module) else other
        warnings.warn(
            f"{layer}.from_linear: this linear's weight is also a parameter of {what} (tied "
            f"weights, e.g. an output head and its embedding); the sharded layer gets a copy, "
            f"so the two are no longer tied and train apart. Keep them tied by sharding both "
            f"with ficco.parallel (docs/training.md, 'Embedding and output head')",
            stacklevel=3)


class _SumGradOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, name):
        ctx.name = name
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        if ctx.name == NO_GROUP:
            return grad, None
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(grad.contiguous(), "sum", ctx.name), None


def replicated(param: Tensor, group=None) -> Tensor:
    """``param`` for use inside the sequence-parallel region: identity forward; the backward
    sums its gradient over ``group``, since each rank's rows contribute only part of it (norm
    weights, a row-parallel bias). Without it such parameters drift apart across ranks.

    >>> norm, x_shard = nn.RMSNorm(512), torch.randn(2, 16, 512)
    >>> torch.nn.functional.rms_norm(x_shard, (512,), replicated(norm.weight)).shape
    torch.Size([2, 16, 512])
    """
    return _SumGradOverGroup.apply(param, name_of(group))


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "UlyssesAttention", "replicated"]
