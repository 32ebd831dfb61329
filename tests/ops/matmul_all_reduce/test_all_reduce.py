"""Matmul_all_reduce: its schedules' plans through the symbolic checker, then end to
end on the rank pool (every schedule x transport at W = 1-4 against float64, bit-identical on
every rank, fp32/bf16, 2-D/3-D, uneven M and K, fp8 scales, bias, avg), gradients, bad inputs,
ranks that disagree, a dead peer, leaks, the selector, the pricing, and the layers."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

import ficco
from ficco import schedules
from ficco.errors import InvalidArgumentError
from ficco.heuristics import model, profiles, simulator
from ficco.heuristics.reductions import check_published, collective_seconds
from ficco.ops.matmul_all_reduce.schedules import RsAg
from ficco.ops.matmul_reduce_scatter import schedules as reduce_scatter
from ficco.plan import AllReduce, Barrier, Reduce
from ficco.plan.problem import Problem

from ... import harness
from ...ar_cases import DTYPES, SHAPES, make_inputs, run_grid
from ...ar_plan_checks import check_ar_plans
from ...plan_checks import PlanCheckError, all_ranks
from ...reference import ROW_TOL, max_row_rel_err

OP = "matmul_all_reduce"
NAMES = schedules.names(op=OP)


def ar_problem(m, k, ns, world, rank=0, **kw):
    return Problem(m, k, ns, "float32", world, rank, op=OP, **kw)


# -- the registry -----------------------------------------------------------------------------------
def test_names_and_registry():
    assert NAMES[0] == "serial" and len(NAMES) == len(set(NAMES)) == 10
    assert {"one-shot", "one-shot-sm", "two-shot", "two-shot-sm", "chunked-4"} <= set(NAMES)
    assert [n for n in NAMES if n.startswith("rs-ag-")] == ["rs-ag-uniform-fused-1d",
                                                            "rs-ag-ring"]
    assert all(schedules.get(n, op=OP).op == OP for n in NAMES)
    with pytest.raises(InvalidArgumentError) as err:
        schedules.get("three-shot", op=OP)
    assert all(n in str(err.value) for n in NAMES)
    with pytest.raises(InvalidArgumentError, match="op='matmul_all_reduce'"):
        schedules.get("serial", op=OP).plan(Problem(4, 8, (3,), "float32", 2))
    with pytest.raises(InvalidArgumentError, match="not a matmul_reduce_scatter schedule"):
        RsAg("three-shot").plan(ar_problem(4, 3, (2,), 2))


# -- plans through the checker ----------------------------------------------------------------------
def _shapes(world):
    """(m, ns): M divisible by W, not (blocks differ by a row), fewer rows than ranks, two b."""
    return [(4 * world, (5,)), (2 * world + 3, (3,)), (max(world - 1, 1), (4,)),
            (13, (world + 2, max(world - 1, 1)))]


@pytest.mark.parametrize("transport", ["dma", "ccl"])
def test_every_plan_passes_the_checker(transport):
    for name in NAMES:
        schedule = schedules.get(name, op=OP)
        for world in (1, 2, 3, 4, 8):
            for m, ns in _shapes(world):
                for reduce_op, bias in (("sum", False), ("avg", True)):
                    problem = ar_problem(m, 6, ns, world, reduce_op=reduce_op, bias=bias)
                    try:
                        check_ar_plans(all_ranks(schedule, problem, transport))
                    except PlanCheckError as err:
                        pytest.fail(f"W={world} m={m} ns={ns} {reduce_op}: {err}")


@pytest.mark.parametrize("transport", ["dma", "ccl"])
def test_rs_ag_runs_every_reduce_scatter_schedule(transport):
    """The decomposition takes any reduce-scatter schedule as it is (per-step or at-the-end
    reductions, 1d or 2d chunks): each plan passes the checker, also with one copy engine."""
    variants = [*reduce_scatter.SCHEDULES,
                *(replace(s, reduce_each_step=not s.reduce_each_step)
                  for s in reduce_scatter.SCHEDULES if hasattr(s, "reduce_each_step"))]
    for rs in variants:
        schedule = replace(RsAg(rs.name), reduce_scatter=rs.name)
        for world, (m, ns) in ((3, (11, (4,))), (4, (13, (5, 3)))):
            problem = ar_problem(m, 5, ns, world, bias=True)
            check_ar_plans(all_ranks(schedule, problem, transport))
            if transport == "dma":
                check_ar_plans(all_ranks(schedule, problem, transport, copy_engines=1))


def test_rs_ag_gathers_each_chunk_as_soon_as_it_is_reduced():
    """With uniform-fused-1d the all-gather of chunk c goes before the reduce-scatter's later
    barriers (pipelined); ring's block is finished at the end, so its all-gather follows."""
    p = ar_problem(16, 8, (12,), 4, rank=1)
    for name, pipelined in (("rs-ag-uniform-fused-1d", True), ("rs-ag-ring", False)):
        ops = schedules.get(name, op=OP).plan(p, "dma").ops
        barriers = [i for i, op in enumerate(ops) if isinstance(op, Barrier)]
        gathers = [i for i, op in enumerate(ops)
                   if getattr(op, "src", None) is not None and op.src.buf == "reduced"
                   and op.src.peer is not None]
        assert gathers and len(barriers) % 2 == 0
        before_last_rs = sum(g < barriers[-3] for g in gathers)
        assert (before_last_rs > 0) == pipelined, (name, gathers, barriers)


def test_checker_catches_broken_all_reduce_plans():
    p = ar_problem(9, 6, (5,), 3, reduce_op="avg")
    plans = all_ranks(schedules.get("two-shot", op=OP), p, "dma")
    # peers pull a reduced block before its owner summed it: the barrier in between gone
    no_done = [replace(pl, ops=tuple(op for op in pl.ops if not (
        isinstance(op, Barrier) and op.channel == 0 and op is [b for b in pl.ops
                                                             if isinstance(b, Barrier)][2])))
               for pl in plans]
    with pytest.raises(PlanCheckError):
        check_ar_plans(no_done)
    dropped = [replace(pl, ops=tuple(op for op in pl.ops if not isinstance(op, Reduce)
                                     or op.dst.buf != "reduced")) for pl in plans]
    with pytest.raises(PlanCheckError, match="nothing wrote|not reduced"):
        check_ar_plans(dropped)
    unscaled = [replace(pl, ops=tuple(replace(op, scale=None) if isinstance(op, Reduce) else op
                                      for op in pl.ops)) for pl in plans]
    with pytest.raises(PlanCheckError, match="scaled"):
        check_ar_plans(unscaled)
    ccl = all_ranks(schedules.get("serial", op=OP), p, "ccl")
    with pytest.raises(PlanCheckError, match="scale"):
        check_ar_plans([replace(pl, ops=tuple(replace(op, scale=0.5) if isinstance(op, AllReduce)
                                              else op for op in pl.ops)) for pl in ccl])
    # ring adds bf16 partials in place: float32 outputs, on every rank (an empty block too)
    rs_ag = all_ranks(schedules.get("rs-ag-ring", op=OP), replace(p, m=2, dtype="bfloat16"),
                      "dma")
    assert [pl.wide_outputs() for pl in rs_ag] == [True] * 3
    with pytest.raises(PlanCheckError, match="float32 outputs"):
        check_ar_plans([replace(rs_ag[0], wide=False), *rs_ag[1:]])


# -- end to end --------------------------------------------------------------------------------------
def _cases():
    """Every schedule x transport x shape x dtype; each schedule and transport also with avg
    and a bias, and with fp8 tensor-wise and row-wise scales (bf16 outputs)."""
    grid = [{"schedule": n, "transport": t, "shape": s, "dtype": d}
            for n in NAMES for t in ("dma", "ccl") for s in range(len(SHAPES)) for d in DTYPES]
    grid += [{"schedule": n, "transport": t, "shape": 0, "reduce_op": "avg", "bias": True}
             for n in NAMES for t in ("dma", "ccl")]
    grid += [{"schedule": n, "transport": t, "shape": 1 + (sc == "row"), "scaling": sc,
              "bias": True} for n in NAMES for t in ("dma", "ccl") for sc in ("tensor", "row")]
    return grid


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_schedule_matches_float64_and_is_the_same_on_every_rank(world):
    seed = random.randrange(1 << 30)
    failures = harness.pool(world).run(run_grid, seed, _cases(), timeout_s=600)
    assert failures == [[]] * world, f"seed {seed}: {failures}"


def test_world_size_one_is_a_plain_matmul():
    seed = random.randrange(1 << 30)
    for name in NAMES:
        for case, (label, lead, k, ns) in enumerate(SHAPES):
            a_s, b_s, _, _, bias, refs = make_inputs(seed + case, 1, lead, k, ns, torch.float32)
            outs = ficco.matmul_all_reduce(a_s[0], b_s[0], schedule=name, reduce_op="avg",
                                           bias=[bias] + [None] * (len(ns) - 1))
            for j, out in enumerate(outs):
                ref = refs[j][0] + (bias.double() if j == 0 else 0)
                assert max_row_rel_err(out, ref) <= ROW_TOL[torch.float32], (name, label, seed)


# -- gradients -----------------------------------------------------------------------------------------
def test_gradcheck_float64_across_ranks():
    from ...ar_cases import gradcheck_ranks

    seed = random.randrange(1 << 30)
    assert harness.pool(3).run(gradcheck_ranks, seed, "avg") == [True] * 3, seed
    torch.manual_seed(seed)
    a, b = torch.randn(3, 4, dtype=torch.float64, requires_grad=True), \
        torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: ficco.matmul_all_reduce(t[0], t[1], bias=t[2]),
                                    (a, b, bias))   # world of one, through the custom op


@pytest.mark.parametrize("transport", ["dma", "ccl"])
def test_gradients_match_float64(transport):
    from ...ar_cases import gradients_vs_float64

    seed = random.randrange(1 << 30)
    for name in ("one-shot", "rs-ag-uniform-fused-1d"):
        for errors in harness.pool(3).run(gradients_vs_float64, seed, name, transport):
            assert max(errors) <= 1e-5, (name, seed, errors)


def test_row_parallel_linear_without_sequence_parallelism_trains_like_the_unsharded_mlp():
    from ...ar_cases import nn_parity

    seed = random.randrange(1 << 30)
    for loss_diff, param_diff, trained in harness.pool(3).run(nn_parity, seed):
        assert loss_diff <= 1e-5 and param_diff <= 1e-5 and trained, (seed, loss_diff,
                                                                       param_diff)


# -- bad input, disagreement, a dead peer, leaks ---------------------------------------------------
def test_bad_inputs_raise_before_any_communication():
    from ...ar_cases import bad_inputs

    for per_rank in harness.pool(2).run(bad_inputs):
        assert set(per_rank.values()) == {"ok"}, per_rank


@pytest.mark.parametrize("transport", ["dma", "ccl"])
def test_ranks_that_disagree_all_get_mismatch(transport):
    from ...rs_cases import disagree

    assert harness.pool(2).run(disagree, "matmul_all_reduce", "two-shot", transport) == \
        ["mismatch", "mismatch"]


def test_disagreement_on_a_cached_shape_raises_on_every_rank_then_runs_right():
    from ...ar_cases import disagree_on_cached_shapes

    for name in ("one-shot-sm", "rs-ag-uniform-fused-1d"):
        for small, large, mismatched, refused, again in harness.pool(3).run(
                disagree_on_cached_shapes, random.randrange(1 << 30), name):
            assert small < 1e-5 and large < 1e-5 and again < 1e-5, (name, small, large, again)
            assert mismatched == "mismatch", (name, mismatched)
            assert refused == "refused", (name, refused)   # poisoned until every rank resets


def test_dead_peer_makes_the_others_fail_within_the_timeout():
    """serial over ccl: the process group's all-reduce, a new plan op (the barriers of the dma
    plans are the reduce-scatter's, whose dead-peer test holds them)."""
    from ...rs_cases import survivors_fail

    text = harness.dead_peer_error(survivors_fail, OP, "ccl", "serial")
    assert "rank 1 died" in text and "did not answer" not in text, text


def test_no_shared_memory_file_outlives_the_calls():
    cases = [{"schedule": n, "transport": "dma", "shape": 0} for n in NAMES]
    assert harness.shm_files_left(harness.pool(2), run_grid, random.randrange(1 << 30),
                                  cases) == [[], []]


# -- choosing, pricing -----------------------------------------------------------------------------
def test_explain_and_selectors_cover_the_new_op():
    from ...ar_cases import selector_picks
    from ...rs_cases import check_selector_picks

    check_selector_picks(harness.pool(3).run(selector_picks, random.randrange(1 << 30)), NAMES)


def test_all_reduce_pricing_holds_to_published_nccl_times_and_prices_every_plan():
    rows = check_published(profiles.load)
    assert len(rows) == 18 and {r[1] for r in rows} == {"nccl", "loads"}, rows
    assert max(abs(r[-1]) for r in rows) < 0.15, rows
    h100 = profiles.load("h100")
    p = Problem(64, 1024, (8192,), "bfloat16", 8, op=OP)
    serial = simulator.simulate(schedules.get("serial", op=OP).plan(p, "ccl"), h100)
    collective = next(r for r in serial.rows if r["kind"] == "all_reduce")
    expected = collective_seconds(h100, 64 * 8192 * 2, 8)
    assert abs(collective["end_s"] - collective["start_s"] - expected) / expected < 0.2
    # the -sm loads cross the links: reading 7 peers' partials takes longer than 1 local one
    loads = simulator.simulate(schedules.get("one-shot-sm", op=OP).plan(p, "dma"), h100)
    reduce_s = next(r["end_s"] - r["start_s"] for r in loads.rows if r["kind"] == "reduce")
    assert reduce_s > 7 * 64 * 8192 * 2 / h100.link_bytes_per_s
    for name in profiles.builtin_names():
        for transport in ("dma", "ccl"):
            times = model.predict_all(replace(p, world=4), profiles.load(name), None, transport)
            assert set(times) == set(NAMES) and min(times.values()) > 0, (name, transport)


def test_torch_has_no_fused_matmul_all_reduce_to_mirror():
    """ficco.compat mirrors torch's fused symm_mem ops; torch has collectives of an all-reduce
    (one_shot_all_reduce, two_shot_all_reduce_, multimem_*) but no GEMM fused with one, so the
    new op has no compat twin. When torch ships one, this fails: add the twin."""
    import torch.distributed._symmetric_memory

    ops = [name for name in torch._C._dispatch_get_all_op_names()
           if name.startswith("symm_mem::")]
    assert "symm_mem::one_shot_all_reduce" in ops
    assert not [name for name in ops if "matmul" in name and "all_reduce" in name], ops


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", OP])
def test_a_bias_list_with_none_entries_gets_its_gradients(op):
    """Before: ``bias=[b0, None]`` with gradients raised torch's "Expected the return from
    backward to be of the same structure as the inputs" in every op (torch flattens a
    ``Tensor?[]`` input holding None as one leaf, its gradient as a list)."""
    torch.manual_seed(0)
    a = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(6, 4, dtype=torch.float64, requires_grad=True),
          torch.randn(6, 2, dtype=torch.float64, requires_grad=True)]
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y, z = getattr(ficco, op)(a, ws, bias=[bias, None])
    (y.square().sum() + z.sum()).backward()
    a_ref, w_ref, bias_ref = (t.detach().clone().requires_grad_(True) for t in (a, ws[0], bias))
    y_ref = a_ref @ w_ref + bias_ref
    y_ref.square().sum().backward()
    assert torch.allclose(bias.grad, bias_ref.grad) and torch.allclose(ws[0].grad, w_ref.grad)
    assert torch.allclose(ws[1].grad, a.detach().reshape(-1, 6).t() @ torch.ones(6, 2,
                                                                               dtype=a.dtype))


def test_decode_example_matches_the_unsharded_block():
    """examples/tp_decode.py: its decode step at batch 1, 3, 17 (over 2 ranks, heads 4) with
    the row-parallel projections on the one-shot over symmetric memory and on two-shot's
    loads, against the unsharded block."""
    from ...ar_cases import decode_example

    seed = random.randrange(1 << 30)
    for name in ("one-shot", "two-shot-sm"):
        for errors in harness.pool(2).run(decode_example, seed, name):
            assert max(errors) <= 1e-5, (name, seed, errors)
