"""Plan-level tests for every schedule: each rank's plan is built and run through the symbolic
checker of :mod:`tests.plan_checks` (no tensors, no processes), plus the shape of each FiCCO
variant's plan and proof that the checker catches broken plans."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from ficco import schedules
from ficco.errors import InvalidArgumentError
from ficco.ops.all_gather_matmul.schedules.ficco import FICCO_SCHEDULES, Ficco, chunks
from ficco.plan import AllGather, Barrier, Copy, Gemm, Record, Wait
from ficco.plan.problem import Problem
from ficco.schedules.common import coalesce

from ..plan_checks import PlanCheckError, check_plan, check_plans

ELEVEN = ["serial", "ring", "ring-bidir",
          "uniform-fused-1d", "uniform-unfused-1d", "hetero-fused-1d", "hetero-unfused-1d",
          "uniform-fused-2d", "uniform-unfused-2d", "hetero-fused-2d", "hetero-unfused-2d"]
WORLDS = (1, 2, 3, 4, 8)


def shapes(world: int) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """(m, k, ns) per case: divisible, uneven rows, fewer rows than ranks, uneven K, two b.
    W = 8 (the slow one) merges them into three cases that still cover each property."""
    if world == 8:
        return {"divisible": (16, 16, (5,)), "m<W, uneven-k": (7, 9, (4,)),
                "uneven-m, uneven-k, several-b": (17, 19, (3, 6))}
    return {"divisible": (2 * world, 2 * world, (5,)),
            "uneven-m": (2 * world + 1, 12, (3,)),
            "m<W": (max(world - 1, 1), 7, (4,)),
            "uneven-k": (world, 2 * world + 3, (2,)),
            "several-b": (5, 9, (3, 6))}


def all_ranks(name: str, problem: Problem, transport: str, copy_engines=None):
    schedule = schedules.get(name)
    return [schedule.plan(replace(problem, rank=r), transport, copy_engines=copy_engines)
            for r in range(problem.world)]


def work(plan, kind):
    return [op for op in plan.ops if isinstance(op, kind)]


# -- the registry -----------------------------------------------------------------------------
def test_names_lists_exactly_the_eleven_schedules():
    assert schedules.names() == ELEVEN
    assert [s.name for s in FICCO_SCHEDULES] == ELEVEN[3:]
    assert all(schedules.get(n).name == n for n in ELEVEN)


def test_unknown_schedule_raises_with_the_valid_names():
    with pytest.raises(InvalidArgumentError) as err:
        schedules.get("uniform-fused-3d")
    assert "uniform-fused-3d" in str(err.value)
    assert all(n in str(err.value) for n in ELEVEN)


def test_bad_transport_and_copy_engines_raise():
    p = Problem(4, 8, (8,), "float32", 2, 0)
    with pytest.raises(InvalidArgumentError, match="transport"):
        Ficco().plan(p, "nvlink")
    with pytest.raises(InvalidArgumentError, match="copy_engines"):
        Ficco().plan(p, "dma", copy_engines=0)


# -- every schedule, every rank, through the checker -----------------------------------------
@pytest.mark.parametrize("transport", ["dma", "ccl"])
@pytest.mark.parametrize("name", ELEVEN)
def test_every_plan_passes_the_checker(name, transport):
    for world in WORLDS:
        for label, (m, k, ns) in shapes(world).items():
            plans = all_ranks(name, Problem(m, k, ns, "float32", world), transport)
            try:
                check_plans(plans)
            except PlanCheckError as err:
                pytest.fail(f"W={world} {label}: {err}")


@pytest.mark.parametrize("engines", [1, 2, 16])
def test_fewer_or_more_copy_engines_than_peers(engines):
    for schedule in FICCO_SCHEDULES:
        plans = all_ranks(schedule.name, Problem(9, 11, (4,), "float32", 4), "dma", engines)
        check_plans(plans)
        used = {op.queue for op in work(plans[0], Copy)}
        assert used == {f"copy{i}" for i in range(min(engines, 3))}


def test_check_plan_rebuilds_the_peers():
    plan = schedules.get("hetero-fused-2d").plan(Problem(6, 10, (3,), "float32", 4, 2), "dma")
    check_plan(plan)


# -- the shape of each FiCCO plan -------------------------------------------------------------
@pytest.mark.parametrize("schedule", FICCO_SCHEDULES, ids=lambda s: s.name)
def test_ficco_steps_pull_one_chunk_of_every_peer_at_once(schedule):
    world, p = 4, Problem(10, 9, (3, 5), "float32", 4, 1)
    plan = schedule.plan(p, "dma")
    pulls = [op for op in work(plan, Copy) if op.src.buf == "gathered"]
    assert len(pulls) == world * (world - 1)          # every chunk of every peer, once
    for c in chunks(p, schedule.two_d):
        step_pulls = [op for op in pulls if (op.src.col0 if schedule.two_d else
                                              op.src.row0 % p.m) == (c.col0 if schedule.two_d
                                                                      else c.row0)]
        assert sorted(op.src.peer for op in step_pulls) == [0, 2, 3]
        assert len({op.queue for op in step_pulls}) == world - 1   # all links busy
        assert all(op.two_d == schedule.two_d for op in step_pulls)
    ccl = schedule.plan(p, "ccl")
    assert len(work(ccl, AllGather)) == world and not work(ccl, Barrier)


@pytest.mark.parametrize("schedule", FICCO_SCHEDULES, ids=lambda s: s.name)
def test_ficco_compute_pattern(schedule):
    world, ns = 8, (3, 5)
    for rank in range(world):
        p = Problem(16, 24, ns, "float32", world, rank)
        plan = schedule.plan(p, "dma")
        gemms = work(plan, Gemm)
        per_step = Counter((g.step, g.b) for g in gemms)
        if schedule.uniform:   # every step computes the same shapes
            shape_of_step = {g.step: sorted((len(h.a), h.a[0].rows, h.kc) for h in gemms
                                            if h.step == g.step) for g in gemms}
            assert len({tuple(v) for v in shape_of_step.values()}) == 1, shape_of_step
        else:
            first = next(op for op in plan.ops if op.queue == "compute")
            assert isinstance(first, Gemm), "hetero must start on the local shard, no wait"
            assert first.a[0].buf == "input" and first.a[0].rows == p.m and first.kc == p.k
            assert {g.step for g in gemms if g.a[0].buf == "input"} == {0}
        middle = 0 < rank < world - 1
        if schedule.fused:
            # hetero-fused middle ranks: one in-place GEMM per run of peers (below, above r)
            expected = 2 if not schedule.uniform and middle else 1
        else:
            expected = world - (0 if schedule.uniform else 1)
        assert set(per_step.values()) == {expected} | ({1} if not schedule.uniform else set())


def test_world_one_is_plain_gemms_and_world_two_hetero_variants_coincide():
    p1 = Problem(5, 7, (3, 4), "float32", 1, 0)
    for schedule in FICCO_SCHEDULES:
        for transport in ("dma", "ccl"):
            plan = schedule.plan(p1, transport)
            assert [type(op) for op in plan.ops] == [Gemm, Gemm]
    for two_d in (False, True):
        for rank in (0, 1):
            p2 = Problem(5, 7, (3,), "float32", 2, rank)
            fused = Ficco(uniform=False, fused=True, two_d=two_d).plan(p2)
            unfused = Ficco(uniform=False, fused=False, two_d=two_d).plan(p2)
            assert fused.ops == unfused.ops


def test_empty_chunks_are_skipped():
    p = Problem(2, 3, (4,), "float32", 4, 1)       # 2 rows and 3 columns over 4 ranks
    for schedule in FICCO_SCHEDULES:
        plan = schedule.plan(p, "dma")
        blocks = [b for op in plan.ops for b in _blocks(op)]
        assert all(b.rows > 0 and b.cols > 0 for b in blocks)
        assert len(work(plan, Copy)) == 1 + 3 * (3 if schedule.two_d else 2)
    assert Ficco().plan(Problem(0, 3, (4,), "float32", 4, 1)).ops == ()


def test_chunk_helpers():
    p = Problem(5, 10, (4,), "float32", 4, 0)
    assert [(c.row0, c.rows) for c in chunks(p, False)] == [(0, 2), (2, 1), (3, 1), (4, 1)]
    assert [(c.col0, c.cols) for c in chunks(p, True)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    from ficco.plan import Block
    a, b, c = (Block("gathered", r, 2, 0, 4) for r in (0, 2, 6))
    assert coalesce([a, b, c]) == [Block("gathered", 0, 4, 0, 4), c]


def _blocks(op):
    for name in ("src", "dst", "send", "recv"):
        if getattr(op, name, None) is not None:
            yield getattr(op, name)
    for name in ("a", "out", "srcs", "dsts"):
        yield from getattr(op, name, ())


# -- the checker can fail ---------------------------------------------------------------------
def _broken(plans, rank, edit):
    bad = list(plans)
    bad[rank] = replace(plans[rank], ops=tuple(edit(list(plans[rank].ops))))
    return bad


def _drop_first(kind, where=lambda op: True):
    def edit(ops):
        i = next(i for i, op in enumerate(ops) if isinstance(op, kind) and where(op))
        return ops[:i] + ops[i + 1:]
    return edit


def test_checker_catches_a_dropped_dependency():
    plans = all_ranks("uniform-unfused-1d", Problem(6, 8, (3,), "float32", 3), "dma")
    check_plans(plans)
    with pytest.raises(PlanCheckError, match="nothing wrote|no dependency"):
        check_plans(_broken(plans, 1, _drop_first(Wait, lambda op: op.queue == "compute")))


def test_checker_catches_a_missing_wait_for_a_collective():
    plans = all_ranks("hetero-fused-1d", Problem(6, 8, (3,), "float32", 3), "ccl")
    with pytest.raises(PlanCheckError, match="nothing wrote|no dependency"):
        check_plans(_broken(plans, 2, _drop_first(Wait, lambda op: op.queue == "compute")))


def test_checker_catches_a_wrong_accumulate_flag():
    plans = all_ranks("uniform-fused-2d", Problem(4, 8, (3,), "float32", 2), "dma")

    def flip(ops):
        i = next(i for i, op in enumerate(ops) if isinstance(op, Gemm))
        return ops[:i] + [replace(ops[i], accumulate=True)] + ops[i + 1:]
    with pytest.raises(PlanCheckError, match="nothing wrote|accumulat"):
        check_plans(_broken(plans, 0, flip))


def test_checker_catches_a_missing_gemm_and_a_missing_copy():
    plans = all_ranks("hetero-unfused-2d", Problem(4, 8, (3,), "float32", 3), "dma")
    with pytest.raises(PlanCheckError, match="out\\[0\\]"):
        check_plans(_broken(plans, 1, _drop_first(Gemm, lambda op: op.step == 2)))
    with pytest.raises(PlanCheckError, match="nothing wrote|received|full A"):
        check_plans(_broken(plans, 1, _drop_first(Copy, lambda op: op.src.buf == "gathered")))


def test_checker_catches_deadlocks():
    plans = all_ranks("serial", Problem(4, 8, (3,), "float32", 3), "dma")
    with pytest.raises(PlanCheckError, match="deadlock"):     # one rank skips a barrier
        check_plans(_broken(plans, 2, _drop_first(Barrier, lambda op: op.channel == 1)))

    def wait_before_record(ops):
        i = next(i for i, op in enumerate(ops) if isinstance(op, Record))
        rec = ops[i]
        ops = ops[:i] + ops[i + 1:]
        j = next(j for j, op in enumerate(ops) if isinstance(op, Wait) and op.event == rec.event)
        # The event is now recorded on the waiting queue, after the wait: it never comes.
        return ops[:j + 1] + [replace(rec, queue=ops[j].queue)] + ops[j + 1:]
    with pytest.raises(PlanCheckError, match="deadlock"):
        check_plans(_broken(plans, 0, wait_before_record))


def test_checker_catches_a_pull_without_closing_barrier_and_a_misplaced_copy():
    plans = all_ranks("ring", Problem(4, 8, (3,), "float32", 2), "dma")
    no_close = [replace(pl, ops=tuple(op for op in pl.ops
                                      if not (isinstance(op, Barrier) and op.channel == 1)))
                for pl in plans]
    with pytest.raises(PlanCheckError, match="closing barrier"):
        check_plans(no_close)

    def shift(ops):
        i = next(i for i, op in enumerate(ops) if isinstance(op, Copy) and op.src.peer is not None)
        moved = replace(ops[i], dst=replace(ops[i].dst, row0=ops[i].dst.row0 + 1))
        return ops[:i] + [moved] + ops[i + 1:]
    with pytest.raises(PlanCheckError, match="lands in"):
        check_plans(_broken(plans, 1, shift))
