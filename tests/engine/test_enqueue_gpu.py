"""The GPU backend's enqueue path without a GPU: ``GpuBackend`` itself (queues, reused events,
prepared copies, compute-stream GEMMs, the join in ``finish``) with ``torch.cuda``'s streams and
events replaced by recorders and a vendor whose copies move the bytes at the integer addresses
the backend computed (``ctypes.memmove``, row by row for 2-D copies), at once.

Every tensor is a CPU tensor, so GEMMs and reductions compute for real; work runs the moment
it is enqueued, which is a valid order because a plan records every event before any queue
waits on it (the property CUDA needs as well: a wait on a not yet recorded event waits for
nothing). One process plays rank RANK; peers are other tensors and barriers pass.
"""
from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch

from ficco import schedules
from ficco.backends.gpu import GpuBackend
from ficco.backends.gpu.vendor import Copy2D, Vendor
from ficco.executor import execute
from ficco.plan.buffers import Buffers
from ficco.plan.problem import Problem

WORLD, RANK, K, NS = 4, 1, 12, (7, 3)


class Recorder:
    def __init__(self):
        self.current = 0        # torch.cuda.current_stream lookups
        self.switches = 0       # torch.cuda.stream(...) contexts entered
        self.events = 0         # torch.cuda.Event objects made
        self.copies: list = []  # (kind, args, stream) of every vendor copy
        self.prepared = 0       # copies whose vendor arguments were computed
        self.marks: list = []   # ("record" | "wait", event, stream handle) in enqueue order


class FakeStream:
    made = 0

    def __init__(self, device=None):
        FakeStream.made += 1
        self.cuda_stream = 0x1000 + FakeStream.made

    def wait_event(self, event):
        event.wait(self)     # as torch.cuda.Stream.wait_event does

    def __eq__(self, other):
        return isinstance(other, FakeStream) and other.cuda_stream == self.cuda_stream

    def __hash__(self):
        return self.cuda_stream


def _vendor_class(rec: Recorder):
    def refuse(self, *args, **kwargs):
        raise NotImplementedError("not part of the enqueue path")

    def copy_1d(self, dst, src, nbytes, stream):
        rec.copies.append(("1d", (dst, src, nbytes), stream))
        ctypes.memmove(dst, src, nbytes)

    def copy_2d(self, args, stream):
        assert isinstance(args, Copy2D)
        rec.copies.append(("2d", tuple(args), stream))
        for row in range(args.height):
            ctypes.memmove(args.dst + row * args.dpitch, args.src + row * args.spitch,
                           args.width)

    body = {name: refuse for name in Vendor.__abstractmethods__}
    body.update(name="fake", copy_1d=copy_1d, copy_2d=copy_2d,
                _describe=lambda self, status: str(status),
                bind_device=lambda self, index: None, relax_capture_mode=lambda self: None)
    return type("FakeVendor", (Vendor,), body)


@pytest.fixture()
def gpu(monkeypatch):
    """(backend, recorder): a GpuBackend over recorders, torch.cuda patched for the test."""
    rec = Recorder()
    compute = FakeStream()

    class FakeEvent:
        def __init__(self, enable_timing=False, **kwargs):
            rec.events += 1

        def record(self, stream=None):
            rec.marks.append(("record", self, stream.cuda_stream))

        def wait(self, stream=None):
            rec.marks.append(("wait", self, stream.cuda_stream))

        def query(self):
            return True

    def current_stream(device=None):
        rec.current += 1
        return compute

    @contextlib.contextmanager
    def stream(s):
        rec.switches += 1
        yield

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    vendor_class = _vendor_class(rec)

    class FakeGpuBackend(GpuBackend):
        name = "fakegpu"
        make_vendor = vendor_class

        @classmethod
        def unavailable_reason(cls):
            return None

        def target(self):
            return "fakegpu"

        def signal_batch(self, queue, ops, deadline):
            pass   # the peers are pretend: every barrier passes (barriers: test_symm_mem)

        def prepare_copy(self, dst, src, two_d=False):
            rec.prepared += 1
            return super().prepare_copy(dst, src, two_d)

    backend = FakeGpuBackend("cuda:0")
    yield backend, rec
    backend.close()


class Handle:
    """Symmetric memory of a pretend group: one tensor per rank, NaN until written."""

    def __init__(self, numel):
        self.rank, self.world, self.nbytes = RANK, WORLD, numel * 4
        self.data = [torch.full((numel,), float("nan")) for _ in range(WORLD)]
        self._programs = {}

    def get_buffer(self, rank, shape, dtype, offset=0):
        start = offset // 4
        return self.data[rank][start: start + shape[0] * shape[1]].view(tuple(shape))

    def slot(self, owner, channel, writer):
        return 0x10 * owner + 4 * (channel * WORLD + writer)


def _ag_call(plan, backend, handle, a=None):
    """One all-gather call with fresh data; ``a``: the input tensor to use (else a new one)."""
    p = plan.problem
    shards = [torch.randn(p.m, K) for _ in range(WORLD)]
    a = shards[RANK].clone() if a is None else a.copy_(shards[RANK])
    for r in range(WORLD):
        if r != RANK:
            handle.get_buffer(r, (p.big_m, K), torch.float32)[r * p.m:(r + 1) * p.m] = shards[r]
    bs = [torch.randn(K, n) for n in p.ns]
    outs = [torch.full((p.big_m, n), float("nan")) for n in p.ns]
    gathered = handle.get_buffer(RANK, (p.big_m, K), torch.float32)
    execute(plan, backend, Buffers(a, bs, outs, gathered, handle, None), timeout_s=10.0)
    full = torch.cat(shards).double()
    torch.testing.assert_close(gathered.double(), full, rtol=0, atol=0)
    for out, b in zip(outs, bs):
        torch.testing.assert_close(out.double(), full @ b.double(), rtol=1e-5, atol=1e-4)


def _rs_call(plan, backend, handle):
    p = plan.problem
    a_s = [torch.randn(p.m, K) for _ in range(WORLD)]
    b_s = [[torch.randn(K, n) for n in p.ns] for _ in range(WORLD)]
    offsets = [0, p.m * p.ns[0] * 4]
    for q in range(WORLD):
        if q != RANK:
            for j, n in enumerate(p.ns):
                handle.get_buffer(q, (p.m, n), torch.float32, offsets[j]).copy_(
                    a_s[q] @ b_s[q][j])
    partials = [handle.get_buffer(RANK, (p.m, n), torch.float32, off)
                for n, off in zip(p.ns, offsets)]
    outs = [torch.full((p.block_rows, n), float("nan")) for n in p.ns]
    recvs = [torch.full((WORLD * p.block_rows, n), float("nan")) for n in p.ns]
    execute(plan, backend, Buffers(a_s[RANK].clone(), b_s[RANK], outs, None, handle, None,
                                   partials=partials, recvs=recvs,
                                   partial_offsets=tuple(offsets)), timeout_s=10.0)
    row0, rows = p.block(RANK)
    for j, out in enumerate(outs):
        ref = sum(a.double() @ b[j].double() for a, b in zip(a_s, b_s))[row0:row0 + rows]
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


AG = Problem(m=5, k=K, ns=NS, dtype="float32", world=WORLD, rank=RANK)
RS = Problem(m=13, k=K, ns=NS, dtype="float32", world=WORLD, rank=RANK,
             op="matmul_reduce_scatter")


@pytest.mark.parametrize("problem", [AG, RS], ids=["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("name", schedules.names())
def test_gpu_enqueue_path_matches_float64(problem, name, gpu):
    """Every schedule of both ops through GpuBackend's real enqueue code, three calls with
    fresh data, then a grown workspace (the old one NaN): results match float64, so every
    prepared address and 2-D pitch is right, also after the workspace moved."""
    backend, rec = gpu
    plan = schedules.get(name, op=problem.op).plan(problem, "dma", None)
    run = _rs_call if problem.reduces else _ag_call
    numel = problem.m * sum(problem.ns) if problem.reduces else problem.big_m * K
    handle = Handle(numel)
    for _ in range(3):
        run(plan, backend, handle)
    assert rec.copies   # the vendor moved the bytes
    grown = Handle(2 * numel)
    for t in handle.data:
        t.fill_(float("nan"))
    for _ in range(2):
        run(plan, backend, grown)


def test_repeat_calls_reuse_events_streams_and_prepared_copies(gpu):
    """A repeated call makes no event and no stream, looks the current stream up a fixed
    number of times whatever its GEMM count, enters no stream context for compute GEMMs, and
    issues the same vendor copies as the first call (prepared once)."""
    backend, rec = gpu
    handle, a = Handle(AG.big_m * K), torch.empty(AG.m, K)
    lookups = {}
    for name in ("serial", "uniform-unfused-1d"):   # 1 GEMM vs 32 GEMMs per call
        plan = schedules.get(name).plan(AG, "dma", None)
        _ag_call(plan, backend, handle, a)
        events, streams, current, switches, prepared = rec.events, FakeStream.made, \
            rec.current, rec.switches, rec.prepared
        rec.copies.clear()
        _ag_call(plan, backend, handle, a)
        first = list(rec.copies)
        rec.copies.clear()
        _ag_call(plan, backend, handle, a)
        assert rec.copies == first            # same addresses, same streams
        assert (rec.events, FakeStream.made, rec.prepared) == (events, streams, prepared)
        assert rec.switches == switches       # all-gather GEMMs run on the compute stream
        lookups[name] = (rec.current - current) / 2
    assert lookups["serial"] == lookups["uniform-unfused-1d"] <= 2
    # reduce-scatter: its reductions (host tasks on the compute queue) look nothing up either
    plan = schedules.get("ring", op=RS.op).plan(RS, "dma", None)
    rs_handle = Handle(RS.m * sum(RS.ns))
    _rs_call(plan, backend, rs_handle)
    current, switches = rec.current, rec.switches
    _rs_call(plan, backend, rs_handle)
    assert (rec.current - current, rec.switches - switches) == (2, 0)


@pytest.mark.parametrize("problem,name", [(AG, "uniform-fused-1d"), (AG, "hetero-unfused-2d"),
                                          (RS, "ring"), (RS, "uniform-fused-2d")])
def test_every_record_and_wait_lands_on_its_event_and_stream(problem, name, gpu):
    """The records and waits a call runs (the plan's, less those that order nothing new:
    :func:`ficco.executor.lowering.coalesce`), bound once per plan as the events' own calls:
    in every call, first or repeated, each one reaches its event on its op's stream, in
    order."""
    from ficco.executor.compiler import compile_plan
    from ficco.executor.lowering import RECORD, WAIT

    backend, rec = gpu
    plan = schedules.get(name, op=problem.op).plan(problem, "dma", None)
    run = _rs_call if problem.reduces else _ag_call
    handle = Handle(problem.m * sum(problem.ns) if problem.reduces else problem.big_m * K)
    events = backend.plan_events(compile_plan(plan), plan.num_events + 1)
    index = {id(e): i for i, e in enumerate(events[:-1])}   # the last is the entry event
    streams = [q.cuda_stream for q in backend.queues(plan.queues)]
    steps = compile_plan(plan).variant(backend).steps
    want = [("record" if step[0] == RECORD else "wait", step[2], streams[step[1]])
            for step in steps if step[0] in (RECORD, WAIT)]
    assert want
    for _ in range(3):
        rec.marks.clear()
        run(plan, backend, handle)
        got = [(kind, index[id(e)], stream) for kind, e, stream in rec.marks if id(e) in index]
        assert got == want


def test_finish_joins_each_side_stream_once_with_a_reused_event(gpu, monkeypatch):
    backend, rec = gpu
    waited = []
    monkeypatch.setattr(FakeStream, "wait_event", lambda self, ev: waited.append((self, ev)))
    queues = backend.queues(["compute", "copy0", "copy1", "copy0"])
    backend.finish(queues)
    first = list(waited)
    assert [s for s, _ in first] == [queues[0]] * 2   # copy0 and copy1, the compute stream once
    made = rec.events
    backend.finish(queues)
    assert waited[2:] == first and rec.events == made


# -- the loopback handle of python -m ficco.bench overhead --gpu ----------------------------------
def _bench_module():
    from ficco.bench import overhead

    return overhead


class PadHandle(Handle):
    """Handle with real CPU signal pads: slot = (pad of owner, channel * W + writer)."""

    def __init__(self, numel):
        super().__init__(numel)
        self.pads = [torch.zeros(4 * WORLD, dtype=torch.int32) for _ in range(WORLD)]

    def slot(self, owner, channel, writer):
        return (self.pads[owner], channel * WORLD + writer)


@pytest.mark.parametrize("name", ["ring", "uniform-fused-2d", "hetero-unfused-1d"])
def test_bench_loopback_handle_passes_every_barrier(name):
    """The GPU benchmark's pretend group: every barrier of a reduce-scatter plan (several per
    call on each channel) passes through the real barrier protocol on the CPU backend, with
    the loopback slots, and the result still matches float64; without the loopback the first
    barrier waits for peers that never come."""
    from ficco.backends.cpu import CpuBackend

    loopback = _bench_module().Loopback
    plan = schedules.get(name, op=RS.op).plan(RS, "dma", None)
    backend = CpuBackend()
    try:
        handle = loopback(PadHandle(RS.m * sum(RS.ns)))
        for _ in range(2):
            _rs_call(plan, backend, handle)
        assert all(int(v) == 0 for pad in handle.pads for v in pad)   # every flag cleared
    finally:
        backend.close()
