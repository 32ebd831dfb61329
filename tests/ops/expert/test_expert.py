"""Expert parallelism: all_to_all_grouped_mm (dispatch) and grouped_mm_all_to_all (combine).

Plans first (count-free, every rank's barriers alike), then end to end on random uneven
routings with zero counts against float64: every schedule x transport, each W in 2-4 and
each L in 1-3 covered (a sampled grid, not the full product: the suite stays small), both
dtypes, dispatch and the round trip; gradients by gradcheck in float64; bad input, ranks that
disagree, bad counts on one rank; explain and the selector; the simulator's pricing.
"""
from __future__ import annotations

import random

import pytest
import torch

import ficco
from ficco import schedules
from ficco.errors import InvalidArgumentError
from ficco.heuristics import profiles, simulator
from ficco.ops.expert.problem import (
    COMBINE,
    DISPATCH,
    ExpertProblem,
    Layout,
    bucket,
    representative,
    summary,
)
from ficco.plan import Barrier

from ... import ep_cases, harness
from ...ep_cases import (
    DTYPES,
    EP_OPS,
    bad_counts_on_one_rank,
    bad_inputs,
    disagree,
    ep_matrix,
    explain_and_choose,
    gradcheck_round_trip,
    make_case,
    send_counts_skip,
)
from ...reference import ROW_TOL, max_row_rel_err

NAMES = schedules.names(op=DISPATCH)


# -- the registry, problems and plans ---------------------------------------------------------------
def test_names_per_op():
    assert NAMES == schedules.names(op=COMBINE) == [
        "serial", "ring", "uniform-fused-1d", "uniform-unfused-1d", "hetero-fused-1d",
        "hetero-unfused-1d", "uniform-fused-2d", "uniform-unfused-2d", "hetero-fused-2d",
        "hetero-unfused-2d", "by-expert"]
    with pytest.raises(InvalidArgumentError, match="op='all_to_all_grouped_mm'"):
        schedules.get("serial", op=DISPATCH).plan(ExpertProblem(4, 4, 1, "float32", 2,
                                                                op=COMBINE))


def test_layout_is_torchs_vdev_2d_order():
    # W=2, L=2: rank 0 holds experts 0, 1; rank 1 holds 2, 3
    counts = ((1, 2, 0, 3), (4, 0, 1, 1))
    lay = Layout(counts, experts=2)
    # rank 1 receives expert 2 from rank 0 (0 rows) and rank 1 (1), then expert 3 (3, then 1)
    assert lay.recv_counts(1) == [[0, 1], [3, 1]] and lay.recv_rows(1) == 5
    assert [lay.block_offset(1, l, s) for l in range(2) for s in range(2)] == [0, 0, 1, 4]
    assert lay.send_offset(0, 3) == 3 and lay.send_rows(1) == 6


def test_plans_are_count_free_and_cached_across_routings():
    from ficco.runtime import path as runtime

    a = ExpertProblem(8, 4, 2, "float32", 3, 1, counts=representative(3, 2, 5, 1.0))
    b = ExpertProblem(8, 4, 2, "float32", 3, 1, counts=representative(3, 2, 40, 3.0))
    assert a == b and hash(a) == hash(b) and a.key() != b.key()
    spec, kept = ficco.ops.get(DISPATCH), ficco.session_of()
    assert runtime.plan_for(spec, "hetero-fused-1d", "dma", a, session=kept) is \
        runtime.plan_for(spec, "hetero-fused-1d", "dma", b, session=kept)


def test_buckets_and_summary():
    assert [bucket(x) for x in (0, 5, 9, 100, 1000)] == [0, 5, 10, 112, 1024]
    assert summary(((0, 0), (0, 0))) == (0, 1.0)
    assert summary(((4, 4), (4, 12))) == (6, 2.0)


@pytest.mark.parametrize("op", EP_OPS)
@pytest.mark.parametrize("transport", ["dma", "ccl"])
def test_every_rank_meets_the_same_barriers(op, transport):
    """dma barriers alternate channels and end on 1, the same count on every rank; ccl plans
    have none; every plan moves something from every peer and multiplies every source."""
    for name in NAMES:
        for world in (1, 2, 3, 4, 8):
            plans = [schedules.get(name, op=op).plan(
                ExpertProblem(8, 4, 2, "float32", world, r, op=op), transport)
                for r in range(world)]
            channels = [[o.channel for o in pl.ops if isinstance(o, Barrier)] for pl in plans]
            assert len({tuple(c) for c in channels}) == 1, (name, world, channels)
            if transport == "ccl" or world == 1:
                assert channels[0] == []
            else:
                assert channels[0] == [i % 2 for i in range(len(channels[0]))]
                assert channels[0][-1] == 1
            for r, pl in enumerate(plans):
                pulled = {o.peer for o in pl.ops if o.kind == "expert_copy"}
                computed = {s for o in pl.ops if o.kind == "expert_gemm" for s in o.sources}
                assert computed == set(range(world)), (name, r, computed)
                if transport == "dma" and world > 1:
                    assert pulled == set(range(world)) - {r}


def test_hetero_dispatch_starts_with_its_own_block_and_combine_ends_with_it():
    p = ExpertProblem(8, 4, 2, "float32", 4, 2)
    first = next(o for o in schedules.get("hetero-fused-1d", op=DISPATCH).plan(p, "dma").ops
                 if o.kind == "expert_gemm")
    assert first.sources == (2,) and first.chunk is None
    q = ExpertProblem(8, 4, 2, "float32", 4, 2, op=COMBINE)
    last = [o for o in schedules.get("hetero-fused-1d", op=COMBINE).plan(q, "dma").ops
            if o.kind == "expert_gemm"][-1]
    assert last.sources == (2,) and last.chunk is None


@pytest.mark.parametrize("op", EP_OPS)
def test_2d_plans_cut_the_moved_columns(op):
    """2d chunks are column chunks of what crosses the links (dispatch K, combine n); a chunk
    with no columns is dropped on every rank; dispatch adds every chunk after the first into
    y, float32 for bf16 (combine's chunks are whole-K products: nothing to add)."""
    for name in ("uniform-fused-2d", "hetero-unfused-2d"):
        for transport in ("dma", "ccl"):
            # K = 3 (dispatch) or n = 3 (combine) over W = 4: chunk 3 has no columns
            problem = {"k": 3, "n": 5} if op == DISPATCH else {"k": 5, "n": 3}
            plans = [schedules.get(name, op=op).plan(
                ExpertProblem(**problem, experts=2, dtype="bfloat16", world=4, rank=r, op=op),
                transport) for r in range(4)]
            for pl in plans:
                moving = [o for o in pl.ops if o.kind in ("expert_copy", "expert_all_to_all")]
                assert {o.chunk for o in moving} == {0, 1, 2} and all(o.two_d for o in moving)
                gemms = [o for o in pl.ops if o.kind == "expert_gemm" and o.chunk is not None]
                assert all(o.two_d for o in gemms)
                assert [o.accumulate for o in gemms] == [
                    op == DISPATCH and o.chunk != 0 for o in gemms]
                assert pl.wide_outputs() == (op == DISPATCH)
            assert len({tuple(o.channel for o in pl.ops if isinstance(o, Barrier))
                        for pl in plans}) == 1
    fp32 = ExpertProblem(8, 4, 2, "float32", 4, 1, op=op)
    assert not schedules.get("uniform-fused-2d", op=op).plan(fp32, "dma").wide_outputs()


@pytest.mark.parametrize("op", EP_OPS)
def test_ring_moves_one_peer_per_step_on_one_queue(op):
    """One peer a step; combine pulls on copy0; dispatch pulls each peer and multiplies its
    rows on one queue, copy0 and compute taking turns (Async-TP's two streams)."""
    p = ExpertProblem(8, 4, 2, "float32", 4, 1, op=op)
    dma = schedules.get("ring", op=op).plan(p, "dma")
    pulls = [o for o in dma.ops if o.kind == "expert_copy"]
    assert [o.peer for o in pulls] == [2, 3, 0]
    if op == DISPATCH:
        assert [o.queue for o in pulls] == ["copy0", "compute", "copy0"]
        queue_of = {o.sources: o.queue for o in dma.ops if o.kind == "expert_gemm"}
        assert [queue_of[(o.peer,)] for o in pulls] == [o.queue for o in pulls]
    else:
        assert {o.queue for o in pulls} == {"copy0"}
    gemms = [o.sources for o in dma.ops if o.kind == "expert_gemm"]
    # dispatch: own block first, then each peer's as it lands; combine: the blocks bound for
    # r - i at step i (pulled back by that rank), the own block last
    assert gemms == ([(1,), (2,), (3,), (0,)] if op == DISPATCH else [(0,), (3,), (2,), (1,)])
    ccl = schedules.get("ring", op=op).plan(p, "ccl")
    assert [o.shift for o in ccl.ops if o.kind == "expert_all_to_all"] == [1, 2, 3]


@pytest.mark.parametrize("op", EP_OPS)
@pytest.mark.parametrize("transport", ["dma", "ccl"])
def test_by_expert_never_cuts_a_gemm(op, transport):
    """Every GEMM of ``by-expert`` is one whole expert over every source (no chunk), one per
    local expert in order; dispatch moves expert l before its GEMM, combine after; the
    simulator prices it like every other plan."""
    p = ExpertProblem(16, 8, 3, "float32", 4, rank=1, op=op,
                      counts=((2, 3, 1, 4, 2, 2, 3, 1, 0, 2, 5, 1),) * 4)
    plan = schedules.get("by-expert", op=op).plan(p, transport)
    gemms = [o for o in plan.ops if o.kind == "expert_gemm"]
    assert [(g.chunk, g.experts, g.sources) for g in gemms] == \
        [(None, (l,), (0, 1, 2, 3)) for l in range(3)]
    moves = [o for o in plan.ops if o.kind in ("expert_copy", "expert_all_to_all")]
    assert {o.experts for o in moves} == {(0,), (1,), (2,)}
    assert all(o.chunk is None for o in moves)
    first_move = next(i for i, o in enumerate(plan.ops) if o in moves)
    first_gemm = plan.ops.index(gemms[0])
    assert (first_move < first_gemm) == (op == DISPATCH)
    assert simulator.simulate(plan, profiles.load("mi300x")).makespan_s > 0


# -- end to end ---------------------------------------------------------------------------------------
def _grid():
    """Every (schedule, transport) at each W in 2-4, L cycling 1-3 along the list so each W sees
    every L: 60 pool calls, each covering two routings x both dtypes x dispatch and combine."""
    combos = [(s, t) for s in NAMES for t in ("dma", "ccl")]
    return [(w, 1 + (i + w) % 3, s, t) for w in (2, 3, 4) for i, (s, t) in enumerate(combos)]


@pytest.mark.parametrize("world,experts,schedule,transport", _grid())
def test_schedule_matches_reference(world, experts, schedule, transport):
    seed = random.randrange(1 << 30)
    failures = harness.pool(world).run(ep_matrix, experts, schedule, transport, seed)
    assert failures == [[]] * world, f"seed {seed}: {failures}"


def test_grouped_mm_and_gemm_loop_paths_agree_with_reference():
    """K, n whose rows are not 16-byte multiples take the loop of GEMMs; the default shapes
    take torch._grouped_mm (on CPU for float32/bfloat16): both right, dma and ccl. 2d: K or n
    narrower than W (chunks with no columns), and column chunks of the weights that
    torch._grouped_mm takes (K=72: 24-row chunks of w) or not (n2=40: 14-column chunks of w2,
    56 bytes: a loop of GEMMs)."""
    seed = random.randrange(1 << 30)
    for transport, schedule in (("dma", "uniform-fused-1d"), ("ccl", "hetero-unfused-1d"),
                                ("dma", "uniform-fused-2d"), ("ccl", "hetero-fused-2d")):
        shapes = ((6, 5, 3), (16, 8, 8)) if schedule.endswith("1d") else \
            ((2, 5, 2), (72, 40, 40))
        failures = harness.pool(3).run(ep_matrix, 2, schedule, transport, seed, 1, shapes)
        assert failures == [[]] * 3, f"seed {seed}: {failures}"


def test_grouped_mm_takes_aligned_chunks_of_the_stacked_weights():
    from ficco.ops.expert.tasks import grouped_view_runs

    stacked = torch.randn(2, 72, 40)
    assert grouped_view_runs(stacked) and grouped_view_runs(stacked[:, 24:48])
    assert not grouped_view_runs(stacked[:, :, 14:27])
    assert grouped_view_runs(stacked[:, :, 16:32])


def test_float16_and_float64_too():
    seed = random.randrange(1 << 30)
    failures = harness.pool(2).run(ep_matrix, 2, "hetero-fused-1d", "dma", seed, 1,
                                   ((16, 8, 8),), (torch.float16, torch.float64))
    assert failures == [[]] * 2, f"seed {seed}: {failures}"


def test_custom_ops_pass_torchs_opcheck():
    """Schema, autograd registration, fake kernels (data-dependent rows) and AOT dispatch with
    dynamic shapes, on one rank."""
    import ficco.ops.expert.torch_op  # noqa: F401 - registers the ops

    x, ws = torch.randn(5, 16), [torch.randn(16, 8), torch.randn(16, 8)]
    report = torch.library.opcheck(torch.ops.ficco.all_to_all_grouped_mm.default,
                                   (x, torch.tensor([2, 3]), ws, "", None, None, True))
    assert set(report.values()) == {"SUCCESS"}, report
    report = torch.library.opcheck(torch.ops.ficco.grouped_mm_all_to_all.default,
                                   (torch.randn(5, 8), torch.tensor([[2], [3]]),
                                    [torch.randn(8, 4)] * 2, "", None, None, None))
    assert set(report.values()) == {"SUCCESS"}, report


@pytest.mark.parametrize("schedule", NAMES)
def test_world_size_one_is_a_grouped_matmul(schedule):
    seed = random.randrange(1 << 30)
    for experts in (1, 3):
        counts, xs, w, w2 = make_case(seed, 1, experts)
        from ...ep_cases import dispatch_reference, round_trip_reference

        y_ref, recv_ref = dispatch_reference(counts, xs, w, 0, experts)
        for dtype in DTYPES:
            y, recv = ficco.all_to_all_grouped_mm(xs[0].to(dtype), counts[0], w.to(dtype),
                                                  schedule=schedule)
            assert recv.tolist() == recv_ref
            assert max_row_rel_err(y, y_ref) <= ROW_TOL[dtype], (seed, dtype)
            z = ficco.grouped_mm_all_to_all(y, recv, w2.to(dtype), schedule=schedule)
            assert max_row_rel_err(z, round_trip_reference(counts, xs, w, w2, 0)) <= \
                2 * ROW_TOL[dtype], (seed, dtype)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gradcheck_float64(world):
    """Gradients of x, w (dispatch) and w2 (combine, fed by dispatch) against finite
    differences, every schedule across the three world sizes, both transports."""
    seed = random.randrange(1 << 30)
    plan = [(s, t) for i, s in enumerate(NAMES) for t in ("dma", "ccl")
            if (i + world) % 3 == 0 or s == "serial"]
    results = harness.pool(world).run(gradcheck_round_trip, 1 + world % 3, plan, seed)
    assert results == [[]] * world, f"seed {seed}: {results}"


def test_send_counts_skips_the_exchange():
    results = harness.pool(3).run(send_counts_skip, random.randrange(1 << 30))
    for skipped, exchanged, diff in results:
        assert skipped and exchanged and diff == 0.0, results


# -- bad input, disagreement, explain ------------------------------------------------------------------
def test_bad_inputs_raise_before_any_communication():
    for per_rank in harness.pool(2).run(bad_inputs):
        assert set(per_rank.values()) == {"ok"}, per_rank


def test_bad_counts_on_one_rank_raise_there_and_time_out_elsewhere():
    results = harness.pool(3).run(bad_counts_on_one_rank)
    assert results[0][0] == "invalid" and results[0][1] < 2, results
    assert all(r[0] == "timeout" and r[1] < 15 for r in results[1:]), results


def test_ranks_that_disagree_all_get_mismatch():
    assert harness.pool(2).run(disagree) == [["mismatch", True]] * 2


def test_disagreement_on_cached_calls_raises_on_every_rank():
    from ...ep_cases import disagree_on_cached_calls

    for first, shape, mismatched, refused, again in harness.pool(3).run(
            disagree_on_cached_calls, random.randrange(1 << 30)):
        assert first <= ROW_TOL[torch.float32] and again <= ROW_TOL[torch.float32]
        assert mismatched == "mismatch" and shape[1] == 4, (mismatched, shape)
        assert refused == "refused", refused          # poisoned until every rank resets


def test_explain_and_the_selector_cover_both_ops():
    results = harness.pool(3).run(explain_and_choose, random.randrange(1 << 30))
    assert len({r[3] for r in results}) == 1 and len({r[4] for r in results}) == 1, results
    for known, text, scored, first, second, err in results:
        assert known and "schedule" in text and set(scored) >= set(NAMES)
        assert err <= ROW_TOL[torch.float32]


def test_table_i_expert_gemms_are_priced_as_all_to_all():
    """validate's g13-g16 rows: the dispatch moves 1/W of the all-gather reading's bytes (uniform
    routing: every rank keeps its own 1/W), its GEMM has the same FLOPs, and every dispatch
    schedule is priced."""
    from ficco.bench.validate_g13_g16 import EXPERT_GEMMS, expert_rows, table_i_expert_problem
    from ficco.heuristics.scenarios import table_i_problem

    for name in EXPERT_GEMMS:
        ep, ag = table_i_expert_problem(name), table_i_problem(name)
        assert ep.flops == ag.flops and ep.gather_bytes * ep.world == ag.gather_bytes
    rows = expert_rows()
    assert [r["gemm"] for r in rows] == list(EXPERT_GEMMS)
    for r in rows:
        assert set(r["speedup"]) == {f"{s}/{t}" for s in NAMES for t in ("dma", "ccl")}
        assert 0 < r["comm_share"] < 1 and all(v > 0 for v in r["speedup"].values())


@pytest.mark.parametrize("schedule, transport", [("hetero-fused-1d", "dma"), ("ring", "ccl")])
def test_a_grouped_gemm_longer_than_ficco_timeout_is_no_failure(schedule, transport):
    """The expert ops after a failure on one queue. Before: their grouped GEMMs, copies and pulls were
    unmarked host tasks, which the CPU backend bounds by FICCO_TIMEOUT like a collective:
    `CommTimeoutError: queue compute did not drain within FICCO_TIMEOUT` and a poisoned
    group. Now they are marked local work: a healthy GEMM takes as long as it takes."""
    from ...ep_cases import slow_grouped_gemms

    results = harness.run_alone(2, slow_grouped_gemms, random.randrange(1 << 30), schedule,
                                transport, timeout_s=120)
    for outcomes in results:
        for kind, value in outcomes:
            assert kind == "ok" and value <= 1e-4, results


@pytest.mark.parametrize("op", ["all_to_all_grouped_mm", "all_gather_matmul"])
def test_every_schedule_rounds_bf16_alike(op):
    """The four 2d dispatch schedules rounded each K chunk's product to
    bfloat16 before adding (257 -> 256, then - 256 = 0) where every other schedule sums in
    float32 and rounds once (1). Every schedule of an op must give the same, exact 1."""
    names = ficco.schedules.names(op=op)
    for transport in ("dma", "ccl"):
        for per_rank in harness.pool(2).run(ep_cases.cancellation_probe, op, names, transport):
            assert per_rank == {name: [1.0] for name in names}, (transport, per_rank)
