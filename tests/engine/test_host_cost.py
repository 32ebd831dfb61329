"""What a call costs the host: the coalesced steps a warm call runs (ficco.executor.lowering.coalesce)
keep every dependency the plan states, never batch copies that touch each other's memory, and
make the runtime calls per W = 8 call (python -m ficco.bench overhead's ``ops`` column) fit the
budget; the CUDA vendor submits a step's copies in one call with either signature of
``cudaMemcpyBatchAsync`` the bindings have had (12.8-12.9: status and failIdx; 13: the status)
and one call per copy without it."""
from __future__ import annotations

import pytest

from ficco import schedules
from ficco.bench import overhead
from ficco.executor.compiler import compile_plan
from ficco.executor.lowering import COPIES, COPY, COPY_2D, RECORD, SIGNALS, WAIT, coalesce
from ficco.plan import Block, Copy, PlanBuilder, Record, Wait
from ficco.plan.problem import Problem

DENSE = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
EXPERT = ("all_to_all_grouped_mm", "grouped_mm_all_to_all")
ULYSSES = ("matmul_all_to_all", "all_to_all_matmul")


def _plans(world: int, ops=DENSE):
    for op in ops:
        p = overhead.problem_of(op, rank=min(3, world - 1), world=world)
        for name in overhead.schedule_names(op):
            yield op, name, schedules.get(name, op=op).plan(p, "dma", None)


def _clocks(steps, stands, queues: int) -> dict[int, tuple[int, list]]:
    """For every plan op a step runs: (its queue, the vector clock of its step): op a happens
    before op b iff clock_b[queue_a] >= clock_a[queue_a]."""
    pos, clock, recorded, out = [0] * queues, [[0] * queues for _ in range(queues)], {}, {}
    for step, ops in zip(steps, stands):
        code, q = step[0], step[1]
        if code == WAIT:
            clock[q] = [max(a, b) for a, b in zip(clock[q], recorded[step[2]])]
        elif code == RECORD:
            recorded[step[2]] = list(clock[q])
        else:
            pos[q] += 1
            clock[q][q] = pos[q]
            for op in ops:
                out[op] = (q, list(clock[q]))
    return out


@pytest.mark.parametrize("merge", [False, True], ids=["one-by-one", "batched"])
@pytest.mark.parametrize("world", [2, 8])
def test_coalesced_steps_keep_every_wait_the_plan_states(world, merge):
    """For every wait of every plan (dense ops, every schedule, gated included): the op whose
    record it waits for still happens before the next op of the waiting queue, in the
    coalesced steps (vector clocks over the queues, copy queues merged when batching); every
    plan op runs in exactly one coalesced step, and a step of several copies holds copies
    only."""
    for op, name, plan in _plans(world):
        v = compile_plan(plan).variants["batched" if merge else "lean"]
        ran = sorted(i for ops in v.stands for i in ops)
        assert ran == [i for i, o in enumerate(plan.ops) if not isinstance(o, (Record, Wait))]
        for step, ops in zip(v.steps, v.stands):
            if step[0] == COPIES:
                assert all(isinstance(plan.ops[i], Copy) for i in ops), (op, name, step)
            elif step[0] == SIGNALS:
                assert len(ops) == len(step[2]) > 1
            elif step[0] not in (RECORD, WAIT, COPY, COPY_2D):
                assert len(ops) == 1
        clocks = _clocks(v.steps, v.stands, len(plan.queues))
        recorder: dict[int, int] = {}
        last_on: dict[str, int] = {}
        waited = 0
        for i, o in enumerate(plan.ops):
            if isinstance(o, Record):
                recorder[o.event] = last_on[o.queue]
            elif isinstance(o, Wait):
                after = next((j for j in range(i + 1, len(plan.ops)) if not isinstance(
                    plan.ops[j], (Record, Wait)) and plan.ops[j].queue == o.queue), None)
                if after is None:
                    continue     # nothing after it on its queue: the call's end joins all
                qa, ca = clocks[recorder[o.event]]
                assert clocks[after][1][qa] >= ca[qa], \
                    (op, name, f"plan op {after} may run before plan op {recorder[o.event]}")
                waited += 1
            else:
                last_on[o.queue] = i
        assert waited or plan.num_events == 0, (op, name)


def test_a_copy_that_reads_what_the_batch_writes_waits_for_it():
    """Copies of one queue that touch each other's memory are never one batch (a batch's
    copies run in any order): the second copy reads the rows the first writes."""
    p = Problem(m=4, k=8, ns=(3,), dtype="float32", world=2, rank=0)
    b = PlanBuilder("test", "dma", p)
    b.add(Copy("copy0", Block("input", 0, 4, 0, 8), Block("gathered", 0, 4, 0, 8)))
    b.add(Copy("copy0", Block("gathered", 0, 4, 0, 8), Block("gathered", 4, 4, 0, 8)))
    b.add(Copy("copy0", Block("gathered", 0, 4, 0, 8, peer=1), Block("out", 0, 4, 0, 3)))
    plan = b.build()
    from ficco.executor.lowering import lower_slots

    for merge in (False, True):
        s, steps, _ = lower_slots(plan)
        lean = coalesce(plan, s, steps, merge)[0]
        assert [st[0] for st in lean] == [COPY, COPIES]
        assert lean[1][2][0][:2] == steps[1][2:4]


@pytest.mark.parametrize("op", DENSE + EXPERT + ULYSSES)
def test_runtime_calls_per_w8_call_fit_the_budget(op):
    """The ops column of bench overhead at W = 8 (runtime calls of one warm call with batched
    copy submission): serial, and the rings of the all-gather and the expert dispatch, <= 24;
    the fused
    FiCCO schedules and the gated ones <= 80; every other <= 160; batching never adds a call.
    Before coalescing, W = 8 serial made 61, the fused FiCCO all-gathers 214-223 (their plans:
    192-201 ops); the all-gather's rings and the dispatch's made 36 while one queue pulled for
    the compute queue; the expert ops' fused schedules made 87-95 and their unfused dispatch
    232-239 while each pull was a host task of its own. (The reduce-scatter's rings and the
    combine's are over the rings' 24, docs/host_cost.md says why: held to 160 here.)"""
    for _, name, plan in _plans(8, (op,)):
        calls = overhead.calls_per_call(plan)
        one_by_one = overhead.calls_per_call(plan, batches=False)
        assert calls <= one_by_one, (op, name, calls, one_by_one)
        if name == "serial" or op in ("all_gather_matmul", "all_to_all_grouped_mm") and \
                name.startswith("ring"):
            assert calls <= 24, (op, name, calls)
        elif op != "matmul_all_reduce" and ("-fused-" in name or name.startswith("gated")):
            assert calls <= 80, (op, name, calls)
        else:
            assert calls <= 160, (op, name, calls)


# -- the CUDA vendor's batched copies ------------------------------------------------------------
class BatchRuntime:
    """cuda.bindings.runtime with a driver of ``version`` and cudaMemcpyBatchAsync returning
    ``batch_result`` (12.8-12.9 bindings: (status, failIdx); 13: (status,)); records calls."""

    def __init__(self, real, version, batch_result, has_batch=True):
        self._real, self.calls = real, []
        self._version, self._batch_result, self._has_batch = version, batch_result, has_batch

    def __getattr__(self, name):
        if name in ("cudaMemcpyBatchAsync", "cudaMemcpy3DBatchAsync") and not self._has_batch:
            raise AttributeError(name)
        attr = getattr(self._real, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        def record(*args):
            self.calls.append((name, args))
            if name == "cudaDriverGetVersion":
                return (0, self._version)
            if name == "cudaMemcpyBatchAsync":
                return self._batch_result
            return (0,)
        return record


@pytest.mark.parametrize("result", [(0, 0), (0,)], ids=["12.8-failIdx", "13-status"])
def test_cuda_vendor_submits_a_batch_in_one_call(result):
    from cuda.bindings import driver, runtime

    from ficco.backends.cuda import CudaVendor
    from ficco.backends.gpu.vendor import Copy2D

    from .test_backend_cuda import Recorder, signature_params

    rt = BatchRuntime(runtime, 12080, result)
    vendor = CudaVendor(runtime=rt, driver=Recorder(driver))
    assert vendor.batches_copies
    vendor.copy_batch([0x1000, 0x2000], [0x5000, 0x6000], [64, 128], 77)
    copies = [Copy2D(0x1000, 256, 0x8000, 512, 64, 3), Copy2D(0x9000, 256, 0xA000, 512, 32, 2)]
    vendor.copy_batch_2d(copies, 77)
    vendor.copy_batch_2d(copies, 77)
    calls = [(n, a) for n, a in rt.calls if n != "cudaDriverGetVersion"]
    assert [n for n, _ in calls] == ["cudaMemcpyBatchAsync"] + ["cudaMemcpy3DBatchAsync"] * 2
    args = calls[0][1]
    assert len(args) == len(signature_params(runtime.cudaMemcpyBatchAsync))
    dsts, srcs, sizes, count, attrs, idxs, nattrs, stream = args
    assert (dsts, srcs, sizes, count, idxs, nattrs, stream) == \
        ([0x1000, 0x2000], [0x5000, 0x6000], [64, 128], 2, [0], 1, 77)
    assert attrs[0].srcAccessOrder == runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    n3, ops, flags, stream = calls[1][1]
    assert len(calls[1][1]) == len(signature_params(runtime.cudaMemcpy3DBatchAsync))
    assert (n3, flags, stream) == (2, 0, 77) and calls[2][1][1] is ops   # built once
    for op, args in zip(ops, copies):
        assert (op.src.op.ptr.ptr, op.src.op.ptr.rowLength, op.dst.op.ptr.ptr,
                op.dst.op.ptr.rowLength) == (args.src, args.spitch, args.dst, args.dpitch)
        assert (op.extent.width, op.extent.height, op.extent.depth) == \
            (args.width, args.height, 1)


@pytest.mark.parametrize("version,has_batch", [(12060, True), (13000, False)],
                         ids=["driver-12.6", "bindings-without-it"])
def test_cuda_vendor_without_batch_copies_one_call_each(version, has_batch):
    from cuda.bindings import driver, runtime

    from ficco.backends.cuda import CudaVendor

    from .test_backend_cuda import Recorder

    rt = BatchRuntime(runtime, version, (0,), has_batch)
    vendor = CudaVendor(runtime=rt, driver=Recorder(driver))
    assert not vendor.batches_copies
    vendor.copy_batch([0x1000, 0x2000], [0x5000, 0x6000], [64, 128], 77)
    assert [a for n, a in rt.calls if n == "cudaMemcpyAsync"] == [
        (0x1000, 0x5000, 64, runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice, 77),
        (0x2000, 0x6000, 128, runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice, 77)]


# -- the fake GPU: every schedule right with batched copies, and its commands per warm call ------
def test_schedules_are_right_on_the_fake_gpu_and_batching_takes_fewer_commands():
    """Three ranks on the fake GPU, copies one call each, then batched (copy queues merged,
    each batch's copies run in reverse order): a schedule of each kind of both dense ops
    matches float64 on every rank either way, and a warm call with batching submits no more device
    commands than without (fewer for serial and the FiCCO schedules: their copies of a step
    go to several peers at once). The expert ops too: their pulls are sized from the routing
    at launch and submitted as copies (one submission per step when batched); dispatch and
    the combine of its result match float64 on fresh uneven routings either way, and
    batching takes fewer commands."""
    import random

    import torch

    from .. import harness, host_cost_cases
    from ..reference import ROW_TOL

    seed = random.randrange(1 << 30)
    # one schedule of each kind (every schedule runs batched in test_executor, in one process)
    chosen = {"all_gather_matmul": ["serial", "ring", "uniform-fused-1d", "hetero-unfused-2d"],
              "matmul_reduce_scatter": ["serial", "ring-bidir", "uniform-fused-2d",
                                        "hetero-unfused-1d"]}
    experts = ["uniform-fused-2d", "hetero-unfused-1d"]
    both = [harness.pool(3).run(host_cost_cases.fake_gpu_calls, seed, batch, chosen, experts,
                                timeout_s=300) for batch in (False, True)]
    runs = [[dense for dense, _ in run] for run in both]
    for found in (f for run in runs for f in run):
        for key, (err, _) in found.items():
            assert err <= ROW_TOL[torch.float32], (seed, key, err)
    for rank in range(3):
        for key, (_, plain) in runs[0][rank].items():
            batched = runs[1][rank][key][1]
            assert batched <= plain, (rank, key, batched, plain)
            if key[1] == "serial" or key[1].startswith(("uniform", "hetero")):
                assert batched < plain, (rank, key, batched, plain)
    for run in both:
        for _, found in run:
            for name, (err_y, err_z, recv_right, _, _) in found.items():
                assert recv_right and err_y <= ROW_TOL[torch.float32] and \
                    err_z <= 2 * ROW_TOL[torch.float32], (seed, name, err_y, err_z)
    for rank in range(3):
        for name in experts:
            plain, batched = both[0][rank][1][name][3:], both[1][rank][1][name][3:]
            assert batched[0] < plain[0] and batched[1] < plain[1], (rank, name, plain, batched)


def test_warmup_makes_the_first_sight_so_the_real_calls_do_not_measure(tmp_path):
    """Two CPU ranks: ``ficco.warmup`` of two shapes measures auto's shortlist for each
    (fresh cache), and the real calls of those shapes that follow, with fresh data, time
    nothing and match float64."""
    import random

    import torch

    from .. import harness, host_cost_cases
    from ..reference import ROW_TOL

    seed = random.randrange(1 << 30)
    results = harness.pool(2).run(host_cost_cases.warmup_then_calls, seed, str(tmp_path),
                                  timeout_s=300)
    for ran, in_warmup, in_calls, errors in results:
        assert len(ran) == 2 and all(r is not None and r[0] in schedules.names() for r in ran)
        assert in_warmup >= 1 and in_calls == 0, (seed, in_warmup, in_calls)
        assert all(e <= ROW_TOL[torch.float32] for e in errors), (seed, errors)
    assert results[0][0] == results[1][0]    # the ranks ran the same schedules


def test_warmup_refuses_what_it_cannot_warm():
    import ficco
    from ficco.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="warmup takes"):
        ficco.warmup("all_to_all_grouped_mm", [(4, 8, 8)])
    with pytest.raises(InvalidArgumentError, match=r"\(rows, K, n\)"):
        ficco.warmup("all_gather_matmul", [(4, 8)])


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])
def test_the_simulator_prices_host_time_per_runtime_call(batched):
    """The simulator issues a plan as the executor's coalesced steps issue it: the runtime
    calls it counts per warm call are the null backend's (bench overhead's ``ops`` and
    ``1-by-1``) for a schedule of each kind of the dense ops at W = 8, and with a host time per call
    far above the ops' own, the predicted makespan is the last call's issue time (it was
    one host_op_s per plan op, events included: 192 for a W = 8 fused FiCCO all-gather that
    makes 39 calls)."""
    import dataclasses

    from ficco.heuristics import profiles, simulator

    host_s = 10.0
    prof = dataclasses.replace(profiles.load("h100"), host_op_s=host_s, batched_copies=batched)
    kinds = ("serial", "ring", "ring-bidir", "uniform-fused-1d", "hetero-unfused-2d", "gated-2d",
             "rs-ag-ring", "chunked-4", "two-shot-sm", "one-shot-kernel")
    for op, name, plan in _plans(8):
        if name not in kinds:
            continue
        issued, total = compile_plan(plan).issue_calls(batched)
        assert total == overhead.calls_per_call(plan, batched), (op, name, batched)
        makespan = simulator.simulate(plan, prof).makespan_s
        assert max(issued) * host_s <= makespan < max(issued) * host_s + 1.0, \
            (op, name, makespan / host_s, max(issued), len(plan.ops))
