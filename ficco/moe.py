"""Expert-parallel mixture-of-experts pieces built on ficco's dispatch and combine.

An expert-parallel (EP) MoE layer spreads E = W*L experts over the W ranks of a group (global
expert e on rank e // L). Each rank routes its own tokens; the tokens travel to their experts
and back. With these pieces the layer is four lines::

    gates, experts = top_k(router(x), k)                     # (T, k) each
    rows, counts, order = route(x, experts, num_experts)     # sorted by global expert
    out = ffn(rows, counts)                                  # ExpertParallelFFN: EP round trip
    y = unroute(out, order, gates)                           # back to token order, gated sum

:class:`ExpertParallelFFN` is the expert half: ``dispatch`` (all-to-all overlapped with the
first grouped GEMM), the activation on the experts' rows, ``combine`` (second grouped GEMM
overlapped with the all-to-all back); its combine passes ``send_counts=`` so the return trip
exchanges no counts. :class:`MoELayer` puts the four lines together. The router's weight is
replicated (every rank holds all of it): sum its gradient over the group (:func:`replicated`
in :mod:`ficco.nn`, or data-parallel gradient reduction) as for any replicated parameter.

>>> torch.manual_seed(0) and None
>>> layer = MoELayer(8, 16, num_experts=4, k=2)          # one rank: all experts local
>>> layer(torch.randn(5, 8)).shape
torch.Size([5, 8])
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import api, schedules
from .errors import InvalidArgumentError
from .group import rank_world, resolve


def _positive(name: str, value) -> None:
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int; got {value!r}")


def route(tokens: Tensor, experts: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(rows, counts, order)``: ``tokens`` (T, K) repeated once per chosen expert and sorted
    by global expert (what dispatch takes), ``counts`` (E,) rows per expert, and ``order``, the
    position in ``experts.flatten()`` of each sorted row (for :func:`unroute`).
    ``experts`` is (T,) or (T, k) global expert indices.

    >>> rows, counts, order = route(torch.arange(3.).view(3, 1), torch.tensor([2, 0, 2]), 3)
    >>> rows.flatten().tolist(), counts.tolist(), order.tolist()
    ([1.0, 0.0, 2.0], [1, 0, 2], [1, 0, 2])
    """
    flat = experts.reshape(-1)
    k = flat.numel() // max(tokens.shape[0], 1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).to(torch.int64)
    return tokens[order // max(k, 1)], counts.cpu(), order


def unroute(rows: Tensor, order: Tensor, gates: Tensor | None = None) -> Tensor:
    """Undo :func:`route`: ``rows`` back to token order and, with ``gates`` (T, k), the gated
    sum over each token's k experts; without, one row per (token, choice)."""
    out = torch.empty_like(rows).index_copy_(0, order, rows)
    if gates is None:
        return out
    return (out.view(*gates.shape, -1) * gates.unsqueeze(-1).to(out.dtype)).sum(1)


def top_k(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(gates, experts) of the ``k`` best experts per token: softmax weights renormalised over
    the chosen ones (Mixtral's rule)."""
    weights, experts = torch.topk(logits.float().softmax(-1), k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), experts


class ExpertParallelFFN(nn.Module):
    """This rank's L experts, each ``act(rows @ w1[l]) @ w2[l]``, fed by tokens from every rank:
    ``forward(rows, counts)`` takes this rank's rows sorted by global expert and their counts
    (:func:`route`) and returns their outputs in the same order.

    ``num_experts`` is E over the whole group (a multiple of its size W); this rank holds experts
    ``rank * L … rank * L + L - 1``. ``schedule`` forces dispatch's and combine's schedule.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, *, group=None,
                 activation=torch.nn.functional.gelu, schedule: str | None = None,
                 device=None, dtype=None):
        super().__init__()
        _, world = rank_world(resolve(group))
        for name, value in (("hidden", hidden), ("ffn_hidden", ffn_hidden),
                            ("num_experts", num_experts)):
            _positive(name, value)
        if num_experts % world:
            raise InvalidArgumentError(
                f"num_experts={num_experts} must be a multiple of the group size {world} "
                f"(every rank holds the same number of experts)")
        for op in ("all_to_all_grouped_mm", "grouped_mm_all_to_all"):
            if schedule is not None:   # a bad name fails here, not in the first forward
                schedules.get(schedule, op)
        self.group, self.activation, self.schedule = group, activation, schedule
        self.num_experts, self.local_experts = num_experts, num_experts // world
        shape = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(self.local_experts, hidden, ffn_hidden, **shape))
        self.w2 = nn.Parameter(torch.empty(self.local_experts, ffn_hidden, hidden, **shape))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2):
            bound = 1 / math.sqrt(w.shape[1])
            nn.init.uniform_(w, -bound, bound)

    def forward(self, rows: Tensor, counts: Tensor) -> Tensor:
        h, recv_counts = api.all_to_all_grouped_mm(rows, counts, self.w1, self.group,
                                                   schedule=self.schedule)
        return api.grouped_mm_all_to_all(self.activation(h), recv_counts, self.w2, self.group,
                                         schedule=self.schedule, send_counts=counts)


class MoELayer(nn.Module):
    """A top-k MoE layer over an expert-parallel group: a replicated router, then
    :class:`ExpertParallelFFN`. ``forward(x)`` takes this rank's tokens (..., hidden)."""

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, k: int = 2, *,
                 group=None, activation=torch.nn.functional.gelu, schedule: str | None = None,
                 device=None, dtype=None):
        super().__init__()
        _positive("k", k)
        if k > num_experts:
            raise InvalidArgumentError(f"k={k} experts per token, but there are only "
                                       f"num_experts={num_experts}")
        self.k = k
        self.router = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype)
        self.experts = ExpertParallelFFN(hidden, ffn_hidden, num_experts, group=group,
                                         activation=activation, schedule=schedule,
                                         device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.router.in_features
        if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != hidden:
            raise InvalidArgumentError(
                f"x must be a tensor (..., hidden={hidden}); got "
                + (f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__))
        tokens = x.reshape(-1, x.shape[-1])
        gates, chosen = top_k(self.router(tokens), self.k)
        rows, counts, order = route(tokens, chosen, self.experts.num_experts)
        out = self.experts(rows, counts)
        return unroute(out, order, gates).view(x.shape)
