"""Train an expert-parallel mixture-of-experts block with ficco, on CPU or GPUs:

    torchrun --nproc-per-node 4 examples/moe_block.py [--compile]

E experts are spread over the W ranks (L = E / W each). Every rank routes its own tokens to
their top-2 experts: ``ficco.moe.MoELayer`` sends them over (the all-to-all hidden behind the
experts' first grouped GEMM), runs the experts, and brings the results back (the second GEMM
hiding the return trip); backward runs the same two ops the other way round. The router's
weight is replicated, so its gradient is summed over the ranks. The script trains a few SGD
steps and checks every step's loss and every weight against the same block trained unsharded
(all experts, all tokens) on each rank. ``--compile`` trains the sharded layer under
``torch.compile(fullgraph=True)``: forward and backward of the whole layer, routing included,
in one graph each (docs/expert_parallel.md, "torch.compile").
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import ficco
from ficco.group import rank_world, resolve
from ficco.moe import MoELayer, top_k


class MoEBlock(nn.Module):
    """The unsharded twin: a router and all E experts in one process, a loop over experts."""

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, k: int = 2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, ffn_hidden) / hidden ** 0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, ffn_hidden, hidden) / ffn_hidden ** 0.5)

    def forward(self, x):
        gates, chosen = top_k(self.router(x), self.k)
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                y = torch.nn.functional.gelu(x[token] @ self.w1[e]) @ self.w2[e]
                out = out.index_add(0, token, y * gates[token, slot].unsqueeze(-1))
        return out


def sharded_from(reference: MoEBlock, group=None) -> MoELayer:
    """This rank's expert-parallel layer holding the same weights as ``reference``."""
    rank, world = rank_world(resolve(group))
    num_experts, hidden, ffn_hidden = reference.w1.shape
    layer = MoELayer(hidden, ffn_hidden, num_experts, reference.k, group=group)
    mine = slice(rank * num_experts // world, (rank + 1) * num_experts // world)
    with torch.no_grad():
        layer.router.weight.copy_(reference.router.weight)
        layer.experts.w1.copy_(reference.w1[mine])
        layer.experts.w2.copy_(reference.w2[mine])
    return layer


def train(model, x, target, count: int, steps: int, lr: float, group=None,
          compiled: bool = False) -> list[float]:
    """SGD on the squared error summed over every rank's tokens / ``count``; returns the global
    loss of every step. ``group``: the model is sharded over it (sum the replicated router's
    gradient and the losses); None: unsharded. ``compiled``: forward (and so backward) through
    ``torch.compile(model, fullgraph=True)``."""
    forward = torch.compile(model, fullgraph=True) if compiled else model
    losses = []
    for _ in range(steps):
        loss = ((forward(x) - target) ** 2).sum() / count
        model.zero_grad()
        loss.backward()
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(model.router.weight.grad, group=group)   # replicated weight
            dist.all_reduce(total, group=group)
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        losses.append(float(total))
    return losses


def parity(rank: int, world: int, seed: int, tokens: int = 6, hidden: int = 16,
           ffn_hidden: int = 32, experts_per_rank: int = 2, steps: int = 3, lr: float = 0.05,
           compiled: bool = False):
    """(worst relative loss difference, worst weight difference, the sharded losses) of the
    sharded block (``compiled``: under torch.compile) against its unsharded twin after
    ``steps`` SGD steps (every rank trains the twin on all tokens)."""
    torch.manual_seed(seed)                      # same weights and data on every rank
    num_experts = experts_per_rank * world
    reference = MoEBlock(hidden, ffn_hidden, num_experts)
    layer = sharded_from(reference)
    x = torch.randn(world * tokens, hidden)
    target = torch.randn(world * tokens, hidden)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    group = dist.group.WORLD if world > 1 else None
    sharded = train(layer, x[mine], target[mine], target.numel(), steps, lr, group, compiled)
    plain = train(reference, x, target, target.numel(), steps, lr)
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(sharded, plain))
    experts = slice(rank * experts_per_rank, (rank + 1) * experts_per_rank)
    pairs = [(layer.router.weight, reference.router.weight),
             (layer.experts.w1, reference.w1[experts]), (layer.experts.w2, reference.w2[experts])]
    weight_diff = max(float((a - b).detach().abs().max() / b.detach().abs().max())
                      for a, b in pairs)
    return loss_diff, weight_diff, sharded


def main():
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.set_default_device("cuda")
    compiled = "--compile" in sys.argv[1:]
    loss_diff, weight_diff, losses = parity(rank, world, seed=0, compiled=compiled)
    if rank == 0:
        print(f"W={world}{' compiled' if compiled else ''} losses {[f'{v:.5f}' for v in losses]}; "
              f"worst relative difference from the unsharded block: loss {loss_diff:.1e}, "
              f"weights {weight_diff:.1e}")
    assert loss_diff < 1e-4 and weight_diff < 1e-4, (loss_diff, weight_diff)
    ficco.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
