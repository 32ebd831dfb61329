"""Hugging Face transformers' tensor and expert parallelism on ficco.

One line, before the model is built::

    ficco.integrations.transformers.use_ficco()

makes the stock style names of every model's plan run on ficco: ``"colwise"`` and ``"rowwise"``
(the tensor-parallel linears) and the ``"auto"`` and ``"all_to_all"`` expert-parallel token
exchanges. Without it, importing this module registers ficco's styles under their own names, so
a plan opts in per layer (``DistributedConfig(tp_size=W, tp_plan={"model.layers.*.mlp.down_proj":
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
(``DistributedConfig.enable_sequence_parallel`` is reserved, not wired). ficco's sequence-parallel
styles (:data:`SP_STYLE_NAMES`) keep the residual stream between the layers' linears as this
rank's slice of the sequence, for a Llama-layout decoder with ``tp_plan=SEQUENCE_PARALLEL_PLAN``:
the MLP's gate and up projections gather it inside ``ficco.all_gather_matmul``, the attention's
output and the MLP's down projections scatter back inside ``ficco.matmul_reduce_scatter``, the
norms run on the slice (their gradients summed over the group). The attention reshapes by its
input's sequence length, so it takes the whole sequence: its input is gathered (a plain
all-gather, its backward a reduce-scatter) and Q/K/V run local GEMMs. A forward whose sequence
does not split evenly over the group (a decode step's single token) runs the replicated path
(``"ficco_colwise"`` / ``"ficco_rowwise"``'s). A Mixtral-layout mixture of experts takes
:data:`SEQUENCE_PARALLEL_MOE_PLAN` with ``ep_implementation="ficco"``: each rank then sends its
own slice of the tokens to the experts.

The release it is tested with is :data:`TESTED_TRANSFORMERS`; :func:`use_ficco` and
:func:`register` refuse others outside :data:`SUPPORTED_TRANSFORMERS` with a ficco error naming
the range. This module imports without transformers.

>>> from ficco.integrations import transformers as ficco_hf
>>> ficco_hf.TESTED_TRANSFORMERS, ficco_hf.STYLE_NAMES
('5.24.0', ('ficco_colwise', 'ficco_rowwise'))
"""
from __future__ import annotations

import warnings

from ..errors import BackendUnavailableError, FiccoWarning, InvalidArgumentError
from . import CLIENTS
from ._common import check_version, column_linear, installed_version

#: The transformers release tests/faces/test_integrations_transformers.py runs (pyproject's
#: ``transformers`` extra pins it).
TESTED_TRANSFORMERS: str = CLIENTS["transformers"][1]
#: ``[low, high)``: the releases whose style API (``transformers.distributed``'s
#: ``TensorParallelLayer``, ``ParallelInterface`` and ``EPImplementationInterface``) this module
#: is written against.
SUPPORTED_TRANSFORMERS: tuple[str, str] = CLIENTS["transformers"][2]
#: ficco's tensor-parallel styles, as registered in transformers' ``ParallelInterface``.
STYLE_NAMES = ("ficco_colwise", "ficco_rowwise")
#: ficco's sequence-parallel styles (:data:`SEQUENCE_PARALLEL_PLAN` names them all).
SP_STYLE_NAMES = ("ficco_sequence_start", "ficco_sequence_shard", "ficco_sequence_norm",
                  "ficco_sequence_gather", "ficco_colwise_gathered", "ficco_colwise_sp",
                  "ficco_rowwise_sp", "ficco_sequence_norm_gather")
#: A Llama-layout decoder (``model.embed_tokens``, ``model.layers.*.{input_layernorm,
#: self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}``,
#: ``model.norm``) under sequence parallelism: the residual stream between the layers' linears
#: holds this rank's slice of the sequence.
SEQUENCE_PARALLEL_PLAN = {
    "model.embed_tokens": "ficco_sequence_start",
    "model.layers.*": "ficco_sequence_shard",
    "model.layers.*.input_layernorm": "ficco_sequence_norm",
    "model.layers.*.self_attn": "ficco_sequence_gather",
    **{f"model.layers.*.self_attn.{p}_proj": "ficco_colwise_gathered" for p in "qkv"},
    "model.layers.*.self_attn.o_proj": "ficco_rowwise_sp",
    "model.layers.*.post_attention_layernorm": "ficco_sequence_norm",
    "model.layers.*.mlp.gate_proj": "ficco_colwise_sp",
    "model.layers.*.mlp.up_proj": "ficco_colwise_sp",
    "model.layers.*.mlp.down_proj": "ficco_rowwise_sp",
    "model.norm": "ficco_sequence_norm_gather",
}
#: A Mixtral-layout mixture of experts under sequence parallelism (with ``ep_size`` = the
#: tensor-parallel size and ``ep_implementation="ficco"``, or after :func:`use_ficco`): the
#: attention as in :data:`SEQUENCE_PARALLEL_PLAN`; the router (``mlp.gate``) runs on this rank's
#: slice, its gradient summed over the group; the experts get each rank's own tokens through
#: ficco's dispatch and combine.
SEQUENCE_PARALLEL_MOE_PLAN = {
    **{k: v for k, v in SEQUENCE_PARALLEL_PLAN.items() if ".mlp." not in k},
    "model.layers.*.mlp.gate": "ficco_sequence_norm",
}
#: ficco's ``DistributedConfig.ep_implementation``.
EP_IMPLEMENTATION = "ficco"
#: The stock names :func:`use_ficco` points at ficco's styles.
STOCK = {"colwise": "ficco_colwise", "rowwise": "ficco_rowwise"}
STOCK_EP = ("auto", "all_to_all")

__all__ = ["EP_IMPLEMENTATION", "SEQUENCE_PARALLEL_MOE_PLAN", "SEQUENCE_PARALLEL_PLAN",
           "SP_STYLE_NAMES", "STYLE_NAMES",
           "SUPPORTED_TRANSFORMERS", "TESTED_TRANSFORMERS", "register", "stock_styles",
           "transformers_version", "use_ficco"]

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

    colwise, rowwise, ep, sp = _classes()
    ParallelInterface.register("ficco_colwise", colwise())
    ParallelInterface.register("ficco_rowwise", rowwise())
    for name, style in sp.items():
        ParallelInterface.register(name, style())
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

    def _own_forward(module, style: str) -> bool:
        """Whether ficco's forward can replace ``module``'s: an ``nn.Linear`` with
        nn.Linear's own forward. A subclass with a forward of its own (a quantized or adapter
        linear) keeps it under transformers' style, with a warning."""
        if not isinstance(module, torch.nn.Linear):
            raise InvalidArgumentError(
                f"{style} shards an nn.Linear; {type(module).__name__} is not one (keep "
                f"transformers' own style for it)")
        if type(module).forward is torch.nn.Linear.forward:
            return True
        warnings.warn(f"{style}: {type(module).__name__} overrides nn.Linear.forward, so it "
                      f"keeps its forward and runs transformers' style (no ficco op)",
                      FiccoWarning, stacklevel=4)
        return False

    class FiccoColwiseParallel(ColwiseParallel):
        """transformers' ``"colwise"`` (replicated input, ``Shard(-1)`` output) with the
        input gradient's all-reduce inside ``ficco.matmul_all_reduce``."""

        def __init__(self):
            super().__init__(input_layouts=Replicate(), output_layouts=Shard(-1))

        def install_forward(self, module, mesh):
            if not _own_forward(module, "ficco_colwise"):
                return super().install_forward(module, mesh)

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
            if not _own_forward(module, "ficco_rowwise"):
                return super().install_forward(module, mesh)

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
            # under sequence parallelism each rank holds its own slice of the tokens already;
            # otherwise the ranks of the TP group share one batch
            shared = self.tp_mesh.size() > 1 and not _sequence_sharded(self.tp_mesh)
            if shared:
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
            if not shared:
                return out
            return DTensor.from_local(out.contiguous(), self.tp_mesh, [Shard(0)],
                                      shape=(num_tokens, hidden),
                                      stride=(hidden, 1)).full_tensor()

    return (FiccoColwiseParallel, FiccoRowwiseParallel, FiccoEP,
            _sequence_parallel_classes(FiccoColwiseParallel, FiccoRowwiseParallel))


def _sequence_parallel_classes(colwise, rowwise) -> dict:
    """The sequence-parallel styles. The embedding's style decides, per forward, whether the
    sequence splits evenly over the group (a decode step's single token does not) and the first
    decoder layer's splits it; every other style reads that decision from the mesh's state and
    runs the replicated (tensor-parallel only) path where the sequence stayed whole. The final
    norm's style ends the forward's state."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    import ficco
    import ficco.nn

    seq = 1         # transformers' models are batch-first: (batch, seq, hidden)

    sharded = _sequence_sharded

    def _local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def _plain_linear(module, style: str) -> None:
        """A sequence-parallel linear must be an ``nn.Linear`` with its own forward: a subclass
        that overrides it (a quantized or adapter linear) cannot take a sequence slice."""
        if not isinstance(module, torch.nn.Linear) or \
                type(module).forward is not torch.nn.Linear.forward:
            raise InvalidArgumentError(
                f"{style} runs an nn.Linear on a slice of the sequence; "
                f"{type(module).__name__} is not one or overrides its forward (leave "
                f"sequence parallelism out of its plan)")

    class FiccoSequenceStart(TensorParallelLayer):
        """The embedding: where a forward starts. Its output stays whole (the model derives
        positions and masks from its length); whether the sequence splits evenly over the group
        is decided here, and the first decoder layer splits it."""

        def install_forward(self, module, mesh):
            original = module.forward

            def forward(*args, **kwargs):
                out = original(*args, **kwargs)
                even = out.dim() > seq and out.shape[seq] % mesh.size() == 0
                _SHARDED[_key(mesh)] = "pending" if even else False
                return out

            module.forward = forward
            return module

    class FiccoSequenceShard(TensorParallelLayer):
        """A decoder layer: the first one of a forward cuts its input to this rank's slice of
        the sequence (its backward gathers the slices' gradients); the layers after it get
        slices already."""

        def install_forward(self, module, mesh):
            original = module.forward

            def forward(*args, **kwargs):
                if _SHARDED.get(_key(mesh)) == "pending":
                    _SHARDED[_key(mesh)] = True
                    if "hidden_states" in kwargs:
                        kwargs["hidden_states"] = split(kwargs["hidden_states"])
                    else:
                        args = (split(args[0]), *args[1:])
                return original(*args, **kwargs)

            def split(x):
                return DTensor.from_local(x, mesh, [Replicate()], run_check=False) \
                    .redistribute(mesh, [Shard(seq)]).to_local()

            module.forward = forward
            return module

    class FiccoSequenceNorm(TensorParallelLayer):
        """A module on this rank's rows with replicated parameters (a norm, a mixture of
        experts' router); under sequence parallelism their gradients are summed over the group
        (each rank's rows give part of them)."""

        gather = False

        def install_forward(self, module, mesh):
            original = module.forward

            def forward(x, *args, **kwargs):
                if not sharded(mesh):
                    return original(x, *args, **kwargs)
                params = dict(module._parameters)
                for name, p in params.items():
                    if p is not None:
                        module._parameters[name] = ficco.nn.replicated(p, mesh)
                try:
                    out = original(x, *args, **kwargs)
                finally:
                    module._parameters.update(params)
                if self.gather:
                    _SHARDED.pop(_key(mesh), None)       # the model's last sequence-parallel op
                    out = DTensor.from_local(out, mesh, [Shard(seq)], run_check=False) \
                        .redistribute(mesh, [Replicate()]).to_local()
                return out

            module.forward = forward
            return module

    class FiccoSequenceNormGather(FiccoSequenceNorm):
        """The final norm: on this rank's rows, then the sequence gathered for the head."""

        gather = True

    class FiccoSequenceGather(TensorParallelLayer):
        """The attention's input gathered (its backward reduce-scatters the input gradient):
        the attention reshapes by its input's sequence length, so it takes the whole
        sequence; its Q/K/V projections are ``"ficco_colwise_gathered"``."""

        def install_forward(self, module, mesh):
            original = module.forward

            def forward(*args, **kwargs):
                if sharded(mesh):
                    if "hidden_states" in kwargs:
                        kwargs["hidden_states"] = gather(kwargs["hidden_states"])
                    else:
                        args = (gather(args[0]), *args[1:])
                return original(*args, **kwargs)

            def gather(x):
                return DTensor.from_local(x, mesh, [Shard(seq)], run_check=False).redistribute(
                    mesh, [Replicate()]).to_local(grad_placements=[Partial()])

            module.forward = forward
            return module

    class FiccoColwiseGathered(colwise):
        """``"ficco_colwise"`` inside a ``"ficco_sequence_gather"`` module: under sequence
        parallelism the gather's backward sums the input gradient, so the GEMM is local both
        ways."""

        def install_forward(self, module, mesh):
            _plain_linear(module, "ficco_colwise_gathered")
            super().install_forward(module, mesh)
            replicated = module.forward

            def forward(x, *args, **kwargs):
                if not sharded(mesh):
                    return replicated(x, *args, **kwargs)
                bias = None if module.bias is None else _local(module.bias)
                return torch.nn.functional.linear(x, _local(module.weight), bias)

            module.forward = forward
            return module

    class FiccoColwiseSP(colwise):
        """A column-parallel linear whose input is this rank's slice of the sequence:
        ``ficco.all_gather_matmul`` (backward: ``ficco.matmul_reduce_scatter``)."""

        def install_forward(self, module, mesh):
            _plain_linear(module, "ficco_colwise_sp")
            super().install_forward(module, mesh)
            replicated = module.forward

            def forward(x, *args, **kwargs):
                if not sharded(mesh):
                    return replicated(x, *args, **kwargs)
                out = ficco.all_gather_matmul(x, _local(module.weight).t(), mesh,
                                              gather_dim=seq)
                return out if module.bias is None else out + _local(module.bias)

            module.forward = forward
            return module

    class FiccoRowwiseSP(rowwise):
        """A row-parallel linear whose output is this rank's slice of the sequence:
        ``ficco.matmul_reduce_scatter`` (backward: ``ficco.all_gather_matmul``); the
        replicated bias is added once, its gradient summed over the group."""

        def install_forward(self, module, mesh):
            _plain_linear(module, "ficco_rowwise_sp")
            super().install_forward(module, mesh)
            replicated = module.forward

            def forward(x, *args, **kwargs):
                if not sharded(mesh):
                    return replicated(x, *args, **kwargs)
                bias = None if module.bias is None else ficco.nn.replicated(
                    _local(module.bias), mesh)
                out = ficco.matmul_reduce_scatter(x, _local(module.weight).t(), mesh,
                                                  scatter_dim=seq)
                return out if bias is None else out + bias

            module.forward = forward
            return module

    return dict(zip(SP_STYLE_NAMES, (FiccoSequenceStart, FiccoSequenceShard, FiccoSequenceNorm,
                                     FiccoSequenceGather,
                                     FiccoColwiseGathered, FiccoColwiseSP, FiccoRowwiseSP,
                                     FiccoSequenceNormGather)))


#: the tensor-parallel group's name -> this forward's sequence: "pending" (it splits evenly; the
#: first decoder layer splits it), True (split), False (kept whole); set by the embedding's
#: style, ended by the final norm's.
_SHARDED: dict[str, bool | str] = {}


def _key(mesh) -> str:
    """The state's key for a tensor-parallel mesh: its group's name (transformers slices a new
    DeviceMesh object for each of its uses)."""
    return mesh.get_group().group_name


def _sequence_sharded(mesh) -> bool:
    """Whether this forward's sequence is split over ``mesh`` (its residual stream holds this
    rank's slice)."""
    return _SHARDED.get(_key(mesh)) is True


def _register_on_import() -> None:
    version = transformers_version()
    if version is None:
        return
    try:
        register()
    except BackendUnavailableError:     # an unsupported release: use_ficco() says why
        return


_register_on_import()
