"""fp8 operands, output dtypes, bias and activation through every schedule of both ops, on both
transports, against float64 references and torch's own fallbacks (tests/fp8_cases.py).

The grid is sampled so the cost stays modest: every schedule runs on both transports, with
tensor-wise scales on one and row-wise on the other (alternating by schedule), and the world
size cycles through 2, 3 and 4 by schedule, so every schedule x transport, both recipes and
every W in 2-4 are covered; the shapes alternate too (uneven rows, 3-D with gather_dim 1,
e4m3 x e5m2, an activation).
"""
from __future__ import annotations

import random

import pytest
import torch

from ficco import schedules

from . import harness
from .fp8_cases import E4M3, E5M2, ag_grid, rs_grid

WORLDS = (2, 3, 4)
TRANSPORTS = ("dma", "ccl")


def _grid(op: str, case_of):
    """{world: [case, ...]}: every schedule of ``op`` on both transports."""
    by_world: dict[int, list] = {w: [] for w in WORLDS}
    for i, name in enumerate(schedules.names(op=op)):
        world = WORLDS[i % len(WORLDS)]
        for t, transport in enumerate(TRANSPORTS):
            scaling = ("tensor", "row")[(i + t) % 2]
            by_world[world].append({"schedule": name, "transport": transport,
                                    "scaling": scaling, **case_of(i, t)})
    return by_world


def _ag_case(i, t):
    if (i + t) % 3 == 2:   # 3-D, gathered along dim 1, mixed fp8 forms, an activation
        return {"shape": (2, 3, 32), "gather_dim": 1, "ns": (32, 16), "a": E4M3, "b": E5M2,
                "activation": "gelu"}
    return {"shape": (5, 48), "gather_dim": 0, "ns": (32, 16), "a": E4M3, "b": E4M3,
            "activation": "silu" if i % 4 == 1 else ""}


def _rs_case(i, t):
    if (i + t) % 3 == 2:   # uneven blocks (float64 reference only), e5m2 b
        return {"shape": (11, 48), "scatter_dim": 0, "ns": (32, 16), "a": E4M3, "b": E5M2,
                "reduce_op": "sum"}
    return {"shape": (2, 12, 32), "scatter_dim": 1, "ns": (16, 32), "a": E4M3, "b": E4M3,
            "reduce_op": "avg" if t else "sum"}


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_matmul_fp8_every_schedule(world):
    cases = _grid("all_gather_matmul", _ag_case)[world]
    for failures in harness.pool(world).run(ag_grid, cases, random.randrange(1 << 30)):
        assert failures == []


@pytest.mark.parametrize("world", WORLDS)
def test_matmul_reduce_scatter_fp8_every_schedule(world):
    cases = _grid("matmul_reduce_scatter", _rs_case)[world]
    for failures in harness.pool(world).run(rs_grid, cases, random.randrange(1 << 30)):
        assert failures == []


def test_the_grid_covers_every_schedule_transport_recipe_and_world():
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        grid = _grid(op, lambda i, t: {})
        seen = {(c["schedule"], c["transport"]) for cases in grid.values() for c in cases}
        names = schedules.names(op=op)
        assert seen == {(n, t) for n in names for t in TRANSPORTS}
        assert all(grid[w] for w in WORLDS)
        for name in names:
            assert {c["scaling"] for cases in grid.values() for c in cases
                    if c["schedule"] == name} == {"tensor", "row"}
    assert torch.float8_e4m3fn in (E4M3,)
