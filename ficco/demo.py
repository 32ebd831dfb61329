"""``python -m ficco demo``: spawn 4 CPU ranks, run the default choice (no settings: the
``auto`` selector times its shortlist at the first call; the row says what it picked) and
every schedule of both ops (``all_gather_matmul`` and its inverse ``matmul_reduce_scatter``)
over both transports on a few shapes (one scaled from the FiCCO paper's Table I), check each
against a float64 reference and print a table. No torchrun needed; finishes in about a minute."""
from __future__ import annotations

import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import InvalidArgumentError

# (label, rows per rank, n, K)
SHAPES = [("g6 / 512 (Table I, scaled)", 128, 256, 256), ("uneven 37 x 96 x 200", 37, 96, 200)]
TOL = 1e-4


def _case(ficco, op, name, rank, world, case, shape):
    """(call, float64 reference) of one demo case. The reduce-scatter case is the all-gather's
    transpose: every rank holds all W*m rows of ``a`` and a K/W slice, and gets its m rows."""
    _, m, n, k = shape
    gen = torch.Generator().manual_seed(1000 + case)
    full = torch.randn(world * m, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    if op == "all_gather_matmul":
        shard = full[rank * m:(rank + 1) * m]
        return (lambda: ficco.all_gather_matmul(shard, b, schedule=name),
                full.double() @ b.double())
    k0, k1 = rank * k // world, (rank + 1) * k // world
    a_r, b_r = full[:, k0:k1], b[k0:k1]
    ref = (full.double() @ b.double())[rank * m:(rank + 1) * m]
    return lambda: ficco.matmul_reduce_scatter(a_r, b_r, schedule=name), ref


def _rank(rank, world, init_file, results):
    os.environ.setdefault("FICCO_BACKEND", "cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
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
                rows.append((op, name or f"default: {ran[0]}", transport or ran[1],
                             slowest[1].item(), slowest[0].item()))
    if rank == 0:
        results.extend(rows)
    ficco.shutdown()
    dist.destroy_process_group()


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
        rows = list(results)
    print(f"ficco demo: {world} CPU ranks, float32, shapes: " + "; ".join(
        f"{label} (m={m}, n={n}, K={k})" for label, m, n, k in SHAPES))
    print(f"{'op':<22} {'schedule':<20} {'transport':<9} {'max rel err':>12} {'median ms':>10}"
          f"  ok")
    failed = 0
    for op, name, transport, err, seconds in rows:
        ok = err <= TOL
        failed += not ok
        print(f"{op:<22} {name:<20} {transport:<9} {err:>12.2e} {seconds * 1e3:>10.2f}  "
              f"{'yes' if ok else 'NO'}")
    print(f"{len(rows) - failed}/{len(rows)} within tolerance {TOL:g}; "
          f"{time.perf_counter() - start:.1f}s in all. Timings on CPU threads say nothing "
          f"about GPUs: see `python -m ficco.bench simulate`.")
    if os.path.exists(init_file):
        os.unlink(init_file)
    return 1 if failed or not rows else 0
