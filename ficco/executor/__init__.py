"""Runs a :class:`~ficco.plan.Plan` (either op) on a backend: the call's tensors
(:class:`Buffers`), the plan compiled once and bound to this backend and workspace
(:mod:`ficco.executor.compiler`), each step turned into a backend call on its queue, and the queues
joined at the end. Shared by every backend; nothing here is vendor specific. Reductions and
collectives are host tasks (:mod:`ficco.plan.tasks`) launched in their queue's order (on GPUs
they enqueue torch kernels on that stream).
"""
from __future__ import annotations

import torch

from .. import profiling
from ..errors import error_context, known_context, name_step
from ..kernels.launch import gated_task, raise_flag, raise_flags
from ..plan import Plan, op_label
from ..plan.buffers import Buffers
from ..symm_mem.barrier import plan_barrier
from .compiler import CompiledPlan, compile_plan
from .lowering import (
    BARRIER,
    CALL,
    COPIES,
    COPY,
    COPY_2D,
    GATED,
    GEMM,
    GEMM_HERE,
    LAUNCH,
    LAUNCH_HERE,
    MOVES,
    RECORD,
    SIGNAL,
    SIGNALS,
    WAIT,
)

__all__ = ["Buffers", "CompiledPlan", "compile_plan", "execute"]


# -- running -------------------------------------------------------------------------------------
def execute(plan: Plan | CompiledPlan, backend, buffers: Buffers, *, timeout_s: float,
            trace: bool = False, lane=None, profiled: bool | None = None) -> list[dict] | None:
    """Enqueue every op of ``plan`` (or its compiled form) on ``lane``'s queues (a session's,
    ``Backend.lane``; None: the backend's shared ones) and join them (``backend.finish``).
    With ``trace``, returns per-op rows {op_index, queue, start_s, end_s, kind, label} of this
    rank. ``profiled``: whether torch.profiler records (the caller asked already; None: ask).

    >>> import torch
    >>> from ficco import schedules
    >>> from ficco.backends.cpu import CpuBackend
    >>> from ficco.plan.problem import Problem
    >>> p = Problem(m=4, k=8, ns=(3,), dtype="float32", world=1, rank=0)
    >>> plan = schedules.get("serial").plan(p, "ccl")
    >>> a, b = torch.randn(4, 8), torch.randn(8, 3)
    >>> out, g = torch.empty(4, 3), torch.empty(4, 8)
    >>> execute(plan, CpuBackend(), Buffers(a, [b], [out], g), timeout_s=10.0)
    >>> torch.allclose(out, a @ b)
    True
    """
    compiled = plan if isinstance(plan, CompiledPlan) else compile_plan(plan)
    plan = compiled.plan
    queues = backend.queues(compiled.queue_names, lane)
    # plan.num_events events and the entry event; GPUs reuse theirs per compiled plan.
    events = backend.plan_events(compiled, plan.num_events + 1)
    entry = events[-1]   # (the same list every call on GPUs: it keys the binding)
    # traces and profiler ranges run per step (profiling: compiled.steps): every view made
    if profiled is None:
        profiled = profiling.recording()
    variant = compiled.variant(backend, trace or profiled)
    steps, views = compiled.bind(backend, buffers, events, every_view=trace or profiled,
                                 variant=variant)
    if compiled.num_flags:   # zeroed on the compute queue, before the side queues start
        buffers.flags = torch.zeros(compiled.num_flags, dtype=torch.int32,
                                    device=buffers.a.device)
    # Side queues start after everything the caller queued before this call (the input may
    # still be being written on the caller's stream): those whose first steps do not wait for
    # a record of the compute queue wait for the entry record.
    if variant.entry_waits:
        backend.record(entry, queues[compiled.compute])
        for i in variant.entry_waits:
            backend.wait(entry, queues[i])
    if len(variant.used) < len(queues):   # coalesced onto fewer queues: join only those
        queues_used = [queues[i] for i in variant.used]
    else:
        queues_used = queues
    try:
        if trace:
            return _run_traced(compiled, steps, backend, buffers, queues, events, views,
                               timeout_s, lane)
        if profiled:   # named ranges for torch.profiler traces; off: one flag read
            profiling.run_with_ranges(compiled, lambda steps: _run(
                steps, backend, buffers, queues, events, views, timeout_s, lane),
                lambda op: op_label(op, plan.problem.rank))
        else:
            _run(steps, backend, buffers, queues, events, views, timeout_s, lane)
        backend.finish(queues_used, timeout_s)
    except BaseException as exc:
        _name_work_step(exc, compiled, variant.work, steps, views)
        backend.finish_failed(queues_used)   # what was queued still runs: order it (GPUs)
        raise
    finally:
        if backend.keeps_alive:
            backend.keep_alive(buffers)
    return None


def _name_work_step(exc: BaseException, compiled: CompiledPlan, numbered, steps,
                    views) -> None:
    """This rank's own work failed (a GEMM or copy): mark ``exc`` as such (its context's
    ``local``) and name its plan step, found by the step being enqueued (``at``, a backend
    that raised at once) or by the tensors the failed task held (``work``, a queue that ran
    it later). Error path only."""
    context = known_context(exc)
    at, work = context.at, context.work
    index = dict(numbered)   # step number -> plan op index, for the steps that ran
    for number, step in enumerate(steps):
        code, _, x, y, z, _ = step
        held: tuple
        if code in (GEMM, GEMM_HERE):
            held = (views[x], views[y], views[z])
        elif code in (COPY, COPY_2D, CALL, COPIES):
            held = (views[x], views[y]) if code in (COPY, COPY_2D) else ()
        else:
            continue
        found = step is at or (work is not None and len(held) == len(work) and all(
            h is t for h, t in zip(held, work)))
        if found and number in index:
            op = compiled.plan.ops[index[number]]
            error_context(exc).local = True
            name_step(exc, f"plan step {index[number]} "
                           f"({op_label(op, compiled.plan.problem.rank)}, queue {op.queue})")
            return


def _run(steps, backend, buffers, queues, events, v, timeout_s, lane=None) -> None:
    # The hot loop: locals only, one integer compare chain per step, commonest codes first.
    copy, copy_2d, gemm = backend.copy, backend.copy_2d, backend.gemm
    # only bound steps use GEMM_HERE / LAUNCH_HERE (backends with compute_on_current)
    gemm_here, launch_here = backend.gemm_current, backend.launch_current
    record, wait = backend.record, backend.wait
    prepares = backend.prepares_copies
    step = None
    try:
        for step in steps:
            code, q, x, y, z, w = step
            if code == WAIT:
                wait(events[x], queues[q])
            elif code == RECORD:
                record(events[x], queues[q])
            elif code == CALL:
                x(queues[q])          # a copy the backend prepared when the plan was bound
            elif code == GEMM_HERE:
                gemm_here(v[x], v[y], v[z], w)
            elif code == GEMM:
                gemm(v[x], v[y], v[z], w, queues[q])
            elif code == COPY:
                copy(v[x], v[y], queues[q])
            elif code == COPY_2D:
                copy_2d(v[x], v[y], queues[q])
            elif code == COPIES:     # a backend that does not prepare copies: one call each
                for dst, src, two_d in x:
                    (copy_2d if two_d else copy)(v[dst], v[src], queues[q])
            elif code == BARRIER:
                plan_barrier(backend, buffers.symm, x, queues[q], timeout_s, y)
            elif code == SIGNAL:
                raise_flag(backend, queues[q], buffers.flags, x)
            elif code == SIGNALS:
                raise_flags(backend, queues[q], buffers.flags, x)
            elif code == MOVES:       # copies sized at launch (HostOps with copy_pairs)
                if prepares:          # one submission (a batch where the backend batches)
                    backend.prepare_copies([(dst, src, False) for op in x
                                            for dst, src in op.copy_pairs(v, buffers, op)])(
                        queues[q])
                else:
                    for op in x:
                        task = op.host_task(v, buffers, op)
                        task.ficco_step = z
                        backend.launch(queues[q], task)
            elif code == GATED:
                backend.launch(queues[q], gated_task(backend, y[0], y[1], v[x[0]], v[x[1]],
                                                     v[x[2]], v[x[3]], buffers.flags,
                                                     timeout_s, buffers.symm, lane))
            else:   # LAUNCH or LAUNCH_HERE: a host task (a reduction, a collective)
                task = x(v, buffers, y)
                task.ficco_step = z      # the queue names it if the task fails or hangs
                if code == LAUNCH_HERE:
                    launch_here(task)
                else:
                    backend.launch(queues[q], task)
    except BaseException as exc:     # a backend that raised at once (a GPU launch)
        if step is not None and step[0] in (LAUNCH, LAUNCH_HERE, MOVES):
            name_step(exc, step[4])
        else:
            error_context(exc).at = step     # execute() names it (_name_work_step)
        raise


def _run_traced(compiled, steps, backend, buffers, queues, events, views,
                timeout_s, lane=None) -> list[dict]:
    ops, marks = compiled.plan.ops, []   # bound steps number like compiled.steps
    work = dict(compiled.work)
    for number, step in enumerate(steps):
        index = work.get(number)
        if index is None:
            _run((step,), backend, buffers, queues, events, views, timeout_s, lane)
            continue
        q = queues[step[1]]
        start = backend.new_event()
        backend.record(start, q)
        _run((step,), backend, buffers, queues, events, views, timeout_s, lane)
        end = backend.new_event()
        backend.record(end, q)
        marks.append((index, ops[index], start, end))
    backend.finish(queues)
    origin = marks[0][2] if marks else None
    rank = compiled.plan.problem.rank
    return [{"op_index": i, "queue": op.queue, "kind": op.kind, "label": op_label(op, rank),
             "start_s": backend.elapsed_s(origin, s), "end_s": backend.elapsed_s(origin, e)}
            for i, op, s, e in marks]

