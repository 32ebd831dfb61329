"""A transformer block (attention + SwiGLU MLP, RMS norms) in two forms with the same weights:

- :class:`Block`: plain PyTorch on one process, the reference;
- :class:`SPTPBlock`: sequence-parallel + tensor-parallel with ficco. Activations enter and
  leave sharded along the sequence (dim 1); norms run on the local shard (the SP region); the
  Q/K/V and gate/up projections are column-parallel (ficco.all_gather_matmul hides the
  sequence all-gather behind their GEMM), the out and down projections row-parallel
  (ficco.matmul_reduce_scatter reduces back to sequence shards). Attention heads are split
  over the ranks.

Used by examples/tp_mlp.py and by tests/faces/test_training.py (parity with :class:`Block`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ficco.nn as fnn
from ficco.group import rank_world, resolve


class Block(nn.Module):
    def __init__(self, dim=32, heads=4, ffn=64):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        # No Q/K/V bias: a key bias has an exactly zero gradient (softmax ignores a constant
        # per query), on which AdamW steps by the sign of rounding noise.
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim)
        self.gate, self.up = nn.Linear(dim, ffn), nn.Linear(dim, ffn)
        self.down = nn.Linear(ffn, dim)

    def forward(self, x):                               # x: (batch, seq, dim)
        h = self.norm1(x)
        x = x + self.o(_attention(self.q(h), self.k(h), self.v(h), self.heads))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class SPTPBlock(nn.Module):
    """This rank's part of ``reference`` (a :class:`Block`) for ``group``."""

    def __init__(self, reference: Block, group=None):
        super().__init__()
        _, world = rank_world(resolve(group))
        if reference.heads % world:
            raise ValueError(f"{reference.heads} heads do not split over {world} ranks")
        self.group, self.heads = group, reference.heads // world
        self.norm1 = nn.RMSNorm(reference.norm1.weight.shape[0])
        self.norm2 = nn.RMSNorm(reference.norm2.weight.shape[0])
        self.norm1.load_state_dict(reference.norm1.state_dict())
        self.norm2.load_state_dict(reference.norm2.state_dict())
        r = reference
        self.qkv = fnn.ColumnParallelLinear.from_linear([r.q, r.k, r.v], group=group, seq_dim=1)
        self.o = fnn.RowParallelLinear.from_linear(r.o, group=group, seq_dim=1)
        self.gate_up = fnn.ColumnParallelLinear.from_linear([r.gate, r.up], group=group,
                                                            seq_dim=1)
        self.down = fnn.RowParallelLinear.from_linear(r.down, group=group, seq_dim=1)

    def _norm(self, norm, x):
        # Norm weights live in the sequence-parallel region: sum their gradient over ranks.
        return F.rms_norm(x, norm.normalized_shape, fnn.replicated(norm.weight, self.group),
                          norm.eps)

    def forward(self, x_shard):                         # (batch, seq / W, dim)
        q, k, v = self.qkv(self._norm(self.norm1, x_shard))       # (batch, seq, dim / W) each
        x_shard = x_shard + self.o(_attention(q, k, v, self.heads))
        gate, up = self.gate_up(self._norm(self.norm2, x_shard))
        return x_shard + self.down(F.silu(gate) * up)

    def reference_params(self, reference: Block, rank: int, world: int):
        """(name, this rank's parameter, the matching slice of ``reference``'s) for each
        parameter, to compare a sharded training run with an unsharded one."""
        from ficco.plan.problem import even_split

        def rows(t, n):
            start, length = even_split(n, world)[rank]
            return t[start:start + length]

        def cols(t, n):
            start, length = even_split(n, world)[rank]
            return t[:, start:start + length]

        r = reference
        pairs = [("norm1", self.norm1.weight, r.norm1.weight),
                 ("norm2", self.norm2.weight, r.norm2.weight),
                 ("o.weight", self.o.weight, cols(r.o.weight, r.o.in_features)),
                 ("o.bias", self.o.bias, r.o.bias),
                 ("down.weight", self.down.weight, cols(r.down.weight, r.down.in_features)),
                 ("down.bias", self.down.bias, r.down.bias)]
        for j, lin in enumerate((r.q, r.k, r.v)):
            pairs.append((f"qkv.weights.{j}", self.qkv.weights[j],
                          rows(lin.weight, lin.out_features)))
        for j, lin in enumerate((r.gate, r.up)):
            pairs.append((f"gate_up.weights.{j}", self.gate_up.weights[j],
                          rows(lin.weight, lin.out_features)))
            pairs.append((f"gate_up.biases.{j}", self.gate_up.biases[j],
                          rows(lin.bias, lin.out_features)))
        return pairs


def _attention(q, k, v, heads):
    batch, seq, width = q.shape
    split = [t.view(batch, seq, heads, width // heads).transpose(1, 2) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*split, is_causal=True)
    return out.transpose(1, 2).reshape(batch, seq, width)


def train(model, x, target, *, count, steps=5, lr=1e-2, compiled=False, autocast_dtype=None):
    """``steps`` AdamW steps on ``sum((model(x) - target)^2) / count``; returns the loss of
    every step. For an :class:`SPTPBlock`, ``x``/``target`` are this rank's shards, ``count``
    the global number of elements, and the reported loss is summed over its group."""
    import contextlib

    import torch.distributed as dist

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    forward = torch.compile(model, fullgraph=True) if compiled else model
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        region = torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype \
            else contextlib.nullcontext()
        with region:
            out = forward(x)
        loss = ((out.float() - target) ** 2).sum() / count
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        if isinstance(model, SPTPBlock):
            dist.all_reduce(total, group=model.group)
        losses.append(float(total))
    return losses
