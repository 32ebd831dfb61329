"""The simulator's sanity (issue 4): ideal overlap, inefficiencies, topology effects."""
from __future__ import annotations

import pytest

from ficco import schedules
from ficco.errors import InvalidArgumentError
from ficco.heuristics import model, profiles, simulator
from ficco.heuristics.scenarios import PAPER_TABLE_I, gemm_problem, table_i_problem
from ficco.plan import COMPUTE, Barrier, Block, Copy, Gemm, Plan, PlanBuilder, Record, Wait
from ficco.problem import Problem

MI300X = profiles.load("mi300x")
H100 = profiles.load("h100")


def speedups(problem, profile, topology=None, transport="dma"):
    times = model.predict_all(problem, profile, topology, transport)
    return {name: times["serial"] / t for name, t in times.items()}


def ideal(problem, profile, topology=None, transport="dma"):
    serial = model.simulate_schedule("serial", problem, profile, topology, transport)
    return simulator.ideal_speedup(serial)


def test_ideal_overlap_of_a_balanced_gemm_approaches_two():
    # Sweep n so GEMM time crosses all-gather time; the best balance must come close to 2x.
    best = max((ideal(gemm_problem(262144, n * 8, 8192, 8), MI300X), n)
               for n in range(256, 4096, 128))
    assert best[0] > 1.9 and best[0] < 2.0


@pytest.mark.parametrize("profile", [MI300X, H100], ids=["mi300x", "h100"])
def test_every_schedule_is_below_its_ideal(profile):
    for name in PAPER_TABLE_I:
        problem = table_i_problem(name)
        bound = ideal(problem, profile)
        for schedule, speedup in speedups(problem, profile).items():
            assert speedup < bound, (name, schedule, speedup, bound)


@pytest.mark.parametrize("scenario", ["g6", "g11"])
def test_mi300x_mesh_ring_loses_while_ficco_1d_wins(scenario):
    # Communication-heavy on the mesh: ring keeps one of seven links busy.
    problem = table_i_problem(scenario)
    serial = model.simulate_schedule("serial", problem, MI300X)
    assert serial.busy_s("copy_1d") / 7 > serial.busy_s("gemm")  # comm-heavy indeed
    s = speedups(problem, MI300X)
    assert s["ring"] < 1.0
    assert max(v for k, v in s.items() if k.endswith("-1d")) > 1.2


def test_h100_switch_ring_is_competitive():
    for name in ("g6", "g11", "g14"):
        s = speedups(table_i_problem(name), H100)
        assert s["ring"] > 1.0
        assert s["ring"] > 0.85 * max(s.values())


def test_switch_override_rescues_ring_on_mi300x():
    problem = table_i_problem("g6")
    assert speedups(problem, MI300X, "switch")["ring"] > 2 * speedups(problem, MI300X)["ring"]


def test_ccl_contends_more_than_dma():
    problem = table_i_problem("g6")
    for name in ("uniform-fused-1d", "hetero-unfused-1d"):
        assert model.predict(name, problem, MI300X, transport="ccl") > \
            model.predict(name, problem, MI300X, transport="dma")


def _single(op, problem, queues=(COMPUTE,)):
    return Plan("test", "dma", problem, queues, (op,))


def test_decomposed_gemm_is_slower_than_whole():
    p = Problem(4096, 8192, (1024,), "bfloat16", 8)
    whole = simulator.simulate(_single(Gemm(COMPUTE, (Block("gathered", 0, p.big_m, 0, p.k),),
                                            (Block("out", 0, p.big_m, 0, 1024),), 0, 0, p.k),
                                       p), MI300X).makespan_s
    rows = p.big_m // 64
    pieces = sum(simulator.simulate(_single(
        Gemm(COMPUTE, (Block("gathered", i * rows, rows, 0, p.k),),
             (Block("out", i * rows, rows, 0, 1024),), 0, 0, p.k), p), MI300X).makespan_s
        for i in range(64))
    assert pieces > 1.05 * whole


def test_strided_2d_copy_is_slower_than_1d_of_same_bytes():
    p = Problem(4096, 4096, (64,), "bfloat16", 2)
    flat = Copy("copy0", Block("gathered", 0, 512, 0, 4096, peer=1),
                Block("gathered", 0, 512, 0, 4096))
    narrow = Copy("copy0", Block("gathered", 0, 4096, 0, 512, peer=1),
                  Block("gathered", 0, 4096, 0, 512), two_d=True)
    t1 = simulator.simulate(_single(flat, p, ("copy0",)), MI300X).makespan_s
    t2 = simulator.simulate(_single(narrow, p, ("copy0",)), MI300X).makespan_s
    assert t2 > t1


def test_queue_order_and_events_are_respected():
    p = Problem(2048, 4096, (4096,), "bfloat16", 8)
    for name in schedules.names():
        plan = schedules.get(name).plan(p, "dma")
        result = simulator.simulate(plan, MI300X)
        by_queue = {}
        for row in result.rows:
            by_queue.setdefault(row["queue"], []).append(row)
        for rows in by_queue.values():
            for before, after in zip(rows, rows[1:]):
                assert after["start_s"] >= before["end_s"] - 1e-15
        assert result.makespan_s == pytest.approx(max(r["end_s"] for r in result.rows))
        gemm_start = min(r["start_s"] for r in result.rows if r["kind"] == "gemm")
        assert gemm_start >= 0 and len(result.rows) == sum(plan.count().values())


def test_wait_holds_its_queue_until_the_record():
    p = Problem(1024, 1024, (1024,), "bfloat16", 2)
    b = PlanBuilder("test", "dma", p)
    copy = b.add(Copy("copy0", Block("gathered", 0, 1024, 0, 1024, peer=1),
                      Block("gathered", 0, 1024, 0, 1024)))
    b.add(Gemm(COMPUTE, (Block("gathered", 0, 1024, 0, 1024),), (Block("out", 0, 1024, 0, 1024),),
               0, 0, 1024), after=[copy])
    rows = simulator.simulate(b.build(), MI300X).rows
    assert rows[1]["start_s"] >= rows[0]["end_s"]


def test_a_wait_without_record_is_reported():
    p = Problem(8, 8, (8,), "float32", 2)
    plan = Plan("broken", "dma", p, (COMPUTE,), (Wait(COMPUTE, 0), Barrier(COMPUTE, 0)), (), 1)
    with pytest.raises(InvalidArgumentError, match="wait forever"):
        simulator.simulate(plan, MI300X)
    ok = Plan("fine", "dma", p, (COMPUTE, "copy0"),
              (Wait(COMPUTE, 0), Record("copy0", 0)), (), 1)
    # Nothing to do but the host enqueueing the two event ops.
    assert simulator.simulate(ok, MI300X).makespan_s == pytest.approx(2 * MI300X.host_op_s)


def test_every_schedule_simulates_over_ccl_and_pcie():
    problem = table_i_problem("g14")
    over_ccl = model.predict_all(problem, MI300X, transport="ccl")
    assert all(0 < t < float("inf") for t in over_ccl.values())
    # PCIe gives each GPU far less than NVSwitch: the all-gather-bound serial run slows down.
    assert model.predict("serial", problem, H100, "pcie") > \
        1.5 * model.predict("serial", problem, H100, "switch")


def test_host_enqueue_cost_bounds_plans_of_many_small_ops():
    """Each op waits for the host to enqueue it: a many-op plan of a tiny GEMM is launch
    bound, and the simulator ranks it behind serial; with free launches it is not."""
    import dataclasses

    p = Problem(64, 256, (256,), "bfloat16", 8)
    for profile in (MI300X, dataclasses.replace(MI300X, host_op_s=0.0)):
        plans = {n: schedules.get(n).plan(p, "dma") for n in ("serial", "uniform-unfused-1d")}
        times = {n: simulator.simulate(plan, profile).makespan_s for n, plan in plans.items()}
        many = plans["uniform-unfused-1d"]
        assert times["uniform-unfused-1d"] >= len(many.ops) * profile.host_op_s
        if profile.host_op_s:
            assert times["uniform-unfused-1d"] > times["serial"], times
