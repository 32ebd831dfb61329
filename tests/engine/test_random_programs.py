"""Randomized programs on CPU ranks (tests/random_programs.py): ranks skip, repeat,
swap, refuse and fail calls at random, and reset every few calls; every result is checked
against float64 by the pairing rule of docs/design.md §7. Error, never data; in bounded time.
(The campaign of many programs: ``python bench/campaigns.py programs``.)"""
from __future__ import annotations

import random

import pytest

from .. import harness
from ..random_programs import judge, run_program

TIMEOUT_S = 2.0


@pytest.mark.parametrize("world", [2, 3])
def test_random_programs_return_right_data_or_a_ficco_error(world):
    seed = random.randrange(1 << 30)
    calls = 18
    results = harness.pool(world).run(run_program, seed, calls, TIMEOUT_S, timeout_s=600)
    counts = judge(seed, world, results, TIMEOUT_S)
    assert counts["wrong"] == counts["crashed"] == counts["hung"] == 0, (seed, counts)
    assert counts["data"] > 0, (seed, counts)      # the program computed something
    # Bounded: no call waits much past its deadline (a few waits per call, at most).
    assert counts["seconds"] < calls * 3 * TIMEOUT_S + 60, (seed, counts)
