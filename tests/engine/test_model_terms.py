"""The terms the shipped model gained from published runs, each checked against
its own arithmetic (so removing or mis-wiring a term fails here): chunking a GEMM that feeds a
collective, per-chunk copy latencies, GEMMs sharing the machine across streams, PyTorch's
Async-TP replayed as torch runs it, DeepGEMM's block menu, the all-reduce priced from
profile numbers rather than a profile's name, NVLS's measured all-reduce curve on 8x H100, and
the latency-bandwidth law of compute-unit collectives on MI300X. No speed of this machine is asserted."""
from __future__ import annotations

import dataclasses
import math

import pytest

from ficco.bench import async_tp, predictors
from ficco.heuristics import collectives, gemm, profiles, reductions, simulator
from ficco.plan import COMPUTE, AllToAll, Barrier, Block, Copy, Gemm, Plan, Record, Reduce
from ficco.plan.problem import Problem

H100 = profiles.load("h100")
H20 = profiles.load("h20")
MI300X = profiles.load("mi300x")


def _one_tile(prof, tile=128, **dil):
    """``prof`` with one tile, no split-K and no partial-wave speedup: wave math in whole waves."""
    return dataclasses.replace(prof, dil={**prof.dil, "tiles": [[tile, tile, 1.0]],
                                          "split_k_below_waves": 0.0,
                                          "partial_wave_speedup": 1.0, **dil})


def test_a_gemm_chunked_for_a_collective_pays_waves_launches_and_weight_reads_per_chunk():
    prof = _one_tile(H100)
    units, dil = prof.compute_units, prof.dil
    k, n = 8192, 128 * (units // 4)      # a 128-row chunk holds a quarter of the units
    unit_flops = prof.flops("bfloat16") * dil["gemm_efficiency"] / units
    tile_s = 2 * 128 * 128 * (k + dil["tile_k_overhead"]) / unit_flops
    whole = gemm.gemm_seconds(prof, "bfloat16", [8 * 128], n, k, 2)
    assert whole == pytest.approx(dil["launch_s"] + 2 * tile_s)         # 2 full waves
    # 8 chunks of 128 rows: a quarter wave each, priced as a whole wave, plus its own launch
    chunk = gemm.gemm_seconds(prof, "bfloat16", [128], n, k, 2)
    assert chunk == pytest.approx(dil["launch_s"] + tile_s)
    assert 8 * chunk / whole == pytest.approx((8 * (dil["launch_s"] + tile_s))
                                              / (dil["launch_s"] + 2 * tile_s))
    # memory-bound chunks read all of B again: 8 chunks move 8 x K x N weight bytes
    slow_hbm = dataclasses.replace(prof, hbm_bytes_per_s=prof.hbm_bytes_per_s / 1000)
    eff = dil["gemm_memory_efficiency"]
    chunks = 8 * gemm.gemm_seconds(slow_hbm, "bfloat16", [128], n, k, 2)
    weight = 8 * k * n * 2 + 8 * 128 * (k + n) * 2
    assert chunks == pytest.approx(8 * dil["launch_s"]
                                   + weight / (slow_hbm.hbm_bytes_per_s * eff))


def test_each_chunked_copy_pays_the_copy_latency_or_the_queued_issue_interval():
    """A schedule that cuts a peer's rows into c copies on one queue pays one copy latency
    and c - 1 issue intervals of copies queued behind it (mi355x: S1's 6 us SDMA round trip,
    mori's 3 us pipelined issue interval); an event between two copies, or a profile with no
    measured interval (mi300x), pays the whole round trip for each."""
    problem = Problem(4096, 1024, (1024,), "bfloat16", 2)

    def copies(prof, count, record=False):
        rows = problem.m // count
        ops = []
        for i in range(count):
            ops.append(Copy("copy0", Block("input", i * rows, rows, 0, problem.k, peer=1),
                            Block("gathered", problem.m + i * rows, rows, 0, problem.k)))
            if record:
                ops.append(Record("copy0", i))
        plan = Plan("c", "dma", problem, ("copy0",), tuple(ops))
        return simulator.simulate(plan, dataclasses.replace(prof, host_op_s=0.0)).makespan_s

    def moving(prof, count):        # the bytes of count copies at their size's efficiency
        nbytes = problem.m // count * problem.k * 2
        engine = min(prof.link_bytes_per_s, prof.copy_engine_bytes_per_s or math.inf)
        return count * nbytes / (engine * prof.copy_fraction(nbytes))

    mi355, mi300 = profiles.load("mi355x"), profiles.load("mi300x")
    assert (mi355.copy_latency_s, mi355.queued_copy_s()) == (6e-6, 3e-6)
    assert copies(mi355, 1) == pytest.approx(6e-6 + moving(mi355, 1))
    assert copies(mi355, 8) == pytest.approx(6e-6 + 7 * 3e-6 + moving(mi355, 8))
    assert copies(mi355, 8, record=True) == pytest.approx(8 * 6e-6 + moving(mi355, 8))
    assert mi300.queued_copy_s() == mi300.copy_latency_s == 10e-6
    assert copies(mi300, 8) == pytest.approx(8 * 10e-6 + moving(mi300, 8))


def test_an_expert_pull_pays_one_round_trip_and_queued_intervals_for_its_other_blocks():
    """An expert-parallel pull of one peer's rows is one copy per local expert, queued back to
    back on one engine: the first pays the copy latency, each further one the issue interval
    (mi355x: 6 + 3 x 3 us for 4 experts; mi300x, no measured interval: 4 x 10 us)."""
    from ficco import schedules
    from ficco.ops.expert.problem import ExpertProblem, representative

    p = ExpertProblem(64, 32, 4, "bfloat16", 2, 0, "all_to_all_grouped_mm",
                      representative(2, 4, 16, 1.0))
    plan = schedules.get("serial", op=p.op).plan(p, "dma")
    pull = next(op for op in plan.ops if op.kind == "expert_copy" and op.experts is None)
    for name, fixed in (("mi355x", 6e-6 + 3 * 3e-6), ("mi300x", 4 * 10e-6)):
        task = simulator.Simulation(plan, profiles.load(name), "mesh")._task(pull)
        assert task.fixed_s == pytest.approx(fixed)


def test_a_copy_past_one_sdma_packet_pays_each_further_packet():
    """A copy longer than one SDMA copy command carries (ROCr: 2^30 - 1 bytes on gfx94x/gfx950)
    is several commands; each after the first costs mi355x's copy_packet_s (mori's ~3 us issue
    interval between queued puts). 2 GiB is three packets: exactly two packet costs more than
    the same copy with no per-packet cost; 1 MiB is one packet and pays none."""
    prof = dataclasses.replace(profiles.load("mi355x"), host_op_s=0.0)
    assert prof.copy_packet_bytes == 2**30 - 1 and prof.copy_packet_s == pytest.approx(3e-6)
    free = dataclasses.replace(prof, copy_packet_s=0.0)

    def copy(profile, rows, k):
        problem = Problem(rows, k, (1024,), "bfloat16", 2)
        op = Copy("copy0", Block("input", 0, rows, 0, k, peer=1), Block("gathered", rows, rows,
                                                                         0, k))
        plan = Plan("c", "dma", problem, ("copy0",), (op,))
        return simulator.simulate(plan, profile).makespan_s

    big = (2**17, 2**13)        # 2^17 rows x 2^13 bf16 columns = 2^31 bytes: 3 packets
    assert copy(prof, *big) - copy(free, *big) == pytest.approx(2 * prof.copy_packet_s)
    assert copy(prof, 512, 1024) == copy(free, 512, 1024)


def _gemm(queue, rows, k, n, row0=0):
    return Gemm(queue, (Block("input", row0, rows, 0, k),), (Block("out", row0, rows, 0, n),),
                0, 0, k)


def _two_streams(problem, prof):
    rows = problem.m // 2
    both = Plan("x", "dma", problem, (COMPUTE, "backend"),
                (_gemm(COMPUTE, rows, problem.k, problem.ns[0]),
                 _gemm("backend", rows, problem.k, problem.ns[0], rows)))
    one = Plan("x", "dma", problem, (COMPUTE,), (_gemm(COMPUTE, rows, problem.k, problem.ns[0]),))
    return (simulator.simulate(both, prof, wide_outputs=False).makespan_s,
            simulator.simulate(one, prof, wide_outputs=False).makespan_s)


def test_gemms_on_two_streams_share_compute_units_and_hbm():
    prof = dataclasses.replace(H100, host_op_s=0.0)
    launch = prof.dil["launch_s"]
    # memory-bound (64 rows against a 14336 x 4096 weight): together they share HBM
    big = Problem(128, 14336, (4096,), "bfloat16", 1)
    cost = gemm.gemm_cost(prof, "bfloat16", [64], 4096, 14336, 2)
    assert cost.hbm == pytest.approx(1.0)
    both, one = _two_streams(big, prof)
    assert both - launch == pytest.approx(2 * (one - launch), rel=1e-6)
    # two small GEMMs that each hold a few units run side by side as fast as alone
    small = Problem(256, 512, (256,), "bfloat16", 1)
    cost = gemm.gemm_cost(prof, "bfloat16", [128], 256, 512, 2)
    assert cost.units < 0.5 and cost.hbm < 0.5
    both, one = _two_streams(small, prof)
    assert both == pytest.approx(one, rel=1e-6)


def test_async_tp_plan_is_torchs_pipelined_produce_and_all2all():
    world = 8
    problem = Problem(1024, 14336, (4096,), "bfloat16", world, op="matmul_reduce_scatter")
    plan = async_tp.plan(problem)
    gemms = [op for op in plan.ops if isinstance(op, Gemm)]
    copies = [op for op in plan.ops if isinstance(op, Copy)]
    assert len(gemms) == world and all(g.a[0].rows == 1024 // world and g.kc == 14336
                                       for g in gemms)
    assert len(copies) == world - 1
    assert [c.queue for c in copies] == ["backend" if s % 2 else COMPUTE for s in range(1, world)]
    assert sorted(c.src.peer for c in copies) == list(range(1, world))
    for copy in copies:      # barrier, copy, barrier on the copy's own stream
        i = plan.ops.index(copy)
        assert isinstance(plan.ops[i - 1], Barrier) and plan.ops[i - 1].queue == copy.queue
        assert isinstance(plan.ops[i + 1], Barrier) and plan.ops[i + 1].queue == copy.queue
        assert isinstance(plan.ops[i - 2], Gemm) and plan.ops[i - 2].queue == copy.queue
    last = plan.ops[-1]
    assert isinstance(last, Reduce) and len(last.srcs) == world and not plan.wide_outputs()


def test_async_tp_two_streams_in_lockstep_expose_their_copies():
    """Its memory-bound chunk GEMMs take as long side by side as one after another, and each
    stream's next GEMM waits for its copy and two barriers: the run is at least every chunk
    GEMM's time plus, per pair of steps, two barriers and a copy."""
    prof = dataclasses.replace(H100, host_op_s=0.0)
    world, m, n, k = 8, 512, 4096, 14336
    problem = Problem(m, k, (n,), "bfloat16", world, op="matmul_reduce_scatter")
    result = simulator.simulate(async_tp.plan(problem), prof, wide_outputs=False)
    chunk = gemm.gemm_seconds(prof, "bfloat16", [m // world], n, k, 2)
    copy_s = min(r["end_s"] - r["start_s"] for r in result.rows if r["kind"] == "copy_1d")
    rounds = world // 2
    floor = world * (chunk - prof.dil["launch_s"]) + rounds * (2 * prof.barrier_latency_s + copy_s)
    assert result.makespan_s >= floor
    assert async_tp.async_tp_us(prof, m, n, k) == pytest.approx(result.makespan_s * 1e6)


def test_deepgemm_menu_follows_its_sm90_candidates_and_prices_small_m_on_h20():
    menu = gemm.deepgemm_tiles(H20, "bfloat16", 2)
    sizes = {(m, n) for m, n, _ in menu}
    assert {m for m, _ in sizes} == {64, 128, 256}
    assert all(n % 16 == 0 and 16 <= n <= 256 and not (m > 128 and n > 128) for m, n in sizes)
    assert (64, 32) in sizes and (128, 256) in sizes and (256, 256) not in sizes
    # 128 x 1024 x 8192: 64 blocks of 64 x 32 in one partial wave of 78 SMs, no split-K
    dil, units = H20.dil, H20.compute_units
    fraction = {(m, n): f for m, n, f in menu}[(64, 32)]
    assert fraction == 1.0       # H20's slow tensor cores never outrun L2's 64 B/cycle/SM
    block_s = 2 * 64 * 32 * (8192 + dil["tile_k_overhead"]) / (
        H20.flops("bfloat16") * dil["gemm_efficiency"] / units)
    expected = dil["launch_s"] + block_s * max(64 / units, 1 / dil["partial_wave_speedup"])
    deep = gemm.gemm_seconds(H20, "bfloat16", [128], 1024, 8192, 2, library="deepgemm")
    assert deep == pytest.approx(expected)
    assert deep < gemm.gemm_seconds(H20, "bfloat16", [128], 1024, 8192, 2)


def test_feed_fraction_is_l2_bandwidth_times_intensity_over_the_unit_rate():
    feed = H20.dil["l2_bytes_per_s_per_unit"]
    unit = H20.flops("bfloat16") / H20.compute_units
    for tm, tn in ((64, 16), (64, 32), (128, 128)):
        intensity = 2 * tm * tn / ((tm + tn) * 2)
        assert gemm.feed_fraction(H20, "bfloat16", tm, tn, 2) == \
            pytest.approx(min(1.0, feed * intensity / unit))
    assert gemm.feed_fraction(H20, "bfloat16", 64, 16, 2) < 1.0
    assert gemm.feed_fraction(H100, "bfloat16", 64, 16, 2) == 1.0   # no L2 number: no limit


def test_all_reduce_is_priced_from_profile_numbers_not_its_name():
    nbytes, world = 4 << 20, 4
    renamed = dataclasses.replace(H100, name="my-calibrated-h100")
    assert reductions.collective_seconds(renamed, nbytes, world) == \
        pytest.approx(reductions.collective_seconds(H100, nbytes, world))
    # the latency term is the profile's, added once
    later = dataclasses.replace(H100, ccl={**H100.ccl, "all_reduce_latency_s": 30e-6})
    assert reductions.collective_seconds(later, nbytes, world) - \
        reductions.collective_seconds(H100, nbytes, world) == pytest.approx(18e-6)
    # the bandwidth part: bus volume at the curve's plateau, ramped by the copy curve
    ramp = H100.copy_fraction(nbytes / world)
    assert reductions.collective_parts(H100, nbytes, world)[1] == pytest.approx(
        2 * (world - 1) / world * nbytes / (480e9 * ramp))
    # without a curve, a law or a latency of its own: two collective latencies, the links it
    # crosses at ccl.efficiency, ramped by the copy curve
    mi = dataclasses.replace(MI300X, ccl={k: v for k, v in MI300X.ccl.items()
                                          if k != "latency_bandwidth"})
    latency, work = reductions.collective_parts(mi, nbytes, 8)
    assert latency == pytest.approx(2 * mi.ccl["latency_s"])
    links = 7 * mi.link_for("mesh", 8) * mi.ccl["efficiency"]
    assert work == pytest.approx(2 * 7 / 8 * nbytes / (links * mi.copy_fraction(nbytes / 8)))
    assert math.isclose(reductions.latency_seconds(profiles.load("h200")), 12e-6)


def test_nvls_all_reduce_on_eight_h100s_is_priced_by_its_measured_curve():
    """N1-N3: NCCL's NVLS all-reduce measured by nccl-tests on 8x H100 (Azure) sets the h100
    all_reduce curve; at 8 MiB it runs at about the all-gather's bus bandwidth (172 GB/s, not
    the 225 of the all-gather curve scaled by 480/360), and an 8-rank call from the curve's
    first size on is priced by the curve itself, a 4-rank one (vLLM's fit) as before."""
    mib8 = 8 << 20
    assert predictors.nccl_busbw_gbps(H100, "all_reduce", mib8) == pytest.approx(172.13)
    assert predictors.nccl_busbw_gbps(H100, "all_reduce", 64 << 20) == pytest.approx(361.78)
    assert predictors.nccl_busbw_gbps(H100, "all_reduce", 1 << 30) == pytest.approx(466.35)
    # below 8 MiB the curve is the all-gather's (its 2 MiB point)
    ar, ag = (collectives.busbw_at(collectives.curve(H100, kind), 2 << 20)
              for kind in ("all_reduce", "all_gather"))
    assert ar == ag == 90.8e9
    # the simulator's all-reduce on 8 ranks: the curve's time, bus volume over 172.13 GB/s,
    # split into the 12 us latency and the rest
    latency, work = reductions.collective_parts(H100, mib8, 8)
    assert latency == pytest.approx(12e-6)
    assert latency + work == pytest.approx(2 * 7 / 8 * mib8 / 172.13e9)
    # on 4 ranks: 12 us + the plateau ramped by the copy curve
    nbytes, world = mib8, 4
    ramp = H100.copy_fraction(nbytes / world)
    assert reductions.collective_seconds(H100, nbytes, world) == pytest.approx(
        12e-6 + 2 * (world - 1) / world * nbytes / (480e9 * ramp))
    # below the curve's first size on 8 ranks: straight from the small-message latency (22 us,
    # ccl.small_latency_s) at no bytes up to the 2 MiB point's time
    first = 2 * 7 / 8 * (2 << 20) / 90.8e9
    for nbytes in (16 << 10, 1 << 20):
        assert reductions.collective_seconds(H100, nbytes, 8) == pytest.approx(
            22e-6 + (first - 22e-6) * nbytes / (2 << 20))


def test_compute_unit_collectives_on_mi300x_follow_their_latency_bandwidth_law():
    """N7-N9, Q1 (RCCL's all-reduce) and Y1-Y4 (mori's all-to-all) on 8x MI300X: latency plus
    the bytes over each link at the law's efficiency, no DMA-shaped copy ramp."""
    link = MI300X.link_bytes_per_s
    per_peer = 607_233      # Y3: 4.86 MB received over 8 ranks
    a2a = collectives.collective_seconds(MI300X, "all_to_all", per_peer, 7, world=8)
    assert a2a == pytest.approx(20e-6 + per_peer / (link * 0.67))
    # the copy ramp and ccl.latency_s (25 us) would price it at 58 us, mori measured 35
    assert collectives.latency_seconds(MI300X, "all_to_all") == 20e-6
    assert collectives.latency_seconds(MI300X, "all_gather") == MI300X.ccl["latency_s"]
    # the simulator's task: the law's latency fixed, the rest bandwidth
    problem = Problem(per_peer // 2, 1, (1,), "bfloat16", 8)
    block = Block("input", 0, per_peer // 2, 0, 1)
    peers = tuple(None if q == 0 else block for q in range(8))
    plan = Plan("a2a", "ccl", problem, ("comm",), (AllToAll("comm", peers, peers),))
    run = simulator.simulate(plan, dataclasses.replace(MI300X, host_op_s=0.0))
    assert run.makespan_s == pytest.approx(20e-6 + (per_peer // 2) * 2 / (link * 0.67))
    task = simulator.Simulation(plan, MI300X, "mesh").collective("all_to_all", 4 << 20, 7)
    assert (task.fixed_s, task.work_s) == pytest.approx((20e-6, (4 << 20) / (link * 0.67)))
    # RCCL's all-reduce: 54 us + the bus volume over the 7 links at 0.695
    mib8 = 8 << 20
    latency, work = reductions.collective_parts(MI300X, mib8, 8)
    assert (latency, work) == pytest.approx((54e-6, 2 * 7 / 8 * mib8 / (7 * link * 0.695)))
    busbw = predictors.nccl_busbw_gbps(MI300X, "all_reduce", mib8)
    assert busbw == pytest.approx(2 * 7 / 8 * mib8 / (latency + work) / 1e9)
    # the law holds on the topology it was measured on only: elsewhere the physics fallback
    assert collectives.law(MI300X, "all_to_all", "switch") is None
    assert collectives.collective_seconds(MI300X, "all_to_all", per_peer, 7, world=8,
                                          topology="switch") > a2a
