"""``python -m ficco demo``: spawn 4 CPU ranks and run ficco's four patterns in a small
mixture-of-experts transformer (ficco/demo/model.py: a sequence-parallel prefill block with
``all_gather_matmul`` and ``matmul_reduce_scatter``, an expert-parallel MoE layer with
``all_to_all_grouped_mm`` and ``grouped_mm_all_to_all``, a tensor-parallel decode step with
``matmul_all_reduce``), each part against its float64 unsharded twin, with what the default
choice picked (no settings: the ``auto`` selector times its shortlist at the first call) and
its time beside serial's. Then every schedule of the two sequence-parallel ops over both
transports on a few shapes (one scaled from the FiCCO paper's Table I), each against float64.
No torchrun needed; finishes in well under a minute. Exit status 1 when a check failed."""
from __future__ import annotations

import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import InvalidArgumentError
from . import model as demo_model

# (label, rows per rank, n, K)
SHAPES = [("g6 / 512 (Table I, scaled)", 128, 256, 256), ("uneven 37 x 96 x 200", 37, 96, 200)]
TOL = demo_model.TOL


def _case(ficco, op, name, rank, world, case, shape):
    """(call, float64 reference) of one demo case: the op's own example and oracle
    (``OpSpec.example``, ``OpSpec.reference``) in float32. The reduce-scatter case is the
    all-gather's transpose: every rank holds all W*m rows of ``a`` and a K/W slice, and gets
    its m rows."""
    from ..ops.examples import Rounding

    _, m, n, k = shape
    if op != "all_gather_matmul":
        k = max(1, k // world)
    spec = ficco.ops.get(op)
    example = spec.example(rank, world, (m, k, n), Rounding("float32"), 1000 + case)
    ref, _ = spec.reference(example)
    fn = getattr(ficco, op)
    return lambda: fn(*example.args, schedule=name, **example.kwargs), ref


def sweep(rank: int, world: int) -> list[tuple]:
    """Every schedule of both sequence-parallel ops over both transports (the default choice
    first), worst over ranks: ``(op, schedule, transport, max rel err, median s)``."""
    import ficco

    rows = []
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        # None first: the default choice, no settings (the auto selector times its shortlist)
        for name in (None, *ficco.schedules.names(op=op)):
            for transport in ((None,) if name is None else ("dma", "ccl")):
                worst, times, ran = 0.0, [], None
                for case, shape in enumerate(SHAPES):
                    run, ref = _case(ficco, op, name, rank, world, case, shape)
                    with ficco.config.scope(**({"transport": transport} if transport else {})):
                        out = run()
                        ran = ran or ficco.api.last_run()
                        err = ((out.double() - ref).norm() / ref.norm()).item()
                        worst = max(worst, float("inf") if math.isnan(err) else err)
                        if case == 0:
                            for _ in range(3):
                                dist.barrier()
                                start = time.perf_counter()
                                run()
                                times.append(time.perf_counter() - start)
                slowest = torch.tensor([statistics.median(times), worst], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                # one rank: ficco runs a plain matmul, no schedule, no transport
                ran = ran or ("plain matmul", "-")
                rows.append((op, name or f"default: {ran[0]}", transport or ran[1],
                             slowest[1].item(), slowest[0].item()))
    return rows


def _rank(rank, world, init_file, results):
    os.environ.setdefault("FICCO_BACKEND", "cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    import ficco

    parts = demo_model.run(rank, world)
    rows = sweep(rank, world)
    if rank == 0:
        results.append((parts, rows))
    ficco.shutdown()
    dist.destroy_process_group()


def report(world: int, parts: list, rows: list) -> tuple[int, int]:
    """Print the parts (demo_model.run's rows) and the sweep's table; ``(failed, checks)``."""
    failed = 0
    ranks = f"{world} CPU rank{'s' if world > 1 else ''}"
    print(f"ficco demo: {ranks}, float32; every result checked against float64 on one process "
          f"(ok: relative error <= {TOL:g}).")
    model = demo_model.Model.for_world(world)
    print(f"\n1. A small mixture-of-experts transformer on {ranks} ({model.describe()}).\n"
          f"   Per ficco call: the schedule the default choice picked (auto: timed at the "
          f"call's first sight),\n   its median time, and its time when every call is forced "
          f"serial.\n")
    print(f"{'part / call':<13} {'op':<22} {'default pick':<24} {'default ms':>10} "
          f"{'serial ms':>10}")
    for name, what, err, calls in parts:
        ok = err <= TOL
        failed += not ok
        print(f"{name:<13} {what}: rel err {err:.1e}, {'ok' if ok else 'FAILED'}")
        for label, op, pick, default_s, serial_s in calls:
            print(f"  {label:<11} {op:<22} {pick:<24} {default_s * 1e3:>10.2f} "
                  f"{serial_s * 1e3:>10.2f}")
    print("\n2. Every schedule of the two sequence-parallel ops over both transports, on\n   "
          + "; ".join(f"{label} (m={m}, n={n}, K={k})" for label, m, n, k in SHAPES) + ".\n")
    print(f"{'op':<22} {'schedule':<20} {'transport':<9} {'max rel err':>12} {'median ms':>10}"
          f"  ok")
    for op, name, transport, err, seconds in rows:
        ok = err <= TOL
        failed += not ok
        print(f"{op:<22} {name:<20} {transport:<9} {err:>12.2e} {seconds * 1e3:>10.2f}  "
              f"{'yes' if ok else 'NO'}")
    return failed, len(parts) + len(rows)


def main(world: int = 4) -> int:
    if world < 1:
        # zero ranks would run nothing and report "0/0 within tolerance" as a pass
        raise InvalidArgumentError(f"the demo needs at least 1 rank; got world={world}")
    fd, init_file = tempfile.mkstemp(prefix="ficco-demo-")
    os.close(fd)
    os.unlink(init_file)
    start = time.perf_counter()
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(_rank, args=(world, init_file, results), nprocs=world, join=True)
        (parts, rows), = list(results)
    failed, checks = report(world, parts, rows)
    print(f"\n{checks - failed}/{checks} checks within tolerance; "
          f"{time.perf_counter() - start:.1f}s in all. Timings on CPU threads say nothing "
          f"about GPUs: see `python -m ficco.bench simulate`.")
    if os.path.exists(init_file):
        os.unlink(init_file)
    return 1 if failed or not checks else 0
