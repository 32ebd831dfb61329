"""A campaign of bad calls to every public surface, each a clean
``ficco.errors`` error before any communication; a multi-process launch without a process
group refused; FICCO_SCHEDULE applied to the op families that have the schedule it names."""
from __future__ import annotations

import random

import pytest
import torch

import ficco
from ficco.errors import InvalidArgumentError

from .. import harness
from ..bad_input_cases import campaign, cases, schedule_env_per_family

LABELS = sorted(cases(2))


@pytest.fixture(scope="module")
def outcomes():
    (results, right0), (_, right1) = harness.pool(2).run(campaign, timeout_s=300)
    assert right0 and right1   # the pool is in step after the campaign: a good call is right
    return results


@pytest.mark.parametrize("label", LABELS)
def test_bad_call_is_a_ficco_error_before_any_communication(outcomes, label):
    assert outcomes[label].startswith("ficco: "), outcomes[label]


def test_a_multi_process_launch_without_a_process_group_is_refused(monkeypatch):
    """Under torchrun without init_process_group a call silently returned a per-rank plain
    matmul of the rank's own shard."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    a, b = torch.randn(4, 6), torch.randn(6, 3)
    for call in (lambda: ficco.all_gather_matmul(a, b),
                 lambda: ficco.matmul_reduce_scatter(a, b),
                 lambda: ficco.all_to_all_grouped_mm(a, [4], torch.randn(1, 6, 3)),
                 lambda: ficco.nn.ColumnParallelLinear(6, 4)):
        with pytest.raises(InvalidArgumentError, match=r"WORLD_SIZE=2 .*init_process_group"):
            call()
    monkeypatch.setenv("WORLD_SIZE", "1")   # a world of one: the plain matmul
    assert torch.allclose(ficco.all_gather_matmul(a, b), a @ b)


def test_ficco_schedule_forces_only_the_ops_that_have_it():
    for ran, refused in harness.pool(2).run(schedule_env_per_family, random.randrange(1 << 20)):
        assert ran["all_gather_matmul"] == ran["matmul_reduce_scatter"] == "ring-bidir", ran
        assert ran["all_to_all_grouped_mm"] != "ring-bidir" != ran["grouped_mm_all_to_all"]
        assert refused == [True, True], refused
