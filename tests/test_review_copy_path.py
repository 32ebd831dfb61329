"""Desk review of the GPU copy and stream path, on the threaded fake GPU of
``tests/fake_gpu.py`` (hardware queues run stream commands in order on host threads; vendor
copies move bytes at the addresses the backend computed). One process plays rank RANK of a
pretend group: peers' symmetric buffers are other tensors and every barrier passes.
"""
from __future__ import annotations

import threading

import pytest
import torch

from ficco import schedules
from ficco.buffers import Buffers
from ficco.compiler import compile_plan
from ficco.errors import BackendCallError
from ficco.executor import execute

from . import fake_gpu
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
    copies = len(compile_plan(plan).copies)
    made = {"n": 0}
    vendor = backend.vendor
    real_1d, real_2d = vendor.copy_1d, vendor.copy_2d

    def failing(real):
        def call(*args):
            made["n"] += 1
            if made["n"] == copies:   # the plan's last copy: the others are queued
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
