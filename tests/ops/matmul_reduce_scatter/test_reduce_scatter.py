"""matmul_reduce_scatter: its schedules' plans through the symbolic checker, then end to end
(every schedule x transport x world size against float64, poisoned buffers), bad inputs,
ranks that disagree, a dead peer."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

import ficco
from ficco import schedules
from ficco.errors import InvalidArgumentError
from ficco.ops.matmul_reduce_scatter.schedules import Ficco, Ring
from ficco.plan import AllToAll, Barrier, Copy, Gemm, Reduce
from ficco.plan.problem import Problem

from ... import harness, rs_cases
from ...plan_checks import PlanCheckError, all_ranks, check_plans
from ...reference import ROW_TOL, max_row_rel_err
from ...rs_cases import DTYPES, SHAPES, make_inputs, run_matrix

OP = "matmul_reduce_scatter"
NAMES = schedules.names(op=OP)


def rs_problem(m, k, ns, world, rank=0, **kw):
    return Problem(m, k, ns, "float32", world, rank, op=OP, **kw)


def plan_shapes(world):
    """(m, ns, unit) per case: divisible, uneven blocks, fewer rows than ranks, whole units
    of a 3-D scatter_dim (uneven), several b of which one is narrower than W (2d chunks)."""
    cases = {"divisible": (4 * world, (5,), 1), "uneven": (2 * world + 3, (3,), 1),
             "m<W": (max(world - 1, 1), (4,), 1), "units": (3 * (world + 1), (2,), 3),
             "several-b": (13, (world + 2, max(world - 1, 1)), 1)}
    return cases if world < 8 else {k: cases[k] for k in ("uneven", "m<W", "several-b")}


# -- the registry ---------------------------------------------------------------------------------
def test_names_per_op_and_unknown_names():
    assert NAMES == schedules.names()   # the same eleven names, one registry per op
    assert all(schedules.get(n, op=OP).op == OP for n in NAMES)
    with pytest.raises(InvalidArgumentError) as err:
        schedules.get("uniform-fused-3d", op=OP)
    assert OP in str(err.value) and all(n in str(err.value) for n in NAMES)
    with pytest.raises(InvalidArgumentError, match="unknown op"):
        schedules.names(op="matmul_all_gather")
    with pytest.raises(InvalidArgumentError, match="op='matmul_reduce_scatter'"):
        schedules.get("ring", op=OP).plan(Problem(4, 8, (3,), "float32", 2))


# -- plans through the checker --------------------------------------------------------------------
VARIANTS = [schedules.get(n, op=OP) for n in NAMES] + \
    [replace(s, reduce_each_step=not s.reduce_each_step)
     for s in (schedules.get(n, op=OP) for n in NAMES if n != "serial")]


@pytest.mark.parametrize("transport", ["dma", "ccl"])
@pytest.mark.parametrize("schedule", VARIANTS,
                         ids=lambda s: s.name + ("/per-step" if s.reduce_each_step else "/at-end")
                         if hasattr(s, "reduce_each_step") else s.name)
def test_every_plan_passes_the_checker(schedule, transport):
    for world in (1, 2, 3, 4, 8):
        for label, (m, ns, unit) in plan_shapes(world).items():
            # avg changes only where the scale goes: checked on the registered variants
            registered = schedules.get(schedule.name, op=OP) == schedule
            for reduce_op in ("sum", "avg") if registered else ("sum",):
                problem = rs_problem(m, 6, ns, world, unit=unit, reduce_op=reduce_op)
                try:
                    check_plans(all_ranks(schedule, problem, transport))
                except PlanCheckError as err:
                    pytest.fail(f"W={world} {label} {reduce_op}: {err}")


@pytest.mark.parametrize("engines", [1, 2, 16])
def test_fewer_or_more_copy_engines_than_peers(engines):
    for name in NAMES:
        check_plans(all_ranks(schedules.get(name, op=OP), rs_problem(11, 5, (4,), 4), "dma",
                              engines))


def test_ficco_steps_move_one_chunk_of_every_peer_at_once():
    p = rs_problem(16, 8, (12,), 4, rank=1)
    for two_d in (False, True):
        plan = Ficco(two_d=two_d).plan(p, "dma")
        pulls = [op for op in plan.ops if isinstance(op, Copy)]
        assert len(pulls) == 4 * 3 and all(op.two_d == two_d for op in pulls)
        for step in range(4):
            here = [op for op in pulls if op.step == step]
            assert sorted(op.src.peer for op in here) == [0, 2, 3]
            assert len({op.queue for op in here}) == 3          # all links busy
        ccl = Ficco(two_d=two_d).plan(p, "ccl")
        assert sum(isinstance(op, AllToAll) for op in ccl.ops) == 4
        assert not any(isinstance(op, Barrier) for op in ccl.ops)


def test_hetero_computes_its_own_block_last_and_reduces_per_step():
    p = rs_problem(16, 8, (12,), 4, rank=2)
    for schedule in (Ficco(uniform=False, fused=True, reduce_each_step=True), Ring()):
        compute = [op for op in schedule.plan(p, "dma").ops if op.queue == "compute"]
        kinds = [op.kind for op in compute]
        own = [i for i, op in enumerate(compute) if isinstance(op, Gemm) and op.out[0].buf == "out"]
        assert own and all(isinstance(compute[i], Gemm) for i in own)
        # every remote GEMM comes before the own block, and reductions start before it
        assert max(i for i, op in enumerate(compute) if isinstance(op, Gemm)
                   and op.out[0].buf == "partial") < own[0]
        assert kinds.index("reduce") < own[0] and kinds[-1] == "reduce"


def test_uniform_fused_is_one_gemm_per_step_when_blocks_are_equal():
    for two_d in (False, True):
        plan = Ficco(two_d=two_d).plan(rs_problem(16, 8, (12,), 4, rank=0), "dma")
        gemms = [op for op in plan.ops if isinstance(op, Gemm)]
        assert len(gemms) == 4 and len({op.step for op in gemms}) == 4


def _drop(plans, rank, pick):
    ops = list(plans[rank].ops)
    i = next(i for i, op in enumerate(ops) if pick(op))
    broken = list(plans)
    broken[rank] = replace(plans[rank], ops=tuple(ops[:i] + ops[i + 1:]))
    return broken


def test_checker_catches_broken_reductions():
    p = rs_problem(12, 6, (5,), 3, reduce_op="avg")
    plans = all_ranks(Ficco(), p, "dma")
    with pytest.raises(PlanCheckError, match="not reduced over all|nothing wrote|initialised"):
        check_plans(_drop(plans, 1, lambda op: isinstance(op, Reduce)))
    twice = [replace(pl, ops=pl.ops + tuple(op for op in pl.ops if isinstance(op, Reduce))[:1])
             for pl in plans]
    with pytest.raises(PlanCheckError, match=r"twice|scales|already scaled|initialised \[1, 2\]"):
        check_plans(twice)
    unscaled = [replace(pl, ops=tuple(replace(op, scale=None) if isinstance(op, Reduce) else op
                                      for op in pl.ops)) for pl in plans]
    with pytest.raises(PlanCheckError, match="scaled"):
        check_plans(unscaled)
    # a reduction that no longer waits for its pulls reads partials before they land
    no_wait = [replace(pl, ops=tuple(op for op in pl.ops if not (
        op.kind == "wait" and op.queue == "compute"))) for pl in plans]
    with pytest.raises(PlanCheckError, match="no dependency|nothing wrote"):
        check_plans(no_wait)
    # a pull that does not wait for the step's barrier reads a partial not yet computed
    early = [replace(pl, ops=tuple(op for op in pl.ops if not (
        op.kind == "barrier" and op.step == 1))) for pl in plans]
    with pytest.raises(PlanCheckError):
        check_plans(early)


# -- end to end -------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["dma", "ccl"])
@pytest.mark.parametrize("schedule", NAMES)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_schedule_matches_reference(world, schedule, transport):
    seed = random.randrange(1 << 30)
    failures = harness.pool(world).run(run_matrix, schedule, transport, seed)
    assert failures == [[]] * world, f"seed {seed}: {failures}"


@pytest.mark.parametrize("transport", ["dma", "ccl"])
def test_world_eight_every_schedule_reduced_shapes(transport):
    """W = 8 is the slow pool: every schedule on the uneven and several-b shapes."""
    seed = random.randrange(1 << 30)
    shapes = [s for s in SHAPES if s[0] in ("uneven", "several-b")]
    pool = harness.pool(8)
    for schedule in NAMES:
        failures = pool.run(run_matrix, schedule, transport, seed, "sum", shapes)
        assert failures == [[]] * 8, f"{schedule} seed {seed}: {failures}"


@pytest.mark.parametrize("schedule", ["serial", "ring", "hetero-fused-1d", "uniform-unfused-2d"])
def test_avg_matches_reference(schedule):
    seed = random.randrange(1 << 30)
    for transport in ("dma", "ccl"):
        failures = harness.pool(3).run(run_matrix, schedule, transport, seed, "avg")
        assert failures == [[]] * 3, f"{transport} seed {seed}: {failures}"


@pytest.mark.parametrize("schedule", NAMES)
def test_world_size_one_is_a_plain_matmul(schedule):
    seed = random.randrange(1 << 30)
    for case, (label, shape, ns, sdim) in enumerate(SHAPES):
        for dtype in DTYPES:
            a_s, b_s, refs = make_inputs(seed + case, 1, shape, ns, dtype, sdim)
            outs = ficco.matmul_reduce_scatter(a_s[0], b_s[0], scatter_dim=sdim,
                                               schedule=schedule)
            for out, ref in zip(outs, refs):
                assert max_row_rel_err(out, ref[0]) <= ROW_TOL[dtype], (label, dtype, seed)


# -- compat, bad inputs, disagreement, a dead peer --------------------------------------------------
def test_compat_matches_torch_fallback():
    from ...rs_cases import compat_compare

    seed = random.randrange(1 << 30)
    for world in (2, 4):
        assert harness.pool(world).run(compat_compare, seed) == [[]] * world, seed


def test_bad_inputs_raise_before_any_communication():
    from ...rs_cases import bad_inputs

    for per_rank in harness.pool(2).run(bad_inputs):
        assert set(per_rank.values()) == {"ok"}, per_rank


def test_ranks_that_disagree_all_get_mismatch():
    from ...rs_cases import disagree

    assert harness.pool(2).run(disagree) == ["mismatch", "mismatch"]


def test_disagreement_on_a_cached_shape_raises_on_every_rank():
    from ...rs_cases import disagree_on_cached_shapes

    for small, large, mismatched, refused, again in harness.pool(3).run(
            disagree_on_cached_shapes, random.randrange(1 << 30)):
        assert small < 1e-5 and large < 1e-5 and again < 1e-5, (small, large, again)
        assert mismatched == "mismatch", mismatched
        assert refused == "refused", refused          # poisoned until every rank resets


def test_dead_peer_makes_the_others_fail_not_hang():
    from ...rs_cases import survivors_fail

    text = harness.dead_peer_error(survivors_fail)
    assert "rank 1 died" in text and "did not answer" not in text, text


def test_no_shared_memory_file_outlives_the_calls():
    assert harness.shm_files_left(harness.pool(2), run_matrix, "hetero-fused-2d", "dma",
                                  random.randrange(1 << 30), "sum", SHAPES[:1]) == [[], []]


def test_explain_and_selectors_cover_the_new_op():
    from ...rs_cases import check_selector_picks, selector_picks

    check_selector_picks(harness.pool(3).run(selector_picks, random.randrange(1 << 30)), NAMES)


# -- Where bf16 partial sums are rounded ------------------------------------------
def _bf16_sums(rank, world, seed):
    """Each rank's bf16 partial a_r @ b_r is the GEMM's own rounding; what differs is how the
    W partials are summed: in fp32 and rounded once (dma; ring and FiCCO over ccl), or by the
    process group's reduce-scatter, which gloo does in bf16 (serial over ccl)."""
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(32, 64, generator=gen).to(torch.bfloat16) for _ in range(world)]
    b = [torch.randn(64, 48, generator=gen).to(torch.bfloat16) for _ in range(world)]
    partials = [a[r] @ b[r] for r in range(world)]       # what every plan's GEMM produces
    once = sum(p.float() for p in partials).to(torch.bfloat16).chunk(world)[rank]
    chained = partials[0]
    for p in partials[1:]:
        chained = chained + p                               # bf16 + bf16: rounded each time
    out = {}
    for name, transport in (("serial", "dma"), ("uniform-fused-1d", "dma"), ("serial", "ccl")):
        with ficco.config.scope(transport=transport):
            got = ficco.matmul_reduce_scatter(a[rank], b[rank], schedule=name)
        out[f"{name}/{transport}"] = (torch.equal(got, once),
                                      float((got != once).double().mean()))
    ficco.shutdown()
    return out, float((chained.chunk(world)[rank] != once).double().mean())


def test_bf16_partials_are_summed_in_fp32_except_by_the_process_groups_reduce_scatter():
    """The docs say which paths round at every addition (serial over ccl: the process group's
    reduce-scatter sums bf16 in bf16); this holds them to it."""
    results = harness.pool(4).run(_bf16_sums, random.randrange(1 << 30))
    for out, chained in results:
        assert out["serial/dma"][0] and out["uniform-fused-1d/dma"][0], out   # rounded once
        assert not out["serial/ccl"][0] and chained > 0, out      # rounded at each addition
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "reduce_scatter.md").read_text()
    assert "rounded at every addition" in doc and "serial" in doc, "docs/reduce_scatter.md"


def test_an_empty_inner_dimension_keeps_the_scatter_dims_size():
    """(1, 0, K) rows scattered along dim 0 have no canonical rows; the output still has this
    rank's block of dim 0 (it had none: (0, 0, n), and the backward of an all-gather of such
    shards failed to build its gradient)."""
    for per_rank in harness.pool(2).run(rs_cases.empty_inner_shapes):
        assert per_rank == [(True, True)] * 5
