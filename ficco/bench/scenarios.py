"""Scenario sets for the benchmarks: the paper's Table I, Llama projection presets, ad-hoc shapes.

A scenario is one GEMM ``(M, N, K)``: ``M`` rows of A after the all-gather (each rank holds
``M / W``), ``K`` the inner dimension, ``N`` the columns of B. For Table I and ``--shape`` it is
the layer's GEMM and each rank holds ``N / W`` weight columns (``split_n``), the reading of
:mod:`ficco.heuristics.scenarios` and of ``bench simulate``, so ``sweep`` measures what
``simulate`` predicts. The llama presets are already per rank (N or K divided by ``--tp``).

    >>> [s.name for s in paper(scale=64)][:3]
    ['g1', 'g2', 'g3']
    >>> qkv = llama("8B", seq_len=8192, tp=8)[0]
    >>> qkv.name, qkv.big_m, qkv.n, qkv.k
    ('llama-8B-qkv', 8192, 768, 4096)
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..heuristics.scenarios import PAPER_TABLE_I
from ..plan.problem import Problem

# Public model configurations: hidden size, attention heads, KV heads, head dim, MLP width.
LLAMA_MODELS = {
    "8B": {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "mlp": 14336},
    "70B": {"hidden": 8192, "heads": 64, "kv_heads": 8, "head_dim": 128, "mlp": 28672},
    "405B": {"hidden": 16384, "heads": 128, "kv_heads": 8, "head_dim": 128, "mlp": 53248},
}

SETS = ("paper", "llama")


@dataclass(frozen=True)
class Scenario:
    """One gathered GEMM ``(M=big_m, N=n, K=k)``; ``source`` says which set it came from."""

    name: str
    big_m: int
    n: int
    k: int
    source: str = "shape"
    note: str = ""
    split_n: bool = False

    def __post_init__(self):
        if min(self.big_m, self.n, self.k) <= 0:
            raise InvalidArgumentError(
                f"scenario {self.name!r} needs positive M, N, K; got "
                f"({self.big_m}, {self.n}, {self.k}); lower --scale or fix --shape")

    def shard_rows(self, world: int) -> int:
        """Rows per rank. M that W does not divide is rounded down (at least one row), so the
        measured M is ``shard_rows(W) * W``; results record that effective M."""
        return max(1, self.big_m // world)

    def local_n(self, world: int) -> int:
        """Columns of B on each rank: N, or N / W for a Table I layer GEMM."""
        return max(1, self.n // world) if self.split_n else self.n

    def problem(self, world: int, rank: int = 0, dtype: str = "bfloat16") -> Problem:
        return Problem(self.shard_rows(world), self.k, (self.local_n(world),), dtype, world, rank)


def _scaled(value: int, scale: int) -> int:
    return max(1, value // scale)


def paper(scale: int = 1, scale_nk: int = 1) -> list[Scenario]:
    """Table I of the paper, g1-g16. ``scale`` divides M (as the paper's sizes need a full
    8-GPU node); ``scale_nk`` also divides N and K, for CPUs where B alone would not fit."""
    return [Scenario(name, _scaled(m, scale), _scaled(n, scale_nk), _scaled(k, scale_nk),
                     "paper", "Table I", split_n=True)
            for name, (m, n, k) in PAPER_TABLE_I.items()]


def llama(model: str, seq_len: int, tp: int, scale: int = 1, scale_nk: int = 1) -> list[Scenario]:
    """The four projections of one transformer layer of ``model`` (8B, 70B or 405B) with
    ``seq_len`` tokens gathered over a ``tp``-way tensor-parallel group.

    QKV and up/gate are column-parallel (N divided by ``tp``; up and gate fused in one B);
    O and down are row-parallel (K divided by ``tp``), measured with the same gather in front,
    as in sequence-parallel layouts that gather before every projection. KV heads are
    replicated when there are fewer than ``tp``.
    """
    if model not in LLAMA_MODELS:
        raise InvalidArgumentError(
            f"unknown llama preset {model!r}; use one of {', '.join(LLAMA_MODELS)}")
    if seq_len <= 0 or tp <= 0:
        raise InvalidArgumentError(f"--seq-len and --tp must be positive; got {seq_len}, {tp}")
    c = LLAMA_MODELS[model]
    heads = max(1, c["heads"] // tp)
    kv_heads = max(1, c["kv_heads"] // tp)
    shapes = {
        "qkv": (c["hidden"], (heads + 2 * kv_heads) * c["head_dim"]),
        "o": (heads * c["head_dim"], c["hidden"]),
        "upgate": (c["hidden"], 2 * max(1, c["mlp"] // tp)),
        "down": (max(1, c["mlp"] // tp), c["hidden"]),
    }
    m = _scaled(seq_len, scale)
    return [Scenario(f"llama-{model}-{proj}", m, _scaled(n, scale_nk), _scaled(k, scale_nk),
                     "llama", f"seq {seq_len} tp {tp}")
            for proj, (k, n) in shapes.items()]


def parse_shape(text: str) -> Scenario:
    """``"M,N,K"`` (``x`` also accepted as separator) -> a layer GEMM named ``MxNxK`` whose N
    is split over the ranks, as ``bench simulate --shape`` reads it.

    >>> parse_shape("1024,512,256").big_m
    1024
    """
    parts = text.replace("x", ",").split(",")
    try:
        m, n, k = (int(p) for p in parts)
    except ValueError:
        raise InvalidArgumentError(
            f"--shape {text!r} is not three integers; write it as M,N,K, e.g. 4096,1024,2048"
        ) from None
    return Scenario(f"{m}x{n}x{k}", m, n, k, "shape", split_n=True)


def add_arguments(parser) -> None:
    """The scenario options shared by sweep and timeline."""
    parser.add_argument("--scenarios", default=None,
                        help="comma list of sets: paper (Table I g1-g16), llama (presets)")
    parser.add_argument("--only", default=None,
                        help="comma list of scenario names to keep, e.g. g2,g6")
    parser.add_argument("--shape", action="append", default=[], metavar="M,N,K",
                        help="an extra layer GEMM: M rows gathered, N weight columns split "
                             "over the ranks, K (repeatable)")
    parser.add_argument("--scale", type=int, default=1, help="divide every M by this")
    parser.add_argument("--scale-nk", type=int, default=1,
                        help="divide every N and K by this too (CPU runs)")
    parser.add_argument("--llama-models", default="8B,70B,405B",
                        help="which llama presets (8B, 70B, 405B)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens for llama presets")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel size for llama presets (default: world size)")


def from_args(args, world: int) -> list[Scenario]:
    """Every scenario the command line asks for, in order, without duplicates."""
    if args.scale <= 0 or args.scale_nk <= 0:
        raise InvalidArgumentError(
            f"--scale and --scale-nk must be positive; got {args.scale}, {args.scale_nk}")
    sets = [s for s in (args.scenarios or "").split(",") if s]
    for name in sets:
        if name not in SETS:
            raise InvalidArgumentError(f"unknown scenario set {name!r}; use one of {SETS}")
    if not sets and not args.shape:
        sets = ["paper"]
    out: list[Scenario] = []
    if "paper" in sets:
        out += paper(args.scale, args.scale_nk)
    if "llama" in sets:
        for model in filter(None, args.llama_models.split(",")):
            out += llama(model, args.seq_len, args.tp or world, args.scale, args.scale_nk)
    out += [parse_shape(s) for s in args.shape]
    if args.only:
        keep = set(args.only.split(","))
        out = [s for s in out if s.name in keep]
    seen, unique = set(), []
    for s in out:
        if s.name not in seen:
            seen.add(s.name)
            unique.append(s)
    if not unique:
        raise InvalidArgumentError(
            "no scenario selected; pass --scenarios paper|llama or --shape M,N,K "
            f"(and check --only={args.only!r})")
    return unique
