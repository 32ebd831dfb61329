"""``python -m ficco.bench default``: is the default choice ever slower than doing nothing?

ficco's promise, checked on CPU ranks: with no settings (the default selector, ``auto``),
across a tiny, a GEMM-bound and a copy-bound shape of every op, the default choice is never
more than 10% slower than the better serial (plain collective + GEMM over either transport)
measured in the same run. This verb spawns ``--world`` CPU ranks (gloo, the cpu backend) and,
per op and shape:

1. makes the first call with no schedule and no settings (in a fresh ``FICCO_CACHE_DIR``, so
   every key is new) and times it (after one forced serial call per op and transport on
   another shape: what a process pays once is not the key's); under ``FICCO_AUTO=explore``
   (the default) the key's next calls explore its shortlist, and the verb makes them until
   the decision settled (``explored``), under ``upfront`` the first call measured it;
2. times ``--calls`` interleaved rounds of four samples (``--per-sample`` back-to-back calls
   each, the ranks lined up before each sample): the default, ``serial`` over dma and
   ``serial`` over ccl (forced), and the default's own pick forced (``vs itself``: how far two
   timings of one schedule drift apart in this run, its noise); each sample the slowest
   rank's;
3. reports each variant's median time, the default against the better serial (``vs serial``,
   the median over rounds of the default's sample over that serial's sample in the same
   round, see :func:`summary`; fails above ``--limit``; ``fastest``: the fastest samples'
   ratio, which a busy machine's bursts cannot inflate) and the first call's extra cost, in
   serial-call times: ``first call`` is the
   first call's time less a warm default call's, ``measuring`` what ``auto`` itself says it
   spent (``Decision.decided_by``).

Ops without cases here are listed as not covered (add their inputs to :data:`CASES`). Timings
on CPU threads say nothing about GPUs; the CPU backend's times are real, which is what the
promise is about. Speed is never asserted in tests: this verb is how it is checked.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time

EXAMPLES = """examples:
  python -m ficco.bench default                   # W=2, every op, tiny/GEMM-bound/copy-bound
  python -m ficco.bench default --world 4 --calls 31 --json bench/runs/default.json
  python -m ficco.bench default --op matmul_reduce_scatter --case GEMM-bound   # one case
"""

#: per op: (label, sizes) with sizes the op's inputs below: dense ops (rows per rank, K, n;
#: the reduce-scatter and all-reduce take W x rows and K / W per rank), expert ops (rows per
#: rank, k, n) routed evenly over two experts per rank
CASES = {
    "all_gather_matmul": (("tiny", (8, 16, 16)), ("GEMM-bound", (128, 256, 768)),
                          ("copy-bound", (512, 512, 8))),
    "matmul_reduce_scatter": (("tiny", (8, 16, 16)), ("GEMM-bound", (128, 1024, 128)),
                              ("copy-bound", (512, 16, 512))),
    "matmul_all_reduce": (("tiny", (8, 16, 16)), ("GEMM-bound", (128, 1024, 128)),
                          ("copy-bound", (256, 16, 512))),
    "all_to_all_grouped_mm": (("tiny", (8, 16, 16)), ("GEMM-bound", (256, 256, 512)),
                              ("copy-bound", (1024, 512, 8))),
    "grouped_mm_all_to_all": (("tiny", (8, 16, 16)), ("GEMM-bound", (256, 256, 512)),
                              ("copy-bound", (1024, 8, 512))),
    "matmul_all_to_all": (("tiny", (8, 16, 16)), ("GEMM-bound", (128, 1024, 128)),
                          ("copy-bound", (512, 16, 512))),
    "all_to_all_matmul": (("tiny", (8, 16, 16)), ("GEMM-bound", (128, 1024, 128)),
                          ("copy-bound", (512, 16, 512))),
}
#: ops whose inputs come from their spec's :meth:`~ficco.ops.base.OpSpec.example` (float32,
#: its ``(m, k, n)``), whose explain() is the op's own
FROM_EXAMPLE = ("matmul_all_to_all", "all_to_all_matmul")
EXPERTS_PER_RANK = 2


def add_arguments(parser) -> None:
    parser.add_argument("--world", type=int, default=2, help="ranks to spawn")
    parser.add_argument("--calls", type=int, default=21,
                        help="interleaved samples of each variant per case")
    parser.add_argument("--per-sample", type=int, default=4,
                        help="back-to-back calls one sample times (its mean per call)")
    parser.add_argument("--limit", type=float, default=1.10,
                        help="fail where the default takes longer than this times the better "
                             "serial")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--op", action="append", default=None, choices=sorted(CASES),
                        help="only this op's cases (repeatable; default: every op)")
    parser.add_argument("--case", action="append", default=None,
                        choices=sorted({label for cases in CASES.values() for label, _ in cases}),
                        help="only cases with this label (repeatable; default: all three)")


def inputs(op: str, rank: int, world: int, sizes: tuple, seed: int):
    """``(call(schedule), explain())``: this rank's call of ``op`` on fresh random inputs."""
    import torch

    import ficco

    rows, k, n = sizes
    if op in FROM_EXAMPLE:
        from ..ops import get as op_spec
        from ..ops.examples import Rounding

        ex = op_spec(op).example(rank, world, sizes, Rounding("float32"), seed)
        run = getattr(ficco, op)
        return (lambda schedule: run(*ex.args, schedule=schedule, **ex.kwargs),
                lambda: ficco.explain(ex.args[0], ex.args[1], op=op, **ex.kwargs))
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    if op == "all_gather_matmul":
        a, b = torch.randn(rows, k, generator=gen), torch.randn(k, n, generator=gen)
        return (lambda schedule: ficco.all_gather_matmul(a, b, schedule=schedule),
                lambda: ficco.explain(a, b))
    if op in ("matmul_reduce_scatter", "matmul_all_reduce"):
        a = torch.randn(world * rows, k // world, generator=gen)
        b = torch.randn(k // world, n, generator=gen)
        run = getattr(ficco, op)
        return (lambda schedule: run(a, b, schedule=schedule),
                lambda: ficco.explain(a, b, op=op))
    each = rows // (world * EXPERTS_PER_RANK)     # rows from every rank to every expert
    w = torch.randn(EXPERTS_PER_RANK, k, n, generator=gen) / k ** 0.5
    if op == "all_to_all_grouped_mm":
        counts = [each] * (world * EXPERTS_PER_RANK)
        x = torch.randn(sum(counts), k, generator=gen)
        return (lambda schedule: ficco.all_to_all_grouped_mm(x, counts, w, schedule=schedule),
                lambda: ficco.explain(x, w, op=op, counts=counts))
    received = [[each] * world for _ in range(EXPERTS_PER_RANK)]    # what dispatch returns
    y = torch.randn(each * world * EXPERTS_PER_RANK, k, generator=gen)
    return (lambda schedule: ficco.grouped_mm_all_to_all(y, received, w, schedule=schedule),
            lambda: ficco.explain(y, w, op=op, counts=received))


def _timed(call, schedule: str | None = None, transport: str | None = None, *,
           calls: int = 1) -> float:
    """Seconds per call of ``calls`` back-to-back calls, the ranks lined up first."""
    import torch.distributed as dist

    import ficco

    dist.barrier()
    with ficco.config.scope(**({"transport": transport} if transport else {})):
        start = time.perf_counter()
        for _ in range(calls):
            call(schedule)
        return (time.perf_counter() - start) / calls


def _slowest(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def selected(ops: list[str] | None = None, labels: list[str] | None = None) -> dict:
    """:data:`CASES` narrowed to ``ops`` and case ``labels`` (None: all)."""
    return {op: tuple(c for c in cases if labels is None or c[0] in labels)
            for op, cases in CASES.items() if ops is None or op in ops}


def _case_rows(rank: int, world: int, calls: int, per_sample: int,
               cases_of: dict | None = None) -> list[dict]:
    """Every case's row on this rank (the numbers agreed: the slowest rank's)."""
    import ficco
    from ficco.runtime import path as runtime

    os.environ["FICCO_CACHE_DIR"] = tempfile.mkdtemp(prefix="ficco-bench-default-")
    cases_of = CASES if cases_of is None else cases_of
    for op, cases in CASES.items():
        # what a process pays once (queues, workspaces, communicators), on a shape of its own,
        # so that the first call below pays only for its own key
        call, _ = inputs(op, rank, world, tuple(2 * x for x in cases[0][1]), 99)
        for via in ("dma", "ccl"):
            _timed(call, "serial", via)
    out = []
    for op, cases in cases_of.items():
        for seed, (label, sizes) in enumerate(cases):
            call, explain = inputs(op, rank, world, sizes, seed)
            first = _timed(call)
            # (FICCO_AUTO=explore: the key's next calls explore its shortlist until it settles)
            explored = 0
            while not ficco.session_of().last.final and explored < 1000:
                _timed(call)
                explored += 1
            ran = runtime.last_run()
            if ran is None:
                raise RuntimeError(f"{op}: a call of {world} ranks ran no schedule")
            decision = explain()      # local: what the first call measured and kept
            # the default, both serials, and the default's own pick forced: the last says how
            # far two timings of one schedule drift apart in this run (its noise)
            variants: list[tuple[str | None, str | None]] = [
                (None, None), ("serial", "dma"), ("serial", "ccl"), ran]
            times: list[list[float]] = [[] for _ in variants]
            for round_ in range(calls):
                # interleaved, in an order shuffled per round (alike on every rank): no variant
                # always runs after the same one
                order = list(range(len(variants)))
                random.Random(round_).shuffle(order)
                for j in order:
                    times[j].append(_timed(call, *variants[j], calls=per_sample))
            # every sample agreed at once: the slowest rank's (the ranks lined up before each)
            flat = _slowest([first] + [x for t in times for x in t])
            first = flat[0]
            times = [flat[1 + j * calls:1 + (j + 1) * calls] for j in range(len(variants))]
            out.append({"op": op, "case": label, "sizes": sizes, "ran": list(ran),
                        "first_s": first, "explored_calls": explored, **summary(times),
                        "decided_by": decision.decided_by,
                        "measured": [list(r) for r in decision.measured]})
    ficco.shutdown()
    return out


def summary(times: list[list[float]]) -> dict:
    """One case's figures from its agreed samples, ``times`` = [default, serial over dma,
    serial over ccl, the default's pick forced], each a list of one sample per round.

    The times are each variant's median. The ratios are paired: the median over rounds of the
    default's sample over the other variant's sample in the same round (``vs_serial``: over the
    serial with the lower median; ``vs_itself``: over its own pick forced). Both samples of a
    pair ran moments apart under the same load, so a drift in the machine's load between rounds
    cancels out of the ratio instead of favouring whichever variant it caught less often.
    ``fastest_vs_serial`` is the default's fastest sample over the better serial's fastest.
    """
    default, dma, ccl, same = times
    serial = dma if statistics.median(dma) <= statistics.median(ccl) else ccl
    return {"default_s": statistics.median(default), "serial_dma_s": statistics.median(dma),
            "serial_ccl_s": statistics.median(ccl), "same_forced_s": statistics.median(same),
            "min_s": [min(t) for t in times],
            "vs_serial": statistics.median(d / s for d, s in zip(default, serial)),
            "vs_itself": statistics.median(d / s for d, s in zip(default, same)),
            "fastest_vs_serial": min(default) / min(serial)}


def measure(world: int = 2, calls: int = 21, per_sample: int = 4,
            cases_of: dict | None = None) -> list[dict]:
    from .cli import cpu_ranks

    return cpu_ranks(_case_rows, world, calls, per_sample, cases_of)[0]


def main(args) -> int:
    from .. import ops
    from .cli import BenchUsageError

    if args.world < 2 or args.calls < 1:
        raise BenchUsageError(f"ficco.bench default compares schedules across ranks: it needs "
                              f"--world 2 or more and --calls 1 or more; got --world "
                              f"{args.world} --calls {args.calls}")
    narrowed = args.op is not None or args.case is not None
    rows = measure(args.world, args.calls, args.per_sample,
                   selected(args.op, args.case) if narrowed else None)
    print(f"the default choice against the better serial: W={args.world} CPU ranks (gloo), "
          f"float32, no settings, {args.calls} interleaved rounds of one sample ("
          f"{args.per_sample} calls) per variant, slowest rank; times: medians; ratios: "
          f"median of each round's paired ratio")
    print(f"{'op':<22} {'case':<11} {'default ran':<26} {'default':>9} {'serial':>9} "
          f"{'vs serial':>9} {'vs itself':>9} {'fastest':>9} {'first call':>10} "
          f"{'measuring':>9} {'explored':>8}")
    worst = noise = 0.0
    for row in rows:
        serial = min(row["serial_dma_s"], row["serial_ccl_s"])
        ratio, itself, fastest = row["vs_serial"], row["vs_itself"], row["fastest_vs_serial"]
        worst = max(worst, ratio)
        noise = max(noise, abs(itself - 1))
        extra = (row["first_s"] - row["default_s"]) / serial
        spent = _measuring_calls(row["decided_by"])
        row.update(first_call_extra_serial_calls=extra)
        print(f"{row['op']:<22} {row['case']:<11} {'/'.join(row['ran']):<26} "
              f"{row['default_s'] * 1e3:7.3f}ms {serial * 1e3:7.3f}ms {ratio:8.2f}x "
              f"{itself:8.2f}x {fastest:8.2f}x {extra:9.1f}x {spent:>9} "
              f"{row['explored_calls']:>8}")
    missing = [op for op in ops.names() if op not in CASES]
    if narrowed:
        print(f"narrowed to --op {args.op or 'all'} --case {args.case or 'all'}: not the "
              f"whole check")
    if missing:
        print(f"not covered (no cases in ficco/bench/default.py): {', '.join(missing)}")
    print(f"worst: the default at {worst:.2f}x the better serial (limit {args.limit:.2f}x); "
          f"this run's noise: the default and its own pick forced differ by up to "
          f"{noise:.0%}; first call and measuring in serial-call times (measuring: up "
          f"front, the shortlist's runs; exploring, the losing candidates' calls over the "
          f"winner's; explored: the key's calls after the first before it settled)")
    if noise > args.limit - 1:
        print("the noise exceeds the limit's margin: a busy machine; rerun with more --calls "
              "or on a quiet one")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if worst <= args.limit and not missing else 1


def _measuring_calls(decided_by: str) -> str:
    """'4.1x' from auto's 'measuring cost ... = 4.1 serial-call times'."""
    marker = " serial-call times"
    if marker not in decided_by:
        return "-"
    return decided_by.split(marker)[0].rsplit("= ", 1)[-1] + "x"
