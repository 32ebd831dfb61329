"""The simulator's invariants: physical bounds, monotonicity, topology effects,
queue semantics. Never a fitted number: those are held against published results by
``python -m ficco.bench validate``."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from ficco import schedules
from ficco.bench import validate
from ficco.errors import InvalidArgumentError
from ficco.heuristics import gemm, model, profiles, simulator
from ficco.heuristics.scenarios import PAPER_TABLE_I, gemm_problem, table_i_problem
from ficco.plan import (
    COMPUTE,
    AllGather,
    Barrier,
    Block,
    Copy,
    Gemm,
    Plan,
    PlanBuilder,
    Record,
    Wait,
)
from ficco.plan.problem import Problem

MI300X = profiles.load("mi300x")
H100 = profiles.load("h100")
PAPER_FOUR = validate.PAPER_FOUR
# Communication-heavy (g6, g11, g14), GEMM-heavy (g10) and M <= K (g1, g5) shapes.
SHAPES = ("g1", "g5", "g6", "g10", "g11", "g14")


def speedups(problem, profile, topology=None, transport="dma"):
    times = model.predict_all(problem, profile, topology, transport)
    return {name: times["serial"] / t for name, t in times.items()}


def ideal(problem, profile, topology=None, transport="dma"):
    serial = model.simulate_schedule("serial", problem, profile, topology, transport)
    return simulator.ideal_speedup(serial)


def physical_bound_s(problem: Problem, profile, topology: str) -> float:
    """max(GEMM at the achievable rate, all-gather at link bandwidth, HBM roofline)."""
    flops = 2 * problem.big_m * problem.n_total * problem.k
    gemm_s = flops / (profile.flops(problem.dtype) * profile.dil["gemm_efficiency"])
    world = problem.world
    link = profile.link_for(topology, world)
    into_gpu = link * (world - 1) if topology == "mesh" else link
    gather_s = (world - 1) * problem.m * problem.k * problem.itemsize / into_gpu
    hbm_s = gemm.traffic_bytes(problem.big_m, problem.n_total, problem.k, problem.itemsize) \
        / profile.hbm_bytes_per_s
    return max(gemm_s, gather_s, hbm_s)


@pytest.mark.parametrize("profile,topology", [(MI300X, "mesh"), (H100, "switch"),
                                              (H100, "pcie"), (MI300X, "switch")],
                         ids=["mi300x-mesh", "h100-switch", "h100-pcie", "mi300x-switch"])
@pytest.mark.parametrize("transport", ["dma", "ccl"])
def test_no_prediction_beats_the_physical_bound(profile, topology, transport):
    for name in SHAPES:
        problem = table_i_problem(name)
        bound = physical_bound_s(problem, profile, topology)
        for schedule, seconds in model.predict_all(problem, profile, topology,
                                                   transport).items():
            assert seconds >= bound * (1 - 1e-9), (name, schedule, seconds, bound)


def _scaled(profile, **factors):
    changes = {}
    if "flops" in factors:
        changes["peak_flops"] = {k: v * factors["flops"] for k, v in profile.peak_flops.items()}
    if "link" in factors:
        changes["link_bytes_per_s"] = profile.link_bytes_per_s * factors["link"]
        changes["pcie_bytes_per_s"] = profile.pcie_bytes_per_s * factors["link"]
        changes["pcie_aggregate_bytes_per_s"] = \
            profile.pcie_aggregate_bytes_per_s * factors["link"]
    return dataclasses.replace(profile, **changes)


@pytest.mark.parametrize("knob", ["flops", "link"])
@pytest.mark.parametrize("profile", [MI300X, H100], ids=["mi300x", "h100"])
def test_more_bandwidth_or_flops_never_makes_a_plan_slower(profile, knob):
    faster = _scaled(profile, **{knob: 2.0})
    for name in SHAPES:
        problem = table_i_problem(name, scale=8)
        for schedule in schedules.names():
            for rank in (0, problem.world // 2):
                base = model.simulate_schedule(schedule, problem, profile, rank=rank)
                quick = model.simulate_schedule(schedule, problem, faster, rank=rank)
                assert quick.makespan_s <= base.makespan_s * (1 + 1e-9), \
                    (name, schedule, rank, quick.makespan_s, base.makespan_s)


@pytest.mark.parametrize("scenario", ["g6", "g11"])
def test_mi300x_mesh_ring_is_slower_than_serial_on_communication_heavy_shapes(scenario):
    # On the mesh a ring keeps one of seven links busy.
    problem = table_i_problem(scenario)
    serial = model.simulate_schedule("serial", problem, MI300X)
    assert serial.busy_s("copy_1d") / 7 > serial.busy_s("gemm")   # comm-heavy indeed
    s = speedups(problem, MI300X)
    assert s["ring"] < 1.0
    assert max(s[name] for name in PAPER_FOUR) > 1.0


def test_switch_lets_ring_win_where_the_mesh_made_it_lose():
    for name in ("g6", "g11"):
        problem = table_i_problem(name)
        assert speedups(problem, H100)["ring"] > 1.0
        assert speedups(problem, MI300X, "switch")["ring"] > 2 * speedups(problem, MI300X)["ring"]


def test_ideal_overlap_of_a_balanced_gemm_approaches_two():
    # Sweep n so GEMM time crosses all-gather time; the best balance must come close to 2x.
    best = max(ideal(gemm_problem(262144, n * 8, 8192, 8), MI300X)
               for n in range(256, 4096, 256))
    assert best > 1.9 and best < 2.0, best


@pytest.mark.parametrize("profile", [MI300X, H100], ids=["mi300x", "h100"])
def test_every_schedule_is_below_its_ideal(profile):
    for name in PAPER_TABLE_I:
        problem = table_i_problem(name)
        bound = ideal(problem, profile)
        for schedule, speedup in speedups(problem, profile).items():
            assert speedup < bound, (name, schedule, speedup, bound)


def test_contention_grows_with_concurrent_copies_and_gemm_traffic():
    small, large = (simulator.mt_factor(MI300X, b) for b in (5e7, 2e9))
    assert 0 < small < large < 1
    for copies in range(1, MI300X.copy_engines):
        fewer = simulator.dma_contention(MI300X, large, copies)
        more = simulator.dma_contention(MI300X, large, copies + 1)
        assert fewer[0] > 1 and fewer[1] > 1, fewer
        assert fewer[0] < more[0] and fewer[1] < more[1], (copies, fewer, more)
    assert simulator.dma_contention(MI300X, large, 0) == (1.0, 1.0)


def test_ccl_contends_more_than_dma():
    problem = table_i_problem("g6")
    for name in ("uniform-fused-1d", "hetero-unfused-1d"):
        assert model.predict(name, problem, MI300X, transport="ccl") > \
            model.predict(name, problem, MI300X, transport="dma")


def _single(op, problem, queues=(COMPUTE,)):
    return Plan("test", "dma", problem, queues, (op,))


def _gemm_s(problem, rows, profile=MI300X, k=None):
    k = k or problem.k
    op = Gemm(COMPUTE, (Block("gathered", 0, rows, 0, k),), (Block("out", 0, rows, 0, 1024),),
              0, 0, k)
    return simulator.simulate(_single(op, problem), profile).makespan_s


def test_decomposed_gemm_pays_launches_and_waves():
    p = Problem(4096, 8192, (1024,), "bfloat16", 8)
    assert 64 * _gemm_s(p, p.big_m // 64) > _gemm_s(p, p.big_m)


def test_gemm_library_picks_its_best_tile_and_split():
    # Offering more tiles or split-K can only help: the library takes the fastest kernel.
    one_tile = dataclasses.replace(MI300X, dil={**MI300X.dil, "tiles": [[256, 256, 1.0]],
                                                "split_k_below_waves": 0.0})
    p = Problem(64, 131072, (1024,), "bfloat16", 8)
    for rows in (64, 512, 4096, 65536):
        assert _gemm_s(p, rows) <= _gemm_s(p, rows, one_tile)


def test_strided_2d_copy_is_slower_than_1d_of_same_bytes():
    p = Problem(4096, 4096, (64,), "bfloat16", 2)
    flat = Copy("copy0", Block("gathered", 0, 512, 0, 4096, peer=1),
                Block("gathered", 0, 512, 0, 4096))
    narrow = Copy("copy0", Block("gathered", 0, 4096, 0, 512, peer=1),
                  Block("gathered", 0, 4096, 0, 512), two_d=True)
    t1 = simulator.simulate(_single(flat, p, ("copy0",)), MI300X).makespan_s
    t2 = simulator.simulate(_single(narrow, p, ("copy0",)), MI300X).makespan_s
    assert t2 > t1


def _all_gather_s(profile, topology, world, per_rank_rows):
    p = Problem(per_rank_rows, 1024, (8,), "bfloat16", world)
    src = Block("input", 0, p.m, 0, p.k)
    dsts = tuple(Block("gathered", q * p.m, p.m, 0, p.k) for q in range(world))
    plan = Plan("ag", "ccl", p, ("comm",), (AllGather("comm", src, dsts),))
    no_host = dataclasses.replace(profile, host_op_s=0.0)
    return simulator.simulate(plan, no_host, topology).makespan_s, p


def test_pcie_gpus_share_the_hosts_bandwidth():
    # Every GPU receives (W-1) shards; over PCIe all W share the aggregate, so no GPU can
    # receive faster than aggregate / W, and more GPUs means less for each.
    per_gpu = {}
    for world in (2, 4, 8):
        seconds, p = _all_gather_s(H100, "pcie", world, 65536)
        received = (world - 1) * p.m * p.k * p.itemsize
        per_gpu[world] = received / seconds
        assert per_gpu[world] <= H100.pcie_aggregate_bytes_per_s / world
    assert per_gpu[8] < per_gpu[4] < per_gpu[2]
    switch_s, _ = _all_gather_s(H100, "switch", 8, 65536)
    assert _all_gather_s(H100, "pcie", 8, 65536)[0] > 10 * switch_s


def test_queue_order_and_events_are_respected():
    p = Problem(2048, 4096, (4096,), "bfloat16", 8)
    for name in schedules.names():
        plan = schedules.get(name).plan(p, "dma")
        result = simulator.simulate(plan, MI300X)
        by_queue = {}
        for row in result.rows:
            by_queue.setdefault(row["queue"], []).append(row)
        for rows in by_queue.values():
            for before, after in itertools.pairwise(rows):
                assert after["start_s"] >= before["end_s"] - 1e-15
        assert result.makespan_s == pytest.approx(max(r["end_s"] for r in result.rows))
        gemm_start = min(r["start_s"] for r in result.rows if r["kind"] == "gemm")
        ops_rows = [r for r in result.rows if r["kind"] != "cast"]
        assert gemm_start >= 0 and len(ops_rows) == sum(plan.count().values())
        # bf16 plans that accumulate (the 2d ones) end with one pass rounding float32 outputs.
        assert (len(ops_rows) < len(result.rows)) == plan.wide_outputs(), name


def test_wait_holds_its_queue_until_the_record():
    p = Problem(1024, 1024, (1024,), "bfloat16", 2)
    builder = PlanBuilder("test", "dma", p)
    copy = builder.add(Copy("copy0", Block("gathered", 0, 1024, 0, 1024, peer=1),
                            Block("gathered", 0, 1024, 0, 1024)))
    builder.add(Gemm(COMPUTE, (Block("gathered", 0, 1024, 0, 1024),),
                     (Block("out", 0, 1024, 0, 1024),), 0, 0, 1024), after=[copy])
    rows = simulator.simulate(builder.build(), MI300X).rows
    assert rows[1]["start_s"] >= rows[0]["end_s"]


def test_a_wait_without_record_is_reported():
    p = Problem(8, 8, (8,), "float32", 2)
    plan = Plan("broken", "dma", p, (COMPUTE,), (Wait(COMPUTE, 0), Barrier(COMPUTE, 0)),
                num_events=1)
    with pytest.raises(InvalidArgumentError, match="wait forever"):
        simulator.simulate(plan, MI300X)
    ok = Plan("fine", "dma", p, (COMPUTE, "copy0"), (Wait(COMPUTE, 0), Record("copy0", 0)),
              num_events=1)
    # Nothing to do: the executor issues neither event (a wait with nothing after it orders
    # nothing, and its record goes with it), so no side queue waits for the entry record.
    assert simulator.simulate(ok, MI300X).makespan_s == 0.0


def test_an_op_kind_without_a_price_is_named():
    @dataclasses.dataclass(frozen=True)
    class Mystery:
        queue: str = COMPUTE
        kind = "mystery"

    p = Problem(8, 8, (8,), "float32", 2)
    with pytest.raises(InvalidArgumentError, match="_price_mystery"):
        simulator.simulate(_single(Mystery(), p), MI300X)


def test_every_schedule_simulates_over_ccl_and_pcie():
    problem = table_i_problem("g14")
    over_ccl = model.predict_all(problem, MI300X, transport="ccl")
    assert all(0 < t < float("inf") for t in over_ccl.values())
    assert model.predict("serial", problem, H100, "pcie") > \
        1.5 * model.predict("serial", problem, H100, "switch")


def test_host_enqueue_cost_bounds_plans_of_many_small_ops():
    """Each op waits for the host to enqueue it: a many-op plan of a tiny GEMM is launch
    bound, and the simulator ranks it behind serial; with free launches it is not."""
    p = Problem(64, 256, (256,), "bfloat16", 8)
    for profile in (MI300X, dataclasses.replace(MI300X, host_op_s=0.0)):
        plans = {n: schedules.get(n).plan(p, "dma") for n in ("serial", "uniform-unfused-1d")}
        times = {n: simulator.simulate(plan, profile).makespan_s for n, plan in plans.items()}
        many = plans["uniform-unfused-1d"]
        assert times["uniform-unfused-1d"] >= len(many.ops) * profile.host_op_s
        if profile.host_op_s:
            assert times["uniform-unfused-1d"] > times["serial"], times


def test_paper_implementation_adds_gathers_only_to_fused_1d_schedules():
    """The paper's fused 1D GEMMs gather and scatter; its emulated 2D copies land where the
    GEMM reads them (no gather); no 2D copy is left, and no publish (its inputs sat in
    symmetric memory). The gathers and scatters never make a plan faster."""
    problem = table_i_problem("g6", scale=16)
    for name in PAPER_FOUR:
        plan = schedules.get(name).plan(problem, "dma")
        paper = validate.as_paper_implemented(plan)
        moves = [op for op in paper.ops if op.queue in ("gather", "scatter")
                 and op.kind == "copy_1d"]
        assert bool(moves) == ("-fused-" in name and name.endswith("-1d")), name
        assert not any(op.kind == "copy_2d" for op in paper.ops)
        assert not any(op.kind == "copy_1d" and op.src.buf == "input" for op in paper.ops)
        without = dataclasses.replace(paper, ops=tuple(op for op in paper.ops
                                                       if not any(op is m for m in moves)))
        assert simulator.simulate(paper, MI300X).makespan_s >= \
            simulator.simulate(without, MI300X).makespan_s * (1 - 1e-9)


def test_graph_launched_profile_drops_only_host_time_and_never_slows_a_plan():
    """``NAME:graphs`` (how the paper's runs are priced) is the named profile without host
    time per op: removing host time never makes any of the paper's four plans slower, and a
    malformed profile name is refused."""
    graphs = validate.load_profile("mi300x:graphs")
    assert graphs.host_op_s == 0.0
    assert dataclasses.replace(graphs, host_op_s=MI300X.host_op_s) == MI300X
    for shape in ("g2", "g6"):
        problem = table_i_problem(shape, scale=16)
        for name in PAPER_FOUR:
            plan = validate.as_paper_implemented(schedules.get(name).plan(problem, "dma"))
            assert simulator.simulate(plan, graphs, wide_outputs=False).makespan_s <= \
                simulator.simulate(plan, MI300X, wide_outputs=False).makespan_s * (1 + 1e-9)
    for bad in ("mi300x:graph", "mi300x:graphs:graphs", "mi300x:graphsx"):
        with pytest.raises(ValueError, match="expected NAME"):
            validate.load_profile(bad)


TWO_D = [n for n in schedules.names() if n.endswith("-2d")]


@pytest.mark.parametrize("base", [MI300X, H100], ids=["mi300x", "h100"])
def test_2d_copies_on_compute_units_never_price_a_2d_schedule_cheaper(base):
    """Where 2-D copies run as kernels (ROCm's hipMemcpy2DAsync ignores the
    NoCU kind), a 2D schedule is never predicted faster than with the same copies on DMA
    engines, and the flag is not ignored: some schedule gets slower."""
    import random

    rng = random.Random()
    # No host enqueue time (graph replays), so small shapes are not launch bound.
    on_dma = dataclasses.replace(base, copy_2d_on_dma=True, host_op_s=0.0)
    on_cus = dataclasses.replace(base, copy_2d_on_dma=False, host_op_s=0.0)
    shapes = [table_i_problem(name, scale=4) for name in ("g1", "g5", "g6")]
    shapes += [gemm_problem(8 * rng.randint(512, 8192), 8 * rng.randint(128, 2048),
                            rng.randint(1024, 32768), 8) for _ in range(2)]
    slower = 0
    for problem in shapes:
        for name in TWO_D:
            dma_s = model.predict(name, problem, on_dma)
            cu_s = model.predict(name, problem, on_cus)
            assert cu_s >= dma_s * (1 - 1e-9), (name, problem)
            slower += cu_s > dma_s * (1 + 1e-6)
    assert slower > 0
    # 1D schedules have no 2-D copy: the flag cannot move them.
    problem = shapes[0]
    assert model.predict("hetero-fused-1d", problem, on_cus) == \
        pytest.approx(model.predict("hetero-fused-1d", problem, on_dma), rel=1e-12)


def test_rocm_target_prices_2d_copies_on_compute_units(monkeypatch):
    """The profile in force on a ROCm target says 2-D copies are not DMA, whatever profile
    FICCO_PROFILE names; a CUDA target keeps the profile's own flag."""
    from ficco.backends.rocm import RocmBackend

    monkeypatch.delenv("FICCO_PROFILE", raising=False)
    assert RocmBackend.copy_2d_on_dma is False
    assert profiles.resolve("rocm:gfx942").copy_2d_on_dma is False
    assert profiles.resolve("cuda:sm_90").copy_2d_on_dma is True
    monkeypatch.setenv("FICCO_PROFILE", "h100")
    assert profiles.load("h100").copy_2d_on_dma is True
    assert profiles.resolve("rocm:gfx942").copy_2d_on_dma is False


def test_a_gather_kernel_beside_a_gemm_costs_at_least_a_copy_engine_move():
    """A local move on a compute queue (a kernel on the CUs, like the paper's gathers) slows a
    GEMM beside it more than the same move on a copy engine (it takes CUs from it)."""
    p = table_i_problem("g2", scale=4)
    a = Block("input", 0, p.m, 0, p.k)
    out = Block("out", 0, p.m, 0, p.ns[0], index=0)
    moved = Block("gathered", 0, p.m, 0, p.k)
    times = {}
    for queue in ("copy0", "gather"):
        plan = Plan("probe", "dma", p, (COMPUTE, queue),
                    (Gemm(COMPUTE, (a,), (out,), 0, 0, p.k), Copy(queue, moved, moved)))
        times[queue] = simulator.simulate(plan, MI300X).makespan_s
    assert MI300X.ccl["compute_unit_fraction"] > 0
    assert times["gather"] > times["copy0"] * (1 + 1e-6)


def test_hipblaslt_auto_split_fills_at_most_one_wave_within_the_workspace():
    """hipBLASLt's automatic split-K (MI300X profile): a split K never gives more parts than
    compute units, keeps 3 K steps per part and fits its float32 partials in the workspace."""
    import random

    rng = random.Random()
    assert MI300X.dil["split_k_rule"] == "hipblaslt_auto"
    units, depth = MI300X.compute_units, MI300X.dil["depth_u"]
    for _ in range(200):
        tiles = rng.randint(1, 4 * units)
        k = rng.randint(64, 1 << 18)
        area = rng.choice([64 * 64, 128 * 128, 256 * 256])
        split = gemm.auto_gsu(MI300X, tiles, k, area)
        assert split >= 1
        if split > 1:
            assert tiles * split <= units
            assert k // split >= 3 * depth
            assert split * tiles * area * 4 <= MI300X.dil["split_k_workspace_bytes"]
        elif tiles * 2 <= units and k >= 6 * depth and 2 * tiles * area * 4 <= 76 * 2 ** 20:
            raise AssertionError((tiles, k, area))   # room for 2 parts: the library splits


def test_partial_sums_in_the_last_level_cache_never_cost_more_than_through_hbm():
    """Split-K's float32 partials: the part that fits in the LLC moves at its bandwidth, the
    rest through HBM; never slower than all through HBM, never faster than all in the LLC,
    growing with the bytes, and a profile without an LLC prices everything through HBM."""
    import random

    rng = random.Random()
    assert MI300X.llc_bytes > 0 and MI300X.llc_bytes_per_s > MI300X.hbm_bytes_per_s
    no_llc = dataclasses.replace(MI300X, llc_bytes_per_s=None)
    all_llc = dataclasses.replace(MI300X, llc_bytes=float("inf"))
    previous = 0.0
    for nbytes in sorted(rng.uniform(1e5, 4 * MI300X.llc_bytes) for _ in range(50)):
        cached = gemm.partials_seconds(MI300X, nbytes)
        assert gemm.partials_seconds(all_llc, nbytes) <= cached <= gemm.partials_seconds(no_llc, nbytes)
        assert cached > previous
        if nbytes <= MI300X.llc_bytes:   # all of it in the cache: strictly cheaper
            assert cached < gemm.partials_seconds(no_llc, nbytes)
        previous = cached
    eff = MI300X.dil["memory_efficiency"]
    assert gemm.partials_seconds(no_llc, 1e8) == pytest.approx(2e8 / (MI300X.hbm_bytes_per_s * eff))
    # A GEMM is never cheaper than its roofline, whatever the cache makes of its split-K.
    p = Problem(2048, 16384, (2048,), "bfloat16", 8)
    for rows in (128, 2048, 16384):
        assert gemm.gemm_seconds(MI300X, "bfloat16", [rows], 2048, p.k, 2) >= \
            gemm.memory_seconds(MI300X, rows, 2048, p.k, 2)
        assert gemm.gemm_seconds(MI300X, "bfloat16", [rows], 2048, p.k, 2) <= \
            gemm.gemm_seconds(no_llc, "bfloat16", [rows], 2048, p.k, 2)


def test_every_piece_of_one_gemm_is_as_exposed_to_contention_as_its_shard():
    """s(MT) is the problem's (one shard's rows, as the paper's Fig. 8 measured), so a 64-way
    piece and a fused step of the same GEMM slow alike beside the same copies."""
    p = table_i_problem("g6")
    shard = simulator.mt_factor(MI300X, gemm.traffic_bytes(p.m, p.ns[0], p.k, p.itemsize))
    sim = simulator.Simulation(_single(Barrier(COMPUTE, 0), p), MI300X, "mesh")
    assert 0 < shard < 1
    for rows in (p.big_m // 64, p.m, 7 * p.big_m // 8):
        op = Gemm(COMPUTE, (Block("gathered", 0, rows, 0, p.k),),
                  (Block("out", 0, rows, 0, p.ns[0]),), 0, 0, p.k)
        assert sim._price_gemm(op).mt_factor == pytest.approx(shard), rows


def test_a_gather_kernel_takes_more_compute_units_than_a_collective():
    """A gather or scatter kernel, launched over a full grid, slows a GEMM beside it more the
    more CUs it is given; never less than a collective's few channels would."""
    p = table_i_problem("g2", scale=4)
    a = Block("input", 0, p.m, 0, p.k)
    out = Block("out", 0, p.m, 0, p.ns[0], index=0)
    moved = Block("gathered", 0, p.m, 0, p.k)
    plan = Plan("probe", "dma", p, (COMPUTE, "gather"),
                (Gemm(COMPUTE, (a,), (out,), 0, 0, p.k), Copy("gather", moved, moved)))
    times = []
    for share in (MI300X.ccl["compute_unit_fraction"], 0.3, 0.5, 0.7):
        prof = dataclasses.replace(MI300X, cil={**MI300X.cil, "cu_mem_unit_fraction": share})
        times.append(simulator.simulate(plan, prof).makespan_s)
    assert times == sorted(times) and times[0] < times[-1], times


# -- One hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) ---------------------------
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_one_hardware_queue_dispatches_in_issue_order_and_serialises_barriers_and_copies(op):
    """With every stream on one hardware queue ops start in the host's issue order, nothing
    issued after a barrier starts before it ended, DMA copies run one at a time. (A schedule
    may still come out faster: copies one at a time slow the GEMM beside them less.)"""
    from dataclasses import replace as changed

    from ficco import schedules

    prof = profiles.load("h100")
    one = changed(prof, hardware_queues=1)
    p = Problem(m=2048, k=8192, ns=(2048,), dtype="bfloat16", world=8, op=op)
    names = [n for n in schedules.names(op=op) if not n.startswith("gated")]

    def total(profile):
        return sum(simulator.simulate(schedules.get(n, op=op).plan(p, "dma"), profile).makespan_s
                   for n in names)
    slower = 0
    for name in names:
        plan = schedules.get(name, op=op).plan(p, "dma")
        base = simulator.simulate(plan, prof)
        result = simulator.simulate(plan, one)
        slower += result.makespan_s > base.makespan_s * 1.01
        rows = sorted(result.rows, key=lambda r: r["op_index"])
        starts = [r["start_s"] for r in rows]
        assert starts == sorted(starts), name                      # issue order
        for r in rows:
            if r["kind"] == "barrier":
                later = [x for x in rows if x["op_index"] > r["op_index"]]
                assert all(x["start_s"] >= r["end_s"] - 1e-12 for x in later), name
        copies = [r for r in rows if r["kind"].startswith("copy") and r["queue"] != "compute"]
        for a in copies:     # never two copies flowing at once
            overlap = [b for b in copies if b is not a and b["start_s"] < a["end_s"] - 1e-9
                       and a["start_s"] < b["end_s"] - 1e-9]
            assert not overlap or all(b["end_s"] - b["start_s"] < 1e-12 for b in overlap), name
    assert slower >= 1      # not a no-op (the reduce-scatter's plans are host-issue bound here)
    assert total(one) > total(prof)


def test_the_profile_follows_cuda_device_max_connections(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert profiles.resolve("cuda:sm_90").hardware_queues == 1
    assert profiles.resolve("rocm:gfx942").hardware_queues is None
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    monkeypatch.setenv("GPU_MAX_HW_QUEUES", "1")
    assert profiles.resolve("rocm:gfx942").hardware_queues == 1
    assert profiles.resolve("cuda:sm_90").hardware_queues is None
