"""Rank-side cases of tests/faces/test_integrations_transformers.py: tiny models built from a config
with random weights (saved to a local directory by rank 0, nothing downloaded), loaded by
transformers' own ``from_pretrained(..., distributed_config=DistributedConfig(...))`` on the W
ranks and whole on each rank, in float64."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .reference import ficco_call_ranges as ficco_calls

VOCAB, SEQ, BATCH, NEW, SEED = 96, 12, 2, 3, 48
# initializer_range: weights large enough that a wrong path moves the logits well past float64's
# rounding (transformers' default, 0.02, keeps a tiny model's logits near uniform)
INIT = 0.2


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=64, tie_word_embeddings=False,
                       initializer_range=INIT)


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                         tie_word_embeddings=False, router_jitter_noise=0.0,
                         initializer_range=INIT)


def _saved(kind: str, path: str):
    """The model's class; rank 0 writes the model to ``path`` first (from the config, random
    weights, float64)."""
    from transformers import LlamaForCausalLM, MixtralForCausalLM

    cls, config = ((LlamaForCausalLM, llama_config) if kind == "llama"
                   else (MixtralForCausalLM, mixtral_config))
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(SEED)
        cls(config()).to(torch.float64).save_pretrained(path)
    dist.barrier()
    return cls


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(a, b) -> float:
    a, b = _full(a).detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# the attention's rules naming ficco's styles: the W = 4 MoE's plan (the Llama's is the block of
# docs/integrations.md)
MOE_PLAN = {**{f"model.layers.*.self_attn.{n}_proj": "ficco_colwise" for n in "qkv"},
            "model.layers.*.self_attn.o_proj": "ficco_rowwise"}


def _load(kind, path, world, how, code):
    """The sharded model: "names" (the MoE, its plan naming ficco's styles and
    ``ep_implementation="ficco"``), "sp" (the Llama under ``SEQUENCE_PARALLEL_PLAN``, the MoE
    under ``SEQUENCE_PARALLEL_MOE_PLAN`` with ``ep_implementation="ficco"``) or
    "block" (``code``, a block of the README or docs/, run as
    written with ``model_dir`` / ``moe_dir`` and, as torchrun sets it, ``WORLD_SIZE``)."""
    from transformers.distributed import DistributedConfig

    from ficco.integrations import transformers as ficco_hf

    cls = _saved(kind, path)
    try:
        if how == "block":
            os.environ["WORLD_SIZE"] = str(world)
            ns = {"model_dir": path, "moe_dir": path}
            exec(compile(code, "docs", "exec"), ns)     # noqa: S102 - the docs' own code
            return ns["model"]
        if how == "sp" and kind == "llama":
            return cls.from_pretrained(
                path, dtype=torch.float64, distributed_config=DistributedConfig(
                    tp_size=world, tp_plan=ficco_hf.SEQUENCE_PARALLEL_PLAN))
        if how == "sp":
            return cls.from_pretrained(
                path, dtype=torch.float64, distributed_config=DistributedConfig(
                    tp_size=world, ep_size=world, tp_plan=ficco_hf.SEQUENCE_PARALLEL_MOE_PLAN,
                    ep_implementation=ficco_hf.EP_IMPLEMENTATION))
        assert how == "names" and kind == "mixtral", (how, kind)
        return cls.from_pretrained(path, dtype=torch.float64, distributed_config=DistributedConfig(
            tp_size=world, ep_size=world, tp_plan=MOE_PLAN,
            ep_implementation=ficco_hf.EP_IMPLEMENTATION))
    finally:
        ficco_hf.use_ficco(False)       # what a block's use_ficco() changed


def compare(rank, world, kind, path, how, code=None):
    """Training step (loss, logits, every gradient) and greedy ``generate`` with the KV cache,
    sharded (see :func:`_load` for ``how``) against the same model unsharded."""
    model = _load(kind, path, world, how, code)
    gen = torch.Generator().manual_seed(SEED + world)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    prompt = ids[:, :SEQ // 2]
    ref = _reference(kind, path, ids, prompt)
    out, calls = ficco_calls(lambda: _step(model, ids))
    worst = {"loss": abs(out.loss.item() - ref["loss"]) / abs(ref["loss"]),
             "logits": _rel(out.logits, ref["logits"]), "grad": 0.0}
    names = []
    for name, p in model.named_parameters():
        names.append(name)
        worst["grad"] = max(worst["grad"], _rel(p.grad, ref["grads"][name]))
    with torch.no_grad():
        tokens, gen_calls = ficco_calls(lambda: model.generate(
            prompt, max_new_tokens=NEW, do_sample=False, use_cache=True, pad_token_id=0))
    return {"worst": worst, "same_params": sorted(names) == sorted(ref["grads"]),
            "sharded": _sharded(model), "calls": calls, "generate_calls": gen_calls,
            "tokens_equal": torch.equal(tokens, ref["tokens"]),
            "new_tokens": tokens.shape[1] - prompt.shape[1]}


_REFERENCES: dict = {}


def _reference(kind, path, ids, prompt) -> dict:
    """The unsharded model's loss, logits, gradients and greedy tokens for ``ids`` (kept per
    pool: the cases of one W share their batch)."""
    key = (kind, path, tuple(ids.flatten().tolist()))
    if key not in _REFERENCES:
        # transformers' default grouped-GEMM experts take no float64: the reference's run eager
        reference = _saved(kind, path).from_pretrained(
            path, dtype=torch.float64,
            **({"experts_implementation": "eager"} if kind != "llama" else {}))
        out = reference(ids, labels=ids)
        out.loss.backward()
        with torch.no_grad():
            tokens = reference.generate(prompt, max_new_tokens=NEW, do_sample=False,
                                        use_cache=True, pad_token_id=0)
        _REFERENCES[key] = {"loss": out.loss.item(), "logits": out.logits.detach(),
                            "grads": {n: p.grad for n, p in reference.named_parameters()},
                            "tokens": tokens}
    return _REFERENCES[key]


def _sharded(model) -> list[str]:
    """The placements of layer 0's attention and expert weights (DTensors, as transformers'
    own styles leave them)."""
    layer = model.model.layers[0]
    weights = [layer.self_attn.q_proj.weight, layer.self_attn.o_proj.weight]
    if hasattr(layer.mlp, "experts"):
        weights.append(layer.mlp.experts.gate_up_proj)
    return [str(tuple(w.placements)) for w in weights]


def _step(model, ids):
    out = model(ids, labels=ids)
    out.loss.backward()
    return out


def run_doctests(rank, world):
    """ficco.integrations' docstring examples (tests/claims/test_docstrings.py leaves the package to
    this pool: importing it imports the clients)."""
    import doctest

    import ficco.integrations
    import ficco.integrations.megatron
    import ficco.integrations.transformers

    results = [doctest.testmod(m, optionflags=doctest.ELLIPSIS)
               for m in (ficco.integrations, ficco.integrations.megatron,
                         ficco.integrations.transformers)]
    return [(r.attempted, r.failed) for r in results]


def registry_case(rank, world):
    """What importing the module registers, what ``use_ficco()`` points the stock names at and
    ``use_ficco(False)`` restores, and the refusals of modules ficco's styles cannot run (each
    an InvalidArgumentError when the model is built, before any communication)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import EPImplementationInterface
    from transformers.distributed.parallel_utils import ParallelInterface

    from ficco.errors import InvalidArgumentError
    from ficco.integrations import transformers as ficco_hf

    out = {"registered": sorted(n for n in ParallelInterface() if n.startswith("ficco")),
           "ep": ficco_hf.EP_IMPLEMENTATION in EPImplementationInterface()}
    out["before"] = ficco_hf.stock_styles()
    ficco_hf.use_ficco()
    ficco_hf.use_ficco()                       # twice: still restorable
    out["on"] = ficco_hf.stock_styles()
    ficco_hf.use_ficco(False)
    out["off"] = ficco_hf.stock_styles()
    mesh = init_device_mesh("cpu", (world,))
    refusals = {}
    for name in ficco_hf.STYLE_NAMES:
        try:
            ParallelInterface()[name].install_forward(nn.Embedding(4, 8), mesh)
            refusals[name] = "no error"
        except InvalidArgumentError as exc:
            refusals[name] = str(exc)
    class OwnForward(nn.Linear):      # a quantized or adapter linear's shape
        def forward(self, x):
            return super().forward(x) * 2

    for name in ("ficco_colwise_sp", "ficco_rowwise_sp", "ficco_colwise_gathered"):
        try:
            ParallelInterface()[name].install_forward(OwnForward(8, 8), mesh)
            refusals[name] = "no error"
        except InvalidArgumentError as exc:
            refusals[name] = str(exc)
    import warnings

    kept = {}
    for name in ficco_hf.STYLE_NAMES:
        linear = OwnForward(8, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ParallelInterface()[name].install_forward(linear, mesh)
        kept[name] = [str(w.message) for w in caught if w.category.__name__ == "FiccoWarning"]
    out["kept_own_forward"] = kept
    try:
        EPImplementationInterface()[ficco_hf.EP_IMPLEMENTATION](nn.Linear(8, 8), mesh, mesh)
        refusals["ep"] = "no error"
    except InvalidArgumentError as exc:
        refusals["ep"] = str(exc)
    out["refusals"] = refusals
    return out
