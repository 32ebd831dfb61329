"""The op contract's oracle: every registered op's ``example`` and ``reference`` (the float64
computation tests, selftest and the demo share) on CPU ranks at W 2 and 3: each op's output is
exact against it, and a wrong output is not."""
from __future__ import annotations

import random

import pytest

from ficco import ops
from ficco.ops.examples import Rounding

from .. import harness
from ..example_cases import every_op_against_its_oracle


@pytest.mark.parametrize("world", [2, 3])
def test_every_op_matches_its_own_oracle_and_a_wrong_output_does_not(world):
    failures = harness.pool(world).run(every_op_against_its_oracle, random.randrange(1 << 30))
    assert failures == [[]] * world, failures


def test_examples_are_every_ranks_and_the_same_from_one_seed():
    """Each rank's example of one seed holds every rank's inputs alike, and its own args are
    its entry of them (rounded as cast)."""
    for op in ops.names():
        spec = ops.get(op)
        made = [spec.example(r, 3, (4, 5, 6), Rounding("bfloat16"), 7) for r in range(3)]
        ref0 = spec.reference(made[0])[0]
        again = spec.reference(spec.example(0, 3, (4, 5, 6), Rounding("bfloat16"), 7))[0]
        assert ref0.equal(again), op
        for r, ex in enumerate(made):
            assert ex.rank == r and ex.world == 3, op
            assert ex.args[0].dtype.is_floating_point and ex.args[0].dtype != ref0.dtype, op
