"""Rank-side functions of the issue-15 GPU tests: peer views are views, captured graphs survive
workspace growth, a stalled or failing rank makes the others raise (never return data), with
CUDA_DEVICE_MAX_CONNECTIONS=1 as well. Several processes share one GPU."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import ficco
from ficco.backends import get_backend
from ficco.errors import FiccoError

from ..cases import fail_next_gemm
from ..reference import make_inputs, max_row_rel_err
from .gpu_cases import capture, replays_match_float64


def peer_views_are_views(rank, world):
    """Every span and pad of an IPC handle is a view of the memory barriers and pulls use (a
    copy would swallow flags and serve stale pulls): device pads at their slot address on this
    rank's GPU, host pads (the default) over their host mapping (
    ``GpuSymmHandle.view_problems``)."""
    backend = get_backend()
    h = backend.symm_provider().allocate(4096, dist.group.WORLD, backend.device())
    try:
        bad = h.view_problems()
        # a value written into a peer's pad through our view is what the peer reads
        h.signal_pad((rank + 1) % world)[5, rank].fill_(100 + rank)
        torch.cuda.synchronize()
        h.barrier(channel=3, timeout_s=30)
        seen = int(h.signal_pad(rank)[5, (rank - 1) % world])
        h.barrier(channel=3, timeout_s=30)
        return bad, seen == 100 + (rank - 1) % world
    finally:
        h.close()


def capture_then_grow_then_replay(rank, world, seed):
    """Capture a small call, run a much larger one eagerly (the workspace grows), replay the
    graph on fresh data: it must still be right (the memory it points at stayed alive)."""
    device = get_backend().device()
    m, k, n = 16, 32, 8
    shard, b = torch.empty(m, k, device=device), torch.empty(k, n, device=device)
    failures = []
    with ficco.config.scope(transport="dma"):
        shard.normal_()
        b.normal_()
        graph, out = capture(lambda: ficco.all_gather_matmul(shard, b, schedule="ring"))
        shards, bs, _, refs = make_inputs(seed, world, (64 * m, k), (n,), torch.float32)
        big = ficco.all_gather_matmul(shards[rank].to(device), bs[0].to(device), schedule="ring")
        if not max_row_rel_err(big, refs[0]) <= 1e-4:
            failures.append("the large eager call is wrong")
        failures += replays_match_float64(graph, out, shard, b, rank, world, seed, 3,
                                          label="replay after growth")
    return failures


def disagreement_on_a_cached_shape(rank, world, seed):
    """A wrong result after a failure, on GPU dma: both shapes agreed and cached, then rank 0 calls with the small
    one and the others with the large one: every rank raises MismatchError (from the call or
    the group's next call) well before FICCO_TIMEOUT, outputs poisoned;
    after ficco.shutdown() the next calls in step are right."""
    from ficco.errors import MismatchError

    backend = get_backend()
    device = backend.device()
    small = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    large = make_inputs(seed + 1, world, (12, 16), (4,), torch.float32)
    report = []
    with ficco.config.scope(transport="dma", timeout=60):
        for shards, bs, _, refs in (small, large):
            out = ficco.all_gather_matmul(shards[rank].to(device), bs[0].to(device),
                                          schedule="ring")
            report.append(max_row_rel_err(out.cpu(), refs[0]))
        shards, bs, _, _ = small if rank == 0 else large
        start, out, outcome = time.monotonic(), None, "returned"
        try:
            out = ficco.all_gather_matmul(shards[rank].to(device), bs[0].to(device),
                                          schedule="ring")
            torch.cuda.synchronize()
            ficco.all_gather_matmul(shards[rank].to(device), bs[0].to(device), schedule="ring")
        except MismatchError as exc:
            outcome = f"MismatchError after {time.monotonic() - start:.1f}s: {exc}"
        torch.cuda.synchronize()
        report.append((outcome, out is None or bool(out.isnan().all())))
        ficco.shutdown()
        for _ in range(2):
            shards, bs, _, refs = small
            try:
                out = ficco.all_gather_matmul(shards[rank].to(device), bs[0].to(device),
                                              schedule="ring")
                report.append(max_row_rel_err(out.cpu(), refs[0]))
            except FiccoError as exc:     # the first call after may still carry the error
                report.append(f"{type(exc).__name__}: {exc}")
    ficco.shutdown()
    return report


def failing_rank_makes_everyone_raise(rank, world, seed):
    """Rank 1's GEMM raises once mid-call: every rank raises (the others at their group's next
    call at the latest); after shutdown() on every rank the next call is right."""
    backend = get_backend()
    device = backend.device()
    shards, bs, _, refs = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    with ficco.config.scope(transport="dma"):
        ficco.all_gather_matmul(shards[rank].to(device), bs[0].to(device), schedule="ring")
    restore = fail_next_gemm(backend) if rank == 1 else (lambda: None)
    try:
        with ficco.config.scope(transport="dma", timeout=3):
            ficco.all_gather_matmul(shards[rank].to(device), bs[0].to(device), schedule="ring")
            torch.cuda.synchronize()
            ficco.all_gather_matmul(shards[rank].to(device), bs[0].to(device), schedule="ring")
        failed = "returned"
    except FiccoError as exc:
        failed = str(exc)
    finally:
        restore()
    ficco.shutdown()
    shards, bs, _, refs = make_inputs(seed + 1, world, (8, 16), (4,), torch.float32)
    with ficco.config.scope(transport="dma"):
        out = ficco.all_gather_matmul(shards[rank].to(device), bs[0].to(device), schedule="ring")
    return failed, max_row_rel_err(out, refs[0])


def wrong_device_is_refused(rank, world):
    """With two GPUs visible, an input on the other GPU than the backend's: a clear error."""
    backend = get_backend()
    other = torch.device("cuda", 1 - backend.device().index)
    try:
        backend.check_device(torch.zeros(2, device=other), "a_shard")
    except FiccoError as exc:
        return str(exc)
    return "accepted"
