"""Single-GPU measurements for the CUDA/ROCm backends (issue 5), bf16 unless noted:

1. copy bandwidth by size: copy-engine 1-D (backend.copy), copy-engine 2-D column chunks
   (backend.copy_2d, K/8 and K/64 wide) and the plain SM-kernel alternatives torch uses;
2. CIL: a GEMM's slowdown while copies run beside it on 7 copy streams, with copy-engine
   copies and with SM-kernel copies; DIL: 8- and 64-way row- and column-sharded GEMMs vs one
   GEMM, on paper Table I shapes scaled to fit one GPU;
3. host time to enqueue one W=8 plan (rank 0 of a simulated 8-rank group whose 'peers' are
   other buffers on this GPU, signal pads pre-set so barriers pass), plan building vs the
   plan cache, and the replay of a CUDA graph capturing the same call;
4. which device activity each copy path produces (torch.profiler: memcpy vs kernel).

Usage: ``python bench/gpu_measure.py --out DIR [--quick]``. Writes ``DIR/*.jsonl`` and prints
summary tables. Timings are medians of CUDA-event-timed repeats after warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ficco import schedules  # noqa: E402
from ficco.backends import get_backend  # noqa: E402
from ficco.backends.gpu_symm import GpuSymmHandle, pad_bytes, tensor_at  # noqa: E402
from ficco.executor import Buffers, execute  # noqa: E402
from ficco.problem import Problem  # noqa: E402
from ficco.symm_mem import SIGNAL_CHANNELS, aligned  # noqa: E402

DTYPE = torch.bfloat16
# Table I (M, N, K); scaled by dividing the larger of M and K by a power of two until one GEMM
# is at most ~4.4 TFLOP (a few ms on an H100).
TABLE_I = {"g1": (16384, 16384, 131072), "g2": (131072, 16384, 16384),
           "g5": (8192, 8192, 262144), "g6": (262144, 8192, 8192),
           "g11": (1048576, 10240, 8192), "g14": (147456, 28672, 4096)}
MAX_FLOP = 4.4e12


def gemm_operands(shape, dev):
    """The scaled (m, n, k) of a Table I shape and fresh random bf16 A, B and an output."""
    m, n, k = scaled(shape)
    a = torch.randn(m, k, device=dev).to(DTYPE)
    b = torch.randn(k, n, device=dev).to(DTYPE)
    return (m, n, k), (a, b, torch.empty(m, n, device=dev, dtype=DTYPE))


def scaled(shape):
    m, n, k = shape
    while 2 * m * n * k > MAX_FLOP:
        if m >= k:
            m //= 2
        else:
            k //= 2
    return m, n, k


def time_ms(fn, stream, reps=20, warmup=3, inner=1):
    """Median ms of one ``fn()`` enqueued on ``stream``, by CUDA events around ``inner``
    back-to-back calls (so small copies are not lost in the event-timing floor)."""
    for _ in range(warmup):
        with torch.cuda.stream(stream):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            for _ in range(inner):
                fn()
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times), min(times), max(times)


def copy_bandwidth(backend, quick):
    dev, rows = backend.device(), []
    ce = backend.queue("copy0")
    sizes_mib = [0.0625, 0.25, 1, 4, 16, 64, 256] if not quick else [1, 64]
    for mib in sizes_mib:
        nbytes = int(mib * 2**20)
        k = 8192 if nbytes >= 8192 * 2 * 64 else 1024
        m = max(nbytes // (k * 2), 1)
        src = torch.randn(m, k, device=dev).to(DTYPE)
        dst = torch.empty_like(src)
        big_src = torch.randn(m, 8 * k, device=dev).to(DTYPE)   # a column chunk = 1/8 of K
        big_dst = torch.empty_like(big_src)
        huge_src = torch.randn(m, 64 * k, device=dev).to(DTYPE) if mib <= 16 else None
        huge_dst = torch.empty_like(huge_src) if huge_src is not None else None
        variants = {
            "ce_1d (cudaMemcpyAsync on a copy stream)": (lambda: backend.copy(dst, src, ce), ce),
            "torch copy_ on compute stream": (lambda: dst.copy_(src), torch.cuda.current_stream()),
            "sm_kernel (torch.mul(src, 1, out=dst))":
                (lambda: torch.mul(src, 1, out=dst), torch.cuda.current_stream()),
            "ce_2d K/8 chunk (cudaMemcpy2DAsync)":
                (lambda: backend.copy_2d(big_dst[:, :k], big_src[:, k:2 * k], ce), ce),
            "sm_2d K/8 chunk (torch strided copy_)":
                (lambda: big_dst[:, :k].copy_(big_src[:, k:2 * k]), torch.cuda.current_stream()),
        }
        if huge_src is not None:
            variants["ce_2d K/64 chunk (cudaMemcpy2DAsync)"] = (
                lambda: backend.copy_2d(huge_dst[:, :k], huge_src[:, k:2 * k], ce), ce)
        for name, (fn, stream) in variants.items():
            med, lo, hi = time_ms(fn, stream, inner=max(1, min(100, 2**26 // nbytes)))
            moved = m * k * 2
            rows.append({"what": "copy_bw", "variant": name, "bytes": moved, "median_ms": med,
                         "min_ms": lo, "max_ms": hi, "gb_per_s": moved / med / 1e6})
        del src, dst, big_src, big_dst, huge_src, huge_dst
        torch.cuda.empty_cache()
    return rows


def gemm_fn(a, b, out):
    return lambda: torch.mm(a, b, out=out)


def cil(backend, quick):
    """GEMM time alone vs with 7 concurrent copy streams streaming 64 MiB copies."""
    dev, rows = backend.device(), []
    copies = [(torch.randn(4096, 8192, device=dev).to(DTYPE),
               torch.empty(4096, 8192, device=dev, dtype=DTYPE)) for _ in range(7)]
    streams = [backend.queue(f"copy{i}") for i in range(7)]
    compute = torch.cuda.current_stream()
    for name, shape in list(TABLE_I.items())[: 2 if quick else None]:
        (m, n, k), (a, b, out) = gemm_operands(shape, dev)
        alone, _, _ = time_ms(gemm_fn(a, b, out), compute, reps=10)
        result = {"what": "cil", "gemm": name, "shape": [m, n, k], "alone_ms": alone,
                  "tflops_alone": 2 * m * n * k / alone / 1e9}
        for mode in ("ce", "sm"):
            times = []
            for _ in range(7):
                torch.cuda.synchronize()
                # enough copy traffic to outlast the GEMM: 64 MiB each, ~alone_ms * 3 worth
                repeats = max(2, int(alone * 3 / 0.05) // 7)
                for (src, dst), s in zip(copies, streams):
                    for _ in range(repeats):
                        if mode == "ce":
                            backend.copy(dst, src, s)
                        else:
                            with torch.cuda.stream(s):
                                torch.mul(src, 1, out=dst)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(compute)
                gemm_fn(a, b, out)()
                end.record(compute)
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            busy = statistics.median(times)
            result[f"with_{mode}_copies_ms"] = busy
            result[f"cil_{mode}"] = busy / alone
        rows.append(result)
        del a, b, out
    return rows


def dil(backend, quick):
    dev, rows = backend.device(), []
    compute = torch.cuda.current_stream()
    for name, shape in list(TABLE_I.items())[: 2 if quick else None]:
        (m, n, k), (a, b, out) = gemm_operands(shape, dev)
        full, _, _ = time_ms(gemm_fn(a, b, out), compute, reps=10)
        result = {"what": "dil", "gemm": name, "shape": [m, n, k], "full_ms": full}
        for ways in (8, 64):
            rm, kc = m // ways, k // ways

            def by_rows():
                for i in range(ways):
                    torch.mm(a[i * rm:(i + 1) * rm], b, out=out[i * rm:(i + 1) * rm])

            def by_cols():
                for i in range(ways):
                    out.addmm_(a[:, i * kc:(i + 1) * kc], b[i * kc:(i + 1) * kc],
                               beta=1 if i else 0)

            rows_ms, _, _ = time_ms(by_rows, compute, reps=5)
            cols_ms, _, _ = time_ms(by_cols, compute, reps=5)
            result[f"dil_rows_{ways}"] = rows_ms / full
            result[f"dil_cols_{ways}"] = cols_ms / full
        rows.append(result)
        del a, b, out
    return rows


def fake_group_handle(backend, world, nbytes):
    """Rank 0 of a ``world``-rank group on this one GPU: every 'peer' is another allocation
    here and every pad slot is pre-set high, so barriers pass and copies move real bytes."""
    dev, vendor = backend.device(), backend.vendor
    total = aligned(nbytes) + pad_bytes(world)
    addresses = [vendor.malloc(total) for _ in range(world)]
    spans = [tensor_at(a, total, dev) for a in addresses]
    for s in spans:
        s[aligned(nbytes):aligned(nbytes) + SIGNAL_CHANNELS * world * 4].view(torch.int32) \
            .fill_(1 << 30)

    def release():
        for a in addresses:
            vendor.free(a)

    handle = GpuSymmHandle(backend, 0, world, nbytes, spans, release)
    return handle, release


def enqueue_cost(backend, quick):
    """Host seconds to enqueue one W=8 call, by schedule; plan build vs cache; graph replay."""
    dev, rows, world = backend.device(), [], 8
    m, n, k = 1024, 8192, 8192              # M = 8192 rows gathered, one GEMM of 8192^3
    problem = Problem(m=m, k=k, ns=(n,), dtype="bfloat16", world=world, rank=0)
    handle, release = fake_group_handle(backend, world, world * m * k * 2)
    for peer in range(world):
        handle.get_buffer(peer, (world * m, k), DTYPE).normal_()
    a = torch.randn(m, k, device=dev).to(DTYPE)
    b = torch.randn(k, n, device=dev).to(DTYPE)
    out = torch.empty(world * m, n, device=dev, dtype=DTYPE)
    names = schedules.names() if not quick else ["serial", "uniform-fused-1d"]
    for name in names:
        t0 = time.perf_counter()
        plan = schedules.get(name).plan(problem, "dma", None)
        build_s = time.perf_counter() - t0
        cache = {(name, problem): plan}
        t0 = time.perf_counter()
        for _ in range(100):
            cache[(name, problem)]
        lookup_s = (time.perf_counter() - t0) / 100

        own_pad = handle.signal_pad(0)

        def call():
            # Plan barriers wait for flag 1 from every peer and clear their slots after
            # passing; with no real peers, re-arm this rank's plan channels before each call
            # (one tiny fill, captured into the graph too).
            own_pad[:2].fill_(1)
            buffers = Buffers(a, [b], [out], handle.get_buffer(0, (world * m, k), DTYPE),
                              handle, None)
            execute(plan, backend, buffers, timeout_s=60.0)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        enqueue, gpu = [], []
        for _ in range(10 if quick else 20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            enqueue.append(t1 - t0)
            gpu.append(time.perf_counter() - t0)
        row = {"what": "enqueue", "schedule": name, "world": world, "shape": [world * m, n, k],
               "ops": len(plan.ops), "plan_build_s": build_s, "plan_cached_lookup_s": lookup_s,
               "enqueue_s": statistics.median(enqueue), "call_wall_s": statistics.median(gpu)}
        try:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                call()          # warm the side stream's allocator pool before capture
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                call()
            torch.cuda.synchronize()
            replay = []
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graph.replay()
                replay.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            expect = handle.get_buffer(0, (world * m, k), DTYPE).float() @ b.float()
            row["graph_replay_enqueue_s"] = statistics.median(replay)
            row["graph_result_rel_err"] = float((out.float() - expect).norm() / expect.norm())
        except Exception as exc:  # noqa: BLE001 - recorded, the other numbers still count
            row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.synchronize()
        rows.append(row)
    torch.cuda.synchronize()
    handle._closed = True
    release()
    return rows


def profile_copies(backend):
    """Names of the device activities each copy path produces."""
    from torch.profiler import ProfilerActivity, profile

    dev = backend.device()
    src = torch.randn(2048, 4096, device=dev).to(DTYPE)
    dst = torch.empty_like(src)
    ce = backend.queue("copy0")
    paths = {"backend.copy": lambda: backend.copy(dst, src, ce),
             "backend.copy_2d": lambda: backend.copy_2d(dst[:, :512], src[:, 512:1024], ce),
             "torch strided copy_": lambda: dst[:, :512].copy_(src[:, 512:1024])}
    rows = []
    for name, fn in paths.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        device_events = sorted({e.name for e in prof.events()
                                if e.device_type == torch.autograd.DeviceType.CUDA})
        rows.append({"what": "profile", "path": name, "device_activities": device_events})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/h100")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="profile,copy,cil,dil,enqueue")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    backend = get_backend()
    props = torch.cuda.get_device_properties(backend.device())
    meta = {"device": props.name, "target": backend.target(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
    print(json.dumps(meta))
    parts = {"profile": lambda: profile_copies(backend),
             "copy": lambda: copy_bandwidth(backend, args.quick),
             "cil": lambda: cil(backend, args.quick), "dil": lambda: dil(backend, args.quick),
             "enqueue": lambda: enqueue_cost(backend, args.quick)}
    for part in args.only.split(","):
        t0 = time.perf_counter()
        rows = parts[part]()
        with open(os.path.join(args.out, f"{part}.jsonl"), "w") as f:
            for row in rows:
                f.write(json.dumps({**meta, **row}) + "\n")
        print(f"== {part} ({time.perf_counter() - t0:.1f}s)")
        for row in rows:
            print("  " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                     for k, v in row.items() if k != "what"}))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
