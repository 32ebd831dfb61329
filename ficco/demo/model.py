"""The model half of ``python -m ficco demo``: a small mixture-of-experts transformer on the
demo's ranks, each of ficco's four patterns where such a model puts it, each part checked
against the same model unsharded in float64.

- prefill, sequence + tensor parallel: a llama-style block on this rank's sequence shard.
  The Q/K/V and gate/up projections gather the sequence behind their GEMM
  (``all_gather_matmul``), the out and down projections scatter it back
  (``matmul_reduce_scatter``); heads and MLP features are split over the ranks.
- MoE, expert parallel: the block's output tokens, routed top-2 to E = 2W experts spread over
  the ranks; the all-to-all out hides behind the experts' first grouped GEMM
  (``all_to_all_grouped_mm``), the way back behind the second (``grouped_mm_all_to_all``).
- decode, tensor parallel: one new token per sequence through the same block, attending to
  the prefill's KV cache of this rank's heads; the out and down projections end in an
  all-reduce (``matmul_all_reduce``).

Each part runs once with the default choice (the ``auto`` selector times its shortlist at a
GEMM's first call: the pick is measured here), is checked, then runs ``repeats`` times with
the default and with every call forced ``serial``, every ficco call timed on its own.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import config
from ..moe import route, top_k, unroute
from ..plan.problem import even_split

TOL = 1e-4


@dataclass(frozen=True)
class Model:
    """The demo model's sizes; :meth:`for_world` gives each of ``world`` ranks two heads, two
    experts and 16 tokens of each sequence (all_gather_matmul takes equal shards)."""

    world: int
    batch: int
    seq: int
    dim: int
    heads: int
    ffn: int
    experts: int
    top: int = 2

    @classmethod
    def for_world(cls, world: int) -> Model:
        heads = 2 * world
        return cls(world, batch=2, seq=16 * world, dim=16 * heads, heads=heads,
                   ffn=48 * heads, experts=2 * world)

    def describe(self) -> str:
        return (f"dim {self.dim}, {self.heads} heads, ffn {self.ffn}, {self.experts} experts "
                f"top-{self.top}, {self.batch} sequences of {self.seq} tokens")

    def weights(self, seed: int = 0) -> dict[str, torch.Tensor]:
        """Every weight as ``x @ w`` takes it (K, n), the same on every rank (one seed)."""
        gen = torch.Generator().manual_seed(seed)
        d, f, e = self.dim, self.ffn, self.experts
        shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "gate": (d, f),
                  "up": (d, f), "down": (f, d), "router": (d, e), "w1": (e, d, d),
                  "w2": (e, d, d)}
        return {name: torch.randn(*shape, generator=gen) / shape[-2] ** 0.5
                for name, shape in shapes.items()}

    def shard(self, weights: dict, rank: int) -> dict[str, torch.Tensor]:
        """This rank's part: its heads' and features' columns of the column-parallel weights,
        the matching rows of the row-parallel ones, its experts, the whole router."""
        heads, features = piece(self.dim, rank, self.world), piece(self.ffn, rank, self.world)
        experts = piece(self.experts, rank, self.world)
        out = {name: weights[name][:, heads] for name in ("q", "k", "v")}
        out.update(gate=weights["gate"][:, features], up=weights["up"][:, features],
                   o=weights["o"][heads], down=weights["down"][features],
                   router=weights["router"], w1=weights["w1"][experts],
                   w2=weights["w2"][experts])
        return out


def piece(total: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s block of ``range(total)``, as ficco's ops split (even_split)."""
    start, length = even_split(total, world)[rank]
    return slice(start, start + length)


def block(x, w, heads, column, row, cache=None):
    """``(out, (keys, values))`` of a llama-style block (unweighted RMS norms, causal attention,
    SwiGLU MLP). ``column(label, h, weights)`` returns ``[h @ w for w in weights]`` and
    ``row(label, h, w)`` ``h @ w``, each as the caller computes it: plain matmuls unsharded,
    ficco's ops on a rank. With ``cache``, ``x`` holds one new token per sequence that attends
    to the cached keys and values and to itself."""
    q, k, v = column("qkv", F.rms_norm(x, x.shape[-1:]), [w["q"], w["k"], w["v"]])
    if cache is not None:
        k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)
    x = x + row("o", _attention(q, k, v, heads, causal=cache is None), w["o"])
    gate, up = column("gate/up", F.rms_norm(x, x.shape[-1:]), [w["gate"], w["up"]])
    return x + row("down", F.silu(gate) * up, w["down"]), (k, v)


def _attention(q, k, v, heads, *, causal):
    batch, length, width = q.shape

    def split(t):
        return t.view(batch, t.shape[1], heads, width // heads).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=causal)
    return out.transpose(1, 2).reshape(batch, length, width)


def moe_reference(tokens, w, top):
    """The MoE layer computed densely: every expert on every token, mixed by the router's
    top-``top`` gates (zero for the experts not chosen)."""
    probs = (tokens @ w["router"]).softmax(-1)
    gates, chosen = probs.topk(top, -1)
    mix = torch.zeros_like(probs).scatter(1, chosen, gates / gates.sum(-1, keepdim=True))
    every = torch.stack([F.gelu(tokens @ w1) @ w2 for w1, w2 in zip(w["w1"], w["w2"])], 1)
    return (mix.unsqueeze(-1) * every).sum(1)


class Calls:
    """Runs a part's ficco calls with ``schedule`` (None: the default choice) and logs each
    call's ``(label, op, pick, seconds)``; a barrier first, so a call's time is its own."""

    def __init__(self, schedule: str | None = None):
        self.schedule = schedule
        self.log: list[tuple[str, str, str, float]] = []

    def __call__(self, label: str, op: str, *args, **kwargs):
        import ficco

        dist.barrier()
        start = time.perf_counter()
        out = getattr(ficco, op)(*args, schedule=self.schedule, **kwargs)
        seconds = time.perf_counter() - start
        ran = ficco.api.last_run()
        pick = "plain (FICCO_DISABLE)" if config.get("disable") else \
            "plain matmul (1 rank)" if ran is None else f"{ran[0]} over {ran[1]}"
        self.log.append((label, op, pick, seconds))
        return out


def _parts(model: Model, rank: int):
    """``[(name, what it shows, run(calls) -> (out, extra), float64 reference of out)]``."""
    world, mine = model.world, piece(model.seq, rank, model.world)
    weights = model.weights()
    local, ref = model.shard(weights, rank), {n: t.double() for n, t in weights.items()}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(model.batch, model.seq, model.dim, generator=gen)
    x_new = torch.randn(model.batch, 1, model.dim, generator=gen)

    def matmuls(label, h, ws):
        return [h @ w for w in ws]

    def plain_row(label, h, w):
        return h @ w

    want, want_cache = block(x.double(), ref, model.heads, matmuls, plain_row)
    state = {}

    def prefill(calls):
        out, state["cache"] = block(
            x[:, mine], local, model.heads // world,
            lambda label, h, ws: calls(label, "all_gather_matmul", h, ws, gather_dim=1),
            lambda label, h, w: calls(label, "matmul_reduce_scatter", h, w, scatter_dim=1))
        state["tokens"] = out.reshape(-1, model.dim)
        return out

    def moe(calls):
        tokens = state["tokens"]
        gates, chosen = top_k(tokens @ local["router"], model.top)
        rows, counts, order = route(tokens, chosen, model.experts)
        h, recv_counts = calls("dispatch", "all_to_all_grouped_mm", rows, counts, local["w1"])
        out = calls("combine", "grouped_mm_all_to_all", F.gelu(h), recv_counts, local["w2"],
                    send_counts=counts)
        return unroute(out, order, gates)

    def decode(calls):
        return block(x_new, local, model.heads // world, matmuls,
                     lambda label, h, w: calls(label, "matmul_all_reduce", h, w),
                     cache=state["cache"])[0]

    return [
        ("prefill", "SP + TP block, the sequence gathered in and scattered out", prefill,
         lambda: want[:, mine]),
        ("MoE", "EP layer on the prefill's tokens, all-to-all out and back", moe,
         lambda: moe_reference(state["tokens"].double(), ref, model.top)),
        ("decode", "TP step, one token per sequence on the KV cache, all-reduced", decode,
         lambda: block(x_new.double(), ref, model.heads, matmuls, plain_row,
                       cache=want_cache)[0]),
    ]


def _medians(part, repeats: int, calls: int) -> list[list[float]]:
    """The median seconds of each of ``part``'s ``calls`` ficco calls over ``repeats`` runs,
    ``[default, serial]``: the two alternate, so a change in the machine's load hits both, and
    which runs first alternates too (on the 2-core VM the second of a pair ran up to 25%
    slower, the same schedule included)."""
    runs: dict[str | None, list] = {None: [], "serial": []}
    for repeat in range(repeats):
        order = list(runs.items())
        for schedule, times in order if repeat % 2 == 0 else order[::-1]:
            timed = Calls(schedule)
            part(timed)
            times.append([seconds for *_, seconds in timed.log])
    return [[statistics.median(call) for call in zip(*times)] if repeats else [math.nan] * calls
            for times in runs.values()]


def run(rank: int, world: int, repeats: int = 5) -> list[tuple]:
    """Every part on this rank; every rank returns the same rows, worst over ranks:
    ``(name, what, rel err, [(label, op, default pick, default s, serial s)])``. The error is
    ``max |out - ref| / max |ref|``, the times medians of ``repeats`` runs."""
    rows = []
    for name, what, part, reference in _parts(Model.for_world(world), rank):
        calls = Calls()
        out = part(calls)                      # the default choice's first sight: it measures
        want = reference()
        err = ((out.double() - want).abs().max() / want.abs().max()).item()
        medians = _medians(part, repeats, len(calls.log))
        worst = torch.tensor([math.inf if math.isnan(err) else err, *medians[0], *medians[1]],
                             dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        n = len(calls.log)
        rows.append((name, what, worst[0].item(), [
            (label, op, pick, worst[1 + i].item(), worst[1 + n + i].item())
            for i, (label, op, pick, _) in enumerate(calls.log)]))
    return rows
