"""Hugging Face transformers' tensor and expert parallelism on ficco.

One line, before the model is built::

    ficco.integrations.transformers.use_ficco()

makes the stock style names of every model's plan run on ficco: ``"colwise"`` and ``"rowwise"``
(the tensor-parallel linears) and the ``"auto"`` and ``"all_to_all"`` expert-parallel token
exchanges. Without it, importing this module registers ficco's styles under their own names, so
a plan opts in per layer (``DistributedConfig(tp_size=W, tp_plan={"layers.*.mlp.down_proj":
"ficco_rowwise"})``) and ``DistributedConfig(ep_size=W, ep_implementation="ficco")`` picks
ficco's token exchange:

- ``"ficco_colwise"``: a column-parallel linear of a replicated input (transformers'
  ``"colwise"``: weight and bias ``Shard(0)``). The forward GEMM is local; the backward's
  all-reduce of the input gradient runs inside ``ficco.matmul_all_reduce``.
- ``"ficco_rowwise"``: a row-parallel linear with a replicated output (``"rowwise"``: weight
  ``Shard(-1)``, bias replicated): ``ficco.matmul_all_reduce``, the bias added once inside it;
  decode (``generate``) and training alike.
- ``ep_implementation="ficco"``: the experts' tokens travel with ``ficco.all_to_all_grouped_mm``
  (dispatch, overlapped with the gate/up grouped GEMM) and ``ficco.grouped_mm_all_to_all``
  (combine, overlapped with the down grouped GEMM), for experts stored as transformers' 3-D
  ``gate_up_proj`` / ``down_proj`` (Mixtral, Qwen-MoE and the models built like them). Where the
  tensor-parallel group shares one batch, each rank sends a disjoint slice of it, as transformers'
  own ``"all_to_all"`` does.

Parameters stay the DTensors transformers' own styles make (same placements), so checkpoints,
optimizers and ``save_pretrained`` see what they see without ficco.

Sequence parallelism: transformers (this release) keeps the whole sequence on every rank
(``DistributedConfig.enable_sequence_parallel`` is reserved, not wired), and its attention
modules reshape by the input's sequence length, so a sequence-sharded activation cannot enter
them. ficco's sequence-parallel forms (``ficco.all_gather_matmul`` /
``ficco.matmul_reduce_scatter``) are reached through ``ficco.parallel`` (torch's
``parallelize_module``), torchtitan or Megatron-core instead (README).

The release it is tested with is :data:`TESTED_TRANSFORMERS`; :func:`use_ficco` and
:func:`register` refuse others outside :data:`SUPPORTED_TRANSFORMERS` with a ficco error naming
the range. This module imports without transformers.

>>> from ficco.integrations import transformers as ficco_hf
>>> ficco_hf.TESTED_TRANSFORMERS, ficco_hf.STYLE_NAMES
('5.24.0', ('ficco_colwise', 'ficco_rowwise'))
"""
from __future__ import annotations

from ..errors import BackendUnavailableError, InvalidArgumentError
from . import CLIENTS
from ._common import check_version, column_linear, installed_version

#: The transformers release tests/test_integrations_transformers.py runs (pyproject's
#: ``transformers`` extra pins it).
TESTED_TRANSFORMERS: str = CLIENTS["transformers"][1]
#: ``[low, high)``: the releases whose style API (``transformers.distributed``'s
#: ``TensorParallelLayer``, ``ParallelInterface`` and ``EPImplementationInterface``) this module
#: is written against.
SUPPORTED_TRANSFORMERS: tuple[str, str] = CLIENTS["transformers"][2]
#: ficco's tensor-parallel styles, as registered in transformers' ``ParallelInterface``.
STYLE_NAMES = ("ficco_colwise", "ficco_rowwise")
#: ficco's ``DistributedConfig.ep_implementation``.
EP_IMPLEMENTATION = "ficco"
#: The stock names :func:`use_ficco` points at ficco's styles.
STOCK = {"colwise": "ficco_colwise", "rowwise": "ficco_rowwise"}
STOCK_EP = ("auto", "all_to_all")

__all__ = ["EP_IMPLEMENTATION", "STYLE_NAMES", "SUPPORTED_TRANSFORMERS", "TESTED_TRANSFORMERS",
           "register", "stock_styles", "transformers_version", "use_ficco"]

_saved: dict = {}


def transformers_version() -> str | None:
    """The installed transformers' version, or None when it is not installed.

    >>> transformers_version() is None or transformers_version()[0].isdigit()
    True
    """
    return installed_version("transformers", "transformers")


def _check() -> None:
    check_version("ficco.integrations.transformers", "transformers", "transformers",
                  TESTED_TRANSFORMERS, SUPPORTED_TRANSFORMERS, "transformers")


def register() -> None:
    """Register ficco's styles (:data:`STYLE_NAMES`) in transformers' ``ParallelInterface`` and
    ``ep_implementation="ficco"`` in its ``EPImplementationInterface`` (done when this module
    is imported with a supported transformers installed)."""
    _check()
    from transformers.distributed.expert_parallel import EPImplementationInterface
    from transformers.distributed.parallel_utils import ParallelInterface

    colwise, rowwise, ep = _classes()
    ParallelInterface.register("ficco_colwise", colwise())
    ParallelInterface.register("ficco_rowwise", rowwise())
    EPImplementationInterface.register(EP_IMPLEMENTATION, ep)


def use_ficco(enable: bool = True) -> None:
    """Point transformers' stock style names at ficco's: ``"colwise"`` and ``"rowwise"`` in
    every tensor-parallel plan, and the ``"auto"`` and ``"all_to_all"`` expert-parallel
    implementations. Models built afterwards run on ficco; ``use_ficco(False)`` restores
    transformers' own styles (for models built afterwards)."""
    register()
    from transformers.distributed.expert_parallel import EPImplementationInterface
    from transformers.distributed.parallel_utils import ParallelInterface

    styles, eps = ParallelInterface._global_mapping, EPImplementationInterface._global_mapping
    if enable:
        for stock, ours in STOCK.items():
            _saved.setdefault(("tp", stock), styles[stock])
            styles[stock] = styles[ours]
        for stock in STOCK_EP:
            _saved.setdefault(("ep", stock), eps[stock])
            eps[stock] = eps[EP_IMPLEMENTATION]
        return
    for (kind, stock), original in list(_saved.items()):
        (styles if kind == "tp" else eps)[stock] = original
        del _saved[(kind, stock)]


def stock_styles() -> dict[str, str]:
    """What each stock name runs now: ``{"colwise": class name, ...}`` (a check that
    :func:`use_ficco` took)."""
    _check()
    from transformers.distributed.expert_parallel import EPImplementationInterface
    from transformers.distributed.parallel_utils import ParallelInterface

    out = {name: type(ParallelInterface._global_mapping[name]).__name__ for name in STOCK}
    out.update({f"ep:{name}": EPImplementationInterface._global_mapping[name].__name__
                for name in STOCK_EP})
    return out


_built: tuple | None = None


def _classes():
    """The style classes, made on first use (they subclass transformers' own)."""
    global _built
    if _built is None:
        _built = _make_classes()
    return _built


def _make_classes():
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from transformers.distributed.expert_parallel import EPImplementation
    from transformers.distributed.tensor_parallel import ColwiseParallel, RowwiseParallel

    import ficco

    def _local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def _linear(module, style: str):
        if not isinstance(module, torch.nn.Linear):
            raise InvalidArgumentError(
                f"{style} shards an nn.Linear; {type(module).__name__} is not one (keep "
                f"transformers' own style for it)")

    class FiccoColwiseParallel(ColwiseParallel):
        """transformers' ``"colwise"`` (replicated input, ``Shard(-1)`` output) with the
        input gradient's all-reduce inside ``ficco.matmul_all_reduce``."""

        def __init__(self):
            super().__init__(input_layouts=Replicate(), output_layouts=Shard(-1))

        def install_forward(self, module, mesh):
            _linear(module, "ficco_colwise")

            def forward(x, *args, **kwargs):
                if isinstance(x, DTensor):
                    x = x.redistribute(placements=[Replicate()]).to_local()
                bias = None if module.bias is None else _local(module.bias)
                return column_linear(x, _local(module.weight), bias, mesh)

            module.forward = forward
            return module

    class FiccoRowwiseParallel(RowwiseParallel):
        """transformers' ``"rowwise"`` (input ``Shard(-1)``, replicated output) as one
        ``ficco.matmul_all_reduce``, the bias added once inside it."""

        def __init__(self):
            super().__init__(input_layouts=Shard(-1), output_layouts=Replicate())

        def install_forward(self, module, mesh):
            _linear(module, "ficco_rowwise")

            def forward(x, *args, **kwargs):
                if isinstance(x, DTensor):
                    x = x.redistribute(placements=[Shard(-1)]).to_local()
                bias = None if module.bias is None else _local(module.bias)
                return ficco.matmul_all_reduce(
                    x, _local(module.weight).t(), mesh, bias=bias)

            module.forward = forward
            return module

    class FiccoEP(EPImplementation):
        """Tokens to their experts and back on ficco's dispatch and combine, each overlapped
        with the experts' grouped GEMM."""

        def __init__(self, experts, ep_mesh, tp_mesh):
            # the layout first: transformers' own __init__ reads num_experts
            gate_up, down = (getattr(experts, n, None) for n in ("gate_up_proj", "down_proj"))
            if (gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3
                    or not hasattr(experts, "act_fn") or not hasattr(experts, "num_experts")
                    or getattr(experts, "has_bias", False)
                    or getattr(experts, "is_transposed", False)):
                raise InvalidArgumentError(
                    f"ep_implementation='ficco' runs experts stored as 3-D gate_up_proj (E, "
                    f"2*I, H) and down_proj (E, H, I) with an act_fn and no biases (Mixtral's "
                    f"layout); {type(experts).__name__} is not: use ep_implementation="
                    f"'all_to_all' for it")
            super().__init__(experts, ep_mesh, tp_mesh)
            self.experts = experts

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            num_tokens = hidden_states.size(0)
            if self.tp_mesh.size() > 1:
                # each rank of the TP group sends a disjoint slice of the batch it shares
                hidden_states, top_k_index, top_k_weights = (
                    DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
                    .redistribute(self.tp_mesh, [Shard(0)]).to_local()
                    for t in (hidden_states, top_k_index, top_k_weights))
            group = self.ep_mesh
            k = top_k_index.size(-1)
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=self.num_local_experts *
                                    self.ep_mesh.size()).to(torch.int64).cpu()
            rows = hidden_states[order // k]
            experts = self.experts
            gate_up = _local(experts.gate_up_proj).transpose(1, 2)
            down = _local(experts.down_proj).transpose(1, 2)
            h, recv_counts = ficco.all_to_all_grouped_mm(rows, counts, gate_up, group)
            gate, up = h.chunk(2, dim=-1)
            z = ficco.grouped_mm_all_to_all(experts.act_fn(gate) * up, recv_counts, down, group,
                                          send_counts=counts)
            hidden = down.shape[-1]
            out = torch.empty_like(z).index_copy(0, order, z)
            out = (out.view(*top_k_weights.shape, hidden)
                   * top_k_weights.unsqueeze(-1).to(out.dtype)).sum(1)
            if self.tp_mesh.size() == 1:
                return out
            return DTensor.from_local(out.contiguous(), self.tp_mesh, [Shard(0)],
                                      shape=(num_tokens, hidden),
                                      stride=(hidden, 1)).full_tensor()

    return FiccoColwiseParallel, FiccoRowwiseParallel, FiccoEP


def _register_on_import() -> None:
    version = transformers_version()
    if version is None:
        return
    try:
        register()
    except BackendUnavailableError:     # an unsupported release: use_ficco() says why
        return


_register_on_import()
