"""The gated GEMM's launch (ficco/kernels/launch.py) on the fake GPU of tests/fake_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from .. import fake_gpu

pytest.importorskip("triton")


def test_a_captured_gated_launch_leaves_nothing_for_the_next_eager_call():
    """A gated GEMM captured into a graph used to queue its error check on the
    group's fault (``fault.gated``), bound to an event recorded in the capture and a host word
    that only a replay writes: the next eager call read it (a spurious CommTimeoutError, or a
    replay's give-up never reported). Captured launches leave no such entry: a replayed
    kernel that gives up raises the group's word itself (W1)."""
    from types import SimpleNamespace

    from ficco import schedules
    from ficco.backends import get_backend
    from ficco.kernels.launch import gated_task
    from ficco.plan import GatedGemm
    from ficco.plan.problem import Problem
    from ficco.symm_mem.fault import GroupFault

    fake_gpu.install("cuda", 8)
    try:
        problem = Problem(m=4, k=8, ns=(5,), dtype="float32", world=2, rank=0)
        plan = schedules.get("gated-1d").plan(problem)
        op = next(o for o in plan.ops if isinstance(o, GatedGemm))
        word = np.zeros(1, np.int32)
        fault = GroupFault(0, word, torch.from_numpy(word), 0)
        gen = torch.Generator().manual_seed(3)
        gathered, b = torch.randn(8, 8, generator=gen), torch.randn(8, 5, generator=gen)
        out = torch.full((8, 5), float("nan"))
        flags = torch.ones(op.num_flags, dtype=torch.int32)
        task = gated_task(get_backend(), problem, op, gathered[:4], gathered, b, out, flags,
                          1.0, SimpleNamespace(fault=fault, device_sharers=1))
        with fake_gpu.capture():
            task()          # what the capturing thread runs when the plan enqueues the launch
        assert fault.gated == []
        assert torch.allclose(out, gathered @ b, atol=1e-5)
        task()              # eagerly, the launch's error check is queued as before
        assert len(fault.gated) == 1 and fault.gated_error() is None
    finally:
        fake_gpu.uninstall()
