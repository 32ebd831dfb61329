"""A sequence-parallel + tensor-parallel MLP block with ficco, runnable on CPU:

    torchrun --nproc-per-node 4 examples/tp_mlp.py

Activations arrive sharded along the sequence (SP); the all-gather in front of the column-
parallel up/gate projection is hidden behind its GEMM by ficco; the row-parallel down
projection ends in a reduce-scatter back to sequence shards. The block is checked against the
same MLP computed unsharded on every rank.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ficco


def main(seq=64, hidden=128, ffn=256, batch=2):
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)  # same full weights and input on every rank
    x = torch.randn(batch, seq * world, hidden, generator=gen)
    w_up = torch.randn(hidden, ffn * world, generator=gen) / hidden ** 0.5
    w_gate = torch.randn(hidden, ffn * world, generator=gen) / hidden ** 0.5
    w_down = torch.randn(ffn * world, hidden, generator=gen) / (ffn * world) ** 0.5

    # This rank's shards: sequence slice of x, columns of up/gate, rows of down.
    x_shard = x[:, rank * seq:(rank + 1) * seq].contiguous().to(device)
    cols = slice(rank * ffn, (rank + 1) * ffn)
    up, gate = w_up[:, cols].to(device), w_gate[:, cols].to(device)
    down = w_down[cols].to(device)

    # all_gather(x_shard, seq dim) @ [up, gate], the gather hidden behind the GEMMs.
    h_up, h_gate = ficco.all_gather_matmul(x_shard, [up, gate], gather_dim=1)
    partial = (F.silu(h_gate) * h_up) @ down                  # (batch, seq*W, hidden), partial sum
    # Reduce-scatter along the sequence dim: move it first so each shard is contiguous.
    scattered = torch.empty(seq, batch, hidden, device=device)
    dist.reduce_scatter_tensor(scattered, partial.transpose(0, 1).contiguous())
    out_shard = scattered.transpose(0, 1)

    ref = ((F.silu(x @ w_gate) * (x @ w_up)) @ w_down)[:, rank * seq:(rank + 1) * seq]
    err = ((out_shard.cpu().double() - ref.double()).norm() / ref.double().norm()).item()
    decision = ficco.explain(x_shard, [up, gate], gather_dim=1)
    if rank == 0:
        print(decision)
    print(f"rank {rank}: output shard {tuple(out_shard.shape)}, relative error {err:.2e}")
    assert err < 1e-4, err
    ficco.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
