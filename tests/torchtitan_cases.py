"""Rank-side cases of tests/faces/test_torchtitan.py: torchtitan 0.3's llama3 debug model, its config
rewritten by ``--override.imports ficco.torchtitan.tensor_parallel`` exactly as torchtitan's
trainer does (``apply_overrides`` after the sharding configs are set, before the build), against
the same model unsharded.

What differs from ``torchtitan.train``, and why:
- the inner attention is ``ScaledDotProductAttention`` (causal): torchtitan's language models use
  FlexAttention, which has no backward on CPU. It is no tensor-parallel GEMM.
- ``Module.parallelize`` and torchtitan's ``apply_compile`` are called directly (what
  ``parallelize_llama`` does before FSDP): FSDP2 under ``spmd_types`` wants DTensor parameters,
  which torchtitan 0.3 with this torch does not hand it on CPU. FSDP is what all-reduces the
  gradients of the sequence-parallel norms (torchtitan types them ``R`` with a pending
  reduction), so the test sums those over the TP group itself, as FSDP would.
- torchtitan chooses the device type "cuda" when it finds no accelerator; the CPU ranks set it
  to "cpu".
"""
from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

from .reference import ficco_calls

OVERRIDE = "ficco.torchtitan.tensor_parallel"
SEQ, BATCH = 64, 2


def _config(world: int, layers: int | None, *, sp: bool = True):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg = model_registry("debugmodel").model
    if layers is not None:
        cfg.layers = cfg.layers[:layers]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(cfg, enable_sp=sp)
    return cfg


def _setup(backend: str = "spmd_types"):
    from torchtitan.distributed import parallel_dims, utils

    parallel_dims.device_type = "cpu"
    torch.autograd.set_multithreading_enabled(False)    # as torchtitan's init_distributed
    utils.set_spmd_backend(backend)


def _override(cfg):
    from torchtitan.config.override import OverrideConfig, apply_overrides

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_overrides(OverrideConfig(imports=[OVERRIDE]), cfg)
    return [str(w.message) for w in caught if w.category.__name__ == "FiccoWarning"]


def _parallel_dims(world: int, tp: int | None = None):
    from torchtitan.distributed import ParallelDims

    tp = world if tp is None else tp
    dims = ParallelDims(dp_replicate=1, dp_shard=world // tp, cp=1, tp=tp, pp=1, ep=1,
                        world_size=world)
    dims.build_mesh()
    return dims


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def train(rank, world, compiled, layers, steps, seed):
    """``steps`` SGD steps of the overridden model on W ranks and of the unsharded model.
    Returns the worst relative loss and gradient differences, the ficco op calls of the last
    step, the build-time report and the replaced modules' class names."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import utils
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.tools.logging import logger

    _setup()
    torch.manual_seed(seed)
    reference = _config(world, layers).build()
    reference.init_weights(buffer_device=None)
    cfg = _config(world, layers)
    _override(cfg)
    records = []
    handler = _Collect(records)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        model = cfg.build()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    model.load_state_dict(reference.state_dict())
    dims = _parallel_dims(world)
    model.parallelize(dims)
    if compiled:
        torch._dynamo.reset()
        apply_compile(model, compile_config=CompileConfig(enable=True), parallel_dims=dims)
    context = utils.get_spmd_context(parallel_dims=dims)
    tp = dims.get_mesh("tp").get_group()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, 2048, (BATCH, SEQ), generator=gen)
    weights = torch.randn(BATCH, SEQ, 2048, generator=gen)     # loss = sum(logits * weights)
    vocab = 2048 // world
    mine = weights[..., rank * vocab:(rank + 1) * vocab]
    loss_diff, grad_diff, calls = 0.0, 0.0, {}

    def step():
        opt.zero_grad()
        with context():
            loss = (model(tokens) * mine).sum()
            loss.backward()
        return loss.detach()

    for i in range(steps):
        if i == steps - 1:
            loss, calls = ficco_calls(step)
        else:
            loss = step()
        dist.all_reduce(loss, group=tp)            # the vocabulary-parallel loss's sum
        ref_opt.zero_grad()
        ref_loss = (reference(tokens) * weights).sum()
        ref_loss.backward()
        loss_diff = max(loss_diff, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        ref_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            ref = ref_params[name].grad
            if p.shape == ref.shape:
                # a replicated parameter: a sequence-parallel norm's gradient is this rank's
                # rows' part until FSDP sums it; the others' are whole
                if "norm" in name:
                    dist.all_reduce(p.grad, group=tp)
            else:
                dim = next(d for d in range(p.dim()) if p.shape[d] != ref.shape[d])
                ref = ref.chunk(world, dim)[rank]
            grad_diff = max(grad_diff, _rel(p.grad, ref))
        opt.step()
        ref_opt.step()
    replaced = sorted({type(m).__name__ for m in model.modules()
                       if type(m).__module__ == "ficco.torchtitan.modules"})
    return loss_diff, grad_diff, calls, [r.getMessage() for r in records
                                         if "ficco.torchtitan" in r.getMessage()], replaced


class _Collect(logging.Handler):
    """Keeps the records of torchtitan's logger, at any level."""

    def __init__(self, records):
        super().__init__(level=0)
        self.records = records

    def emit(self, record):
        self.records.append(record)


def nothing_reaches(rank, world):
    """The ways the override reaches no TP GEMM, each said: sequence parallelism off (a
    warning at override time, torchtitan's modules kept), TP degree 1 (a warning when
    parallelized, torchtitan's forward runs), a DTensor backend (ConfigError)."""
    from torchtitan.distributed import utils

    from ficco.errors import ConfigError

    _setup()
    out = {}
    cfg = _config(world, 1, sp=False)
    out["no_sp_warnings"] = _override(cfg)
    out["no_sp_types"] = [type(cfg.layers[0].feed_forward).__qualname__,
                          type(cfg.layers[0].attention.wo).__qualname__]
    cfg = _config(world, 1)
    _override(cfg)
    model = cfg.build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.parallelize(_parallel_dims(world, tp=1))
    out["tp1_warnings"] = [str(w.message) for w in caught
                           if w.category.__name__ == "FiccoWarning"]
    tokens = torch.randint(0, 2048, (1, 16))
    with utils.get_spmd_context(parallel_dims=None)():
        out["tp1_shape"] = tuple(model(tokens).shape)
    utils.set_spmd_backend("partial_dtensor")
    try:
        _override(_config(world, 1))
        out["dtensor"] = "no error"
    except ConfigError as exc:
        out["dtensor"] = str(exc)
    finally:
        utils.set_spmd_backend("spmd_types")
    return out


def run_doctests(rank, world):
    """ficco.torchtitan's docstring examples (tests/claims/test_docstrings.py leaves the package to
    this pool: importing it imports torchtitan's model stack, which patches torch)."""
    import doctest

    import ficco.torchtitan
    import ficco.torchtitan.modules

    results = [doctest.testmod(m, optionflags=doctest.ELLIPSIS)
               for m in (ficco.torchtitan, ficco.torchtitan.modules)]
    return [(r.attempted, r.failed) for r in results]

