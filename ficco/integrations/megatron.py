"""Megatron-core's tensor-parallel linears on ficco, as ``ModuleSpec`` submodules.

One line turns a layer spec built from Megatron-core's own modules (the local spec, no
Transformer Engine) into one whose linears run on ficco::

    spec = ficco.integrations.megatron.use_ficco(get_gpt_layer_local_spec())

It replaces, wherever the spec names them, Megatron's ``ColumnParallelLinear`` with
:class:`FiccoColumnParallelLinear`, its ``RowParallelLinear`` with
:class:`FiccoRowParallelLinear` and the local spec's norm (``WrappedTorchNorm``, which refuses
sequence parallelism) with :class:`FiccoNorm`. The classes can also be named in a spec directly
(``linear_fc1=FiccoColumnParallelLinear``). They subclass Megatron's: the parameters, their
initialisation, their attributes (``tensor_model_parallel``, ``partition_dim``, ``allreduce``,
``sequence_parallel``) and ``sharded_state_dict`` are Megatron's; only the forward changes:

================================  ==============================  ===============================
layer                             ``sequence_parallel=True``      ``sequence_parallel=False``
================================  ==============================  ===============================
column (``linear_qkv``, ``fc1``)  ``ficco.all_gather_matmul`` of  local GEMM; backward: the input
                                  the sequence (dim 0); backward: gradient's all-reduce inside
                                  ``matmul_reduce_scatter``       ``ficco.matmul_all_reduce``
row (``linear_proj``, ``fc2``)    ``ficco.matmul_reduce_scatter`` ``ficco.matmul_all_reduce``
                                  to sequence shards              (every rank the whole output)
================================  ==============================  ===============================

The gradients are the ones Megatron's own layers produce: the column layer's input gradient is
summed over the tensor-parallel group (what ``async_tensor_model_parallel_allreduce`` /
``allreduce_dgrad`` does, here inside the GEMM that produces it instead of beside the weight
gradient's GEMM); weight gradients land in ``.grad`` (Megatron's DDP adds them to ``main_grad``,
as with ``gradient_accumulation_fusion`` off); under sequence parallelism the norms' weights and
the row layers' bias carry ``sequence_parallel=True`` and see only this rank's rows, so
Megatron's ``finalize_model_grads`` sums them over the group, as for its own fused norms.

Kept on Megatron's own forward (nothing to overlap, or a path ficco does not take): a column
layer with ``gather_output``, a weight passed to ``forward``, deferred embedding wgrad or
``disable_grad_reduce``; a row layer whose input is not parallel; expert layers; a group of
one rank.

Megatron's ``tp_comm_overlap`` (Transformer Engine's userbuffers) is the switch these replace:
docs/integrations.md maps its knobs to ficco's. The release tested is
:data:`TESTED_MEGATRON_CORE`; others outside :data:`SUPPORTED_MEGATRON_CORE` get a ficco error
naming the range. This module imports without megatron-core.

>>> from ficco.integrations import megatron as ficco_megatron
>>> ficco_megatron.TESTED_MEGATRON_CORE
'0.16.1'
"""
from __future__ import annotations

import copy
import dataclasses

from . import CLIENTS
from ._common import check_version, column_linear, installed_version

#: The megatron-core release tests/faces/test_integrations_megatron.py runs (pyproject's
#: ``megatron`` extra pins it).
TESTED_MEGATRON_CORE: str = CLIENTS["megatron"][1]
#: ``[low, high)``: the releases whose layer signatures this module is written against.
SUPPORTED_MEGATRON_CORE: tuple[str, str] = CLIENTS["megatron"][2]

# and, made on first use (module __getattr__): FiccoColumnParallelLinear,
# FiccoRowParallelLinear, FiccoNorm
__all__ = ["SUPPORTED_MEGATRON_CORE", "TESTED_MEGATRON_CORE", "megatron_core_version",
           "use_ficco"]

_CLASSES = ("FiccoColumnParallelLinear", "FiccoRowParallelLinear", "FiccoNorm")


def megatron_core_version() -> str | None:
    """The installed megatron-core's version, or None when it is not installed.

    >>> megatron_core_version() is None or megatron_core_version()[0].isdigit()
    True
    """
    return installed_version("megatron-core", "megatron.core")


def _check() -> None:
    check_version("ficco.integrations.megatron", "megatron-core", "megatron.core",
                  TESTED_MEGATRON_CORE, SUPPORTED_MEGATRON_CORE, "megatron")


def use_ficco(spec):
    """A copy of ``spec`` (a ``ModuleSpec``, e.g. ``get_gpt_layer_local_spec()``, or a layer
    class) with Megatron's column/row parallel linears and the local norm replaced by ficco's,
    at any depth; everything else is kept."""
    _check()
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    column, row, norm = _classes()
    swap = {ColumnParallelLinear: column, RowParallelLinear: row, WrappedTorchNorm: norm}
    return _replace(spec, swap)


def _replace(node, swap: dict):
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(node, type):
        return swap.get(node, node)
    if isinstance(node, ModuleSpec):
        return dataclasses.replace(node, module=_replace(node.module, swap),
                                   params=dict(node.params),
                                   submodules=_replace(node.submodules, swap))
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.replace(node, **{f.name: _replace(getattr(node, f.name), swap)
                                            for f in dataclasses.fields(node) if f.init})
    if isinstance(node, (list, tuple)):
        return type(node)(_replace(x, swap) for x in node)
    return node


_built: tuple | None = None


def _classes():
    global _built
    if _built is None:
        _check()
        _built = _make_classes()
    return _built


def __getattr__(name: str):
    """The layer classes, made on first use (they subclass megatron-core's)."""
    if name in _CLASSES:
        return dict(zip(_CLASSES, _classes()))[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_classes():
    import torch
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    import ficco

    class FiccoColumnParallelLinear(ColumnParallelLinear):
        """Megatron's ``ColumnParallelLinear`` whose GEMM runs on ficco (module docstring)."""

        def forward(self, input_, weight=None, runtime_gather_output=None):
            gather = self.gather_output if runtime_gather_output is None \
                else runtime_gather_output
            if (weight is not None or self.weight is None or gather
                    or self.explicit_expert_comm or self.disable_grad_reduce
                    or self.config.defer_embedding_wgrad_compute
                    or self.tp_group.size() == 1):
                return super().forward(input_, weight, runtime_gather_output)
            bias = None if self.skip_bias_add else self.bias
            if self.sequence_parallel:
                out = ficco.all_gather_matmul(input_, self.weight.t(), self.tp_group,
                                                gather_dim=0)
                if bias is not None:
                    out = out + bias
            else:
                out = column_linear(input_, self.weight, bias, self.tp_group)
            return out, (self.bias if self.skip_bias_add else None)

    class FiccoRowParallelLinear(RowParallelLinear):
        """Megatron's ``RowParallelLinear`` whose GEMM and reduction run on ficco (module
        docstring)."""

        def forward(self, input_):
            if (not self.input_is_parallel or self.explicit_expert_comm
                    or self.tp_group.size() == 1):
                return super().forward(input_)
            if self.sequence_parallel:
                out = ficco.matmul_reduce_scatter(input_, self.weight.t(), self.tp_group,
                                                    scatter_dim=0)
            else:
                out = ficco.matmul_all_reduce(input_, self.weight.t(),
                                                           self.tp_group)
            if self.skip_bias_add or self.bias is None:
                return out, self.bias if self.skip_bias_add else None
            return out + self.bias, None

    class FiccoNorm:
        """The local spec's norm (torch's ``LayerNorm`` / ``RMSNorm``, as ``WrappedTorchNorm``
        builds it) that also runs under sequence parallelism: there its parameters carry
        ``sequence_parallel=True``, as Megatron's fused norms' do, so ``finalize_model_grads``
        sums their gradients over the tensor-parallel group."""

        def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
            sequence_parallel = config.sequence_parallel
            if sequence_parallel:     # WrappedTorchNorm asserts it off; the norm is the same
                config = copy.copy(config)
                config.sequence_parallel = False
            norm = WrappedTorchNorm(config, hidden_size, eps, **kwargs)
            for param in norm.parameters():
                param.sequence_parallel = sequence_parallel
            return norm

    for cls in (FiccoColumnParallelLinear, FiccoRowParallelLinear, FiccoNorm):
        cls.__module__ = __name__
    del torch
    return FiccoColumnParallelLinear, FiccoRowParallelLinear, FiccoNorm
