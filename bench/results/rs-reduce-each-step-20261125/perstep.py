"""Per-step reduction vs once at the end, simulated, for every reduce-scatter schedule on the six
row-parallel llama GEMMs, MI300X and H100, eager and graph replay (240 cases): each schedule is
simulated with ``reduce_each_step`` True and False. Cited by docs/reduce_scatter.md ("Summing").

    python bench/results/rs-reduce-each-step-20261125/perstep.py > perstep.txt

Per case the number is t(per step) / t(at the end) - 1: > 0 means at the end is faster.
"""
import argparse
import dataclasses
import statistics
from collections import defaultdict

from ficco import schedules
from ficco.bench import simulate as sim_cli
from ficco.heuristics import profiles
from ficco.heuristics.model import representative_ranks
from ficco.heuristics.simulator import simulate

OP = "matmul_reduce_scatter"
ARGS = argparse.Namespace(op="matmul-reduce-scatter", scenarios="llama", world=8, shape=[],
                          scale=1, dtype="bfloat16", scaling="row")


def main() -> None:
    res = defaultdict(list)
    for name in ("mi300x", "h100"):
        for graph in (False, True):
            prof = profiles.load(name)
            if graph:   # a CUDA-graph replay pays no host launch
                prof = dataclasses.replace(prof, host_op_s=0.0)
            for _, (m, n, k) in sim_cli.scenarios(ARGS):
                problem = sim_cli._problem(ARGS, m, n, k)
                for s in schedules.names(op=OP):
                    if s == "serial":
                        continue
                    sch = schedules.get(s, op=OP)
                    t = {}
                    for each in (True, False):
                        variant = dataclasses.replace(sch, reduce_each_step=each)
                        t[each] = max(simulate(variant.plan(dataclasses.replace(problem, rank=r),
                                                            "dma"), prof).makespan_s
                                      for r in representative_ranks(8))
                    res[(s, name, graph)].append(t[True] / t[False] - 1)
    every = [x for v in res.values() for x in v]
    print("end faster", sum(x > 1e-9 for x in every), "per step faster",
          sum(x < -1e-9 for x in every), "of", len(every),
          "median", f"{statistics.median(every):+.1%}")
    for s in schedules.names(op=OP):
        if s == "serial":
            continue
        v = [x for (ss, _, _), xs in res.items() if ss == s for x in xs]
        print(s, f"median {statistics.median(v):+.1%} min {min(v):+.1%} max {max(v):+.1%}")
        for key in [kk for kk in res if kk[0] == s]:
            print("   ", key[1:], " ".join(f"{x:+.1%}" for x in res[key]))


if __name__ == "__main__":
    main()
