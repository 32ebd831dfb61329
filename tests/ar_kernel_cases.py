"""Rank-side functions for the one-kernel all-reduce's fault tests (importable by spawned
ranks): a late peer, then the group made right again by ficco.shutdown()."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import ficco
from ficco import config
from ficco.errors import FiccoError


def _inputs(seed, world, rank, rows=5, k=6, n=4):
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(rows, k, generator=gen, dtype=torch.float64) for _ in range(world)]
    b = [torch.randn(k, n, generator=gen, dtype=torch.float64) for _ in range(world)]
    return a[rank].float(), b[rank].float(), sum(x @ y for x, y in zip(a, b))


def late_peer(rank, world, seed, schedule, late_s):
    """The last rank calls ``late_s`` (past FICCO_TIMEOUT) after the others: every rank must
    raise (never return data) and do so within FICCO_TIMEOUT of reaching the kernel's wait;
    after ficco.shutdown() on every rank the next call is exact. Returns (outcome, seconds
    the call took, error of the call after the shutdown)."""
    a, b, _ = _inputs(seed, world, rank)
    with config.scope(transport="dma"):
        ficco.matmul_all_reduce(a, b, schedule=schedule)     # agreed, warm: no exchange
        dist.barrier()
        if rank == world - 1:
            time.sleep(late_s)
        started = time.monotonic()
        try:
            out = ficco.matmul_all_reduce(a, b, schedule=schedule)
            outcome = "NaN" if bool(out.isnan().all()) else "data"
        except FiccoError as exc:
            outcome = type(exc).__name__
        took = time.monotonic() - started
        dist.barrier()
        ficco.shutdown()
        a, b, ref = _inputs(seed + 1, world, rank)
        out = ficco.matmul_all_reduce(a, b, schedule=schedule)
    ficco.shutdown()
    return outcome, took, float((out.double() - ref).abs().max() / ref.abs().max())


def torch_plumbing(rank, world, seed, cases):
    """torch's kernels cannot run on CPU: ``torch-*`` run here with stand-ins for
    ``torch.ops.symm_mem`` (the process group's all-reduce, with torch's signatures: input,
    reduce_op, group_name[, out]), for torch's rendezvoused buffer (a copy) and for the
    availability check (CUDA only), so the plan, its
    barriers, the avg scale, wide outputs (a bias) and several b are checked, not torch's
    kernels. Returns run_grid's failures and the stand-in's calls."""
    from ficco.ops.matmul_all_reduce.schedules import torch_kernels

    from .ar_cases import run_grid

    seen = []

    def stand_in(name):
        def kernel(source, reduce_op, group_name, out=None):
            seen.append((name, reduce_op, group_name == dist.group.WORLD.group_name,
                         out is not None))
            total = source.clone()
            dist.all_reduce(total)
            if out is None:
                source.copy_(total)
                return source
            out.copy_(total)
            return out
        return kernel

    saved = torch_kernels.torch_op, torch_kernels.symmetric_input, torch_kernels.torch_reason
    torch_kernels.torch_op = stand_in
    torch_kernels.symmetric_input = lambda partial, group: partial.clone()
    torch_kernels.torch_reason = lambda variant, target: None     # "runs here"
    try:
        return run_grid(rank, world, seed, cases), sorted(set(seen))
    finally:
        (torch_kernels.torch_op, torch_kernels.symmetric_input,
         torch_kernels.torch_reason) = saved


def explain_decode(rank, world, profile):
    """``ficco.explain`` of a decode-sized all-reduce on ``profile``: its printed text."""
    with config.scope(profile=profile):
        return str(ficco.explain(torch.randn(4, 64), torch.randn(64, 4096),
                                 op="matmul_all_reduce"))


def on_fake_gpu(rank, world, seed, names):
    """The one-kernel schedules on the fake GPU (tests/fake_gpu.py: the GPU backend's
    symmetric handles, device-address slots and the group's error word as the kernel's halt,
    tensors in host memory, the kernel in the interpreter): each name's error against float64
    and whether the group's word stayed down."""
    from ficco.backends import get_backend

    from .fault_cases import _setup

    _setup("cuda", 8)
    device = get_backend().device()
    out = {}
    with config.scope(transport="dma"):
        for i, name in enumerate(names):
            a, b, ref = _inputs(seed + i, world, rank)
            got = ficco.matmul_all_reduce(a.to(device), b.to(device), schedule=name)
            torch.cuda.synchronize()
            out[name] = float((got.double().cpu() - ref).abs().max() / ref.abs().max())
    ficco.shutdown()
    return out


def new_to_one_rank(rank, world, seed, schedule, timeout_s):
    """An agreed call (5 rows on every rank), then rank 0 calls with 6 rows (new to it: it
    opens the first-call exchange) while its peers repeat the agreed 5 rows (they go straight
    to the one-kernel all-reduce's wait), then the group refused, then made right by
    ficco.shutdown(). Returns (kind, message, seconds) of the uneven call, the refused call's
    kind, and the error of the call after the shutdown."""
    def call(rows, s):
        a, b, ref = _inputs(s, world, rank, rows=rows)
        out = ficco.matmul_all_reduce(a, b, schedule=schedule)
        return float((out.double() - ref).abs().max() / ref.abs().max())

    def outcome(fn):
        started = time.monotonic()
        try:
            return ("ok", str(fn()), time.monotonic() - started)
        except FiccoError as exc:
            return (type(exc).__name__, str(exc), time.monotonic() - started)

    with config.scope(transport="dma", timeout=timeout_s):
        first = call(5, seed)
        uneven = outcome(lambda: call(6 if rank == 0 else 5, seed + 1))
        refused = outcome(lambda: call(5, seed + 2))[0]
        dist.barrier()
        ficco.shutdown()
        after = call(5, seed + 3)
    ficco.shutdown()
    return first, uneven, refused, after


def new_to_one_rank_on_fake_gpu(rank, world, seed, schedule, timeout_s):
    """:func:`new_to_one_rank` on the fake GPU (the kernel's launch is asynchronous there, as
    on a GPU): for the uneven call and the one after it, (kind, message, seconds, whether
    the output was all NaN); then the error of a call after ficco.shutdown()."""
    from ficco.backends import get_backend

    from .fault_cases import _setup

    _setup("cuda", 8)
    device = get_backend().device()

    def call(rows, s):
        a, b, ref = _inputs(s, world, rank, rows=rows)
        out = ficco.matmul_all_reduce(a.to(device), b.to(device), schedule=schedule)
        torch.cuda.synchronize()
        return out.cpu(), ref

    def outcome(rows, s):
        started = time.monotonic()
        try:
            out, _ = call(rows, s)
            return ("ok", "", time.monotonic() - started, bool(out.isnan().all()))
        except FiccoError as exc:
            return (type(exc).__name__, str(exc), time.monotonic() - started, None)

    with config.scope(transport="dma", timeout=timeout_s):
        call(5, seed)
        uneven = outcome(6 if rank == 0 else 5, seed + 1)
        following = outcome(5, seed + 2)
        dist.barrier()
        ficco.shutdown()
        _setup("cuda", 8)
        out, ref = call(5, seed + 3)
    ficco.shutdown()
    return uneven, following, float((out.double() - ref).abs().max() / ref.abs().max())
