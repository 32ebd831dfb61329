"""ficco by name in the ``torch.profiler`` traces users already take.

While a profiler is recording, each ficco call is a ``record_function`` range named after the
op and its shape, and each plan op inside it a range named after the schedule, the op's kind
and what it moves or multiplies; outside a profiler nothing is added (one flag read per call),
so the eager hot path keeps its cost::

    with torch.profiler.profile() as prof:
        ficco.all_gather_matmul(a_shard, w)
    # ranges: "ficco.all_gather_matmul 4096x1024x2048 W=8 r0", "ficco uniform-fused-1d: gemm b0 ..."
    prof.export_chrome_trace("trace.json")
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd import profiler as _profiler


def recording() -> bool:
    """True while a ``torch.profiler`` / autograd profiler is recording in this process."""
    return bool(_profiler._is_profiler_enabled)


def call_range(op_name: str, problem=None):
    """A range around one ficco call (a no-op context when no profiler records).

    >>> with call_range("all_gather_matmul"):
    ...     pass
    """
    if not recording():
        return contextlib.nullcontext()
    name = f"ficco.{op_name}"
    if problem is not None:
        name += (f" {problem.big_m}x{sum(problem.ns)}x{problem.k} {problem.dtype} "
                 f"W={problem.world} r{problem.rank}")
    return torch.profiler.record_function(name)


def run_with_ranges(compiled, run_steps, label) -> None:
    """Run ``compiled.steps`` through ``run_steps(steps)``, each plan op's step inside a range
    ``"ficco <schedule>: <kind> <label(op)>"``; the waits and records between ops run bare."""
    plan = compiled.plan
    schedule = getattr(plan, "schedule", None) or getattr(plan, "name", "plan")
    work = dict(compiled.work)
    with torch.profiler.record_function(f"ficco.execute {schedule}"):
        for number, step in enumerate(compiled.steps):
            index = work.get(number)
            if index is None:
                run_steps((step,))
                continue
            op = plan.ops[index]
            with torch.profiler.record_function(f"ficco {schedule}: {op.kind} {label(op)}"):
                run_steps((step,))
