"""``python -m ficco.bench decode``: the simulated decode table of ``docs/all_reduce.md``.

Tensor-parallel decode's row-parallel projections, priced by ficco's model (no GPU): for each
profile, layer, batch and TP degree the whole ``matmul_all_reduce`` call (eager: the host's
time per plan op included) as ``serial`` over ccl (the GEMM, then NCCL/RCCL), as the model's
pick among the schedules offered today, and as the faster one-kernel all-reduce forced; then
the all-reduce alone (NCCL/RCCL and the faster one-kernel), beside the published custom
all-reduce time nearest in size on the same hardware and rank count (``validate``'s
``decode`` rows, within 2x of the message). The layers::

    8B o        Llama-3 8B attention out:   N 4096, K 4096
    70B down    Llama-3 70B MLP down:       N 8192, K 28672
    8x7B moe    Mixtral-8x7B expert down:   N 4096, K = experts touched x 14336

Mixtral-8x7B (hidden 4096, expert FFN 14336, 8 experts, 2 per token: its config.json on the
Hugging Face hub, mistralai/Mixtral-8x7B-v0.1, and Table 1 of arXiv 2401.04088) runs its
experts tensor-parallel as a serving engine does without expert parallelism: every rank
holds a K-slice of every expert's down projection, sums its two experts' partials per
token, and one all-reduce of ``batch x 4096`` follows, as for a dense layer. Its GEMM is
priced as one dense GEMM whose K is the experts the batch touches (expected distinct of 8
with 2 per token: 2 at batch 1, 8 from batch 32 on) times 14336, the weights a decode step
reads; that overstates its FLOPs (each token uses 2 of them), which only counts once a GEMM
leaves the memory-bound regime.

Every number is simulated; nothing here was measured::

    python -m ficco.bench decode                       # the docs' three tables (TP 8, 4, 2)
    python -m ficco.bench decode --profiles h100 --tp 8 --batches 1,32
"""
from __future__ import annotations

import math

from .. import config, schedules
from ..errors import InvalidArgumentError
from ..heuristics import model, profiles, reductions
from ..plan.problem import Problem

EXAMPLES = """\
  python -m ficco.bench decode
  python -m ficco.bench decode --profiles h100,mi355x --tp 8 --batches 1,32,256"""

OP = "matmul_all_reduce"
PROFILES = ("h100", "h200", "b200", "mi300x", "mi355x")
TPS = (8, 4, 2)
BATCHES = (1, 32, 256)
HEADER = ("| hardware | GEMM (batch, N, K/TP) | message | whole call: serial over ccl / model's "
          "pick today / best one-kernel | all-reduce alone: NCCL/RCCL / best one-kernel | "
          "published custom all-reduce near that size |")
#: the validate quantities of published custom all-reduce times
CUSTOM = ("kernel_all_reduce_us", "torch_all_reduce_us")
#: Mixtral-8x7B: experts, experts per token, expert FFN width
MOE_EXPERTS, MOE_TOP_K, MOE_FFN = 8, 2, 14336


def experts_touched(batch: int) -> int:
    """Expected distinct experts of :data:`MOE_EXPERTS` that ``batch`` tokens with
    :data:`MOE_TOP_K` each route to, rounded.

    >>> [experts_touched(b) for b in (1, 2, 8, 32, 256)]
    [2, 4, 7, 8, 8]
    """
    untouched = math.comb(MOE_EXPERTS - 1, MOE_TOP_K) / math.comb(MOE_EXPERTS, MOE_TOP_K)
    return round(MOE_EXPERTS * (1 - untouched ** batch))


def layers(batch: int) -> list[tuple[str, int, int]]:
    """(label, N, K of the whole layer) of the three row-parallel projections at ``batch``."""
    return [("8B o", 4096, 4096), ("70B down", 8192, 28672),
            ("8x7B moe", 4096, experts_touched(batch) * MOE_FFN)]


def row(profile_name: str, label: str, batch: int, n: int, k: int, tp: int) -> dict:
    """One table row's numbers (seconds): the whole call three ways, the all-reduce alone
    two ways, and the published time it is held against (or None)."""
    if k % tp:
        raise InvalidArgumentError(f"{label}: K {k} does not split over TP {tp}")
    prof = profiles.load(profile_name)
    problem = Problem(batch, k // tp, (n,), "bfloat16", tp, op=OP)
    engines = config.copy_engines()
    names = schedules.names(op=OP)
    from .simulate import selector_pick

    pick = selector_pick(problem, prof, prof.topology, "dma", engines, names)
    kernels = {s: model.predict(s, problem, prof, None, "dma", engines)
               for s in ("one-shot-kernel", "two-shot-kernel")}
    kernel = min(kernels, key=lambda s: kernels[s])
    nbytes = batch * n * 2
    alone = {"ccl": reductions.collective_seconds(prof, nbytes, tp),
             "kernel": min(reductions.shot_kernel_seconds(prof, nbytes, tp, two_shot=t)
                           for t in (False, True))}
    return {"profile": profile_name, "layer": label, "batch": batch, "n": n, "k": k, "tp": tp,
            "bytes": nbytes,
            "serial_ccl": model.predict("serial", problem, prof, None, "ccl", engines),
            "pick": (pick["schedule"], pick["transport"], pick["time_s"]),
            "kernel": (kernel, kernels[kernel]), "alone": alone,
            "published": published_near(profile_name, nbytes, tp)}


def published_near(profile_name: str, nbytes: int, world: int) -> tuple | None:
    """(microseconds, bytes, row id) of the best published custom all-reduce (one kernel:
    Triton's, aiter's, vLLM's, torch's ``one_shot_all_reduce``) nearest in size to ``nbytes``
    on ``profile_name`` at ``world`` ranks, within 2x, from ``validate``'s ``decode`` rows:
    the fastest at the nearest size; None when none is that near."""
    near = []
    for r in reductions.published_rows():
        if r["profile"] != profile_name or r["quantity"] not in CUSTOM:
            continue
        shapes = dict(item.split("=", 1) for item in r["shapes"].split())
        if int(shapes.get("world", 8)) != world:
            continue
        size = int(shapes["size"])
        distance = abs(math.log(size / nbytes))
        if distance <= math.log(2) + 1e-9:
            near.append((round(distance, 9), float(r["published"]), size, r["id"]))
    if not near:
        return None
    _, us, size, row_id = min(near)      # the nearest size, then the fastest there
    return us, size, row_id


def _kb(nbytes: int) -> str:
    return f"{nbytes / 1024:.0f} KB"


def markdown(rows: list[dict]) -> str:
    """The rows as one markdown table per TP degree (in the order the rows come)."""
    out: list[str] = []
    for tp in dict.fromkeys(r["tp"] for r in rows):
        out += ["", f"TP {tp} ({tp} GPUs of one node), bf16, us:", "",
                HEADER,
                "|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["tp"] == tp):
            schedule, transport, pick_s = r["pick"]
            kernel, kernel_s = r["kernel"]
            pub = r["published"]
            held = f"{pub[0]:.1f} us at {_kb(pub[1])} ({pub[2]})" if pub else "-"
            out.append(
                f"| {r['profile']} | {r['layer']} ({r['batch']}, {r['n']}, {r['k'] // tp}) "
                f"| {_kb(r['bytes'])} | {r['serial_ccl'] * 1e6:.1f} / {schedule} ({transport}) "
                f"{pick_s * 1e6:.1f} / {kernel} {kernel_s * 1e6:.1f} | "
                f"{r['alone']['ccl'] * 1e6:.1f} / {r['alone']['kernel'] * 1e6:.1f} | {held} |")
    return "\n".join(out[1:])


def table(profile_names=PROFILES, tps=TPS, batches=BATCHES) -> str:
    """The docs' tables: :func:`markdown` of every (TP, profile, layer, batch) row."""
    rows = [row(p, label, b, n, k, tp) for tp in tps for p in profile_names
            for label, _, _ in layers(1) for b in batches
            for lab, n, k in layers(b) if lab == label]
    return markdown(rows)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise InvalidArgumentError(f"--{what} {text!r}: expected a comma list of integers") \
            from None


def add_arguments(parser) -> None:
    parser.add_argument("--profiles", default=",".join(PROFILES),
                        help="comma list of built-in profiles")
    parser.add_argument("--tp", default=",".join(map(str, TPS)), help="comma list of TP degrees")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)),
                        help="comma list of decode batches (rows of the GEMM)")


def main(args) -> int:
    names = tuple(p for p in args.profiles.split(",") if p)
    for name in names:
        profiles.load(name)          # an unknown name fails here, listing the built-in ones
    print(table(names, _ints(args.tp, "tp"), _ints(args.batches, "batches")))
    return 0
