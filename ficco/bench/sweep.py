"""``sweep``: time every schedule and the baselines on the live group, one record per
scenario x (schedule, transport), as JSON lines + CSV + plots.

Run under torchrun (any backend: NCCL/RCCL on GPUs, gloo on CPU)::

    torchrun --nproc-per-node 8 -m ficco.bench sweep --scenarios paper --scale 8
    torchrun --nproc-per-node 2 -m ficco.bench sweep --shape 256,128,64 --dtype float32

Each timed iteration starts behind a barrier; its time is the slowest rank's (all-reduce
MAX), since a collective is only done when its last rank is. Medians and p10/p90 go into the
records; so do the GEMM and all-gather alone (for the GEMM/comm ratio), what each selector
would pick, and the measured speedup of that pick.
"""
from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

from ..errors import InvalidArgumentError
from . import results, rs_inputs, scenarios

# max |C - ref| / max |ref| above which a schedule's result counts as wrong
RELATIVE_TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}
TORCH_FUSED = "torch-fused"
CHECKED_ROWS = 8192
#: share of the free memory a sweep may plan to use (the rest: allocator slack, other tenants)
MEMORY_HEADROOM = 0.8

EXAMPLES = """\
  torchrun --nproc-per-node 8 -m ficco.bench sweep --scenarios paper
  torchrun --nproc-per-node 8 -m ficco.bench sweep --shape 65536,8192,8192 --transports dma,ccl
  # CPU: Table I shrunk to fit (M / 256; N and K / 32), 2 ranks
  torchrun --nproc-per-node 2 -m ficco.bench sweep --scenarios paper --scale 256 \\
      --scale-nk 32 --warmup 2 --repeat 5"""


def add_arguments(parser) -> None:
    scenarios.add_arguments(parser)
    rs_inputs.add_op_argument(parser)
    parser.add_argument("--schedules", default=None,
                        help="comma list of schedule names (default: every schedule)")
    parser.add_argument("--transports", default="dma",
                        help="transports to time each schedule over: dma, ccl or dma,ccl")
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16 or float16 "
                             "(default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per schedule")
    parser.add_argument("--repeat", type=int, default=10, help="timed calls per schedule")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="FICCO_TIMEOUT for the sweep's calls, seconds")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random operands")
    parser.add_argument("--out", default=None,
                        help="result directory (default bench/runs/sweep-<target>-<date>)")
    parser.add_argument("--no-plots", action="store_true",
                        help="write results only (no matplotlib needed)")
    parser.add_argument("--single-rank", action="store_true",
                        help="allow a plain `python` run: one rank, nothing gathered (checks "
                             "the GEMM path and the baselines only)")


# -- process group and timing, shared with ``timeline`` --------------------------------------
def init_distributed() -> tuple[int, int]:
    """Join (or create) the default process group; a plain ``python`` run is a group of one."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        use_gpu = torch.cuda.is_available() and os.environ.get("FICCO_BACKEND") != "cpu"
        if use_gpu:
            local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=local)
        else:
            dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def all_gather_rows(out: torch.Tensor, shard: torch.Tensor) -> None:
    """The plain all-gather along rows (``all_gather_single`` where torch has it)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, shard)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, warmup: int, repeat: int, device: torch.device) -> list[float]:
    """Per-iteration wall time of ``fn()`` on the slowest rank (all-reduce MAX)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    local = []
    for _ in range(repeat):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        local.append(time.perf_counter() - start)
    # CPU tensor with gloo; NCCL needs it on the device.
    times = torch.tensor(local, dtype=torch.float64,
                         device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.cpu().tolist()


def agree_on_failure(error: str | None) -> str | None:
    """Every rank learns whether any rank failed (and the first failure, named by rank), so
    all skip the timing together and rank 0 records the real reason."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(everyone) if e), None)


def memory_bytes(sc, world: int, dtype: str) -> int:
    """Peak bytes one rank allocates for scenario ``sc`` in :func:`run_scenario`: its shard and
    B (each also made in float32 first), the gathered A, the float64/32 reference rows, and a
    call's output plus the workspace ficco gathers into (also what torch's op holds)."""
    import torch

    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    problem = sc.problem(world, 0, dtype)
    m, big_m, n, k = problem.m, problem.big_m, problem.ns[0], sc.k
    rows = min(big_m, CHECKED_ROWS)
    operands = (m * k + k * n) * (size + 4)
    gathered = big_m * k * size
    reference = 8 * (rows * k + k * n + 2 * rows * n)
    call = 2 * big_m * n * size + big_m * k * size
    return operands + gathered + reference + call


def free_memory_bytes(device) -> tuple[int, int]:
    """(bytes free to this rank, ranks sharing them): the device's free memory on a GPU; on
    CPU the host's available memory, shared by every local rank."""
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], 1
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info["MemFree"]), sharing
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), sharing


def check_memory(scenario_list, world: int, dtype: str, device, verb: str = "sweep") -> None:
    """Refuse, before any allocation, a scenario that cannot fit, naming its size and the
    flag that shrinks it (the kernel's OOM killer says neither)."""
    free, sharing = free_memory_bytes(device)
    budget = MEMORY_HEADROOM * free / sharing
    too_big = [sc for sc in scenario_list if memory_bytes(sc, world, dtype) > budget]
    if not too_big:
        return
    sc = max(too_big, key=lambda s: memory_bytes(s, world, dtype))
    need = memory_bytes(sc, world, dtype)
    # one --scale-nk for the whole run: the one that makes its largest scenario fit
    factor = next((f for f in (2 ** p for p in range(1, 16))
                   if memory_bytes(shrunk(sc, f), world, dtype) <= budget), None)
    where = (f"{sharing} ranks share {free / 2**30:.1f} GiB available" if sharing > 1
             else f"{free / 2**30:.1f} GiB is free on {device}")
    fix = (f"divide N and K with --scale-nk {factor}" if factor
           else "pick a smaller --shape or --only")
    others = f" ({len(too_big)} scenarios do not fit)" if len(too_big) > 1 else ""
    raise InvalidArgumentError(
        f"{verb}: scenario {sc.name} (M={sc.big_m}, N={sc.n}, K={sc.k}, {dtype}, W={world}) "
        f"needs about {need / 2**30:.1f} GiB per rank{others}, but {where} (use at most "
        f"{MEMORY_HEADROOM:.0%}: {budget / 2**30:.1f} GiB per rank): {fix}, or M with "
        f"--scale, or leave it out with --only")


def shrunk(sc, factor: int):
    import dataclasses

    return dataclasses.replace(sc, n=max(1, sc.n // factor), k=max(1, sc.k // factor))


# -- what gets timed -------------------------------------------------------------------------
def _entries(schedules: list[str], transports: list[str]) -> list[tuple[str, str, str]]:
    """(schedule, transport, kind) in timing order: baseline serial over ccl first."""
    out = [("serial", "ccl", "baseline")]
    out += [(name, t, "schedule") for t in transports for name in schedules
            if (name, t) != ("serial", "ccl")]
    out.append((TORCH_FUSED, "symm_mem", "baseline"))
    return out


def _ficco_call(op: str, a, b, name: str, transport: str):
    """The ficco call timed for (schedule ``name``, ``transport``): ``op`` is the Problem's op,
    the name of the public function."""
    import ficco

    from .. import config

    fn = getattr(ficco, op)

    def call():
        with config.scope(transport=transport):
            return fn(a, b, schedule=name)
    return call


def _torch_fused_call(a, b, device):
    """torch's own fused op where it runs (CUDA symmetric memory); else a reason to skip."""
    if device.type != "cuda":
        return None, (f"torch.ops.symm_mem.fused_all_gather_matmul needs CUDA; device is "
                      f"{device.type}")
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        group = dist.group.WORLD
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group.group_name)
        op = torch.ops.symm_mem.fused_all_gather_matmul
    except Exception as exc:  # noqa: BLE001 - any failure here only means "skip this baseline"
        return None, f"torch symmetric memory unavailable: {type(exc).__name__}: {exc}"
    return (lambda: op(a, [b], 0, group.group_name)[1][0]), None


def _picks(problem, target: str) -> dict[str, str]:
    picks: dict[str, str] = {}
    try:
        from .. import heuristics
    except ImportError:
        return picks
    for sel in results.SELECTORS:
        try:
            picks[sel] = heuristics.choose(problem, transport="dma", target=target,
                                           selector=sel).schedule
        except Exception:  # noqa: BLE001, S112 - a selector that cannot decide has no pick
            continue
    return picks


def _work(sc, world: int) -> float:
    """Relative cost of one timed entry of ``sc`` (its GEMM's FLOPs), for an honest bar."""
    return 2.0 * sc.big_m * sc.k * max(1, sc.n // world if sc.split_n else sc.n)


def run_scenario(sc, entries, args, dtype: str, device, rank: int, world: int, env: dict,
                 progress) -> list[dict]:
    """Time every entry on one scenario; returns this scenario's records (same on all ranks)."""
    torch.manual_seed(args.seed * 7919 + rank)
    # float64 reference on CPU, float32 on GPUs where float64 GEMMs crawl; at most
    # CHECKED_ROWS rows, spread over every rank's shard, so a full-size check fits in memory
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
    if rs_inputs.wants(args):   # the row-parallel GEMM, reduce-scattered (ficco/bench/rs_inputs.py)
        problem = rs_inputs.problem(sc, world, rank, dtype)
        a, b = rs_inputs.operands(problem, device, args.seed * 7919 + rank)
        n = problem.ns[0]
        rows, reference = rs_inputs.block_reference(problem, a, b, CHECKED_ROWS, ref_dtype)
        product = torch.matmul(a, b)
        gemm_fn, comm_fn = (lambda: torch.matmul(a, b)), rs_inputs.comm_call(problem, product)
    else:
        problem = sc.problem(world, rank, dtype)
        tdtype = problem.torch_dtype
        a = torch.randn(problem.m, sc.k, device=device).to(tdtype)
        n = problem.ns[0]
        b = (torch.randn(sc.k, n, device=device) / sc.k ** 0.5).to(tdtype)
        gathered = torch.empty(problem.big_m, sc.k, device=device, dtype=tdtype)
        all_gather_rows(gathered, a)
        rows = torch.linspace(0, problem.big_m - 1, min(problem.big_m, CHECKED_ROWS),
                              device=device).round().long().unique()
        reference = gathered[rows].to(ref_dtype) @ b.to(ref_dtype)
        gemm_fn, comm_fn = (lambda: torch.matmul(gathered, b)), \
            (lambda: all_gather_rows(gathered, a))
    ref_scale = max(reference.abs().max().item(), 1e-30) if reference is not None else 1.0
    gemm_times = time_calls(gemm_fn, args.warmup, args.repeat, device)
    comm_times = time_calls(comm_fn, args.warmup, args.repeat, device)
    gemm_s = results.timing_summary(gemm_times)["median_s"]
    comm_s = results.timing_summary(comm_times)["median_s"]
    base = {"schema": results.SWEEP_SCHEMA, "scenario": sc.name, "source": sc.source,
                "op": problem.op,
                "big_m": problem.big_m, "n": n, "n_layer": sc.n, "k": sc.k, "m": problem.m, "dtype": dtype,
                "world": world,
                "warmup": args.warmup, "repeat": args.repeat, "gemm_s": gemm_s, "comm_s": comm_s,
                "gemm_comm_ratio": gemm_s / comm_s if comm_s else None,
                "ideal_speedup": (gemm_s + comm_s) / max(gemm_s, comm_s), "env": env}
    records = []
    for name, transport, kind in entries:
        rec = dict(base, schedule=name, transport=transport, kind=kind, status="ok", reason="",
                   times_s=[], median_s=None, p10_s=None, p90_s=None, max_abs_err=None)
        if name == TORCH_FUSED:
            fn, skip = rs_inputs.torch_fused_call(a, b, device, world) if problem.reduces \
                else _torch_fused_call(a, b, device)
        else:
            fn, skip = _ficco_call(problem.op, a, b, name, transport), None
        if skip:
            rec.update(status="skipped", reason=skip)
        else:
            error = None
            try:
                out = fn()
                synchronize(device)
                err = (out[rows].to(ref_dtype) - reference).abs().max().item() \
                    if len(rows) else 0.0
                del out
                rec["max_abs_err"] = err
                if not err / ref_scale <= RELATIVE_TOLERANCE[dtype]:
                    error = (f"wrong result: max |C - ref| = {err:.3g} is above "
                             f"{RELATIVE_TOLERANCE[dtype]} x max |ref| = {ref_scale:.3g}")
            except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
                error = f"{type(exc).__name__}: {exc}"
            error = agree_on_failure(error)
            if error:
                rec.update(status="error", reason=error.splitlines()[0][:500])
            else:
                rec["times_s"] = time_calls(fn, args.warmup, args.repeat, device)
                rec.update(results.timing_summary(rec["times_s"]))
        records.append(rec)
        progress.update(_work(sc, world))
    results.finalize_scenario(records, _picks(problem, env["env_backend"]))
    return records


def format_table(records: list[dict]) -> str:
    """The end-of-sweep table: one line per scenario x schedule; marks: P = paper selector's
    pick, M = model selector's pick, * = best measured schedule."""
    head = (f"{'scenario':<18} {'M x N x K':<20} {'schedule':<18} {'transport':<9} "
            f"{'median ms':>10} {'p10-p90 ms':>17} {'speedup':>8}  marks")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(records):
        if i and records[i - 1]["scenario"] != r["scenario"]:
            lines.append(_picks_line(records[i - 1]))
        shape = f"{r['big_m']}x{r['n']}x{r['k']}"
        if r["status"] != "ok":
            lines.append(f"{r['scenario']:<18} {shape:<20} {r['schedule']:<18} "
                         f"{r['transport']:<9} {r['status'].upper()}: {r['reason'][:70]}")
            continue
        marks = "".join(sel[0].upper() for sel in r.get("picked_by", []))
        if r["kind"] == "schedule" and r["schedule"] == r.get("best_schedule") \
                and r["transport"] == "dma":
            marks += "*"
        spread = f"{1e3 * r['p10_s']:.3f}-{1e3 * r['p90_s']:.3f}"
        speedup = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        lines.append(f"{r['scenario']:<18} {shape:<20} {r['schedule']:<18} {r['transport']:<9} "
                     f"{1e3 * r['median_s']:>10.3f} {spread:>17} {speedup:>8}  {marks}")
    if records:
        lines.append(_picks_line(records[-1]))
    acc = results.selector_accuracy(records)
    for sel, a in acc.items():
        if a["scenarios"]:
            lines.append(f"selector {sel}: pick within {results.PICK_TOLERANCE:.0%} of best in "
                         f"{a['hits']}/{a['scenarios']} scenarios; mean speedup lost when it "
                         f"misses {100 * a['mean_loss_when_missed']:.1f}%")
        else:
            lines.append(f"selector {sel}: no pick measured")
    return "\n".join(lines)


def _picks_line(rec: dict) -> str:
    picks = rec.get("picks") or {}
    if not picks:
        return "  picks: no selector could decide"
    speedups = rec.get("pick_speedups") or {}
    return "  picks: " + ", ".join(
        f"{sel} {name} ({speedups[sel]:.2f}x)" if speedups.get(sel) else f"{sel} {name} (not timed)"
        for sel, name in picks.items())


def start_run(dtype_arg: str | None):
    """Shared start of the multi-rank verbs: join the group, the active backend, its device,
    and the dtype (bf16 on GPUs, fp32 on CPU unless asked), validated."""
    from ..backends import get_backend

    rank, world = init_distributed()
    backend = get_backend()
    device = backend.device()
    dtype = dtype_arg or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype not in RELATIVE_TOLERANCE:
        raise InvalidArgumentError(f"--dtype {dtype!r}; use one of {list(RELATIVE_TOLERANCE)}")
    return rank, world, backend, device, dtype


def main(args) -> int:
    import ficco

    from .. import config
    from .cli import progress_bar, require_plots, require_torchrun, run_dir

    require_plots("sweep", not args.no_plots, "--no-plots")
    if not args.single_rank:
        require_torchrun("sweep", "--shape 2048,1024,1024", single_rank_ok=True)
    rank, world, backend, device, dtype = start_run(args.dtype)
    op = getattr(args, "op", "all-gather-matmul").replace("-", "_")
    names = ficco.schedules.names(op=op)
    schedules = [s for s in args.schedules.split(",") if s] if args.schedules else names
    for s in schedules:
        ficco.schedules.get(s, op=op)  # unknown names fail here, before any timing
    transports = [t for t in args.transports.split(",") if t]
    if not transports or any(t not in ("dma", "ccl") for t in transports):
        raise InvalidArgumentError(f"--transports {args.transports!r}; use dma, ccl or dma,ccl")
    if args.warmup < 0 or args.repeat < 1:
        raise InvalidArgumentError(f"need --warmup >= 0 and --repeat >= 1; got "
                                   f"{args.warmup}, {args.repeat}")
    scenario_list = scenarios.from_args(args, world)
    try:
        check_memory(scenario_list, world, dtype, device)
        too_big = None
    except InvalidArgumentError as exc:
        too_big = str(exc)
    too_big = agree_on_failure(too_big)   # every rank refuses together, none waits on a peer
    if too_big:
        raise InvalidArgumentError(too_big)
    entries = _entries(schedules, transports)
    env = results.environment(world, backend.target(), device)
    progress = progress_bar("sweep", sum(_work(sc, world) for sc in scenario_list) * len(entries),
                            "run", disable=rank != 0, weighted=True)
    records = []
    with config.scope(timeout=args.timeout):
        for sc in scenario_list:
            progress.set_postfix_str(sc.name)
            records += run_scenario(sc, entries, args, dtype, device, rank, world, env, progress)
    progress.close()
    if rank == 0:
        out_dir = run_dir("sweep", backend.target(), args.out)
        written = [results.write_jsonl(out_dir / "results.jsonl", records),
                   results.write_csv(out_dir / "results.csv", records)]
        table = format_table(records)
        (out_dir / "table.txt").write_text(table + "\n")
        written.append(out_dir / "table.txt")
        if not args.no_plots:
            from . import plots

            written += plots.sweep_plots(records, out_dir)
        print(table)
        print("wrote " + ", ".join(str(p) for p in written))
    dist.barrier()
    return 0
