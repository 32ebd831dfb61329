"""ficco shows up by name in torch.profiler traces: a range per call and per plan op while a
profiler records, nothing added otherwise; results stay exact either way."""
from __future__ import annotations

import torch

import ficco
from ficco import profiling, schedules
from ficco.backends.cpu import CpuBackend
from ficco.executor import execute
from ficco.plan.buffers import Buffers
from ficco.plan.problem import Problem


def _names(prof) -> list[str]:
    return [e.name for e in prof.events()]


def test_plan_ops_are_named_ranges_while_profiling():
    torch.manual_seed(7)
    p = Problem(m=12, k=16, ns=(5,), dtype="float32", world=1, rank=0)
    plan = schedules.get("serial").plan(p, "ccl")
    a, b = torch.randn(12, 16), torch.randn(16, 5)
    out, gathered = torch.empty(12, 5), torch.empty(12, 16)
    assert not profiling.recording()
    with torch.profiler.profile() as prof:
        assert profiling.recording()
        execute(plan, CpuBackend(), Buffers(a, [b], [out], gathered), timeout_s=30.0)
    names = _names(prof)
    assert "ficco.execute serial" in names
    gemm_ranges = [n for n in names if n.startswith("ficco serial: gemm")]
    assert len(gemm_ranges) == sum(op.kind == "gemm" for op in plan.ops) > 0
    expected = a.double() @ b.double()
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_call_is_one_named_range_and_nothing_when_not_profiling():
    torch.manual_seed(8)
    a, w = torch.randn(6, 4), torch.randn(4, 3)
    with torch.profiler.profile() as prof:
        c = ficco.all_gather_matmul(a, w)
    calls = [n for n in _names(prof) if n.startswith("ficco.all_gather_matmul")]
    assert calls == ["ficco.all_gather_matmul 6x3x4 float32 W=1 r0"]
    assert torch.allclose(c.double(), a.double() @ w.double(), rtol=1e-5, atol=1e-5)
    assert not profiling.recording()
    assert isinstance(profiling.call_range("all_gather_matmul"),
                      type(__import__("contextlib").nullcontext()))
