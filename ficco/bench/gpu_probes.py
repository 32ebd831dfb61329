"""GPU-only parts of ``characterize`` (``--parts paths,enqueue``):

- ``paths``: bandwidth of each way to copy a block on one GPU (the backend's 1D and 2D DMA
  copies, torch's ``copy_`` and a copy done by an SM kernel) and which device activity each
  produces under ``torch.profiler`` (``Memcpy DtoD`` vs a kernel), the first check that ficco's
  copies are not kernels.
- ``enqueue``: host seconds to enqueue one W = 8 plan per schedule, as rank 0 of a simulated
  8-rank group whose "peers" are other buffers on this GPU (signal pads pre-set so barriers
  pass), the plan build vs a cached plan, and the replay of a CUDA graph of the same call.

Both need a CUDA/ROCm device and ficco's GPU backend; on CPU they are skipped with a reason.
"""
from __future__ import annotations

import statistics
import time

import torch

from . import results

DTYPE = torch.bfloat16


def _time_s(backend, queue, fn, repeat: int = 10, inner: int = 1) -> float:
    """Median seconds of one ``fn()`` on ``queue``, events around ``inner`` back-to-back calls
    (small copies are otherwise lost in the event-timing floor)."""
    fn()
    backend.synchronize()
    times = []
    for _ in range(repeat):
        start, end = backend.new_event(), backend.new_event()
        backend.record(start, queue)
        for _ in range(inner):
            fn()
        backend.record(end, queue)
        backend.synchronize()
        times.append(backend.elapsed_s(start, end) / inner)
    return statistics.median(times)


def measure_copy_paths(backend, quick: bool, progress=None) -> list[dict]:
    """One record per (path, size): ``kind="copy_path"``, ``path``, ``bytes``, ``time_s``,
    ``bytes_per_s``, and for the 4 MiB size ``device_activities`` seen by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    dev, ce = backend.device(), backend.queue("copy0")
    compute = backend.queue("compute")
    recs = []
    for mib in ([1, 64] if quick else [0.0625, 1, 4, 16, 64, 256]):
        k = 1024 if mib < 1 else 8192
        m = max(1, int(mib * 2 ** 20) // (2 * k))
        src = torch.randn(m, 8 * k, device=dev).to(DTYPE)
        dst = torch.empty_like(src)
        paths = {
            "backend.copy (1D DMA)": (ce, lambda: backend.copy(
                dst.view(-1)[:m * k], src.view(-1)[:m * k], ce)),
            "backend.copy_2d (K/8 column block)": (ce, lambda: backend.copy_2d(
                dst[:, :k], src[:, k:2 * k], ce)),
            "torch copy_ of the column block (SM kernel)": (compute, lambda: backend.launch(
                compute, lambda: dst[:, :k].copy_(src[:, k:2 * k]))),
            "torch.mul(src, 1, out=dst) (SM kernel)": (compute, lambda: backend.launch(
                compute, lambda: torch.mul(src.view(-1)[:m * k], 1, out=dst.view(-1)[:m * k]))),
        }
        for name, (queue, fn) in paths.items():
            nbytes = m * k * src.element_size()
            seconds = _time_s(backend, queue, fn, inner=max(1, min(100, 2 ** 26 // nbytes)))
            rec = {"schema": results.CHARACTERIZE_SCHEMA, "kind": "copy_path", "path": name,
                       "bytes": nbytes, "time_s": seconds, "bytes_per_s": nbytes / seconds}
            if mib == 4 or (quick and mib == 1):
                backend.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    fn()
                    backend.synchronize()
                rec["device_activities"] = sorted(
                    {e.name for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA})
            recs.append(rec)
        if progress is not None:
            progress.update(1)
        src = dst = torch.empty(0)   # this size's buffers freed before the next is made
    return recs


def fake_group_handle(backend, world: int, nbytes: int):
    """Rank 0 of a ``world``-rank group on this one GPU: every "peer" is another allocation
    here and every pad slot is pre-set high, so barriers pass and copies move real bytes.
    Returns ``(handle, release)``."""
    from ..symm_mem.device import single_gpu_group

    handle = single_gpu_group(backend, world, nbytes, pad_value=1 << 30)
    return handle, handle.close


def measure_enqueue(backend, quick: bool, progress=None) -> list[dict]:
    """One record per schedule: ``kind="enqueue"``, ``ops`` (runtime calls per warm call on
    this backend; ``plan_ops``: the plan's ops), ``plan_build_s``, ``enqueue_s`` (host time of
    one eager call), ``call_wall_s`` (to the GPU's end), ``graph_replay_enqueue_s`` and
    ``graph_result_rel_err`` (or ``graph_error``)."""
    from .. import schedules
    from ..executor import execute
    from ..executor.compiler import compile_plan
    from ..plan.buffers import Buffers
    from ..plan.problem import Problem

    dev, world = backend.device(), 8
    m, n, k = (256, 2048, 2048) if quick else (1024, 8192, 8192)
    problem = Problem(m=m, k=k, ns=(n,), dtype="bfloat16", world=world, rank=0)
    handle, release = fake_group_handle(backend, world, world * m * k * 2)
    recs = []
    try:
        for peer in range(world):
            handle.get_buffer(peer, (world * m, k), DTYPE).normal_()
        a = torch.randn(m, k, device=dev).to(DTYPE)
        b = torch.randn(k, n, device=dev).to(DTYPE)
        out = torch.empty(world * m, n, device=dev, dtype=DTYPE)
        own_pad = handle.signal_pad(0)
        for name in (["serial", "uniform-fused-1d"] if quick else schedules.names()):
            t0 = time.perf_counter()
            plan = schedules.get(name).plan(problem, "dma", None)
            build_s = time.perf_counter() - t0

            def call():
                # Plan barriers wait for flag 1 from every peer and clear it after passing;
                # with no real peers, re-arm this rank's plan channels before each call.
                own_pad[:2].fill_(1)
                buffers = Buffers(a, [b], [out], handle.get_buffer(0, (world * m, k), DTYPE),
                                  handle, None)
                execute(plan, backend, buffers, timeout_s=60.0)

            for _ in range(3):
                call()
            backend.synchronize()
            enqueue, wall = [], []
            for _ in range(10 if quick else 20):
                backend.synchronize()
                t0 = time.perf_counter()
                call()
                t1 = time.perf_counter()
                backend.synchronize()
                enqueue.append(t1 - t0)
                wall.append(time.perf_counter() - t0)
            rec = {"schema": results.CHARACTERIZE_SCHEMA, "kind": "enqueue", "schedule": name,
                       "world": world, "shape": [world * m, n, k],
                       "ops": compile_plan(plan).issue_calls(backend.batches_copies)[1],
                       "plan_ops": len(plan.ops),
                       "plan_build_s": build_s, "enqueue_s": statistics.median(enqueue),
                       "call_wall_s": statistics.median(wall)}
            rec.update(_graph_replay(call, handle, world, m, k, b, out))
            recs.append(rec)
            if progress is not None:
                progress.update(1)
    finally:
        backend.synchronize()
        release()
    return recs


def capture_and_time_replays(call, replays: int = 20):
    """Capture ``call()`` into a CUDA graph (after one warm-up run on a side stream, as torch's
    docs do) and return (graph, host seconds of each replay's launch)."""
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()          # warm the side stream's allocator pool before capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return graph, times


def _graph_replay(call, handle, world, m, k, b, out) -> dict:
    try:
        _, replay = capture_and_time_replays(call)
        expect = handle.get_buffer(0, (world * m, k), DTYPE).float() @ b.float()
        return {"graph_replay_enqueue_s": statistics.median(replay),
                "graph_result_rel_err": float((out.float() - expect).norm() / expect.norm())}
    except Exception as exc:  # noqa: BLE001 - recorded; the other numbers still count
        torch.cuda.synchronize()
        return {"graph_error": f"{type(exc).__name__}: {exc}"[:300]}
