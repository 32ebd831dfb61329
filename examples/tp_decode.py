"""One tensor-parallel decode step of a transformer block with ficco, on CPU or GPUs:

    torchrun --nproc-per-node 4 examples/tp_decode.py

Decoding feeds one new token per sequence, so a row-parallel GEMM has as many rows as the
batch (1 to a few hundred): small messages, where the latency of the all-reduce dominates.
Without sequence parallelism every rank holds the whole (batch, hidden) activation: the Q/K/V
and gate/up projections are local GEMMs of this rank's heads and features, and the attention
out and MLP down projections end in an all-reduce of their partial sums,
``ficco.nn.RowParallelLinear(..., sequence_parallel=False)`` (``ficco.matmul_all_reduce``),
which picks its schedule per GEMM (one-shot or two-shot over symmetric memory, the process
group's all-reduce, chunked, a reduce-scatter and all-gather).

From a vLLM-style model the switch is one line per projection: where vLLM builds
``RowParallelLinear(input_size, output_size, bias=False, input_is_parallel=True,
reduce_results=True)`` (a local GEMM, then its custom all-reduce or NCCL), build
``ficco.nn.RowParallelLinear.from_linear(linear, sequence_parallel=False)`` from the unsharded
``nn.Linear`` (as ``TPDecodeBlock`` below) or ``ficco.nn.RowParallelLinear(in, out,
sequence_parallel=False)``; the output is the same all-reduced activation on every rank. To run
the one-kernel all-reduce vLLM's custom all-reduce corresponds to, force it:
``FICCO_SCHEDULE=one-shot-kernel`` (or ``two-shot-kernel``; Triton needed, the interpreter on
CPU; selectors do not offer it until a GPU verified it).

For each batch size the script runs one decode step against a KV cache of ``cache`` tokens,
checks it against the same block unsharded on each rank, and prints what ficco picked for the
down projection and why (``ficco.explain``), with the kernel that pick runs and the published
time it is priced against on that hardware. On CPU the times mean nothing; the picks follow the
CPU profile.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ficco
import ficco.nn as fnn
from ficco.plan.problem import even_split


class DecodeBlock(nn.Module):
    """A llama-style block (RMS norms, attention over a KV cache, SwiGLU MLP) for one token per
    sequence; ``TPDecodeBlock`` is this rank's part of it."""

    def __init__(self, dim=64, heads=8, ffn=128):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x, k_cache, v_cache):   # x: (batch, dim); caches: (batch, heads, T, hd)
        h = self.norm1(x)
        q, k, v = self.qkv(h).chunk(3, -1)
        x = x + self.o(_attend(q, k, v, k_cache, v_cache))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class TPDecodeBlock(nn.Module):
    """This rank's heads and MLP features of ``ref``: local column GEMMs, all-reduced row ones."""

    def __init__(self, ref: DecodeBlock, rank: int, world: int):
        super().__init__()
        if ref.heads % world:
            raise ValueError(f"{ref.heads} heads do not split over {world} ranks")
        dim, ffn = ref.o.in_features, ref.down.in_features
        self.heads = ref.heads // world
        hd = dim // ref.heads
        self.mine = slice(rank * self.heads * hd, (rank + 1) * self.heads * hd)
        f0, fn = even_split(ffn, world)[rank]
        self.norm1, self.norm2 = ref.norm1, ref.norm2           # replicated
        q, k, v = ref.qkv.weight.chunk(3, 0)
        self.qkv = nn.Parameter(torch.cat([w[self.mine] for w in (q, k, v)]).detach())
        gate, up = ref.gate_up.weight.chunk(2, 0)
        self.gate_up = nn.Parameter(torch.cat([gate[f0:f0 + fn], up[f0:f0 + fn]]).detach())
        # the row-parallel projections: this rank's input features (its heads' outputs, its
        # MLP features: even_split's slices), summed over the ranks
        self.o = fnn.RowParallelLinear.from_linear(ref.o, sequence_parallel=False)
        self.down = fnn.RowParallelLinear.from_linear(ref.down, sequence_parallel=False)

    def forward(self, x, k_cache, v_cache):        # caches: this rank's heads only
        h = self.norm1(x)
        q, k, v = (h @ self.qkv.t()).chunk(3, -1)
        x = x + self.o(_attend(q, k, v, k_cache, v_cache))
        gate, up = (self.norm2(x) @ self.gate_up.t()).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


def _attend(q, k, v, k_cache, v_cache):
    """One query per sequence over its cache plus the new token; heads from the caches."""
    b, heads, _, hd = k_cache.shape
    q, k, v = (t.reshape(b, heads, 1, hd) for t in (q, k, v))
    keys, values = torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)
    out = F.scaled_dot_product_attention(q, keys, values)
    return out.reshape(b, heads * hd)


def decode_step(ref: DecodeBlock, tp: TPDecodeBlock, batch: int, cache: int, rank: int,
                world: int, device="cpu"):
    """One decode step of ``batch`` sequences on fresh inputs (the same on every rank): the
    largest error of ``tp`` against ``ref`` relative to the output, and ficco's decision for
    the down projection."""
    dim, heads = ref.o.in_features, ref.heads
    hd, local = dim // heads, heads // world
    x = torch.randn(batch, dim, device=device)
    k_cache, v_cache = (torch.randn(batch, heads, cache, hd, device=device) for _ in "kv")
    with torch.no_grad():
        want = ref(x, k_cache, v_cache)
        mine = slice(rank * local, (rank + 1) * local)
        got = tp(x, k_cache[:, mine], v_cache[:, mine])
    error = float((got - want).abs().max() / want.abs().max())
    h = torch.randn(batch, tp.down.weight.shape[1], device=device)
    return error, ficco.explain(h, tp.down.weight.t(), op="matmul_all_reduce")


def main(batches=(1, 8, 64), dim=64, heads=8, ffn=128, cache=16):
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)                                  # same weights and caches everywhere
    ref = DecodeBlock(dim, heads, ffn).to(device)
    tp = TPDecodeBlock(ref, rank, world).to(device)
    for batch in batches:
        error, decision = decode_step(ref, tp, batch, cache, rank, world, device)
        if rank == 0:
            print(f"batch {batch:4d}: max error {error:.1e} vs the unsharded block; down "
                  f"projection ({batch} x {ffn} x {dim}) over {world} ranks: "
                  f"{decision.schedule} over {decision.transport} ({decision.reason})")
            for line in decision.priced:
                print(f"    {line}")
        assert error < 1e-4, error
    ficco.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
