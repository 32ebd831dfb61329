"""The torchtitan modules that run their tensor-parallel GEMMs on ficco, and the config rewrite
that puts them in a transformer block (:func:`replace_block`). Imported only with torchtitan 0.3.

Each module subclasses torchtitan's stock one (same parameters, names, initializers and
checkpoint hooks) and changes only ``forward``: under torchtitan's ``spmd_types`` backend the
activations and parameters it sees are this rank's local tensors, the sequence shard
``(batch, seq / W, dim)`` on the way in and out of a block. The tensor-parallel group is the
one torchtitan parallelizes the module over (``parallelize``), not read from a context at call
time, so a module called outside torchtitan's train context still gathers rather than
computing on a shard.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torchtitan.config.override import derive
from torchtitan.distributed.utils import get_spmd_backend
from torchtitan.models.common.attention import FusedQKVLinear, GQAttention, QKVLinear
from torchtitan.models.common.decoder_sharding import dense_sequence_parallel_placement
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.sharding import ShardingConfig
from torchtitan.tools.logging import logger

from ..errors import ConfigError, FiccoWarning, first_time
from ..ops.all_gather_matmul import torch_op as all_gather_op
from ..ops.matmul_reduce_scatter import torch_op as reduce_scatter_op

_SEQ_DIM = 1     # torchtitan's activations are (batch, seq, dim)


# -- the modules ---------------------------------------------------------------------------------
class _OnTensorParallelGroup:
    """What every module here shares: built, it reports the plan (:func:`_report_plan`);
    parallelized, it remembers the tensor-parallel mesh torchtitan parallelizes it over (None:
    TP is off, torchtitan's own forward runs). Each module still declares its own ``Config``:
    torchtitan builds the class a ``Config`` is declared in."""

    _ficco_tp = None

    def __init__(self, config) -> None:   # torchtitan builds a module as ``Owner(config=...)``
        super().__init__(config)  # type: ignore[call-arg]
        _report_plan()

    def parallelize(self, parallel_dims) -> None:
        self._ficco_tp = parallel_dims.get_mesh("tp") if parallel_dims.tp_enabled else None
        if self._ficco_tp is None:
            _warn_unreached(type(self).__name__, "tensor_parallel_degree is 1")
        super().parallelize(parallel_dims)  # type: ignore[misc]

    def _tp_mesh(self):
        if self._ficco_tp is None and not torch.compiler.is_compiling() \
                and not getattr(self, "_parallelized", False):
            _warn_unreached(type(self).__name__, "the model was not parallelized")
        return self._ficco_tp


class FiccoFusedQKVLinear(_OnTensorParallelGroup, FusedQKVLinear):
    """torchtitan's fused Q/K/V projection; the sequence gather runs inside the GEMM."""

    @dataclass(kw_only=True, slots=True)
    class Config(FusedQKVLinear.Config):
        pass

    def forward(self, x: Tensor):  # type: ignore[override]
        mesh = self._tp_mesh()
        if mesh is None:
            return super().forward(x)
        (qkv,) = _gather_matmul(x, [self.wqkv], mesh)
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, -1, self.r_dim, self.head_dim)
        q, k, v = qkv.split([self.heads_per_kv, 1, 1], dim=-2)
        return tuple(t.reshape(b, s, -1, self.head_dim).contiguous() for t in (q, k, v))


class FiccoQKVLinear(_OnTensorParallelGroup, QKVLinear):
    """torchtitan's separate Q, K, V projections; one gather feeds all three GEMMs."""

    @dataclass(kw_only=True, slots=True)
    class Config(QKVLinear.Config):
        pass

    def forward(self, x: Tensor):  # type: ignore[override]
        mesh = self._tp_mesh()
        if mesh is None:
            return super().forward(x)
        outs = _gather_matmul(x, [self.wq, self.wk, self.wv], mesh)
        b, s = outs[0].shape[:2]
        return tuple(t.view(b, s, -1, self.head_dim) for t in outs)


class FiccoRowParallelLinear(_OnTensorParallelGroup, Linear):
    """A row-parallel linear (attention's ``wo``) whose reduce-scatter back to the sequence
    shard runs inside the GEMM; the replicated bias is added once."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        pass

    def forward(self, input: Tensor) -> Tensor:
        mesh = self._tp_mesh()
        if mesh is None:
            return super().forward(input)
        return _matmul_reduce_scatter(input, self, mesh)


class FiccoFeedForward(_OnTensorParallelGroup, FeedForward):
    """torchtitan's SwiGLU feed-forward: one gather into ``w1`` and ``w3``, ``w2``
    reduce-scattered back to the sequence shard."""

    @dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        pass

    def forward(self, x: Tensor) -> Tensor:
        mesh = self._tp_mesh()
        if mesh is None:
            return super().forward(x)
        h1, h3 = _gather_matmul(x, [self.w1, self.w3], mesh)
        return _matmul_reduce_scatter(F.silu(h1) * h3, self.w2, mesh)


def _gather_matmul(x: Tensor, linears, mesh) -> list[Tensor]:
    biases = [lin.bias for lin in linears]
    return all_gather_op.all_gather_matmul(
        x, [lin.weight.t() for lin in linears], mesh, gather_dim=_SEQ_DIM,
        bias=biases if any(b is not None for b in biases) else None)


def _matmul_reduce_scatter(x: Tensor, linear, mesh) -> Tensor:
    return reduce_scatter_op.matmul_reduce_scatter(x, linear.weight.t(), mesh, scatter_dim=_SEQ_DIM,
                                         bias=linear.bias)


# -- the config rewrite --------------------------------------------------------------------------
def replace_block(cfg):
    """``cfg`` (a ``TransformerBlock.Config``) with its tensor-parallel linears on ficco,
    where it can: attention of torchtitan's ``GQAttention`` with its stock Q/K/V and ``wo``,
    torchtitan's stock SwiGLU ``FeedForward``. What it cannot replace keeps torchtitan's
    modules and is named when the model is built."""
    backend = get_spmd_backend()
    if backend != "spmd_types":
        raise ConfigError(
            f"ficco.torchtitan.tensor_parallel needs parallelism.spmd_backend='spmd_types' "
            f"(torchtitan 0.3's default: its modules take and return local tensors); got "
            f"{backend!r}, whose DTensor modules torchtitan is retiring")
    total = _tp_linears(cfg)
    if not _sequence_parallel(cfg):
        _PLAN.skip(total, "sequence parallelism is off (parallelism.enable_sequence_parallel"
                          "=False): ficco overlaps the sequence all-gather and reduce-scatter; "
                          "an all-reduce TP layer has neither")
        return cfg
    reached = 0
    attention = cfg.attention
    if (type(attention) is GQAttention.Config and type(attention.wo) is Linear.Config
            and type(attention.qkv_linear) in _QKV):
        qkv = attention.qkv_linear
        attention.qkv_linear = derive(qkv, _QKV[type(qkv)])
        attention.wo = _row_parallel(attention.wo, FiccoRowParallelLinear.Config)
        attention.sharding_config = None     # no gather at the boundary: Q/K/V gather inside
        reached += _count_qkv(qkv) + 1
    else:
        _PLAN.note(f"attention {type(attention).__qualname__} is not torchtitan's GQAttention "
                   f"with its stock Q/K/V and wo")
    ffn = cfg.feed_forward
    if ffn is not None and type(ffn) is FeedForward.Config:
        cfg.feed_forward = derive(ffn, FiccoFeedForward.Config, sharding_config=None,
                                  w2=_row_parallel(ffn.w2, Linear.Config))
        reached += 3
    else:
        _PLAN.note(f"feed_forward {type(ffn).__qualname__} is not torchtitan's stock "
                   f"FeedForward (an MoE, a fused or another override's)")
    _PLAN.add(reached, total)
    return cfg


_QKV = {FusedQKVLinear.Config: FiccoFusedQKVLinear.Config, QKVLinear.Config: FiccoQKVLinear.Config}


def _row_parallel(linear_cfg, config_cls):
    """The row-parallel linear's config with only its parameters' shardings: it returns the
    final sequence shard itself, so there is no partial sum left to redistribute."""
    old = linear_cfg.sharding_config
    sharding = None if old is None else ShardingConfig(state_shardings=old.state_shardings)
    if config_cls is type(linear_cfg):
        return dataclasses.replace(linear_cfg, sharding_config=sharding)
    return derive(linear_cfg, config_cls, sharding_config=sharding)


def _sequence_parallel(cfg) -> bool:
    """Whether torchtitan set this block up for sequence parallelism: its norm computes on
    sequence shards (what ``set_*_sharding_config(enable_sp=True)`` declares)."""
    sharding = getattr(cfg.attention_norm, "sharding_config", None)
    return sharding is not None and sharding.out_src_shardings == \
        dense_sequence_parallel_placement()


def _count_qkv(qkv_cfg) -> int:
    return 1 if isinstance(qkv_cfg, FusedQKVLinear.Config) else 3


def _tp_linears(cfg) -> int:
    """The block's tensor-parallel GEMMs under torchtitan's stock plan: Q/K/V, wo, w1, w2, w3
    (an MoE block's experts are counted by their own parallelism, not here)."""
    attention = getattr(cfg.attention, "qkv_linear", None)
    n = (_count_qkv(attention) + 1) if attention is not None else 0
    return n + (3 if cfg.feed_forward is not None else 0)


# -- what reaches ficco --------------------------------------------------------------------------
class _Plan:
    """What the factory replaced, told once when the first replaced module is built (every
    override has run by then) or, when it replaced nothing, right away."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.blocks, self.reached, self.total = 0, 0, 0
        self.notes: dict[str, int] = {}

    def add(self, reached: int, total: int) -> None:
        self.blocks += 1
        self.reached += reached
        self.total += total

    def note(self, why: str) -> None:
        self.notes[why] = self.notes.get(why, 0) + 1

    def skip(self, total: int, why: str) -> None:
        self.add(0, total)
        if why not in self.notes:
            _warn(f"ficco.torchtitan: 0 TP GEMMs of this block reach ficco: {why}")
        self.note(why)

    def report(self) -> None:
        if not self.blocks:
            return
        notes = "; ".join(f"{n} block(s): {why}" for why, n in self.notes.items())
        line = (f"ficco.torchtitan: {self.reached} of {self.total} TP GEMMs in "
                f"{self.blocks} transformer blocks run on ficco (Q/K/V and w1/w3 gathers, wo "
                f"and w2 reduce-scatters){'; not: ' + notes if notes else ''}")
        if self.reached:
            logger.info(line)
        else:
            _warn(line)
        self.reset()


_PLAN = _Plan()
_report_plan = _PLAN.report


def _warn_unreached(module: str, why: str) -> None:
    _warn(f"ficco.torchtitan: {module} runs torchtitan's own forward, so none of its TP GEMMs "
          f"reach ficco: {why}", once=f"{module}: {why}")


def _warn(message: str, once: str | None = None) -> None:
    if once is not None and not first_time(("torchtitan", once)):
        return
    logger.warning(message)
    warnings.warn(message, FiccoWarning, stacklevel=3)
