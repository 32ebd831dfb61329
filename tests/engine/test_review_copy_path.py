"""Desk review of the GPU copy and stream path, on the threaded fake GPU of
``tests/fake_gpu.py`` (hardware queues run stream commands in order on host threads; vendor
copies move bytes at the addresses the backend computed). One process plays rank RANK of a
pretend group: peers' symmetric buffers are other tensors and every barrier passes.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from ficco import schedules
from ficco.errors import BackendCallError
from ficco.executor import execute
from ficco.plan import Copy, Wait
from ficco.plan.buffers import Buffers

from .. import fake_gpu
from .test_enqueue_gpu import RANK, RS, WORLD, Handle


@pytest.fixture()
def device():
    dev = fake_gpu.install("cuda", hw_queues=8)
    base = fake_gpu.backend_class("cuda")

    class PretendPeers(base):
        def signal_batch(self, queue, ops, deadline):
            pass   # the peers are pretend: every barrier passes (barriers: test_symm_mem)

    backend = PretendPeers()
    yield dev, backend
    backend.close()
    fake_gpu.uninstall()


def _gate(stream) -> threading.Event:
    """Hold ``stream`` (its hardware queue) until the returned event is set."""
    gate = threading.Event()
    stream.enqueue(lambda: stream.device.spin(gate.is_set, "test gate"))
    return gate


def _rs_buffers(p, handle):
    """A reduce-scatter call's buffers with fresh data: the peers' partials in the handle."""
    offsets = [0, p.m * p.ns[0] * 4]
    for q in range(WORLD):
        if q != RANK:
            for j, n in enumerate(p.ns):
                handle.get_buffer(q, (p.m, n), torch.float32, offsets[j]).copy_(
                    torch.randn(p.m, n))
    partials = [handle.get_buffer(RANK, (p.m, n), torch.float32, off)
                for n, off in zip(p.ns, offsets)]
    outs = [torch.empty(p.block_rows, n) for n in p.ns]
    recvs = [torch.empty(WORLD * p.block_rows, n) for n in p.ns]
    return Buffers(torch.randn(p.m, RS.k), [torch.randn(RS.k, n) for n in p.ns], outs, None,
                   handle, None, partials=partials, recvs=recvs, partial_offsets=tuple(offsets))


@pytest.mark.parametrize("name", ["ring", "uniform-fused-1d"])
def test_a_call_failing_mid_enqueue_orders_the_callers_stream_after_its_side_copies(
        device, name, monkeypatch):
    """A vendor copy fails while the plan is being enqueued (its error is raised): the pulls
    already queued on the copy streams still run, into this call's ``recv`` buffers, which
    the caller's stream then owns again (the caching allocator hands a freed block to the
    next kernel of the stream it was allocated on). The caller's next kernel, writing that
    memory, must not be overwritten by the failed call's late pulls: the caller's stream
    waits for the side streams on the error path too."""
    dev, backend = device
    p = RS
    plan = schedules.get(name, op=p.op).plan(p, "dma", None)
    handle = Handle(p.m * sum(p.ns))
    buffers = _rs_buffers(p, handle)
    lane: dict = {}
    gates = [_gate(stream) for stream in (
        backend._queue(q, None, lane) for q in plan.queues if q.startswith("copy"))]
    # Fail at the last copy enqueued before the compute stream first waits for a side
    # stream: the copies before it are covered by no wait of the caller's stream.
    first_wait = next(i for i, op in enumerate(plan.ops)
                      if isinstance(op, Wait) and op.queue == "compute")
    copies = sum(isinstance(op, Copy) for op in plan.ops[:first_wait])
    assert copies >= 2
    made = {"n": 0}
    vendor = backend.vendor
    real_1d, real_2d = vendor.copy_1d, vendor.copy_2d

    def failing(real):
        def call(*args):
            made["n"] += 1
            if made["n"] == copies:
                raise BackendCallError("cudaMemcpyAsync failed with status 1 (invalid value)")
            real(*args)
        return call

    monkeypatch.setattr(vendor, "copy_1d", failing(real_1d))
    monkeypatch.setattr(vendor, "copy_2d", failing(real_2d))
    with pytest.raises(BackendCallError):
        execute(plan, backend, buffers, timeout_s=10.0, lane=lane)
    assert made["n"] == copies
    # The caller's next kernel gets the failed call's recv block: y = x @ w written there.
    recv = buffers.recvs[0]
    x, w = torch.randn(recv.shape[0], 5), torch.randn(5, recv.shape[1])
    ran = threading.Event()

    def next_kernel():
        torch.mm(x, w, out=recv)
        ran.set()
    fake_gpu.current_stream().enqueue(next_kernel)
    ran.wait(0.5)          # today it runs at once, before the held pulls
    for gate in gates:
        gate.set()
    dev.synchronize()
    torch.testing.assert_close(recv.double(), x.double() @ w.double(), rtol=1e-5, atol=1e-5)



def _ag_call(p, k, handle):
    """An all-gather call's buffers with fresh own data (the pretend peers' shards, already
    in the handle, stay) and its float64 reference outputs."""
    peers = handle.peer_shards
    a = torch.randn(p.m, k)
    bs = [torch.randn(k, n) for n in p.ns]
    outs = [torch.empty(p.big_m, n) for n in p.ns]
    full = torch.cat([a if r == RANK else peers[r] for r in range(WORLD)]).double()
    return (Buffers(a, bs, outs, handle.get_buffer(RANK, (p.big_m, k), torch.float32), handle,
                    None), [full @ b.double() for b in bs])


def _rs_call(p, k, handle):
    """A reduce-scatter call's buffers with fresh own data (the pretend peers' partials, in
    the handle, stay) and its float64 reference outputs."""
    a = torch.randn(p.m, k)
    bs = [torch.randn(k, n) for n in p.ns]
    offsets = (0, p.m * p.ns[0] * 4)
    partials = [handle.get_buffer(RANK, (p.m, n), torch.float32, off)
                for n, off in zip(p.ns, offsets)]
    outs = [torch.empty(p.block_rows, n) for n in p.ns]
    recvs = [torch.empty(WORLD * p.block_rows, n) for n in p.ns]
    row0, rows = p.block(RANK)
    refs = [(a.double() @ b.double() + sum(handle.peer_partials[q][j].double()
                                            for q in handle.peer_partials))[row0:row0 + rows]
            for j, b in enumerate(bs)]
    return (Buffers(a, bs, outs, None, handle, None, partials=partials, recvs=recvs,
                    partial_offsets=offsets), refs)


def _pretend_peers(p, k) -> Handle:
    """A handle whose peers' gathered rows (all-gather) or partials (reduce-scatter) hold
    fresh random data, the same for every call of a test."""
    from .test_enqueue_gpu import Handle

    if p.reduces:
        handle = Handle(p.m * sum(p.ns))
        offsets = (0, p.m * p.ns[0] * 4)
        handle.peer_partials = {q: [torch.randn(p.m, n) for n in p.ns]
                                for q in range(WORLD) if q != RANK}
        for q, parts in handle.peer_partials.items():
            for part, off in zip(parts, offsets):
                handle.get_buffer(q, part.shape, torch.float32, off).copy_(part)
        return handle
    handle = Handle(p.big_m * k)
    handle.peer_shards = {r: torch.randn(p.m, k) for r in range(WORLD) if r != RANK}
    for r, shard in handle.peer_shards.items():
        handle.get_buffer(r, (p.big_m, k), torch.float32)[r * p.m:(r + 1) * p.m] = shard
    return handle


@pytest.mark.parametrize("op,name", [("all_gather_matmul", "serial"),
                                     ("matmul_reduce_scatter", "serial"),
                                     ("matmul_reduce_scatter", "uniform-fused-1d")])
def test_two_calls_on_two_caller_streams_never_share_the_workspace_at_once(device, op, name):
    """Call 1 on stream S1 (busy with the caller's earlier work), call 2 right after on
    stream S2, same group: call 2's compute-stream work (publishing this rank's shard into
    the symmetric ``gathered`` buffer; the GEMMs writing this rank's symmetric partials) must
    not run before call 1's compute-stream work that writes or reads the same workspace. The
    caller ordered nothing between the two (the workspace is ficco's, not theirs): each
    call's result must match float64."""
    from .test_enqueue_gpu import AG, K

    dev, backend = device
    p = AG if op == "all_gather_matmul" else RS
    plan = schedules.get(name, op=p.op).plan(p, "dma", None)
    handle = _pretend_peers(p, K)
    lane: dict = {}
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    gate = _gate(s1)          # the caller's earlier work on S1, still running
    calls = []
    for stream in (s1, s2):
        buffers, refs = (_rs_call if p.reduces else _ag_call)(p, K, handle)
        with torch.cuda.stream(stream):
            execute(plan, backend, buffers, timeout_s=10.0, lane=lane)
        calls.append((buffers, refs))   # (alive: the fake's tensors are CPU allocator's)
    time.sleep(0.3)           # S2 runs what it may meanwhile
    gate.set()
    dev.synchronize()
    for buffers, refs in calls:
        for out, ref in zip(buffers.outs, refs):
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
