"""FiCCO Table I's expert-parallel GEMMs (g13-g16) priced as what they are: an all-to-all of
tokens to their experts, then the experts' GEMM (``all_to_all_grouped_mm``), not an all-gather.

The paper (seeds/001, §V-B "expert-parallelism, wherein input tokens are communicated in an
all-to-all fashion before executing the expert layers") gives each as a layer GEMM
``(M, N, K)``. Our reading, the same as for g1-g12 where it can be: M tokens over W = 8
MI300X ranks, routed uniformly (every rank sends M / (W * E) rows to every expert), each rank
holding L experts of weight ``(K, N)``, so a rank multiplies ``M / W`` rows by ``N`` columns:
the local GEMM of the all-gather reading (``M x N/W x K``) has the same FLOPs. L = 1 (Mixtral's
8 experts on 8 GPUs; the paper does not say how DeepSeek's were placed, we keep one per rank).
Runs are priced launched from graphs (``mi300x:graphs``, as for the other Table I rows).

What the paper measured for these four is a figure (Fig. 12b) without numbers in its text;
what its text states is that its rule picked the fastest of its four schedules on every
Table I GEMM (§VI-C). So beside each simulated all-to-all speedup this prints the paper rule's
pick (its measured fastest) and the model's pick among the same four FiCCO points run as
all-to-all, and the speedup the all-gather reading predicts (ficco's own all-gather plans, as
``validate`` priced these four before). All speedups here are simulated.

>>> rows = expert_rows()
>>> [r["gemm"] for r in rows]
['g13', 'g14', 'g15', 'g16']
"""
from __future__ import annotations

import dataclasses

from .. import schedules
from ..heuristics import model, profiles
from ..heuristics.paper import paper_choice
from ..heuristics.scenarios import PAPER_TABLE_I, table_i_problem
from ..ops.expert.problem import DISPATCH, ExpertProblem, representative

EXPERT_GEMMS = ("g13", "g14", "g15", "g16")
#: the paper's four schedules (its rule picks among them, §VI-C)
PAPER_POINTS = ("uniform-fused-1d", "hetero-fused-1d", "hetero-unfused-1d", "uniform-fused-2d")


def table_i_expert_problem(name: str, world: int = 8, experts: int = 1,
                           dtype: str = "bfloat16") -> ExpertProblem:
    """Rank 0's dispatch problem for Table I entry ``name`` read as expert parallelism.

    >>> p = table_i_expert_problem("g14")
    >>> p.big_m, p.k, p.n
    (18432, 4096, 28672)
    """
    big_m, n, k = PAPER_TABLE_I[name]
    per_entry = big_m // (world * world * experts)
    counts = representative(world, experts, per_entry, 1.0)
    return ExpertProblem(k, n, experts, dtype, world, 0, DISPATCH, counts)


def expert_rows(profile_name: str = "mi300x") -> list[dict]:
    """Per g13-g16: simulated seconds of every dispatch schedule over dma and ccl, the paper
    rule's pick, the model's pick among :data:`PAPER_POINTS`, and the all-gather reading's
    best speedup."""
    # launched from graphs: no host time per op (validate.load_profile's ":graphs")
    prof = dataclasses.replace(profiles.load(profile_name), host_op_s=0.0)
    out = []
    for name in EXPERT_GEMMS:
        problem = table_i_expert_problem(name)
        times = {(s, t): model.predict(s, problem, prof, transport=t)
                 for s in schedules.names(op=DISPATCH) for t in ("dma", "ccl")}
        serial = times["serial", "ccl"]
        gathered = table_i_problem(name)
        ag = {s: model.predict(s, gathered, prof) for s in ("serial", *PAPER_POINTS)}
        pick = paper_choice(gathered, prof)[0]
        best = min(PAPER_POINTS, key=lambda s: times[s, "dma"])
        out.append({"gemm": name, "paper_pick": pick, "model_pick": best,
                    "agree": pick == best,
                    "speedup": {f"{s}/{t}": serial / v for (s, t), v in times.items()},
                    "all_gather_best": ag["serial"] / min(ag[s] for s in PAPER_POINTS),
                    "comm_share": _comm_share(problem, prof)})
    return out


def _comm_share(problem: ExpertProblem, prof) -> float:
    """The serial run's exposed all-to-all over its whole time (what overlap can hide)."""
    result = model.simulate_schedule("serial", problem, prof, transport="ccl")
    gemm_s = result.busy_s("expert_gemm")
    return 1 - gemm_s / result.makespan_s


def report(profile_name: str = "mi300x") -> None:
    """The g13-g16 section of ``python -m ficco.bench validate``."""
    rows = expert_rows(profile_name)
    print("Table I g13-g16 as expert parallelism (all-to-all + grouped GEMM), MI300X, W=8, "
          "uniform routing; speedups over serial over ccl, simulated")
    print(f"  {'gemm':5}{'a2a share':>10} {'serial/dma':>11} {'ring/dma':>9} {'best 1d/dma':>12} "
          f"{'best 2d/dma':>12} {'best FiCCO/ccl':>15} {'all-gather reading':>19}  "
          f"picks (paper / model)")
    for r in rows:
        sp = r["speedup"]
        best = {d: max(v for key, v in sp.items() if key.endswith(f"-{d}/dma"))
                for d in ("1d", "2d")}
        ccl = max(v for key, v in sp.items() if key.endswith("d/ccl"))
        mark = "=" if r["agree"] else "x"
        print(f"  {r['gemm']:5}{r['comm_share']:>10.1%} {sp['serial/dma']:>10.2f}x "
              f"{sp['ring/dma']:>8.2f}x {best['1d']:>11.2f}x {best['2d']:>11.2f}x "
              f"{ccl:>14.2f}x {r['all_gather_best']:>18.2f}x  "
              f"{r['paper_pick']} / {r['model_pick']} {mark}")
    print(f"picks agree {sum(r['agree'] for r in rows)}/{len(rows)}\n")
