"""Rank-side functions of the GPU fault tests: on the fake GPU of tests/fake_gpu.py
in CI (tests/engine/test_gpu_faults.py: host threads for hardware queues, stream memory operations
over host memory), and unchanged on a real GPU (tests/gpu/test_gpu_faults.py, where the pool
sets FICCO_TEST_REAL_GPU=1 and CUDA_DEVICE_MAX_CONNECTIONS before CUDA starts)."""
from __future__ import annotations

import contextlib
import os
import time
from typing import ClassVar

import torch

import ficco
from ficco.backends import get_backend

from . import fake_gpu
from .reference import make_inputs, max_row_rel_err


def schedules_match_float64(rank, world, vendor, hw_queues, names, seed):
    _setup(vendor, hw_queues)
    errors = {}
    with ficco.config.scope(transport="dma"):
        for i, name in enumerate(names):
            shards, bs, _, refs = _inputs(seed + i, world, (13, 24), 7)
            out = ficco.all_gather_matmul(shards[rank], bs[0], schedule=name)
            torch.cuda.synchronize()
            errors[name] = max_row_rel_err(out, refs[0])
    return errors


def _bounded(fn, seconds):
    """``fn()`` on a helper thread: ("ok", value), ("raised", exception) or ("hung", None) if
    it did not return within ``seconds`` (a hang is left behind on its daemon thread)."""
    import threading

    box = []

    def run():
        try:
            box.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box.append(("raised", exc))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if box:
        return box[0]
    import sys
    import traceback

    return ("hung", "".join(traceback.format_stack(sys._current_frames()[thread.ident])[-14:]))


def _warm_up(rank, world, schedule, shape=(8, 16), n=4):
    """One call every rank makes (the workspace is allocated collectively), checked."""
    shards, bs, _, refs = _inputs(1, world, shape, n)
    with ficco.config.scope(transport="dma"):
        out = ficco.all_gather_matmul(shards[rank], bs[0], schedule=schedule)
    torch.cuda.synchronize()
    assert max_row_rel_err(out, refs[0]) <= 1e-4
    return shards, bs


def _call(a, b, schedule, timeout_s, group=None):
    """One dma call (config scopes are per thread: set here, where it runs)."""
    with ficco.config.scope(transport="dma", timeout=timeout_s):
        return ficco.all_gather_matmul(a, b, group, schedule=schedule)


def _outcome(result) -> str:
    kind, value = result
    if kind == "raised":
        return f"{type(value).__name__}: {value}"
    return kind if kind != "hung" else f"hung at {value}"


_ENV_KEYS = ("CUDA_DEVICE_MAX_CONNECTIONS", "GPU_MAX_HW_QUEUES", "FICCO_SIGNAL_PADS")


def _real() -> bool:
    return os.environ.get("FICCO_TEST_REAL_GPU") == "1"


class _RealDevice:
    blocking: ClassVar[list] = []   # a real device cannot tell which thread blocked


def _setup(vendor, hw_queues, env=None):
    """A fresh fake device and backend for one test on a reused rank pool (on a real GPU the
    real one; its hardware queues are the pool's CUDA_DEVICE_MAX_CONNECTIONS): what the last
    test left (workspaces, failed groups, agreements) goes with ficco.shutdown()."""
    ficco.shutdown()
    for key in _ENV_KEYS:
        if not (_real() and key == "CUDA_DEVICE_MAX_CONNECTIONS"):
            os.environ.pop(key, None)
    os.environ.update({k: v for k, v in (env or {}).items()
                       if not (_real() and k == "CUDA_DEVICE_MAX_CONNECTIONS")})
    if _real():
        return _RealDevice()
    return fake_gpu.install(vendor, hw_queues)


def _inputs(seed, world, shape=(8, 16), n=4, device=None):
    """make_inputs' shards and b's on the backend's device (or ``device``)."""
    shards, bs, full, refs = make_inputs(seed, world, shape, (n,), torch.float32)
    device = device or get_backend().device()
    return [s.to(device) for s in shards], [b.to(device) for b in bs], full, refs


@contextlib.contextmanager
def _capture():
    """A graph capture: the fake device's, or a CUDA/HIP graph on a real GPU."""
    if not _real():
        with fake_gpu.capture() as graph:
            yield graph
        return
    graph = torch.cuda.CUDAGraph()
    graph.nodes, graph.invalidated = (), None
    with torch.cuda.graph(graph):
        yield graph


def _signal_done(tag):
    """This rank finished its part of test ``tag`` (the stalled rank waits for all)."""
    import torch.distributed as dist

    dist.distributed_c10d._get_default_store().add(f"fake-gpu-done/{tag}", 1)


def _stall(tag, world, seconds):
    """The stalled rank: make no call until every other rank is done (bounded)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + seconds
    while store.add(f"fake-gpu-done/{tag}", 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return "stalled"


def stalled_peer(rank, world, tag, vendor, hw_queues, env, schedule, calls, timeout_s):
    """The last rank never makes the call. Every other rank enqueues ``calls`` calls (the
    first may be stuck, the rest queue behind it, as layers of a model would), then waits for
    the device; returns (seconds until the device drained or "hung", whether every output of
    those calls is NaN, what the next call raised, the blocking host calls the watchdog made,
    the watchdog's outcome counts)."""
    device = _setup(vendor, hw_queues, env)
    shards, bs = _warm_up(rank, world, schedule)
    if rank == world - 1:
        return _stall(tag, world, 30 + 4 * timeout_s * calls)
    outs = []
    start = time.monotonic()
    for _ in range(calls):
        outs.append(_call(shards[rank], bs[0], schedule, timeout_s))
    drained = _bounded(torch.cuda.synchronize, 4 * timeout_s * calls + 10)
    seconds = time.monotonic() - start if drained[0] != "hung" else "hung"
    poisoned = drained[0] != "hung" and all(bool(o.isnan().all()) for o in outs)
    nxt = _bounded(lambda: _call(shards[rank], bs[0], schedule, timeout_s), 3 * timeout_s + 5)
    watchdog_blocked = [what for thread, what in device.blocking if thread == "ficco-watchdog"]
    outcomes = dict(getattr(get_backend()._watchdog, "outcomes", {}))
    _signal_done(tag)
    return seconds, poisoned, _outcome(nxt), watchdog_blocked, outcomes


def two_groups(rank, world, tag, timeout_s):
    """Group A times out (the last rank never calls it) while every rank
    makes two calls on group B. B's results must be right and B's next call must not raise
    A's error; A's next call raises its own."""
    import torch.distributed as dist

    _setup("cuda", 8)
    group_a, group_b = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    shards, bs = _warm_up(rank, world, "ring")
    for g in (group_a, group_b):
        with ficco.config.scope(transport="dma"):
            ficco.all_gather_matmul(shards[rank], bs[0], g, schedule="ring")
    torch.cuda.synchronize()
    stalled = rank == world - 1
    if not stalled:
        _call(shards[rank], bs[0], "ring", timeout_s, group_a)       # released at its deadline
    b_errors = []
    for i in range(2):
        b_shards, b_bs, _, refs = _inputs(100 + i, world)
        out = _call(b_shards[rank], b_bs[0], "ring", 20.0, group_b)
        torch.cuda.synchronize()
        b_errors.append(max_row_rel_err(out, refs[0]))
    b_shards, b_bs, _, refs = _inputs(200, world)
    b_next = _bounded(lambda: _call(b_shards[rank], b_bs[0], "ring", 20.0, group_b), 30)
    torch.cuda.synchronize()
    b_next = max_row_rel_err(b_next[1], refs[0]) if b_next[0] == "ok" else _outcome(b_next)
    a_next = "stalled" if stalled else _outcome(
        _bounded(lambda: _call(shards[rank], bs[0], "ring", timeout_s, group_a), 15))
    # The groups go now, on every rank alike (their release runs collective steps), not
    # whenever the garbage collector gets to them during a later test.
    torch.cuda.synchronize()
    dist.barrier()
    ficco.shutdown()
    for g in (group_a, group_b):
        dist.destroy_process_group(g)
    import gc

    gc.collect()
    return b_errors, b_next, a_next


def replay_after_shutdown(rank, world, seed):
    """A call captured into a graph, replayed, then ficco.shutdown() on every
    rank: a replay must still read live memory and be right."""
    _setup("cuda", 8)
    shards, bs = _warm_up(rank, world, "uniform-fused-1d", shape=(8, 16), n=4)
    a, b = shards[rank].clone(), bs[0].clone()
    with _capture() as graph, ficco.config.scope(transport="dma"):
        out = ficco.all_gather_matmul(a, b, schedule="uniform-fused-1d")
    errors = []
    for i in range(2):
        if i == 1:
            ficco.shutdown()
        new, new_bs, _, refs = _inputs(seed + i, world, device=a.device)
        a.copy_(new[rank])
        b.copy_(new_bs[0])
        graph.replay()
        result = _bounded(torch.cuda.synchronize, 30)
        errors.append(max_row_rel_err(out, refs[0]) if result[0] == "ok" else _outcome(result))
    return errors


def late_peer(rank, world, tag, timeout_s, env=None):
    """The last rank is late for call 1; the others give up on it and run
    call 2 (other data, same shapes) right behind. When the late rank finally makes call 1, it
    must raise or return NaN, never a result built from the others' call-2 rows. ``env``:
    e.g. device signal pads."""
    _setup("cuda", 8, env)
    _shards, _bs = _warm_up(rank, world, "ring")
    x1, b1, _, refs1 = _inputs(300, world)
    x2, _b2, _, _ = _inputs(301, world)
    if rank == world - 1:
        _stall(tag, world, 30 + 8 * timeout_s)        # until the others drained both calls
        result = _bounded(lambda: _call(x1[rank], b1[0], "ring", timeout_s), 15)
        if result[0] != "ok":
            return _outcome(result)
        torch.cuda.synchronize()
        out = result[1]
        return "NaN" if bool(out.isnan().all()) else f"data, error {max_row_rel_err(out, refs1[0])}"
    _call(x1[rank], b1[0], "ring", timeout_s)
    _call(x2[rank], b1[0], "ring", timeout_s)
    drained = _bounded(torch.cuda.synchronize, 8 * timeout_s + 10)
    _signal_done(tag)
    return drained[0]


def hip_capture_is_refused_before_it_begins(rank, world):
    """A multi-rank dma call inside a HIP graph capture is refused with
    nothing enqueued into the capture and nothing that invalidates it; eager calls go on."""
    from ficco.errors import InvalidArgumentError

    _setup("rocm", 4)
    shards, bs = _warm_up(rank, world, "ring")
    with _capture() as graph:
        try:
            with ficco.config.scope(transport="dma"):
                ficco.all_gather_matmul(shards[rank], bs[0], schedule="ring")
            outcome = "captured"
        except InvalidArgumentError as exc:
            outcome = str(exc)
    shards, bs, _, refs = _inputs(400, world)
    with ficco.config.scope(transport="dma"):
        out = ficco.all_gather_matmul(shards[rank], bs[0], schedule="ring")
    torch.cuda.synchronize()
    return outcome, len(graph.nodes), graph.invalidated, max_row_rel_err(out, refs[0])


def gated_with_one_hardware_queue(rank, world, names, timeout_s):
    """With one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) a gated GEMM
    launched before its copies holds the queue while it waits for them."""
    _setup("cuda", 1, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    errors = {}
    for i, name in enumerate(names):
        shards, bs, _, refs = _inputs(500 + i, world, (13, 24), 7)
        result = _bounded(lambda: _call(shards[rank], bs[0], name, timeout_s), 4 * timeout_s + 20)
        if result[0] == "ok":
            done = _bounded(torch.cuda.synchronize, 4 * timeout_s + 20)
            errors[name] = max_row_rel_err(result[1], refs[0]) if done[0] == "ok" \
                else _outcome(done)
        else:
            errors[name] = _outcome(result)
    return errors


def late_within_timeout(rank, world, names, late_s, timeout_s):
    """The last rank makes each call ``late_s`` seconds after the others, well
    inside FICCO_TIMEOUT = ``timeout_s``: every rank's result must be exact (the gated GEMM's
    tiles wait for the late rows however fast they poll)."""
    import torch.distributed as dist

    _setup("cuda", 8)
    errors = {}
    for i, name in enumerate(names):
        _warm_up(rank, world, name, shape=(13, 24), n=7)
        shards, bs, _, refs = _inputs(600 + i, world, (13, 24), 7)
        dist.barrier()
        if rank == world - 1:
            time.sleep(late_s)
        result = _bounded(lambda: _call(shards[rank], bs[0], name, timeout_s), 4 * timeout_s)
        if result[0] == "ok":
            done = _bounded(torch.cuda.synchronize, 4 * timeout_s)
            errors[name] = max_row_rel_err(result[1], refs[0]) if done[0] == "ok" \
                else _outcome(done)
        else:
            errors[name] = _outcome(result)
        # the next call of this group raises whatever this one left (nothing, when right)
        nxt = _bounded(lambda: _call(shards[rank], bs[0], name, timeout_s), 4 * timeout_s)
        torch.cuda.synchronize()
        errors[name + " next"] = "ok" if nxt[0] == "ok" else _outcome(nxt)
    return errors


def gated_kernel_gives_up(rank, world, name, timeout_s):
    """Rank 0's copy queue never raises one arrival flag (a stuck copy), every
    barrier passes: its gated GEMM waits ``timeout_s`` and gives up. That call's outputs must
    be NaN, every one of them (they kept the other tiles' values, and the skipped tile's
    earlier contents, with nothing raised), and the group's next call raises."""
    from ficco import executor

    _setup("cuda", 8)
    shards, bs = _warm_up(rank, world, name, shape=(13, 24), n=7)
    real = executor.raise_flag
    if rank == 0:
        executor.raise_flag = lambda backend, queue, flags, index: None if index == 1 else \
            real(backend, queue, flags, index)
    try:
        out = _call(shards[rank], bs[0], name, timeout_s)
        done = _bounded(torch.cuda.synchronize, 4 * timeout_s + 10)
    finally:
        executor.raise_flag = real
    all_nan = done[0] == "ok" and bool(out.isnan().all())
    nxt = _bounded(lambda: _call(shards[rank], bs[0], name, timeout_s), 4 * timeout_s + 10)
    return done[0], all_nan, _outcome(nxt)


def capture_that_must_allocate(rank, world):
    """A dma call captured before any eager call of its size must allocate (or
    grow) the group's workspace, which synchronizes and allocates: refused with a clear error
    before anything is captured, the capture intact; eager calls and a capture after them
    go on."""
    from ficco.errors import InvalidArgumentError

    _setup("cuda", 8)
    shards, bs, _, refs = _inputs(700, world)
    outcomes = []
    for _ in range(2):     # a fresh group, then a workspace too small for the call
        with _capture() as graph:
            try:
                _call(shards[rank], bs[0], "ring", 20.0)
                outcome = "captured"
            except InvalidArgumentError as exc:
                outcome = str(exc)
        outcomes.append((outcome, len(graph.nodes), graph.invalidated))
        _warm_up(rank, world, "ring", shape=(2, 16), n=4)    # smaller than the call
    out = _call(shards[rank], bs[0], "ring", 20.0)
    torch.cuda.synchronize()
    return outcomes, max_row_rel_err(out, refs[0])


def gated_grid_of_shared_gpu(rank, world, name):
    """The grid (programs) each rank's gated GEMM launches with, and its error,
    with ``world`` ranks sharing one (fake) GPU."""
    from ficco.kernels import gated_gemm as module

    _setup("cuda", 8)
    real, grids = module.gated_gemm, []

    def recording(*args, **kwargs):
        grids.append(kwargs.get("max_programs"))
        return real(*args, **kwargs)

    module.gated_gemm = recording
    try:
        shards, bs, _, refs = _inputs(800, world, (13, 24), 7)
        out = _call(shards[rank], bs[0], name, 20.0)
        torch.cuda.synchronize()
    finally:
        module.gated_gemm = real
    return grids, max_row_rel_err(out, refs[0])


def peer_views(rank, world, env):
    """tests/gpu's peer-view check, run on the fake GPU with ``env``'s signal pads."""
    from .gpu.gpu_fault_cases import peer_views_are_views

    _setup("cuda", 8, env)
    return peer_views_are_views(rank, world)


def one_rank_cannot_close_its_workspace(rank, world, seed):
    """The workspace grows while rank 0's old one cannot be closed (its queues did not
    drain): every rank keeps the old one, so no rank's release exchange meets a peer's
    allocation. Returns each call's error against float64."""
    from ficco.symm_mem import workspace

    _setup("cuda", 8)
    real = workspace.drained
    if rank == 0:
        workspace.drained = lambda backend, lane: False
    errors = []
    try:
        with ficco.config.scope(transport="dma", timeout=10):
            for i, shape in enumerate([(4, 8), (64, 96)]):     # the second grows it
                shards, bs, _, refs = _inputs(seed + i, world, shape, 16)
                out = ficco.all_gather_matmul(shards[rank], bs[0], schedule="ring")
                torch.cuda.synchronize()
                errors.append(max_row_rel_err(out, refs[0]))
    finally:
        workspace.drained = real
        ficco.shutdown()
    return errors
