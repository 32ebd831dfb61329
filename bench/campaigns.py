"""Reliability campaigns on CPU ranks: many randomized programs, killed ranks, a soak of mixed
warm calls, disagreements, the per-rank knobs with the cache in every state. Each prints its figures (cases run, wrong, hung,
crashed, leaked); nothing is written to the tree.

    python bench/campaigns.py programs 40 --world 2   # tests/random_programs.py, 40 seeds
    python bench/campaigns.py kill 20                 # a rank killed mid-call, 20 runs
    python bench/campaigns.py soak 3000               # mixed warm calls, fds/threads/maps
    python bench/campaigns.py disagree 20             # ranks that call differently at random
    python bench/campaigns.py per-rank 20 --calls 12  # per-rank scales, biases, widths, caches

Run from the repository root (it uses the tests' rank pools, tests/harness.py).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("FICCO_BACKEND", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _right(err: float) -> bool:
    return err <= 1e-4


# -- randomized programs -------------------------------------------------------------------------
def programs(count: int, world: int, calls: int, timeout: float) -> dict:
    from tests import harness
    from tests.random_programs import judge, run_program

    totals = {"programs": 0, "calls": 0, "data": 0, "errors": 0, "wrong": 0, "crashed": 0,
              "hung": 0, "failures": []}
    pool = None
    for i in range(count):
        if pool is None or i % 10 == 0:      # fresh ranks now and then: groups accumulate
            if pool is not None:
                pool.close()
            pool = harness.RankPool(world, {"FICCO_TIMEOUT": "20"})
        seed = random.randrange(1 << 30)
        try:
            results = pool.run(run_program, seed, calls, timeout, timeout_s=calls * 30)
        except harness.RankError as exc:   # a rank crashed or hung past the pool's bound
            totals["crashed"] += 1
            totals["failures"].append((seed, str(exc)[-300:]))
            pool.close()
            pool = None
            continue
        counts = judge(seed, world, results, timeout)
        totals["programs"] += 1
        for key in ("calls", "data", "errors", "wrong", "crashed", "hung"):
            totals[key] += counts[key]
        if counts["failures"]:
            totals["failures"].append((seed, counts["failures"]))
    if pool is not None:
        pool.close()
    return totals


# -- killed ranks -----------------------------------------------------------------------------------
def _killed(rank: int, world: int, seed: int, init_file: str, dead: int, delay: float,
            transport: str):
    """Calls until rank ``dead`` exits after ``delay`` s (mid-call, most likely); the others
    must raise in time; then the survivors make a fresh group and compute right."""
    import threading

    import torch
    import torch.distributed as dist

    import ficco
    from tests.reference import make_inputs, max_row_rel_err

    inputs = make_inputs(seed, world, (32, 64), (48,), torch.float32)
    if rank == dead:
        threading.Timer(delay, os._exit, (17,)).start()
    outcome = {"right": 0, "wrong": 0, "raised": None, "hung": False}
    start = time.monotonic()
    with ficco.config.scope(transport=transport, timeout=3):
        while time.monotonic() - start < 60:
            began = time.monotonic()
            try:
                err = max_row_rel_err(ficco.all_gather_matmul(inputs[0][rank], inputs[1][0]),
                                      inputs[3][0])
            except ficco.errors.FiccoError as exc:
                outcome["raised"] = type(exc).__name__
                outcome["hung"] = time.monotonic() - began > 3 * 3 + 5
                break
            outcome["right" if _right(err) else "wrong"] += 1
    ficco.shutdown()
    dist.destroy_process_group()
    survivors = [r for r in range(world) if r != dead]
    new_rank = survivors.index(rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=new_rank,
                            world_size=len(survivors), timeout=datetime.timedelta(seconds=60))
    fresh = []
    for call, mode in enumerate(["dma", "ccl", "dma"]):
        new = make_inputs(seed + call + 1, len(survivors), (16, 64), (48,), torch.float32)
        with ficco.config.scope(transport=mode, timeout=10):
            try:
                fresh.append(_right(max_row_rel_err(
                    ficco.all_gather_matmul(new[0][new_rank], new[1][0]), new[3][0])))
            except ficco.errors.FiccoError as exc:
                fresh.append(type(exc).__name__)
    ficco.shutdown()
    return outcome, fresh


def kill(count: int, world: int) -> dict:
    from tests import harness

    totals = {"runs": 0, "survivors": 0, "raised in time": 0, "wrong": 0, "hung": 0,
              "crashed": 0, "fresh group right": 0, "fresh group failed": 0, "leaked": 0,
              "failures": []}
    shm_before = set(glob.glob("/dev/shm/ficco-*"))
    for _ in range(count):
        fd, init_file = tempfile.mkstemp(prefix="ficco-kill-")
        os.close(fd)
        os.unlink(init_file)
        dead = random.randrange(world)
        delay = random.uniform(0.5, 3.0)
        transport = random.choice(["dma", "ccl"])
        results = harness.run_alone(world, _killed, random.randrange(1 << 30), init_file, dead,
                                    delay, transport, timeout_s=240, raw=True)
        totals["runs"] += 1
        for rank, (status, value) in enumerate(results):
            if rank == dead:
                continue
            totals["survivors"] += 1
            if status != "ok":
                totals["crashed"] += 1
                totals["failures"].append((rank, dead, transport, str(value)[-300:]))
                continue
            outcome, fresh = value
            totals["wrong"] += outcome["wrong"]
            totals["hung"] += outcome["hung"]
            totals["raised in time"] += outcome["raised"] is not None and not outcome["hung"]
            if all(f is True for f in fresh):
                totals["fresh group right"] += 1
            else:
                totals["fresh group failed"] += 1
                totals["failures"].append((rank, dead, transport, fresh))
        if os.path.exists(init_file):
            os.unlink(init_file)
    totals["leaked"] = len(set(glob.glob("/dev/shm/ficco-*")) - shm_before)
    return totals


# -- soak ---------------------------------------------------------------------------------------------
def _soak(rank: int, world: int, seed: int, calls: int):
    import threading

    import torch

    import ficco
    from tests.reference import make_inputs, max_row_rel_err

    def resources():
        with open("/proc/self/maps") as maps:
            mapped = sum(1 for line in maps if "/dev/shm" in line)
        return len(os.listdir("/proc/self/fd")), threading.active_count(), mapped

    def rs_case(case_seed, rows, k, n):
        gen = torch.Generator().manual_seed(case_seed)
        a = [torch.randn(rows * world, k, generator=gen, dtype=torch.float64)
             for _ in range(world)]
        b = [torch.randn(k, n, generator=gen, dtype=torch.float64) for _ in range(world)]
        full = sum(x @ y for x, y in zip(a, b))
        return a[rank].float(), b[rank].float(), full[rank * rows:(rank + 1) * rows]

    rng = random.Random(seed)
    cases = []
    for rows, k, n in [(8, 32, 16), (16, 32, 40), (24, 64, 16)]:
        shards, bs, _, refs = make_inputs(rng.randrange(1 << 30), world, (rows, k), (n,),
                                          torch.float32)
        cases.append(("ag", shards[rank], bs[0], refs[0]))
        cases.append(("rs", *rs_case(rng.randrange(1 << 30), rows, k, n)))
    wrong = raised = 0
    before = None
    for i in range(calls):
        if i == 50:
            before = resources()          # after the first uses (threads, workspaces)
        op, a, b, ref = cases[rng.randrange(len(cases))]
        with ficco.config.scope(transport=rng.choice(["dma", "ccl"])):
            try:
                out = ficco.all_gather_matmul(a, b) if op == "ag" else \
                    ficco.matmul_reduce_scatter(a, b)
            except ficco.errors.FiccoError:
                raised += 1
                continue
        wrong += not _right(max_row_rel_err(out, ref))
    after = resources()
    ficco.shutdown()
    return wrong, raised, before, after


def soak(calls: int, world: int) -> dict:
    from tests import harness

    shm_before = set(glob.glob("/dev/shm/ficco-*"))
    results = harness.run_alone(world, _soak, random.randrange(1 << 30), calls,
                                timeout_s=calls * 2 + 120)
    return {"calls": calls * world, "wrong": sum(r[0] for r in results),
            "raised": sum(r[1] for r in results),
            "fds/threads/maps after 50 calls": [r[2] for r in results],
            "at the end": [r[3] for r in results],
            "leaked": len(set(glob.glob("/dev/shm/ficco-*")) - shm_before)}


# -- disagreement ---------------------------------------------------------------------------------
def _disagree(rank: int, world: int, seed: int):
    import torch

    import ficco
    from tests.reference import make_inputs

    rng = random.Random(seed)
    odd = rng.randrange(world)
    kind = rng.choice(["rows", "dtype-width", "role", "transport"])
    transport = rng.choice(["dma", "ccl"])
    warm = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    with ficco.config.scope(transport=transport, timeout=10):
        ficco.all_gather_matmul(warm[0][rank], warm[1][0])       # agreed
        rows = 9 if (rank == odd and kind == "rows") else 8
        shards, bs, _, _ = make_inputs(seed + 1, world, (rows, 16), (4,), torch.float32)
        b = bs[0] if not (rank == odd and kind == "dtype-width") else torch.randn(16, 5)
        scope = {"transport": "ccl" if transport == "dma" else "dma"} \
            if (rank == odd and kind == "transport") else {}
        start = time.monotonic()
        try:
            with ficco.config.scope(**scope):
                if rank == odd and kind == "role":
                    ficco.matmul_reduce_scatter(torch.cat([shards[rank]] * world), bs[0])
                else:
                    ficco.all_gather_matmul(shards[rank], b)
            result = "data"
        except ficco.errors.FiccoError as exc:
            result = type(exc).__name__
        seconds = time.monotonic() - start
    ficco.shutdown()
    return kind, result, seconds


def disagree(count: int, world: int) -> dict:
    from tests import harness

    totals = {"runs": 0, "every rank raised": 0, "mismatch": 0, "data": 0, "slowest s": 0.0,
              "by kind": {}}
    pool = harness.pool(world)
    for _ in range(count):
        results = pool.run(_disagree, random.randrange(1 << 30), timeout_s=120)
        totals["runs"] += 1
        kinds = {r[0] for r in results}
        results_ = [r[1] for r in results]
        totals["every rank raised"] += all(r != "data" for r in results_)
        totals["mismatch"] += all(r == "MismatchError" for r in results_)
        totals["data"] += sum(r == "data" for r in results_)
        totals["slowest s"] = max(totals["slowest s"], max(r[2] for r in results))
        for kind in kinds:
            totals["by kind"][kind] = totals["by kind"].get(kind, 0) + 1
    pool.close()
    return totals


# -- what a rank supplies on its own, and the cache's states -------------------------------------
def per_rank(count: int, world: int, calls: int) -> dict:
    """``count`` random programs of ``calls`` calls over the per-rank knobs (each rank's fp8
    scales, widths, a bias that may drift, dtype recipes, schedules, transports) with the
    cache in a random state (tests/per_rank_cases.py): outcomes counted; a program whose
    ranks crash or hang past the pool's bound counts as lost."""
    from tests import harness
    from tests.per_rank_cases import random_per_rank_program

    totals: dict = {"programs": 0, "calls (every rank's)": 0, "right": 0,
                    "refused as wanted": 0, "wrong": 0, "raw errors": 0, "ficco errors": 0,
                    "lost programs": 0, "cache states": {}, "failures": []}
    pool = harness.RankPool(world, {"FICCO_TIMEOUT": "20"})
    for _ in range(count):
        seed = random.randrange(1 << 30)
        root = tempfile.mkdtemp(prefix="ficco-campaign-cache-")
        try:
            results = pool.run(random_per_rank_program, seed, calls, root,
                               timeout_s=calls * 60)
        except harness.RankError as exc:
            totals["lost programs"] += 1
            totals["failures"].append((seed, str(exc)[-300:]))
            pool.close()
            pool = harness.RankPool(world, {"FICCO_TIMEOUT": "20"})
            continue
        totals["programs"] += 1
        state = results[0][0]
        totals["cache states"][state] = totals["cache states"].get(state, 0) + 1
        for _, outcomes in results:
            for outcome in outcomes:
                totals["calls (every rank's)"] += 1
                kind = {"right": "right", "refused": "refused as wanted", "wrong": "wrong",
                        "raw error": "raw errors", "ficco error": "ficco errors"
                        }[outcome.split(":")[0]]
                totals[kind] += 1
                if kind not in ("right", "refused as wanted"):
                    totals["failures"].append((seed, outcome))
    pool.close()
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("campaign", choices=["programs", "kill", "soak", "disagree", "per-rank"])
    parser.add_argument("count", type=int)
    parser.add_argument("--world", type=int, default=None)
    parser.add_argument("--calls", type=int, default=24, help="calls per random program")
    parser.add_argument("--timeout", type=float, default=2.0,
                        help="FICCO_TIMEOUT inside a random program")
    args = parser.parse_args()
    start = time.monotonic()
    if args.campaign == "programs":
        result = programs(args.count, args.world or 2, args.calls, args.timeout)
    elif args.campaign == "kill":
        result = kill(args.count, args.world or 3)
    elif args.campaign == "soak":
        result = soak(args.count, args.world or 2)
    elif args.campaign == "per-rank":
        result = per_rank(args.count, args.world or 2, args.calls)
    else:
        result = disagree(args.count, args.world or 2)
    result["wall seconds"] = round(time.monotonic() - start, 1)
    for key, value in result.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
