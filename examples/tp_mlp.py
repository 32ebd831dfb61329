"""Train a sequence-parallel + tensor-parallel transformer block with ficco, on CPU or GPUs:

    torchrun --nproc-per-node 4 examples/tp_mlp.py

Activations stay sharded along the sequence between blocks. In front of the column-parallel
Q/K/V and gate/up projections ficco all-gathers the sequence, hidden behind their GEMMs; after
the row-parallel out and down projections it reduce-scatters back to sequence shards, hidden
too (examples/sp_block.py). The backward of each op is the other op, so training needs no
hand-written collectives. The script trains a few AdamW steps eagerly and under
``torch.compile(fullgraph=True)``, and checks every step's loss against the same block trained
unsharded on each rank.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sp_block import Block, SPTPBlock, train

import ficco


def main(batch=2, seq=32, dim=64, heads=8, ffn=128, steps=3):
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)                               # same full weights and data everywhere
    x = torch.randn(batch, seq * world, dim, device=device)
    target = torch.randn(batch, seq * world, dim, device=device)
    mine = slice(rank * seq, (rank + 1) * seq)         # this rank's sequence shard

    for compiled in (False, True):
        reference = Block(dim, heads, ffn).to(device)
        block = SPTPBlock(reference)                   # this rank's shards of the same weights
        sharded = train(block, x[:, mine], target[:, mine], count=target.numel(), steps=steps,
                        compiled=compiled)
        plain = train(reference, x, target, count=target.numel(), steps=steps)
        worst = max(abs(a - b) / abs(b) for a, b in zip(sharded, plain))
        if rank == 0:
            mode = "compiled" if compiled else "eager"
            print(f"{mode:8s} W={world} losses {[f'{v:.5f}' for v in sharded]}, "
                  f"worst relative difference from the unsharded block {worst:.1e}")
        assert worst < 1e-4, worst
    ficco.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
