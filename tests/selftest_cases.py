"""Rank-side functions of tests/faces/test_selftest.py (ficco/selftest on the pool's ranks)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ficco
from ficco import schedules
from ficco.selftest import Options, run_rank

from . import fake_gpu

QUICK = Options(shapes=("tiny",), dtypes=("float32", "bfloat16", "float8"), fault_timeout_s=1.0,
                timeout_s=20.0)


def quick(rank, world, fake=None, options=QUICK):
    """selftest's checks, quick, on the CPU backend or (``fake``: "cuda") the fake GPU."""
    ficco.shutdown()          # (closes the backends: the fake one is installed after)
    real_shutdown = ficco.shutdown
    if fake:
        fake_gpu.install(fake, 8)
        # selftest resets ficco after a failed check (and after its fault smoke): the fake
        # backend comes back as a real GPU's would
        ficco.shutdown = lambda: (real_shutdown(), fake_gpu.ensure(fake, 8))
    try:
        return run_rank(rank, world, options, emit=lambda line: None)
    finally:
        ficco.shutdown = real_shutdown
        ficco.shutdown()
        if fake:
            fake_gpu.uninstall()


@dataclass(frozen=True)
class Broken:
    """A planted schedule: ``ring``'s plan without its last GEMM (rows left unwritten)."""

    real: object
    name: str = "ring"

    def plan(self, problem, transport="dma", copy_engines=None):
        from ficco.plan import Gemm

        plan = self.real.plan(problem, transport, copy_engines)
        last = max(i for i, op in enumerate(plan.ops) if isinstance(op, Gemm))
        return dataclasses.replace(plan, ops=plan.ops[:last] + plan.ops[last + 1:])


def planted(rank, world):
    """selftest with all_gather_matmul's ``ring`` broken on purpose."""
    real_get = schedules.get
    broken = Broken(real_get("ring", op="all_gather_matmul"))

    def get(name, op="all_gather_matmul"):
        found = real_get(name, op=op)
        return broken if (found.name, op) == ("ring", "all_gather_matmul") else found

    schedules.get = get
    try:
        return quick(rank, world, options=Options(
            shapes=("tiny",), dtypes=("float32",), ops=("all_gather_matmul",), fault=False))
    finally:
        schedules.get = real_get
        ficco.shutdown()


def hangs(rank, world):
    """selftest where rank 1's first call never returns: the watch ends it (exit 3)."""
    import time

    real = ficco.all_gather_matmul
    if rank == 1:
        ficco.all_gather_matmul = lambda *a, **k: time.sleep(3600)
    try:
        return quick(rank, world, options=Options(
            shapes=("tiny",), dtypes=("float32",), ops=("all_gather_matmul",), fault=False,
            bound_s=3.0))
    finally:
        ficco.all_gather_matmul = real


def slow_pick(rank, world):
    """selftest's timing row where the default path (the selector's pick) is planted slower
    than serial: every default call sleeps 20 ms more."""
    import time

    real = ficco.all_gather_matmul

    def slower(*args, schedule=None, **kwargs):
        if schedule is None:
            time.sleep(0.02)
        return real(*args, schedule=schedule, **kwargs)

    ficco.all_gather_matmul = slower
    try:
        return quick(rank, world, options=Options(
            shapes=(), dtypes=("float32",), ops=("all_gather_matmul",), fault=False,
            graph=False, timing_shape=(32, 32, 32)))
    finally:
        ficco.all_gather_matmul = real
