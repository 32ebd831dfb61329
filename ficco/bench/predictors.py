"""What the simulator predicts for each published figure in ``validation/published.csv``.

Each row's ``quantity`` names a function of :data:`PREDICTORS`, called with the row's profile
and its ``shapes`` as keyword strings. A predictor replays the experiment the source ran, as it
ran it (same ops, same overlap, same launches), so that a published ratio is compared with the
same ratio, never with a constant that only resembles it. The FiCCO paper's rows run under
its own conditions (:mod:`ficco.bench.paper_runs`).

Example::

    >>> from ficco.bench.paper_runs import load_profile
    >>> round(PREDICTORS["nccl_all_gather_us"](load_profile("h100"), "134217728"))
    385
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

from ..heuristics import bands, collectives, gemm, simulator
from ..plan import COMPUTE, AllGather, AllToAll, Block, Copy, Gemm, Op, Plan, ReduceScatter
from ..plan.problem import Problem
from .async_tp import async_tp_us
from .paper_runs import PAPER_FOUR, emulated_2d, fraction_of_ideal, geomean, paper_run, table_i


# -- FiCCO paper §IV: contention and decomposition, measured on single ops -----------------------
class Fig8Times(NamedTuple):
    """Seconds of the Fig. 8 replay: each op alone, and where each ended when run together."""

    gemm_alone: float
    copies_alone: float
    gemm_end: float
    copies_end: float


def fig8_times(prof, problem: Problem, copies: int) -> Fig8Times:
    """The simulated times behind :func:`fig8_experiment` (same arguments)."""
    world, rows, n, k = problem.world, problem.m, problem.n_total, problem.k
    gemm = Gemm(COMPUTE, (Block("gathered", 0, rows, 0, k),),
                (Block("out", 0, rows, 0, n, index=0),), 0, 0, k)
    moves: tuple[Copy, ...]
    if copies == 1:
        moves = (Copy("copy0", Block("input", 0, rows, 0, k, peer=1),
                      Block("gathered", rows, rows, 0, k)),)
    else:
        chunk = rows // world
        moves = tuple(Copy(f"copy{q - 1}", Block("input", 0, chunk, 0, k, peer=q),
                           Block("gathered", q * chunk, chunk, 0, k)) for q in range(1, world))
    queues = (COMPUTE,) + tuple(c.queue for c in moves)

    def run(ops, used):
        return simulator.simulate(Plan("fig8", "dma", problem, used, ops), prof)

    both = run((gemm,) + moves, queues)
    return Fig8Times(run((gemm,), (COMPUTE,)).makespan_s, run(moves, queues[1:]).makespan_s,
                     max(r["end_s"] for r in both.rows if r["kind"] == "gemm"),
                     max(r["end_s"] for r in both.rows if r["kind"] == "copy_1d"))


def fig8_experiment(prof, problem: Problem, copies: int) -> tuple[float, float]:
    """(GEMM slowdown, all-gather slowdown) of the paper's Fig. 8 experiment on one Table I
    GEMM, as it ran (§IV-D): the 8-way M-sharded GEMM (one shard's rows, ``(M/W) x n x K``)
    and a DMA all-gather started together, each op's whole time over its time alone. The
    all-gather is one FiCCO step's (``copies`` = W - 1: every peer's 1/W chunk at once) or a
    shard-level step's (``copies`` = 1: one peer's whole shard over one link). Where one op
    outlasts the other it runs alone for the rest, so the published ratio is a diluted rate."""
    t = fig8_times(prof, problem, copies)
    return t.gemm_end / t.gemm_alone, t.copies_end / t.copies_alone


def gemm_cil(prof, copies: str) -> float:
    """Geomean over Table I of the GEMM's slowdown in :func:`fig8_experiment` (Fig. 8 left:
    1.11 beside a FiCCO step's all-gather; §IV-D1: 1.07 at shard level)."""
    return geomean(fig8_experiment(prof, p, int(copies))[0] for _, p in table_i())


def copy_cil(prof, copies: str) -> float:
    """Geomean over Table I of the all-gather's slowdown in :func:`fig8_experiment` (Fig. 8
    right: 1.12; §IV-D2: 1.03 at shard level)."""
    return geomean(fig8_experiment(prof, p, int(copies))[1] for _, p in table_i())


#: The paper's Fig. 8 geomeans the four contention constants are calibrated to (P1-P4).
FIG8 = {("gemm", 1): 1.07, ("gemm", 7): 1.11, ("copy", 1): 1.03, ("copy", 7): 1.12}


def fit_fig8_cil(prof, rounds: int = 4) -> dict:
    """The ``cil`` constants that make :func:`fig8_experiment` give the paper's geomeans
    (:data:`FIG8`): the GEMM's and the copies' rates beside one and beside seven copies, as
    ``dma_gemm``/``gemm_copies_exp`` and ``dma_copy``/``copy_copies_exp``. Four constants,
    four measured numbers; ``mt_half_bytes``, ``mt_exp`` and ``copy_mt_power`` are kept.
    Each rate is solved by bisection with the others fixed, a few rounds (they interact only
    through how long the ops overlap). ``python -m ficco.bench validate --fit-cil mi300x``."""
    engines = prof.copy_engines
    cil = prof.cil
    # Coefficients at one copy and at all engines: c(x) = coef * (x / engines) ** exp.
    rates = {("gemm", engines): cil["dma_gemm"],
             ("gemm", 1): cil["dma_gemm"] * engines ** -cil["gemm_copies_exp"],
             ("copy", engines): cil["dma_copy"],
             ("copy", 1): cil["dma_copy"] * engines ** -cil["copy_copies_exp"]}

    def constants(r):
        return dict(cil, dma_gemm=r["gemm", engines], dma_copy=r["copy", engines],
                    gemm_copies_exp=math.log(r["gemm", engines] / r["gemm", 1]) / math.log(engines),
                    copy_copies_exp=math.log(r["copy", engines] / r["copy", 1]) / math.log(engines))

    measure = {"gemm": gemm_cil, "copy": copy_cil}
    for _ in range(rounds):
        for (victim, copies), target in FIG8.items():
            key = (victim, engines if copies > 1 else 1)
            lo, hi = 1e-4, 4.0
            for _ in range(40):
                mid = math.sqrt(lo * hi)
                trial = dataclasses.replace(prof, cil=constants({**rates, key: mid}))
                if measure[victim](trial, str(copies)) < target:
                    lo = mid
                else:
                    hi = mid
            rates[key] = math.sqrt(lo * hi)
    return {k: round(v, 4) for k, v in constants(rates).items()
            if k in ("dma_gemm", "dma_copy", "gemm_copies_exp", "copy_copies_exp")}


def copy_dil(prof, ways: int | str = "8") -> float:
    """Geomean over Table I of the DMA all-gather's time with copies ``ways`` times smaller
    (issued ``ways`` times) over its time in one piece per peer (paper §IV-C2, Fig. 9)."""
    ways = int(ways)

    def seconds(nbytes):
        return prof.copy_latency_s + nbytes / (prof.link_bytes_per_s * prof.copy_fraction(nbytes))

    return geomean(ways * seconds(p.m * p.k * p.itemsize / ways) / seconds(p.m * p.k * p.itemsize)
                   for _, p in table_i())


# -- FiCCO paper §VI: whole schedules, as the paper ran them ------------------------------------
def _speedups(prof, problem, names) -> dict:
    serial = paper_run("serial", problem, prof).makespan_s
    return {n: serial / paper_run(n, problem, prof).makespan_s for n in names}


def ring_comm_slowdown(prof) -> float:
    """Geomean over Table I of the shard-level (``ring``) all-gather's copy time over the
    serial all-gather's (one link busy instead of W-1; paper §VI-A)."""
    def comm_s(name, problem):
        rows = [r for r in paper_run(name, problem, prof).rows
                if r["kind"].startswith("copy") and r["label"].startswith("peer")]
        if name == "serial":
            return max(r["end_s"] for r in rows) - min(r["start_s"] for r in rows)
        return sum(r["end_s"] - r["start_s"] for r in rows)

    return geomean(comm_s("ring", p) / comm_s("serial", p) for _, p in table_i())


def ring_worst_slowdown(prof) -> float:
    """Largest slowdown of ``ring`` against ``serial`` over Table I (paper §I: up to 3.9x)."""
    return max(1 / _speedups(prof, p, ["ring"])["ring"] for _, p in table_i())


def ideal_max(prof) -> float:
    """Largest ideal overlap speedup over Table I (paper §I: as high as 1.7x)."""
    return max(simulator.ideal_speedup(paper_run("serial", p, prof)) for _, p in table_i())


def ficco_1d_max(prof) -> float:
    """Largest speedup of the paper's 1D schedules over Table I (paper §VI-B: up to 1.6x)."""
    return max(max(_speedups(prof, p, PAPER_FOUR[:3]).values()) for _, p in table_i())


def emulated_2d_max(prof) -> float:
    """Largest ``uniform-fused-2d`` speedup with its 2D copies emulated by 1D copies of the same
    size, as the paper ran them (§VI-B: up to 1.7x)."""
    emulated = emulated_2d(prof)
    return max(_speedups(emulated, p, ["uniform-fused-2d"])["uniform-fused-2d"]
               for _, p in table_i())


def fraction_1d(prof) -> float:
    """§VI-D's fraction of ideal for the best of the paper's 1D schedules per GEMM."""
    return fraction_of_ideal(prof, "1d")


def fraction_2d(prof) -> float:
    """§VI-D's fraction of ideal for the best of the four with 2D emulated, per GEMM."""
    return fraction_of_ideal(prof, "2d")


# -- collectives and GEMMs timed by other projects ----------------------------------------------
def nccl_all_gather_us(prof, total_bytes: int | str, world: int | str = "8",
                       topology: str = "") -> float:
    """Microseconds of one NCCL all-gather whose output is ``total_bytes`` over ``world`` GPUs."""
    world = int(world)
    per_rank = int(total_bytes) // world // 2      # bf16 elements each rank contributes
    problem = Problem(per_rank, 1, (1,), "bfloat16", world)
    src = Block("input", 0, per_rank, 0, 1)
    dsts = tuple(Block("gathered", q * per_rank, per_rank, 0, 1) for q in range(world))
    plan = Plan("all-gather", "ccl", problem, ("comm",), (AllGather("comm", src, dsts),))
    no_host = dataclasses.replace(prof, host_op_s=0.0)
    return simulator.simulate(plan, no_host, topology or None).makespan_s * 1e6


def nccl_reduce_scatter_us(prof, total_bytes: int | str, world: int | str = "8", topology: str = "",
                           dtype: str = "float16") -> float:
    """Microseconds of one NCCL reduce-scatter of a ``total_bytes`` input per rank over
    ``world`` GPUs (each receives ``total_bytes / world`` of the sum)."""
    world = int(world)
    problem = Problem(max(int(total_bytes) // 2 // world, 1) * world, 1, (1,), dtype, world,
                      op="matmul_reduce_scatter")
    rows = problem.m // world
    srcs = tuple(Block("partial", q * rows, rows, 0, 1) for q in range(world))
    plan = Plan("reduce-scatter", "ccl", problem, ("comm",),
                (ReduceScatter("comm", srcs, Block("out", 0, rows, 0, 1)),))
    no_host = dataclasses.replace(prof, host_op_s=0.0)
    return simulator.simulate(plan, no_host, topology or None).makespan_s * 1e6


def independent_overlap_ms(prof, m: int | str, n: int | str, k: int | str,
                           ag_in_bytes: int | str, world: int | str = "8",
                           mode: str = "sequential", dtype: str = "float16") -> float:
    """Milliseconds of one eager iteration of an ``(m, k) @ (k, n)`` GEMM and an independent
    all-gather of ``ag_in_bytes`` per rank over ``world`` GPUs (no data dependence): one
    after the other on one stream (``sequential``), or the all-gather on a second stream
    beside the GEMM, run by NCCL's kernels (``overlap_ccl``) or by copy engines, one copy per
    peer (``overlap_ce``). PyTorch's bench_overlapped_matmul_allgather.py (pytorch#172714)."""
    m, n, k, world = int(m), int(n), int(k), int(world)
    problem = Problem(m, k, (n,), dtype, world)
    elems = int(ag_in_bytes) // problem.itemsize
    gemm_op = Gemm(COMPUTE, (Block("input", 0, m, 0, k),), (Block("out", 0, m, 0, n, index=0),),
                   0, 0, k)
    src = Block("recv", 0, elems, 0, 1)
    ops: tuple[Op, ...]
    if mode == "overlap_ce":
        copies = tuple(Copy(f"copy{q - 1}", Block("recv", 0, elems, 0, 1, peer=q),
                            Block("gathered", q * elems, elems, 0, 1)) for q in range(1, world))
        ops, queues = (gemm_op,) + copies, (COMPUTE,) + tuple(c.queue for c in copies)
    else:
        gather = AllGather(COMPUTE if mode == "sequential" else "comm", src,
                           tuple(Block("gathered", q * elems, elems, 0, 1) for q in range(world)))
        ops = (gemm_op, gather)
        queues = (COMPUTE,) if mode == "sequential" else (COMPUTE, "comm")
    plan = Plan(f"independent-{mode}", "ccl", problem, queues, ops)
    return simulator.simulate(plan, prof).makespan_s * 1e3


def ag_then_mm_us(prof, m: int | str, n: int | str, k: int | str, world: int | str = "8",
                  dtype: str = "bfloat16") -> float:
    """Microseconds of an NCCL all-gather of an ``(m, k)`` shard per rank over ``world``
    GPUs followed by the ``(world * m, k) @ (k, n)`` GEMM, launches queued ahead (no host
    time): the ``nccl`` baseline of kraken's benchmark_all_gather_matmul.py."""
    m, n, k, world = int(m), int(n), int(k), int(world)
    problem = Problem(m, k, (n,), dtype, world)
    src = Block("input", 0, m, 0, k)
    dsts = tuple(Block("gathered", q * m, m, 0, k) for q in range(world))
    rows = Block("gathered", 0, world * m, 0, k)
    ops = (AllGather(COMPUTE, src, dsts),
           Gemm(COMPUTE, (rows,), (Block("out", 0, world * m, 0, n, index=0),), 0, 0, k))
    plan = Plan("ag-then-mm", "ccl", problem, (COMPUTE,), ops)
    return simulator.simulate(plan, dataclasses.replace(prof, host_op_s=0.0)).makespan_s * 1e6


def schedule_us(prof, op: str, schedule: str, transport: str, m: int | str, n: int | str,
                k: int | str, world: int | str = "8", dtype: str = "bfloat16") -> float:
    """Microseconds of ficco's ``schedule`` over ``transport`` for one shape of ``op``, the
    slower of the representative ranks (as the ``model`` selector prices it). ``m, n, k`` are
    the call's: for ``matmul_reduce_scatter`` every rank multiplies ``(m, k) @ (k, n)`` and
    receives ``m / world`` rows of the sum (``serial`` over ``ccl`` is ``torch.matmul`` then
    NCCL's ``reduce_scatter_tensor``); for ``all_gather_matmul`` each rank holds ``(m, k)`` and
    multiplies the gathered ``(world * m, k)`` by ``(k, n)``."""
    from ..heuristics import model

    problem = _problem(op, m, n, k, world, dtype)
    return max(model.simulate_schedule(schedule, problem, prof, transport=transport,
                                       rank=rank).makespan_s
               for rank in model.representative_ranks(problem.world)) * 1e6


def all_to_all_us(prof, recv_bytes: int | str, world: int | str = "8") -> float:
    """Microseconds of one all-to-all in which each of ``world`` ranks receives
    ``recv_bytes`` in total, its own share (1/W, which never travels) included, spread evenly
    over the peers (DeepEP's and TileScale's intranode dispatch/combine benchmarks report that
    volume over the time)."""
    world = int(world)
    per_peer = int(recv_bytes) // world
    problem = Problem(per_peer // 2, 1, (1,), "bfloat16", world)
    block = Block("input", 0, per_peer // 2, 0, 1)
    peers = tuple(None if q == 0 else block for q in range(world))
    plan = Plan("all-to-all", "ccl", problem, ("comm",), (AllToAll("comm", peers, peers),))
    return simulator.simulate(plan, dataclasses.replace(prof, host_op_s=0.0)).makespan_s * 1e6


def all_to_all_gbps(prof, recv_bytes: int | str, world: int | str = "8") -> float:
    """GB/s (1e9 bytes) of :func:`all_to_all_us`: ``recv_bytes`` over its time, the figure
    DeepEP's and mori's dispatch/combine benchmarks print where they give no time."""
    return int(recv_bytes) / all_to_all_us(prof, recv_bytes, world) / 1e3


def gemm_us(prof, m: int | str, n: int | str, k: int | str, dtype: str = "bfloat16",
            library: str = "") -> float:
    """Microseconds of one ``(m, k) @ (k, n)`` GEMM launch on ``prof`` by the kernel
    ``library`` (empty: the profile's vendor library; ``deepgemm``: DeepGEMM's kernels,
    :func:`ficco.heuristics.gemm.deepgemm_tiles`)."""
    problem = Problem(int(m), int(k), (int(n),), dtype, 1)
    return gemm.gemm_seconds(prof, dtype, [int(m)], int(n), int(k), problem.itemsize,
                             library=library or None) * 1e6


def gemm_tflops(prof, m: int | str, n: int | str, k: int | str, dtype: str = "bfloat16",
                library: str = "") -> float:
    """TFLOP/s of one ``(m, k) @ (k, n)`` GEMM launch on ``prof`` (:func:`gemm_us`)."""
    return 2 * int(m) * int(n) * int(k) / gemm_us(prof, m, n, k, dtype, library) / 1e6


def nccl_busbw_gbps(prof, kind: str, size: int | str, world: int | str = "8") -> float:
    """nccl-tests' bus bandwidth (GB/s) of collective ``kind`` at message ``size`` over
    ``world`` ranks as the profile prices it (:mod:`ficco.heuristics.collectives`)."""
    world, size = int(world), int(size)
    per_peer = size // world
    seconds = collectives.collective_seconds(prof, kind, per_peer, world - 1, world=world)
    return size * collectives.bus_factor(kind, world) / seconds / 1e9


def all_reduce_us(prof, size: int | str, world: int | str = "8") -> float:
    """Microseconds of the process group's all-reduce (NCCL/RCCL) of ``size`` bytes per rank
    over ``world`` ranks, alone (:mod:`ficco.heuristics.reductions`)."""
    from ..heuristics import reductions as pricing

    return pricing.collective_seconds(prof, int(size), int(world)) * 1e6


def kernel_all_reduce_us(prof, size: int | str, world: int | str = "8",
                         shots: str = "best") -> float:
    """Microseconds of the one-kernel all-reduce of ``size`` bytes per rank: ``shots`` "one"
    (``one-shot-kernel``), "two" (``two-shot-kernel``) or "best" (the faster: what a custom
    all-reduce that picks its algorithm by size runs)."""
    from ..heuristics import reductions as pricing

    one, two = (pricing.shot_kernel_seconds(prof, int(size), int(world), two_shot=t) * 1e6
                for t in (False, True))
    return {"one": one, "two": two, "best": min(one, two)}[shots]


def torch_all_reduce_us(prof, size: int | str, world: int | str = "8",
                        variant: str = "one-shot") -> float:
    """Microseconds of torch's ``symm_mem`` all-reduce ``variant`` of ``size`` bytes per rank
    as ``torch-<variant>`` prices it, its input already in torch's symmetric memory."""
    from ..heuristics import reductions as pricing

    return pricing.torch_kernel_seconds(prof, int(size), int(world), variant) * 1e6


def dma_copy_us(prof, nbytes: int | str) -> float:
    """Microseconds of one peer DMA copy of ``nbytes`` with its completion (latency + bytes
    over the copy's bandwidth at its size), alone on the link."""
    problem = Problem(int(nbytes), 1, (1,), "float16" if int(nbytes) % 2 == 0 else "float32", 2)
    rows = int(nbytes) // problem.itemsize
    plan = Plan("copy", "dma", problem, ("copy0",),
                (Copy("copy0", Block("input", 0, rows, 0, 1, peer=1),
                      Block("gathered", rows, rows, 0, 1)),))
    return simulator.simulate(plan, dataclasses.replace(prof, host_op_s=0.0)).makespan_s * 1e6


def problem_of(shapes: dict) -> Problem:
    """The Problem of a ``schedule_us`` row's ``shapes`` (``op``, ``m``, ``n``, ``k``,
    ``world``, ``dtype``)."""
    return _problem(shapes.get("op", "all_gather_matmul"), shapes["m"], shapes["n"], shapes["k"],
                    shapes.get("world", 8), shapes.get("dtype", "bfloat16"))


def _problem(op: str, m: int | str, n: int | str, k: int | str, world: int | str,
             dtype: str) -> Problem:
    return Problem(int(m), int(k), (int(n),), dtype, int(world), op=op)


#: Each called with the row's profile and its ``shapes`` (strings; ints work as well).
PREDICTORS: dict[str, Callable[..., float]] = {
    "gemm_cil_geomean": gemm_cil,
    "copy_cil_geomean": copy_cil,
    "copy_dil_geomean": copy_dil,
    "ring_comm_slowdown": ring_comm_slowdown,
    "ring_worst_slowdown": ring_worst_slowdown,
    "ideal_speedup_max": ideal_max,
    "ficco_1d_speedup_max": ficco_1d_max,
    "emulated_2d_speedup_max": emulated_2d_max,
    "fraction_of_ideal_1d": fraction_1d,
    "fraction_of_ideal_2d": fraction_2d,
    "nccl_all_gather_us": nccl_all_gather_us,
    "nccl_reduce_scatter_us": nccl_reduce_scatter_us,
    "independent_overlap_ms": independent_overlap_ms,
    "ag_then_mm_us": ag_then_mm_us,
    "schedule_us": schedule_us,
    "async_tp_us": async_tp_us,
    "all_to_all_us": all_to_all_us,
    "all_to_all_gbps": all_to_all_gbps,
    "gemm_us": gemm_us,
    "gemm_tflops": gemm_tflops,
    "nccl_busbw_gbps": nccl_busbw_gbps,
    "dma_copy_us": dma_copy_us,
    "all_reduce_us": all_reduce_us,
    "kernel_all_reduce_us": kernel_all_reduce_us,
    "torch_all_reduce_us": torch_all_reduce_us,
}


# -- shape classes of point rows (for the selector's error bands) -------------------------------
def row_class(quantity: str, prof, **shapes) -> str:
    """``"<op>/<regime>"`` (:func:`ficco.heuristics.bands.shape_class`) of a point row, or
    ``""`` for a quantity that is not one shape of an op."""
    if quantity == "async_tp_us":      # an overlapped MM+RS plan the simulator replays
        shapes = dict(shapes, op="matmul_reduce_scatter")
    if quantity in ("ag_then_mm_us", "schedule_us", "async_tp_us"):
        problem = _problem(shapes.get("op", "all_gather_matmul"), shapes["m"], shapes["n"],
                           shapes["k"], shapes.get("world", 8), shapes.get("dtype", "bfloat16"))
        return bands.shape_class(problem, prof)
    if quantity == "independent_overlap_ms":
        m, n, k = int(shapes["m"]), int(shapes["n"]), int(shapes["k"])
        problem = Problem(m, k, (n,), shapes.get("dtype", "float16"), int(shapes.get("world", 8)))
        gemm_s = gemm.gemm_seconds(prof, problem.dtype, [m], n, k, problem.itemsize)
        # the all-gather's input is its own buffer, not the GEMM's rows
        shard = int(shapes["ag_in_bytes"]) // (k * problem.itemsize)
        comm_s = bands.parts(dataclasses.replace(problem, m=max(shard, 1)), prof)[1]
        return f"{problem.op}/{bands.regime(gemm_s, comm_s)}"
    return ""
