"""Rank-side cases of tests/faces/test_integrations_megatron.py: one GPT ``TransformerLayer`` of
megatron-core built from ``get_gpt_layer_local_spec()`` (no Transformer Engine), unsharded
(tensor-parallel size 1) and with the spec ``ficco.integrations.megatron.use_ficco`` returns
(tensor-parallel size W, sequence parallelism on or off), in float64 on CPU."""
from __future__ import annotations

import warnings

import torch

from .reference import ficco_call_ranges

SEQ, BATCH, HIDDEN, HEADS, FFN = 16, 2, 32, 4, 64


def _config(tp: int, sp: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    # CPU: initialisation on the CPU, no fused kernels (CUDA extensions), no dropout (the
    # comparison is exact); bias on, so the row layers' bias path is checked
    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
        params_dtype=torch.float64, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, add_bias_linear=True,
        init_method_std=0.2)


def _layer(config, spec):
    from megatron.core.transformer.spec_utils import build_module

    # the local norm is torch's, made in the default dtype: the whole layer in float64, as
    # Megatron's Float16Module casts a model to its training dtype
    return build_module(spec, config=config, layer_number=1).to(torch.float64)


def _run(layer, x):
    # the causal mask passed in (True: masked), as Megatron's GPT model passes it: without
    # one, its softmax builds the default causal mask on a CUDA device
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    out, _ = layer(x, attention_mask=mask)
    return out


def _state(tp: int):
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    # DotProductAttention's scores go to a buffer Megatron allocates on the current CUDA
    # device: held on the CPU here (the buffer is the attention's, no tensor-parallel GEMM's)
    parallel_state.get_global_memory_buffer().buffer[("mpu", torch.float64)] = torch.empty(
        1 << 16, dtype=torch.float64)
    _cpu_rng_tracker()
    return parallel_state


def _cpu_rng_tracker():
    """Megatron forks its CUDA RNG tracker around the attention dropout outside sequence
    parallelism; with no CUDA device (and dropout 0 here, so nothing is drawn) the fork is
    empty."""
    import contextlib

    from megatron.core.tensor_parallel import random

    class CPUTracker(random.CudaRNGStatesTracker):
        @contextlib.contextmanager
        def fork(self, name=None):
            yield

    random._CUDA_RNG_STATE_TRACKER = CPUTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _sum_grads_as_megatron(layer, config, group):
    """Megatron's own ``finalize_model_grads`` step for a tensor-parallel group: the
    gradients of parameters marked ``sequence_parallel`` summed over the group."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    layer.ddp_config = DistributedDataParallelConfig()
    _allreduce_non_tensor_model_parallel_grads([layer], config, group)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def layer_case(rank, world, sp, seed, spec_kind, code=None):
    """The worst relative differences (output, input gradient, every parameter gradient), the
    ficco calls of one forward+backward and the layer classes, sharded against unsharded.
    ``spec_kind``: "use_ficco" (the helper on the local spec), "by_hand" (the classes named
    in the spec) or "readme" (``code``, the README's block, run as written: it makes
    ``layer_spec``)."""
    warnings.filterwarnings("ignore", module="megatron")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ficco.integrations import megatron as ficco_megatron

    try:
        _state(1)
        torch.manual_seed(seed)
        reference = _layer(_config(1, False), get_gpt_layer_local_spec())
        gen = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64, generator=gen)
        weights = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64, generator=gen)
        x_ref = x.clone().requires_grad_()
        ref_out = _run(reference, x_ref)
        (ref_out * weights).sum().backward()

        state = _state(world)
        config = _config(world, sp)
        if spec_kind == "use_ficco":
            spec = ficco_megatron.use_ficco(get_gpt_layer_local_spec())
        elif spec_kind == "by_hand":
            spec = _by_hand(get_gpt_layer_local_spec(), ficco_megatron)
        else:
            ns: dict = {}
            exec(compile(code, "README.md", "exec"), ns)     # noqa: S102 - the docs' own code
            spec = ns["layer_spec"]
        layer = _layer(config, spec)
        ref_params = dict(reference.named_parameters())
        with torch.no_grad():
            for name, p in layer.named_parameters():
                full = ref_params[name]
                if getattr(p, "tensor_model_parallel", False):
                    full = full.chunk(world, p.partition_dim)[rank]
                p.copy_(full)
        rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world) if sp else slice(None)
        x_in = x[rows].clone().requires_grad_()

        def step():
            out = _run(layer, x_in)
            (out * weights[rows]).sum().backward()
            return out

        out, calls = ficco_call_ranges(step)
        group = state.get_tensor_model_parallel_group()
        _sum_grads_as_megatron(layer, config, group)
        worst = {"out": _rel(out, ref_out[rows]), "dx": _rel(x_in.grad, x_ref.grad[rows]),
                 "grad": 0.0}
        for name, p in layer.named_parameters():
            ref = ref_params[name].grad
            if getattr(p, "tensor_model_parallel", False):
                ref = ref.chunk(world, p.partition_dim)[rank]
            worst["grad"] = max(worst["grad"], _rel(p.grad, ref))
        kinds = sorted({type(m).__name__ for m in layer.modules()
                        if type(m).__module__ == "ficco.integrations.megatron"})
        marked = sorted(n for n, p in layer.named_parameters()
                        if getattr(p, "sequence_parallel", False))
        return {"worst": worst, "calls": calls, "classes": kinds, "sp_marked": marked,
                "params": len(ref_params)}
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


def _by_hand(spec, ficco_megatron):
    """The spec with the classes named in it directly (what a spec written by hand does)."""
    attention = spec.submodules.self_attention.submodules
    attention.linear_qkv = ficco_megatron.FiccoColumnParallelLinear
    attention.linear_proj = ficco_megatron.FiccoRowParallelLinear
    mlp = spec.submodules.mlp.submodules
    mlp.linear_fc1 = ficco_megatron.FiccoColumnParallelLinear
    mlp.linear_fc2 = ficco_megatron.FiccoRowParallelLinear
    spec.submodules.input_layernorm = ficco_megatron.FiccoNorm
    spec.submodules.pre_mlp_layernorm = ficco_megatron.FiccoNorm
    return spec


