"""The code blocks of README.md and docs/*.md, and what runs them (tests/claims/test_docs.py).

A ```` ```python ```` block runs as written on 2 CPU ranks, in a namespace that holds the names
the docs use without defining them (``x_shard``, ``w_up``, ``group_name``, ``tp_mesh``, ...,
built by :func:`namespace` from one seed, so every rank holds shards of the same tensors). A
```` ```python fragment ```` block is not runnable as written (a signature with ``*,``, a plan
shown with ``...``, a CUDA graph); its ``ficco.…`` names must resolve after ``import ficco`` and
the keywords it passes to them must be parameters of theirs. A ```` ```python client ```` block
is a client package's code (:func:`client_blocks`), run by that client's tests. :data:`CHECKS` compares what a
block computes, or what it prints, with a float64 reference.
"""
from __future__ import annotations

import ast
import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    page: str          # README.md, docs/fp8.md, ...
    line: int          # the line of the opening fence
    info: str          # the fence's info string: "python", "python fragment", "bash", ""
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            out.append(Block(str(page.relative_to(REPO)), line, match.group(1).strip(),
                             match.group(2)))
    return out


def runnable() -> list[Block]:
    return [b for b in blocks() if b.info == "python"]


def fragments() -> list[Block]:
    return [b for b in blocks() if b.info == "python fragment"]


def client_blocks() -> list[Block]:
    """```` ```python client ```` blocks: a client package's code (transformers,
    megatron-core), run as written by that client's tests (tests/test_integrations_*.py), in
    their pools, with the names they use (a model directory, ...)."""
    return [b for b in blocks() if b.info == "python client"]


# --- the names the docs use -------------------------------------------------------------------
# batch 2, sequence 8 (4 per rank), hidden d = 16, ffn 32 (16 per rank); MoE: 2 experts per
# rank, 8 tokens per rank whose counts differ by rank.
BATCH, SEQ, D, FFN, W = 2, 8, 16, 32, 2


class _DropoutLoss:
    """``model(batch)`` of docs/training.md's ShardRNG loop: a loss through a dropout."""

    def __init__(self):
        import torch

        self.linear = torch.nn.Linear(D, D)

    def __call__(self, batch):
        import torch.nn.functional as F

        return F.dropout(self.linear(batch), 0.5).square().mean()


_MESH = None


def _mesh():
    global _MESH
    if _MESH is None:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH = init_device_mesh("cpu", (W,))
    return _MESH


def namespace(rank: int, world: int) -> dict:
    """Every name a runnable block uses but does not define; ``_full`` holds the whole tensors
    the checks compare with."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import ficco

    assert world == W, world
    gen = torch.Generator().manual_seed(2026)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    rows = slice(rank * SEQ // W, (rank + 1) * SEQ // W)
    cols = slice(rank * FFN // W, (rank + 1) * FFN // W)
    full = {"x": randn(BATCH, SEQ, D), "w_up": randn(D, FFN), "w_gate": randn(D, FFN),
            "w_qkv": randn(D, 3 * FFN), "w_down": randn(FFN, D), "h": randn(BATCH, FFN),
            "a": randn(W * 4, D), "b": randn(D, 8), "bias": randn(D)}
    fp8 = torch.float8_e4m3fn
    e4m3 = {"x8": (randn(BATCH, SEQ // W, D) * 4).to(fp8), "w8": (randn(D, D) * 4).to(fp8),
            "h8": (randn(BATCH, SEQ, D) * 4).to(fp8), "A8": (randn(4, D) * 4).to(fp8)}
    group_name = dist.group.WORLD.group_name
    # MoE: E = 4 experts, 2 per rank; this rank's 8 tokens routed as counts (sum 8 on every rank)
    counts = torch.tensor([1 + rank, 3 - rank, 2, 2], dtype=torch.int64)
    torch.manual_seed(7)                       # modules the blocks make start alike on each rank
    ns = {
        "torch": torch, "nn": nn, "F": F, "dist": dist, "ficco": ficco,
        "d": D, "hidden": D, "ffn_hidden": FFN, "E": 4, "ep_group": None, "group_name": group_name,
        "tp_mesh": _mesh(),
        "x_shard": full["x"][:, rows], "a_shard": full["a"][rank * 4:(rank + 1) * 4],
        "A_shard": full["a"][rank * 4:(rank + 1) * 4], "A": full["a"], "B": full["b"],
        "w": full["b"], "w_up": full["w_up"][:, cols], "w_gate": full["w_gate"][:, cols],
        "w_qkv": full["w_qkv"][:, rank * 3 * FFN // W:(rank + 1) * 3 * FFN // W],
        "w_down": full["w_down"][cols], "h": full["h"][:, cols], "b": full["bias"],
        "b2": full["bias"], "norm_w": torch.ones(D),
        "linear": nn.Linear(FFN, D),
        # fp8, row-wise scales (one per row of A, one per column of B)
        **e4m3, "B8": e4m3["w8"], "sx": torch.rand(BATCH, SEQ // W, 1, generator=gen) + 0.5,
        "sw": torch.rand(1, D, generator=gen) + 0.5, "sh": torch.rand(BATCH, SEQ, 1, generator=gen) + 0.5,
        "sa": torch.rand(4, 1, generator=gen) + 0.5, "sb": torch.rand(1, D, generator=gen) + 0.5,
        "x_bf16": full["a"][rank * 4:(rank + 1) * 4].bfloat16(), "w_bf16": full["b"].bfloat16(),
        # MoE and the float8 training op share x: (T, K) tokens sorted by global expert
        "x": randn(W * 4, D)[rank * 4:(rank + 1) * 4].repeat(2, 1), "counts": counts,
        "w1": randn(W, 2, D, 8)[rank], "w2": randn(W, 2, 8, D)[rank],
        "model": _DropoutLoss(), "data": [randn(4, D), randn(4, D)],
    }
    ns["_full"] = full
    ns["_rows"], ns["_rank"] = rows, rank
    return ns


def run_block(rank: int, world: int, code: str, where: str) -> dict:
    """One rank's run of a block: what it printed, and the checks' verdicts."""
    import torch.distributed as dist

    import ficco

    ns = namespace(rank, world)
    out = io.StringIO()
    destroyed = []
    real_destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: destroyed.append(True)  # the pool's group stays
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, where, "exec"), ns)      # noqa: S102 - the docs' own code
    finally:
        dist.destroy_process_group = real_destroy
        ficco.compat.install_symm_mem_override().remove()   # undoes the block's, if it made one
    verdicts = [check(ns, out.getvalue()) for marker, check in CHECKS if marker in code]
    return {"printed": out.getvalue(), "checks": verdicts, "destroyed": bool(destroyed)}


# --- what the blocks compute, against float64 -------------------------------------------------
def _close(got, want, tol=1e-5) -> str | None:
    want = want.double()
    err = ((got.double() - want).norm() / want.norm()).item()
    return None if err <= tol else f"relative error {err:.2e} > {tol}"


def _gathered_gemms(ns, printed):
    x = ns["_full"]["x"].double()
    got = [ns["h_up"], ns["h_gate"], ns["out"], ns["c"], ns["C"]]
    want = [x @ ns["w_up"].double(), x @ ns["w_gate"].double(), x @ ns["w_qkv"].double(),
            x @ ns["w_qkv"].double(), ns["_full"]["a"].double() @ ns["B"].double()]
    errs = [_close(g, w) for g, w in zip(got, want)] + [_close(ns["ag"], x)]
    if "schedule" not in printed:
        errs.append(f"explain printed no schedule: {printed!r}")
    return [e for e in errs if e] or None


def _sp_mlp(ns, printed):
    full, rows = ns["_full"], ns["_rows"]
    y = (full["x"].double() @ full["w_up"].double()).relu() @ full["w_down"].double()
    summed = W * ns["A"].double() @ ns["B"].double()       # every rank passes the same A, B
    mine = slice(ns["_rank"] * 4, (ns["_rank"] + 1) * 4)
    errs = [_close(ns["y_shard"], y[:, rows]), _close(ns["D"], summed[mine])]
    if "matmul_reduce_scatter" not in printed:
        errs.append(f"explain printed another op: {printed!r}")
    return [e for e in errs if e] or None


def _all_reduce(ns, printed):
    full = ns["_full"]
    y = full["h"].double() @ full["w_down"].double()
    errs = [_close(ns["y"], y)]
    if tuple(ns["down"].weight.shape) != (D, FFN // W):
        errs.append(f"RowParallelLinear weight {tuple(ns['down'].weight.shape)}")
    return [e for e in errs if e] or None


def _fp8_gather(ns, printed):
    import torch

    x = torch.cat([ns["x8"].double() * ns["sx"].double()] * W, dim=1)  # every rank's x8 alike
    want = torch.nn.functional.gelu(x @ (ns["w8"].double() * ns["sw"].double()) + ns["b"].double())
    return _close(ns["c"], want, tol=1e-2)


CHECKS = [
    ("h_up, h_gate = ficco.all_gather_matmul", _gathered_gemms),
    ("y_shard = ficco.matmul_reduce_scatter(h, w_down", _sp_mlp),
    ("y = ficco.matmul_all_reduce(h, w_down)          #", _all_reduce),
    ("c = ficco.all_gather_matmul(x8, w8, a_scale=sx", _fp8_gather),
]


# --- fragments: names and keywords ------------------------------------------------------------
def fragment_calls(code: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The dotted ``ficco.…`` names a fragment uses, and each call's (name, keywords) where the
    fragment parses once signature marks (``*,``, ``<...>``) are taken out."""
    names = sorted(set(re.findall(r"\bficco(?:\.[A-Za-z_]\w*)+", code)))
    text = re.sub(r",\s*\*\s*,", ",", code)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return names, []
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            dotted = _dotted(node.func)
            if dotted and dotted.startswith("ficco."):
                calls.append((dotted, [k.arg for k in node.keywords if k.arg]))
    return names, calls


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None
