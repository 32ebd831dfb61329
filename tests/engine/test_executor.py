"""The compiled executor: views equal to what plain slicing gives, results equal to a float64
reference through the real CPU backend on fresh data every call, cached workspace views that
follow the handle, copies prepared once per bound plan (as GPUs run them: integer addresses,
replayed byte by byte) that follow a grown workspace and moved per-call buffers, and tracing
that still times every work op.

One process plays rank ``RANK`` of a ``WORLD``-rank group: its "peers" are tensors of a stub
symmetric handle pre-filled with the other ranks' shards, and barriers pass at once, so every
dma schedule moves real bytes and multiplies real numbers without spawning ranks.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from ficco import schedules
from ficco.backends.cpu import CpuBackend
from ficco.backends.gpu.vendor import Copy2D, copy_call_args
from ficco.errors import InvalidArgumentError
from ficco.executor import compile_plan, execute
from ficco.plan import WORK_OPS
from ficco.plan.buffers import Buffers
from ficco.plan.problem import Problem

WORLD, RANK = 4, 1
M_SHARD, K, NS = 5, 12, (7, 3)     # uneven chunks on purpose (5 rows over 4 peers)


class StubHandle:
    """Symmetric memory of a pretend group: one tensor per rank, barriers that pass."""

    def __init__(self, world: int, numel: int, dtype=torch.float32):
        self.rank, self.world, self.nbytes = RANK, world, numel * 4
        self.data = [torch.full((numel,), float("nan"), dtype=dtype) for _ in range(world)]
        self._programs = {}   # barrier programs, cached by ficco.symm_mem.barrier

    def get_buffer(self, rank, shape, dtype, offset=0):
        return self.data[rank][: shape[0] * shape[1]].view(tuple(shape))

    def slot(self, owner, channel, writer):
        return (_RAISED, 0)   # the peers are pretend: every flag reads as raised

    def barrier(self, channel=2, timeout_s=None, step=None):
        pass


class _AlwaysRaised:
    """A signal pad whose slots always read 1 and ignore writes (CPU slots are (pad, index))."""

    def __getitem__(self, index):
        return 1

    def __setitem__(self, index, value):
        pass


_RAISED = _AlwaysRaised()


def _problem(m=M_SHARD):
    return Problem(m=m, k=K, ns=NS, dtype="float32", world=WORLD, rank=RANK)


def _dma_plan(name, problem):
    return schedules.get(name).plan(problem, "dma", None)


def _run_once(plan, backend, handle, *, trace=False):
    """Fresh random shards for every rank, placed as the peers would have published them; one
    call; returns (outputs, float64 reference, trace rows)."""
    p = plan.problem
    shards = [torch.randn(p.m, p.k) for _ in range(p.world)]
    for r, shard in enumerate(shards):
        if r != p.rank:
            handle.get_buffer(r, (p.big_m, p.k), torch.float32)[r * p.m:(r + 1) * p.m] = shard
    bs = [torch.randn(p.k, n) for n in p.ns]
    outs = [torch.full((p.big_m, n), float("nan")) for n in p.ns]
    gathered = handle.get_buffer(p.rank, (p.big_m, p.k), torch.float32)
    a = shards[p.rank].clone()
    rows = execute(plan, backend, Buffers(a, bs, outs, gathered, handle, None), timeout_s=10.0,
                   trace=trace)
    full = torch.cat(shards).double()
    # The gathered buffer the call was given holds the gathered matrix (return_gathered)
    torch.testing.assert_close(gathered.double(), full, rtol=0, atol=0)
    return outs, [full @ b.double() for b in bs], rows


def _assert_close(outs, refs):
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


class AddressBackend(CpuBackend):
    """The CPU backend driven the way the GPU backends are: every copy is prepared once per
    bound plan into integer addresses and copy arguments (the GPU layer's own
    ``copy_call_args``) and later replayed as raw byte moves on the copy queue's worker, and the
    compute queue's GEMMs come through ``gemm_current``. A prepared copy that outlived the
    memory it was made for moves bytes of an earlier call's buffers: results go wrong."""

    compute_on_current = prepares_copies = True

    def __init__(self):
        super().__init__()
        self.prepared = 0

    def prepare_copy(self, dst, src, two_d=False):
        self.prepared += 1
        args = copy_call_args(dst, src, two_d)
        if args is None:
            return lambda queue: None
        if isinstance(args, Copy2D):
            def move():
                for row in range(args.height):
                    ctypes.memmove(args.dst + row * args.dpitch, args.src + row * args.spitch,
                                   args.width)
        else:
            d, s, n = args

            def move():
                ctypes.memmove(d, s, n)
        return lambda queue: self.launch(queue, move)

    def gemm_current(self, a, b, out, accumulate):
        self.gemm(a, b, out, accumulate, self.queue("compute"))


class BatchingBackend(AddressBackend):
    """:class:`AddressBackend` that submits a queue's copies as one batch, the way a backend
    with ``cudaMemcpyBatchAsync`` does, so the executor merges the copy queues
    (:func:`ficco.executor.lowering.coalesce`). A batch's copies run in the reverse of their order
    (a batch promises none): copies that depend on each other in one batch give wrong
    results."""

    batches_copies = True

    def __init__(self):
        super().__init__()
        self.batches = 0

    def prepare_copies(self, pairs):
        self.batches += 1
        moves = [AddressBackend.prepare_copy(self, d, s, t) for d, s, t in pairs]
        return lambda queue: [move(queue) for move in reversed(moves)]


@pytest.fixture(scope="module", params=["cpu", "prepared", "batched"])
def backend(request):
    b = {"cpu": CpuBackend, "prepared": AddressBackend,
         "batched": BatchingBackend}[request.param]()
    yield b
    b.close()


def _reference_view(buffers: Buffers, source, spec):
    """What the first executor did for a slot: two-level slicing / its as_strided formula."""
    if source[0] == "b":
        t = buffers.bs[source[1]]
        _, k0, kc, c0, nc = spec
        return t[k0: k0 + kc, c0: c0 + nc]
    if source[0] in ("gathered", "partial"):
        _, index, peer = source
        t = buffers.local(source[0], index) if peer is None else \
            buffers.peer(peer, source[0], index)
    elif source[0] == "input":
        t = buffers.a
    elif source[0] == "out":
        t = buffers.outs[source[1]]
    else:
        t = buffers.recvs[source[1]]
    if spec[0] == "rect":
        _, r0, rows, c0, cols = spec
        return t[r0: r0 + rows, c0: c0 + cols]
    _, n, rows, cols, r0, c0, spacing = spec
    ld = t.stride(0)
    return t.as_strided((n, rows, cols), (spacing * ld, ld, 1), t.storage_offset() + r0 * ld + c0)


@pytest.mark.parametrize("name", schedules.names())
def test_every_view_is_what_slicing_gives(name):
    p = _problem()
    plan = _dma_plan(name, p)
    compiled = compile_plan(plan)
    handle = StubHandle(WORLD, p.big_m * p.k)
    # A transposed weight and an input with a row pitch: views must keep their strides.
    bs = [torch.randn(n, p.k).t() for n in p.ns]
    a = torch.randn(p.m, p.k + 3)[:, 2:2 + p.k]
    buffers = Buffers(a, bs, [torch.empty(p.big_m, n) for n in p.ns],
                      handle.get_buffer(RANK, (p.big_m, p.k), torch.float32), handle, None)
    views = compiled.views(buffers)
    assert len(views) == len(compiled.slots)
    for (source, spec), got in zip(compiled.slots, views):
        want = _reference_view(buffers, source, spec)
        assert (got.shape, got.stride(), got.data_ptr()) == \
            (want.shape, want.stride(), want.data_ptr()), (source, spec)


@pytest.mark.parametrize("name", schedules.names())
def test_repeated_calls_with_fresh_data_match_float64(name, backend):
    plan = _dma_plan(name, _problem())
    handle = StubHandle(WORLD, plan.problem.big_m * K)
    for _ in range(3):   # new input, weights and outputs each time; same workspace handle
        outs, refs, _ = _run_once(plan, backend, handle)
        _assert_close(outs, refs)
    assert compile_plan(plan)._binding is not None   # the workspace views were kept


def _grow_workspace_and_check(plan, backend, before_growth=lambda: None) -> None:
    """Run ``plan`` on a workspace handle, then on a grown one (a new handle, other addresses)
    twice, against float64. The old handle stays alive (its views are valid memory) but holds
    NaN, so a plan that kept its views or prepared addresses fails the comparison."""
    numel = plan.problem.big_m * K
    old = StubHandle(WORLD, numel)
    _assert_close(*_run_once(plan, backend, old)[:2])
    before_growth()
    new = StubHandle(WORLD, 2 * numel)
    for t in old.data:
        t.fill_(float("nan"))
    for _ in range(2):
        _assert_close(*_run_once(plan, backend, new)[:2])


@pytest.mark.parametrize("name", ["serial", "uniform-fused-1d", "hetero-fused-2d"])
def test_new_workspace_handle_drops_cached_views(name, backend):
    _grow_workspace_and_check(_dma_plan(name, _problem()), backend)


def test_dropped_handle_frees_cached_views(backend):
    plan = _dma_plan("ring", _problem())
    handle = StubHandle(WORLD, plan.problem.big_m * K)
    _run_once(plan, backend, handle)
    assert compile_plan(plan)._binding is not None
    del handle
    assert compile_plan(plan)._binding is None


def test_same_gathered_elsewhere_in_the_handle_is_not_reused(backend):
    # Same handle, but this call's gathered tensor starts at another offset: new views.
    plan = _dma_plan("uniform-unfused-1d", _problem())
    p = plan.problem
    handle = StubHandle(WORLD, 2 * p.big_m * K)
    _assert_close(*_run_once(plan, backend, handle)[:2])
    shifted = handle.data[RANK][p.big_m * K:].view(p.big_m, K)
    shards = [torch.randn(p.m, p.k) for _ in range(WORLD)]
    for r in range(WORLD):
        handle.get_buffer(r, (p.big_m, K), torch.float32)[r * p.m:(r + 1) * p.m] = shards[r]
    handle.data[RANK][: p.big_m * K].fill_(float("nan"))   # the old spot must not be used
    outs = [torch.empty(p.big_m, n) for n in p.ns]
    bs = [torch.randn(K, n) for n in p.ns]
    execute(plan, backend, Buffers(shards[RANK], bs, outs, shifted, handle, None), timeout_s=10.0)
    full = torch.cat(shards).double()
    torch.testing.assert_close(shifted.double(), full, rtol=0, atol=0)   # not the old spot
    _assert_close(outs, [full @ b.double() for b in bs])


@pytest.mark.parametrize("name", ["ring", "hetero-unfused-1d", "uniform-fused-2d"])
def test_trace_has_one_row_per_work_op(name, backend):
    plan = _dma_plan(name, _problem())
    handle = StubHandle(WORLD, plan.problem.big_m * K)
    outs, refs, rows = _run_once(plan, backend, handle, trace=True)
    _assert_close(outs, refs)
    work = [i for i, op in enumerate(plan.ops) if isinstance(op, WORK_OPS)]
    assert [r["op_index"] for r in rows] == work
    for r in rows:
        op = plan.ops[r["op_index"]]
        assert (r["queue"], r["kind"]) == (op.queue, op.kind)
        assert r["start_s"] <= r["end_s"]   # origin: the first op's start, on its own queue


def test_world_one_ccl_plan_runs_without_a_handle(backend):
    p = Problem(m=6, k=K, ns=(5,), dtype="float32", world=1, rank=0)
    plan = schedules.get("serial").plan(p, "ccl", None)
    for _ in range(2):
        a, b = torch.randn(6, K), torch.randn(K, 5)
        out = torch.full((6, 5), float("nan"))
        execute(plan, backend, Buffers(a, [b], [out], torch.empty(6, K)), timeout_s=10.0)
        torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-4)


def test_peer_read_without_symmetric_memory_is_refused(backend):
    p = _problem()
    plan = _dma_plan("ring", p)
    buffers = Buffers(torch.randn(p.m, K), [torch.randn(K, n) for n in p.ns],
                      [torch.empty(p.big_m, n) for n in p.ns], torch.empty(p.big_m, K))
    with pytest.raises(InvalidArgumentError, match="no symmetric memory"):
        execute(plan, backend, buffers, timeout_s=10.0)


# -- reduce-scatter plans: partial buffers at offsets, Reduce ops, column-sliced weights ---------
RS_NAMES = schedules.names(op="matmul_reduce_scatter")


def _rs_run_once(plan, backend, handle, recvs=None):
    """Rank RANK's reduce-scatter call with fresh data: the peers' partials (their a_q @ b_qj)
    are placed in their symmetric buffers as they would have computed them; returns
    (outputs, float64 references of this rank's block)."""
    from ficco.ops.matmul_reduce_scatter.spec import SPEC

    p = plan.problem
    a_s = [torch.randn(p.m, p.k) for _ in range(p.world)]
    b_s = [[torch.randn(p.k, n) for n in p.ns] for _ in range(p.world)]
    offsets, at = [], 0
    for n in p.ns:
        offsets.append(at)
        at += p.m * n * 4
    for q in range(p.world):
        if q != p.rank:
            for j, n in enumerate(p.ns):
                handle.get_buffer(q, (p.m, n), torch.float32, offsets[j]).copy_(a_s[q] @ b_s[q][j])
    outs = [torch.full((p.block_rows, n), float("nan")) for n in p.ns]
    if recvs is None:
        recvs = [torch.empty(p.world * p.block_rows, n) for n in p.ns]
    for t in recvs:
        t.fill_(float("nan"))
    partials = [handle.get_buffer(p.rank, (p.m, n), torch.float32, off)
                for n, off in zip(p.ns, offsets)]
    for t in partials:
        t.fill_(float("nan"))
    buffers = Buffers(a_s[p.rank].clone(), b_s[p.rank], outs, None, handle, None,
                      partials=partials, recvs=recvs, partial_offsets=tuple(offsets))
    execute(plan, backend, buffers, timeout_s=10.0)
    row0, rows = p.block(p.rank)
    refs = [sum(a.double() @ b[j].double() for a, b in zip(a_s, b_s))[row0:row0 + rows]
            for j in range(len(p.ns))]
    assert SPEC.name == p.op
    return outs, refs


class _OffsetStub(StubHandle):
    def get_buffer(self, rank, shape, dtype, offset=0):
        start = offset // 4
        return self.data[rank][start: start + shape[0] * shape[1]].view(tuple(shape))


@pytest.mark.parametrize("name", RS_NAMES)
def test_reduce_scatter_plans_match_float64(name, backend):
    p = Problem(m=13, k=K, ns=NS, dtype="float32", world=WORLD, rank=RANK,
                op="matmul_reduce_scatter", reduce_op="avg")
    plan = schedules.get(name, op=p.op).plan(p, "dma", None)
    handle = _OffsetStub(WORLD, p.m * sum(p.ns))
    for _ in range(2):   # fresh data each time, same workspace handle
        outs, refs = _rs_run_once(plan, backend, handle)
        _assert_close(outs, [r / WORLD for r in refs])


# -- prepared copies (the GPU path) follow the workspace and the per-call buffers -----------------
@pytest.fixture(params=["prepared", "batched"])
def prepared(request):
    b = AddressBackend() if request.param == "prepared" else BatchingBackend()
    yield b
    b.close()


def _copies_touching(plan, bufs) -> int:
    return sum(1 for op in plan.ops if op.kind.startswith("copy")
               and (op.src.buf in bufs or op.dst.buf in bufs))


@pytest.mark.parametrize("name", ["serial", "uniform-fused-1d", "hetero-unfused-2d"])
def test_prepared_copies_follow_a_grown_workspace(name, prepared):
    plan = _dma_plan(name, _problem())
    copies = sum(1 for op in plan.ops if op.kind.startswith("copy"))

    def prepared_once():
        assert prepared.prepared == copies
    _grow_workspace_and_check(plan, prepared, prepared_once)
    assert prepared.prepared >= 2 * copies   # everything prepared again for the new handle


@pytest.mark.parametrize("name", ["ring", "uniform-fused-1d", "hetero-unfused-2d"])
def test_reallocated_workspace_at_the_same_own_address(name, backend):
    """A new handle whose own buffer lands where the old one's was (the allocator reused it)
    but whose peers are mapped elsewhere: nothing kept from the old handle may be used."""
    plan = _dma_plan(name, _problem())
    numel = plan.problem.big_m * K
    old = StubHandle(WORLD, numel)
    _assert_close(*_run_once(plan, backend, old)[:2])
    new = StubHandle(WORLD, numel)
    new.data[RANK] = old.data[RANK]
    for r, t in enumerate(old.data):
        if r != RANK:
            t.fill_(float("nan"))
    _assert_close(*_run_once(plan, backend, new)[:2])


@pytest.mark.parametrize("name", ["ring", "uniform-unfused-1d", "hetero-fused-2d"])
def test_prepared_copies_of_the_input_follow_it(name, prepared):
    """The own shard's copy reads the caller's input: prepared again only when the input moved,
    kept when the same tensor comes back (with new contents)."""
    plan = _dma_plan(name, _problem())
    p = plan.problem
    handle = StubHandle(WORLD, p.big_m * K)
    gathered = handle.get_buffer(RANK, (p.big_m, K), torch.float32)
    a, alive = torch.empty(p.m, K), []
    for call, moved in enumerate((True, False, True, False)):
        if moved:
            alive.append(a)           # the old input stays alive: the new one lands elsewhere
            a = torch.empty(p.m, K)
        shards = [torch.randn(p.m, K) for _ in range(WORLD)]
        for r in range(WORLD):
            handle.get_buffer(r, (p.big_m, K), torch.float32)[r * p.m:(r + 1) * p.m] = shards[r]
        gathered.fill_(float("nan"))
        a.copy_(shards[RANK])
        bs = [torch.randn(K, n) for n in p.ns]
        outs = [torch.full((p.big_m, n), float("nan")) for n in p.ns]
        before = prepared.prepared
        execute(plan, prepared, Buffers(a, bs, outs, gathered, handle, None), timeout_s=10.0)
        full = torch.cat(shards).double()
        _assert_close(outs, [full @ b.double() for b in bs])
        if call:   # after the first call: only the copies that read a moved input again
            assert prepared.prepared - before == \
                (_copies_touching(plan, {"input"}) if moved else 0)


@pytest.mark.parametrize("name", ["serial", "uniform-fused-1d", "hetero-unfused-2d"])
def test_prepared_copies_into_moved_landing_buffers(name, prepared):
    """Reduce-scatter pulls land in per-call buffers: same address, reused; a new address (the
    old buffer still alive, holding NaN), prepared again. Results match float64 either way,
    also after the workspace grew."""
    p = Problem(m=13, k=K, ns=NS, dtype="float32", world=WORLD, rank=RANK,
                op="matmul_reduce_scatter")
    plan = schedules.get(name, op=p.op).plan(p, "dma", None)
    handle = _OffsetStub(WORLD, p.m * sum(p.ns))
    recvs, alive = None, []
    for moved, grown in ((True, False), (False, False), (True, False), (False, False),
                         (True, True)):
        if grown:
            old, handle = handle, _OffsetStub(WORLD, 2 * p.m * sum(p.ns))
            for t in old.data:
                t.fill_(float("nan"))
        if moved:   # new landing buffers while the last ones stay alive: other addresses
            alive.append(recvs)
            recvs = [torch.empty(p.world * p.block_rows, n) for n in p.ns]
        before = prepared.prepared
        outs, refs = _rs_run_once(plan, prepared, handle, recvs)
        _assert_close(outs, refs)
        if not grown and before:
            assert prepared.prepared - before == (_copies_touching(plan, {"recv"}) if moved
                                                  else 0)
