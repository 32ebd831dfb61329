"""What ``characterize --quick`` measures besides DIL, copies and CIL: the GEMM rate of a few
shapes per dtype, copy-engine bandwidth to each peer GPU, and each collective's bus-bandwidth
curve (all-gather, reduce-scatter, all-to-all, all-reduce) over every device of the machine
(CPU: two gloo ranks), so the profile it writes prices this machine's own collectives
(:mod:`ficco.heuristics.collectives`).

Collectives need a process group: this module starts one (``world`` processes, a file store
in a temporary directory, NCCL/RCCL on GPUs, gloo on CPU), times each primitive at each size
as nccl-tests does (``size`` and bus-bandwidth factor of
:func:`ficco.heuristics.collectives.bus_factor`) and hands the records back to the caller.
"""
from __future__ import annotations

import os
import tempfile
import time
import warnings
from queue import Empty

import torch

from ..errors import TransportError
from ..heuristics.collectives import KINDS, bus_factor
from . import results

#: How long the collective ranks may take together before characterize gives up on them.
TIMEOUT_S = 180
#: GEMM shapes (M, N, K) timed per dtype: enough rows to fill a GPU, and a tall-skinny one.
GEMM_SHAPES = {"quick": ((2048, 2048, 2048), (4096, 1024, 4096)),
               "cpu": ((256, 256, 256), (512, 128, 512))}


def gemm_dtypes(device: torch.device) -> tuple[str, ...]:
    """The dtypes whose GEMM rate is measured: the GPU's tensor-core types and float32; on
    CPU float32 and bfloat16."""
    return ("float32", "bfloat16") if device.type == "cpu" else \
        ("bfloat16", "float16", "float32")


def measure_gemm_rates(timer, device: torch.device, warmup: int, repeat: int) -> list[dict]:
    """The FLOP/s of each :data:`GEMM_SHAPES` shape per dtype, on the compute queue."""
    shapes = GEMM_SHAPES["cpu" if device.type == "cpu" else "quick"]
    backend, recs = timer.backend, []
    for dtype in gemm_dtypes(device):
        kind = getattr(torch, dtype)
        for m, n, k in shapes:
            a = torch.randn(m, k, device=device).to(kind)
            b = torch.randn(k, n, device=device).to(kind)
            out = torch.empty(m, n, device=device, dtype=kind)
            seconds = timer.alone(timer.compute, lambda q: backend.gemm(a, b, out, False, q),
                                  warmup, repeat)
            recs.append({"schema": results.CHARACTERIZE_SCHEMA, "kind": "gemm_rate",
                         "dtype": dtype, "M": m, "N": n, "K": k, "time_s": seconds,
                         "flops_per_s": 2 * m * n * k / seconds})
    return recs


def measure_peer_copies(nbytes: int, repeat: int) -> list[dict]:
    """Bandwidth of one copy-engine copy from device 0 to each other visible GPU (a peer
    ``copy_`` between devices runs on a copy engine over the peer link). Nothing on CPU or
    with one GPU."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return []
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    recs = []
    for peer in range(1, torch.cuda.device_count()):
        dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{peer}")
        dst.copy_(src)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeat):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / repeat
        recs.append({"schema": results.CHARACTERIZE_SCHEMA, "kind": "peer_copy", "path": "ce",
                     "peer": peer, "bytes": nbytes, "time_s": seconds,
                     "bytes_per_s": nbytes / seconds})
    return recs


def collective_sizes(device_type: str, quick: bool) -> tuple[int, ...]:
    """Message sizes (nccl-tests' ``size``) each collective is timed at."""
    if device_type == "cpu":
        return (1 << 16, 1 << 20, 8 << 20)
    return (1 << 20, 8 << 20, 64 << 20, 512 << 20) if quick else \
        tuple(1 << p for p in range(16, 33, 2))


def measure_collectives(device_type: str, quick: bool, repeat: int) -> list[dict]:
    """Every :data:`~ficco.heuristics.collectives.KINDS` at every size over a group of all
    the machine's devices (two gloo ranks on CPU), one record per (kind, size). Nothing with
    fewer than two devices."""
    world = 2 if device_type == "cpu" else torch.cuda.device_count()
    if world < 2:
        return []
    sizes = collective_sizes(device_type, quick)
    context = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ficco-ccl-") as tmp:
        queue = context.Queue()
        procs = [context.Process(target=_rank_main, daemon=True,
                                 args=(r, world, device_type, os.path.join(tmp, "store"),
                                       sizes, repeat, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            got = queue.get(timeout=TIMEOUT_S)
        except Empty:
            got = f"no result within {TIMEOUT_S} s"
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if not isinstance(got, list):
        raise TransportError(f"characterize: measuring collectives over {world} ranks failed: "
                             f"{got}")
    return got


def _rank_main(rank, world, device_type, store_path, sizes, repeat, queue):
    import torch.distributed as dist

    try:
        warnings.simplefilter("ignore", FutureWarning)   # reduce_scatter_tensor's rename
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        gpu = device_type != "cpu"
        if gpu:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if gpu else "gloo", store=store, rank=rank,
                                world_size=world)
        device = torch.device("cuda", rank) if gpu else torch.device("cpu")
        recs = [_time_collective(kind, size, world, device, repeat)
                for kind in KINDS for size in sizes]
        dist.barrier()
        if rank == 0:
            queue.put(recs)
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        if rank == 0:
            queue.put(f"rank {rank}: {type(exc).__name__}: {exc}")


def _time_collective(kind: str, size: int, world: int, device, repeat: int) -> dict:
    import torch.distributed as dist

    elems = max(size // 4 // world, 1) * world          # float32, a multiple of the world
    block = elems // world
    full = torch.ones(elems, device=device)
    other = torch.empty_like(full)
    part = torch.ones(block, device=device)
    run = {"all_gather": lambda: dist.all_gather_into_tensor(full, part),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
           "all_to_all": lambda: dist.all_to_all_single(other, full),
           "all_reduce": lambda: dist.all_reduce(full)}[kind]
    run()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    _sync(device)
    seconds = (time.perf_counter() - start) / repeat
    nbytes = elems * 4
    return {"schema": results.CHARACTERIZE_SCHEMA, "kind": "ccl", "op": kind, "bytes": nbytes,
            "world": world, "time_s": seconds,
            "busbw_bytes_per_s": nbytes * bus_factor(kind, world) / seconds}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
