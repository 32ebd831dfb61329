"""``ficco.nn.UlyssesAttention``: multi-head self-attention under Ulysses sequence parallelism.

Each rank holds a sequence shard of ``x`` (``(batch, S_r, hidden)``, the chunk rule's lengths:
``even_split(S, W)``, longer first) and the whole, replicated weights. The QKV projection's
output goes from sequence shards to head shards in one :func:`ficco.matmul_all_to_all` (its
columns, head-major, scattered: rank r gets heads ``even_split``'s chunk r of all ``S``); each
rank runs attention over the whole sequence for its heads; :func:`ficco.all_to_all_matmul`
sends them back (sequence scattered, heads gathered as the output projection's K, ``C +=
o_j @ w_out[K_j]``). Each rank's weight gradients are its own contribution: sum them over the
group as for any replicated weight (DDP does).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ... import group as groups
from ...errors import InvalidArgumentError
from .layout import ALL_TO_ALL_MATMUL, MATMUL_ALL_TO_ALL
from .torch_op import front


class UlyssesAttention(nn.Module):
    """Self-attention whose sequence is sharded over ``group`` (None: the default group):
    ``forward(x)`` with ``x`` this rank's ``(batch, S_r, hidden)`` returns this rank's rows of
    the unsharded attention's output. ``heads`` must divide by the group's size (each rank
    runs whole heads). Weights: ``w_qkv`` ``(hidden, heads * 3 * head_dim)``, columns
    head-major (q, k, v of head 0, then head 1, …); ``w_out`` ``(heads * head_dim, hidden)``.
    docs/ulysses.md."""

    def __init__(self, hidden: int, heads: int, head_dim: int | None = None, group=None, *,
                 causal: bool = False, dtype=None, device=None):
        super().__init__()
        head_dim = head_dim or hidden // heads
        if heads <= 0 or head_dim <= 0:
            raise InvalidArgumentError(f"UlyssesAttention needs heads > 0 and head_dim > 0; got "
                                       f"heads={heads}, head_dim={head_dim}")
        self.group = group
        self.heads, self.head_dim, self.causal = heads, head_dim, causal
        kw = {"dtype": dtype, "device": device}
        self.w_qkv = nn.Parameter(torch.randn(hidden, heads * 3 * head_dim, **kw)
                                  / math.sqrt(hidden))
        self.w_out = nn.Parameter(torch.randn(heads * head_dim, hidden, **kw)
                                  / math.sqrt(heads * head_dim))

    def forward(self, x: Tensor) -> Tensor:
        world = groups.rank_world(groups.resolve(self.group))[1]
        if self.heads % world:
            raise InvalidArgumentError(
                f"UlyssesAttention runs whole heads per rank: heads={self.heads} must divide "
                f"by the group's {world} ranks")
        if x.dim() != 3:
            raise InvalidArgumentError(f"x must be (batch, S_r, hidden); got {tuple(x.shape)}")
        local = self.heads // world
        qkv = front(MATMUL_ALL_TO_ALL, x, self.w_qkv, self.group, -1, 1)   # (B, S, h*3D)
        batch, seq = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.view(batch, seq, local, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        o = o.transpose(1, 2).reshape(batch, seq, local * self.head_dim)          # (B, S, h*D)
        return front(ALL_TO_ALL_MATMUL, o, self.w_out, self.group, 1, -1)     # (B, S_r, hidden)


def reference_attention(x: Tensor, w_qkv: Tensor, w_out: Tensor, heads: int,
                        causal: bool = False) -> Tensor:
    """The unsharded attention :class:`UlyssesAttention` computes (the same weights)."""
    batch, seq, _ = x.shape
    head_dim = w_qkv.shape[1] // (3 * heads)
    q, k, v = (x @ w_qkv).view(batch, seq, heads, 3, head_dim).permute(3, 0, 2, 1, 4).unbind(0)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return o.transpose(1, 2).reshape(batch, seq, heads * head_dim) @ w_out
