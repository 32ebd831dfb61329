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
                    if op == "all_gather_matmul":
                        a, w = x[rank].float(), b[0].float()
                        ref = x.reshape(-1, 16) @ b[0]
                    else:   # rank r: the full rows of a and its K-row shard of the weight
                        a, w = x.reshape(-1, 16).float(), b[rank].float()
                        ref = sum(x.reshape(-1, 16) @ b[r] for r in range(world)) \
                            .reshape(world, 8, 6)[rank]
                    call = ficco.all_gather_matmul if op == "all_gather_matmul" else \
                        ficco.matmul_reduce_scatter
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
