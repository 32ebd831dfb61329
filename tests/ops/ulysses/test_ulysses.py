"""Ulysses sequence parallelism: matmul_all_to_all (all_to_all(a @ b)) and all_to_all_matmul
(all_to_all(a) @ b).

Plans first (each rank's barriers alike, the serial baseline and the pieces), then end to end
against float64 on CPU ranks: W 2, 3, 4, both transports, every schedule, float64 and bf16,
uneven sequence shards and chunks that do not divide; bad input raises before any
communication; the simulator prices every plan.
"""
from __future__ import annotations

import random

import pytest
import torch

import ficco
from ficco import schedules
from ficco.errors import InvalidArgumentError
from ficco.heuristics import profiles, simulator
from ficco.ops.ulysses.layout import UlyssesProblem
from ficco.plan import Barrier

from ... import harness
from ...ulysses_cases import (
    OPS,
    after_bad_inputs,
    attention_parity,
    compiled_parity,
    gradient_off_the_chunk_rule,
    gradient_parity,
    lengths_change,
    reference_all_to_all,
    style_parity,
    ulysses_matrix,
)


def problem(op, world, rank=0, shape=(8, 6, 16), scatter=1, gather=0):
    return UlyssesProblem(shape, scatter, gather, 16, 16, "float32", world, rank, op)


def test_names_and_registry():
    for op in OPS:
        assert schedules.names(op=op) == ["serial", "pieces"]
        assert ficco.ops.get(op).name == op
    with pytest.raises(InvalidArgumentError, match="op='all_to_all_matmul'"):
        schedules.get("serial", op="all_to_all_matmul").plan(problem("matmul_all_to_all", 2))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("transport", ["dma", "ccl"])
def test_plans_barriers_alike_and_every_peer_once(op, transport):
    for world in (2, 3, 4):
        for name in schedules.names(op=op):
            plans = [schedules.get(name, op=op).plan(problem(op, world, r), transport)
                     for r in range(world)]
            barriers = [[(b.channel) for b in p.ops if isinstance(b, Barrier)] for p in plans]
            assert all(b == barriers[0] for b in barriers)
            if transport == "dma":
                assert len(barriers[0]) % 2 == 0 and barriers[0][-1] == 1
            for r, plan in enumerate(plans):
                moved = sorted(o.peer for o in plan.ops if o.kind == "ulysses_copy")
                exchanges = [o for o in plan.ops if o.kind == "ulysses_all_to_all"]
                if transport == "dma":
                    assert moved == [q for q in range(world) if q != r]
                else:
                    shifts = sorted(o.shift for o in exchanges if o.shift is not None)
                    assert shifts == ([] if name == "serial" else list(range(1, world)))
                    assert len(exchanges) == (1 if name == "serial" else world - 1)


def test_layout_uneven():
    p = UlyssesProblem((5, 7, 3), 1, 0, 3, 3, "float32", 3, rank=2, sizes=(5, 4, 4))
    assert [p.chunk(j) for j in range(3)] == [(0, 3), (3, 2), (5, 2)]
    assert p.recv_shape(0) == (5, 2, 3) and p.recv_shape(1) == (4, 2, 3)
    assert p.gathered_shape == (13, 2, 3) and p.gather_offset(2) == 9
    ts = [torch.randn(n, 7, 3) for n in (5, 4, 4)]
    assert reference_all_to_all(ts, 1, 0, 2).shape == p.gathered_shape


@pytest.mark.parametrize("op", OPS)
def test_simulator_prices_every_plan(op):
    prof = profiles.load("mi300x")
    shape = (4096, 32, 1024)
    times = {}
    for transport in ("dma", "ccl"):
        for name in schedules.names(op=op):
            p = UlyssesProblem(shape, 1, 0, 1024, 1024, "bfloat16", 4, 1, op,
                               sizes=(4096,) * 4)
            plan = schedules.get(name, op=op).plan(p, transport)
            times[name, transport] = simulator.simulate(plan, prof).makespan_s
    assert all(t > 0 for t in times.values()), times


@pytest.mark.parametrize("world,transport", [(2, "dma"), (3, "ccl"), (4, "dma"), (2, "ccl"),
                                             (3, "dma"), (4, "ccl")])
def test_exact_every_schedule(world, transport):
    failures = harness.pool(world).run(ulysses_matrix, transport, random.randrange(1 << 30))
    assert failures == [[]] * world, failures


@pytest.mark.parametrize("world", [2, 3])
def test_every_call_uses_its_own_lengths_when_a_peers_change(world):
    failures = harness.pool(world).run(lengths_change, random.randrange(1 << 30))
    assert failures == [[]] * world, failures


def test_bad_input_raises_before_communication_and_calls_still_pair():
    results = harness.pool(2).run(after_bad_inputs, random.randrange(1 << 30))
    assert results == [[], []], results


def test_world_of_one_is_the_plain_expression():
    a, w = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    assert torch.equal(ficco.matmul_all_to_all(a, w, scatter_dim=0, gather_dim=1), a @ w)
    assert torch.allclose(ficco.all_to_all_matmul(a, w, scatter_dim=1, gather_dim=-1), a @ w)


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_match_autograd_through_the_reference(world):
    failures = harness.pool(world).run(gradient_parity, random.randrange(1 << 30))
    assert failures == [[]] * world, failures


def test_gradient_off_the_chunk_rule_raises_on_every_rank():
    assert harness.pool(2).run(gradient_off_the_chunk_rule) == [{"backward": "ok"}] * 2


def test_compiled_fullgraph_is_exact_with_gradients():
    failures = harness.pool(2).run(compiled_parity, random.randrange(1 << 30))
    assert failures == [[], []], failures


@pytest.mark.parametrize("world,heads,causal", [(2, 4, False), (3, 3, True)])
def test_ulysses_attention_matches_the_unsharded_attention(world, heads, causal):
    failures = harness.pool(world).run(attention_parity, random.randrange(1 << 30), heads,
                                       causal)
    assert failures == [[]] * world, failures


@pytest.mark.parametrize("world,heads", [(2, 4), (3, 3)])
def test_parallel_style_pair_matches_the_unsharded_attention(world, heads):
    failures = harness.pool(world).run(style_parity, random.randrange(1 << 30), heads)
    assert failures == [[]] * world, failures


@pytest.mark.parametrize("op", ["matmul_all_to_all", "all_to_all_matmul"])
def test_explain_decides_locally_assuming_every_rank_is_like_this_one(op):
    """explain() never communicates: on one process it takes this rank's length along
    gather_dim for every rank's and names one of the op's schedules."""
    a, w = torch.randn(6, 8, 4), torch.randn(4, 8)
    decision = ficco.explain(a, w, op=op, scatter_dim=1, gather_dim=0)
    assert decision.schedule in ficco.schedules.names(op=op)
