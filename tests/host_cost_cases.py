"""Rank functions of tests/engine/test_host_cost.py (importable without the names it tests)."""
from __future__ import annotations

from ficco import schedules


def fake_gpu_calls(rank, world, seed, batch, schedules_of=None, experts=None):
    """Every dma schedule of both dense ops (or ``schedules_of``: op -> names) through the API
    on the fake GPU (copies batched or one call each), two calls of fresh data each (a first, then a warm one): the worst
    relative error against float64 and the device commands of the warm call, per (op,
    schedule). With ``experts`` (schedule names), returns ``(that, fake_gpu_expert's)``."""
    import torch

    import ficco

    from . import fake_gpu
    from .reference import max_row_rel_err

    if schedules_of is None:
        schedules_of = {op: schedules.names(op=op)
                        for op in ("all_gather_matmul", "matmul_reduce_scatter")}
    ficco.shutdown()
    fake_gpu.install("cuda", 8, batch_copies=batch)
    found = {}
    try:
        gen = torch.Generator().manual_seed(seed)
        for op, names in schedules_of.items():
            for name in names:
                worst, calls = 0.0, 0
                for _ in range(2):
                    b = torch.randn(world, 16, 6, dtype=torch.float64, generator=gen)
                    x = torch.randn(world, 8, 16, dtype=torch.float64, generator=gen)
                    # inputs held until the device ran the call (CPU tensors: no caching
                    # allocator keeps them for the queued work)
                    call, a, w, ref = _dense_case(op, rank, world, x, b)
                    with ficco.config.scope(transport="dma"):
                        before = fake_gpu.submitted()
                        out = call(a, w, schedule=name)
                        calls = fake_gpu.submitted() - before
                        torch.cuda.synchronize()
                    worst = max(worst, max_row_rel_err(out, ref))
                found[(op, name)] = (worst, calls)
        if experts is not None:
            return found, _expert_calls(rank, world, seed, experts)
    finally:
        ficco.shutdown()
        fake_gpu.uninstall()
    return found


def warmup_then_calls(rank, world, seed, cache_dir):
    """``ficco.warmup`` of two all-gather shapes (a fresh auto cache), then one real call of
    each with fresh data: (what warmup ran, shortlist timings during warmup, during the real
    calls, the real calls' errors against float64)."""
    import os

    import torch

    import ficco
    from ficco.heuristics import measured

    from .reference import max_row_rel_err

    ficco.shutdown()
    os.environ["FICCO_CACHE_DIR"] = cache_dir
    k = 40 + 8 * (seed % 50)          # a K no other test's key has
    shapes = [(4, k, 6), (40, k, 6)]
    timed: list[str] = []
    real = measured.time_candidates

    def counting(*args, **kwargs):
        timed.append("warmup" if phase == "warmup" else "call")
        return real(*args, **kwargs)

    measured.time_candidates = counting
    try:
        with ficco.config.scope(selector="auto"):    # the pool's ranks run the model's
            phase = "warmup"
            ran = ficco.warmup("all_gather_matmul", shapes, dtype=torch.float32)
            phase = "calls"
            gen = torch.Generator().manual_seed(seed)
            errors = []
            for rows, kk, n in shapes:
                x = torch.randn(world, rows, kk, dtype=torch.float64, generator=gen)
                b = torch.randn(kk, n, dtype=torch.float64, generator=gen)
                out = ficco.all_gather_matmul(x[rank].float(), b.float())
                errors.append(max_row_rel_err(out, x.reshape(-1, kk) @ b))
    finally:
        measured.time_candidates = real
        os.environ.pop("FICCO_CACHE_DIR", None)
    return ran, timed.count("warmup"), timed.count("call"), errors



def _dense_case(op, rank, world, x, b):
    """(the op's API call, a, b, the float64 reference) of this rank, from every rank's ``x``
    (world, 8, 16) and ``b`` (world, 16, 6)."""
    import functools

    import ficco

    if op == "all_gather_matmul":
        return ficco.all_gather_matmul, x[rank].float(), b[0].float(), x.reshape(-1, 16) @ b[0]
    if op == "matmul_reduce_scatter":   # rank r: the full rows of a, its K-row shard of b
        ref = sum(x.reshape(-1, 16) @ b[r] for r in range(world)).reshape(world, 8, 6)[rank]
        return ficco.matmul_reduce_scatter, x.reshape(-1, 16).float(), b[rank].float(), ref
    if op == "matmul_all_reduce":       # rank r: its K columns of a and K rows of b
        ref = sum(x[r] @ b[r] for r in range(world))
        return ficco.matmul_all_reduce, x[rank].float(), b[rank].float(), ref
    # The Ulysses pair: 6 columns over 3 ranks, 2 each (world 3).
    cols = slice(6 // world * rank, 6 // world * (rank + 1))
    if op == "matmul_all_to_all":       # rank r: 8 tokens; rank j gets every token, cols j
        call = functools.partial(ficco.matmul_all_to_all, scatter_dim=1, gather_dim=0)
        return call, x[rank].float(), b[0].float(), (x.reshape(-1, 16) @ b[0])[:, cols]
    # all_to_all_matmul: rank r holds every token's K columns r (16 = 6 + 5 + 5 at W = 3);
    # rank j gets its 8 tokens with every column, times b (16 x 6)
    ks = [16 // world + (1 if r < 16 % world else 0) for r in range(world)]
    k0 = sum(ks[:rank])
    full = x.reshape(-1, 16)
    call = functools.partial(ficco.all_to_all_matmul, scatter_dim=0, gather_dim=1)
    ref = full[8 * rank: 8 * (rank + 1)] @ b[0]
    return call, full[:, k0: k0 + ks[rank]].float(), b[0].float(), ref


def fake_gpu_expert(rank, world, seed, batch, names):
    """The expert ops' ``names`` schedules over dma on the fake GPU (copies batched or one call
    each): :func:`_expert_calls`."""
    import ficco

    from . import fake_gpu

    ficco.shutdown()
    fake_gpu.install("cuda", 8, batch_copies=batch)
    try:
        return _expert_calls(rank, world, seed, names)
    finally:
        ficco.shutdown()
        fake_gpu.uninstall()


def _expert_calls(rank, world, seed, names):
    """On the installed fake GPU, dispatch, then combine of its result, two calls each on fresh
    uneven routings (float32, 2 experts per rank), against float64. Returns {schedule: (worst
    dispatch error, worst combine error, recv counts right, device commands of the second
    dispatch, of the second combine)}."""
    import torch

    import ficco
    from ficco import config

    from . import fake_gpu
    from .ep_cases import dispatch_reference, make_case, round_trip_reference
    from .reference import max_row_rel_err

    found = {}
    local = slice(rank * 2, rank * 2 + 2)
    for n, name in enumerate(names):
        worst_y = worst_z = 0.0
        recv_right = True
        for case in range(2):
            counts, xs, w, w2 = make_case(seed + 2 * n + case, world, 2)
            y_ref, recv_ref = dispatch_reference(counts, xs, w, rank, 2)
            z_ref = round_trip_reference(counts, xs, w, w2, rank)
            x, c = xs[rank].float(), torch.tensor(counts[rank])
            wl, w2l = w[local].float(), list(w2[local].float())
            with config.scope(transport="dma"):
                before = fake_gpu.submitted()
                y, recv = ficco.all_to_all_grouped_mm(x, c, wl, schedule=name)
                mid = fake_gpu.submitted()
                z = ficco.grouped_mm_all_to_all(y, recv, w2l, schedule=name)
                end = fake_gpu.submitted()
                torch.cuda.synchronize()
            recv_right = recv_right and recv.tolist() == recv_ref
            worst_y = max(worst_y, max_row_rel_err(y, y_ref))
            worst_z = max(worst_z, max_row_rel_err(z, z_ref))
        found[name] = (worst_y, worst_z, recv_right, mid - before, end - mid)
    return found


def main() -> None:
    """``PYTHONPATH=. python -m tests.host_cost_cases``: the device commands of one warm call of
    every schedule of every op on the fake GPU (three ranks, rank 0's count; copies one call
    each, then batched) and the worst error against float64 over both modes, as a table."""
    import random

    from ficco.ops.expert.problem import DISPATCH

    from . import harness

    seed = random.randrange(1 << 30)
    dense = {op: schedules.names(op=op) for op in
             ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
              "matmul_all_to_all", "all_to_all_matmul")}
    experts = schedules.names(op=DISPATCH)
    runs = [harness.pool(3).run(fake_gpu_calls, seed, batch, dense, experts, timeout_s=1800)
            for batch in (False, True)]
    print("| op | schedule | commands, one call per copy | batched | worst error vs float64 |")
    print("|---|---|---|---|---|")
    for (op, name), (_, plain) in runs[0][0][0].items():
        batched = runs[1][0][0][(op, name)][1]
        err = max(run[rank][0][(op, name)][0] for run in runs for rank in range(3))
        print(f"| {op} | {name} | {plain} | {batched} | {err:.1e} |")
    for name, found in runs[0][0][1].items():
        batched = runs[1][0][1][name]
        err = max(max(run[rank][1][name][:2]) for run in runs for rank in range(3))
        print(f"| all_to_all_grouped_mm + grouped_mm_all_to_all | {name} | {found[3]} + "
              f"{found[4]} | {batched[3]} + {batched[4]} | {err:.1e} |")


if __name__ == "__main__":
    main()
