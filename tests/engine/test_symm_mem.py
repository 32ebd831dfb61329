"""ficco.symm_mem on the CPU backend: every rank sees every peer's allocation."""
from __future__ import annotations

import operator
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

import ficco
from ficco.errors import InvalidArgumentError
from ficco.symm_mem.barrier import plan_barrier

from .. import harness


def _exchange(rank, world, seed):
    t = ficco.symm_mem.empty((5, 7), dtype=torch.float32)
    handle = ficco.symm_mem.rendezvous(t)
    values = torch.randn(world, 5, 7, generator=torch.Generator().manual_seed(seed))
    t.copy_(values[rank])
    handle.barrier(channel=3, timeout_s=20)
    seen = [torch.equal(handle.get_buffer(p, (5, 7), torch.float32), values[p])
            for p in range(world)]
    handle.barrier(channel=3, timeout=20)      # DESIGN's keyword; timeout_s is the same
    pads = [tuple(handle.signal_pad(p).shape) for p in range(world)]
    try:
        handle.get_buffer(0, (100, 100), torch.float32)
        too_big = "no error"
    except InvalidArgumentError as exc:
        too_big = str(exc)
    return all(seen), pads, too_big


def test_empty_rendezvous_get_buffer_barrier():
    world = 3
    for ok, pads, too_big in harness.pool(world).run(_exchange, random.randrange(1 << 20)):
        assert ok
        assert pads == [(ficco.symm_mem.SIGNAL_CHANNELS, world)] * world
        assert "needs 40000 bytes" in too_big


def test_rendezvous_rejects_ordinary_tensors():
    with pytest.raises(InvalidArgumentError, match="ficco.symm_mem.empty"):
        ficco.symm_mem.rendezvous(torch.zeros(3))


# -- Failures during allocation are collective -----------------------------------
def _allocation_with_a_failing_rank(rank, world, seed, failing, stage):
    """``failing`` cannot create (stage "create") or map (stage "map") its shared memory: every
    rank must raise the same SymmAllocationError instead of waiting in a collective; then a
    healthy allocation exchanges fresh data correctly."""
    import ficco.symm_mem.cpu as cpu_symm
    from ficco.symm_mem.agree import SymmAllocationError

    real = {"create": cpu_symm.os.ftruncate, "map": cpu_symm.map_file}
    if rank == failing:
        def broken(*args, **kwargs):
            raise OSError(28, f"injected {stage} failure")
        if stage == "create":
            cpu_symm.os.ftruncate = broken
        else:
            cpu_symm.map_file = broken
    try:
        ficco.symm_mem.empty((4, 3), dtype=torch.float64)
        outcome = "no error"
    except SymmAllocationError as exc:
        outcome = str(exc)
    finally:
        cpu_symm.os.ftruncate, cpu_symm.map_file = real["create"], real["map"]
    ok = _exchange(rank, world, seed)[0]
    return outcome, ok


@pytest.mark.parametrize("stage", ["create", "map"])
def test_a_rank_failing_to_allocate_makes_every_rank_raise(stage):
    world, failing = 3, 1
    results = harness.pool(world).run(_allocation_with_a_failing_rank, random.randrange(1 << 20),
                                      failing, stage, timeout_s=60)
    for rank, (outcome, ok) in enumerate(results):
        assert f"rank {failing}: " in outcome and "injected" in outcome, (rank, outcome)
        assert outcome.startswith(f"rank {rank}: could not"), outcome
        assert ok   # the next allocation works and moves the right bytes


def _larger_than_dev_shm(rank, world, seed):
    """A dma workspace larger than /dev/shm's free space (every rank died of
    SIGBUS at its first write): a SymmAllocationError on every rank, naming the size and the
    way out, before any rank maps anything. Two ways: an allocation really larger than the
    free space, and a call whose workspace is larger than a (patched) free-space query. Then
    the same call over ccl, and over dma once there is room, are right."""
    import ficco.symm_mem.cpu as cpu_symm
    from ficco.symm_mem.agree import SymmAllocationError

    from ..reference import make_inputs, max_row_rel_err

    outcomes = []
    mapped = cpu_symm.map_file
    cpu_symm.map_file = lambda *args: outcomes.append("mapped") or mapped(*args)
    stat = os.statvfs("/dev/shm")
    free = [stat.f_bavail * stat.f_frsize]
    dist.broadcast_object_list(free, src=0)   # one size on every rank
    real_free = cpu_symm.shm_free_bytes
    shards, bs, _, refs = make_inputs(seed, world, (16, 32), (8,), torch.float32)
    try:
        try:
            ficco.symm_mem.empty((free[0] // 4 + 1, 2), dtype=torch.float32)
            outcomes.append("allocated")
        except SymmAllocationError as exc:
            outcomes.append(str(exc))
        cpu_symm.shm_free_bytes = lambda: 4096
        try:
            with ficco.config.scope(transport="dma"):
                ficco.all_gather_matmul(shards[rank], bs[0], schedule="ring")
            outcomes.append("returned")
        except SymmAllocationError as exc:
            outcomes.append(str(exc))
    finally:
        cpu_symm.map_file, cpu_symm.shm_free_bytes = mapped, real_free
    ficco.shutdown()   # (a failed call leaves the group refused until every rank shuts down)
    errors = []
    for transport in ("ccl", "dma"):
        with ficco.config.scope(transport=transport):
            out = ficco.all_gather_matmul(shards[rank], bs[0], schedule="ring")
        errors.append(max_row_rel_err(out, refs[0]))
    return outcomes, errors


def test_a_workspace_larger_than_dev_shm_is_an_error_on_every_rank_not_a_sigbus():
    results = harness.pool(3).run(_larger_than_dev_shm, random.randrange(1 << 20), timeout_s=90)
    for rank, (outcomes, errors) in enumerate(results):
        assert len(outcomes) == 2, (rank, outcomes)   # nothing mapped, nothing returned
        for outcome in outcomes:
            assert outcome.startswith(f"rank {rank}: could not allocate"), outcome
            assert "/dev/shm has" in outcome and " per rank" in outcome, outcome
            assert "--shm-size" in outcome and "FICCO_TRANSPORT=ccl" in outcome, outcome
        assert max(errors) <= 1e-4, (rank, errors)


# -- the one barrier protocol on CPU ranks -------------------------------------------------------
def _plan_barriers(rank, world, seed, rounds):
    """Alternating flag-mode barriers 0 and 1 on two queues of every rank (the plans' pattern),
    each guarding a publish/pull of fresh random data: every pull sees the round's data."""
    from ficco.backends import get_backend

    backend = get_backend()
    gen = torch.Generator().manual_seed(seed)
    h = backend.symm_provider().allocate(world * 16 * 8, dist.group.WORLD, backend.device())
    try:
        mine = h.get_buffer(rank, (world, 16), torch.float64)
        wrong = 0
        for _ in range(rounds):
            data = torch.randn(world, 16, generator=gen, dtype=torch.float64)
            h.call_flag = int(torch.randint(1, 1 << 31, (), generator=gen))  # one per call
            q = backend.queue("copy0")
            backend.copy(mine[rank], data[rank], q)
            plan_barrier(backend, h, 0, q, 20.0, 0)
            pulled = torch.full((world, 16), float("nan"), dtype=torch.float64)
            for p in range(world):
                backend.copy(pulled[p], h.get_buffer(p, (world, 16), torch.float64)[p], q)
            plan_barrier(backend, h, 1, q, 20.0, 1)
            backend.finish([q])
            wrong += int((pulled != data).sum())
        h.barrier(channel=3, timeout_s=20)   # every owner finished clearing its slots
        pads = [h.signal_pad(p)[:2].clone() for p in range(world)]
        return wrong, [int(p.abs().sum()) for p in pads]
    finally:
        h.close()


def test_cpu_ranks_run_the_flag_protocol_and_leave_pads_clear():
    results = harness.pool(3).run(_plan_barriers, random.randrange(1 << 20), 5)
    for wrong, pads in results:
        assert wrong == 0
        assert pads == [0, 0, 0]   # every flag cleared by its owner after passing


def _barrier_then_pull(backend, h, rank, world, timeout_s, step):
    """A plan's pattern on one queue: barrier 0, then pull the next rank's 4 doubles into a
    NaN-filled destination. Returns (queue, destination, monotonic start)."""
    q = backend.queue("copy0")
    out = torch.full((4,), float("nan"), dtype=torch.float64)
    src = h.get_buffer((rank + 1) % world, (4,), torch.float64)
    start = time.monotonic()
    plan_barrier(backend, h, 0, q, timeout_s, step)
    backend.copy(out, src, q)
    return q, out, start


def _another_call(rank, world, seed):
    """Rank ``world - 1`` makes another call (its call flag differs) at round 2 of 3: every
    rank raises MismatchError at that round's barrier, long before the deadline, and nothing
    after the barrier (the pull) ran: the destination keeps its poison."""
    from ficco.backends import get_backend
    from ficco.errors import MismatchError

    backend = get_backend()
    gen = torch.Generator().manual_seed(seed)
    h = backend.symm_provider().allocate(64, dist.group.WORLD, backend.device())
    outcomes = []
    try:
        for round_ in range(3):
            flag = int(torch.randint(1, 1 << 30, (), generator=gen))
            h.call_flag = flag + 1 if round_ == 1 and rank == world - 1 else flag
            q, out, start = _barrier_then_pull(backend, h, rank, world, 30.0, 3)
            # A plan's barriers alternate channels 0 and 1 (what lets a rank clear its slots
            # without erasing a fast peer's next flag): end each round on channel 1.
            plan_barrier(backend, h, 1, q, 30.0, 4)
            try:
                backend.finish([q])
                outcomes.append(("passed", bool(torch.isnan(out).any())))
            except MismatchError as exc:
                backend.synchronize()
                outcomes.append((str(exc), bool(torch.isnan(out).all()),
                                 time.monotonic() - start))
                break
        return outcomes
    finally:
        h.close()


def test_a_rank_in_another_call_makes_every_rank_raise_a_mismatch_at_the_barrier():
    """Disagreement on an already-agreed call, caught by the barrier's call flag
    (the mechanism GPU dma calls share), on every rank, at once."""
    results = harness.pool(3).run(_another_call, random.randrange(1 << 20))
    for rank, outcomes in enumerate(results):
        assert outcomes[0] == ("passed", False), results
        assert len(outcomes) == 2, results
        message, untouched, seconds = outcomes[1]
        assert "MismatchError" not in message and "from a different call" in message, results
        assert untouched and seconds < 15, results
        assert ("rank(s) [2]" in message) == (rank != 2), results


def _released_by_the_deadline(rank, world, seed):
    """Rank ``world - 1`` never reaches barrier 0: the others' barrier is released by its
    deadline, their queue raises the one timeout message, and nothing after the barrier
    (the pull) ran: the destination keeps its poison."""
    from ficco.backends import get_backend
    from ficco.errors import CommTimeoutError

    backend = get_backend()
    h = backend.symm_provider().allocate(64, dist.group.WORLD, backend.device())
    try:
        if rank == world - 1:
            h.barrier(channel=4, timeout_s=20)   # only after the others gave up
            return "absent", True
        q, out, start = _barrier_then_pull(backend, h, rank, world, 1.5, 7)
        try:
            backend.finish([q])
            message = "returned"
        except CommTimeoutError as exc:
            message = f"{time.monotonic() - start:.1f} {exc}"
        h.barrier(channel=4, timeout_s=20)
        return message, bool(torch.isnan(out).all())
    finally:
        h.close()


def test_a_barrier_released_by_its_deadline_raises_and_runs_nothing_after_it():
    world = 3
    results = harness.pool(world).run(_released_by_the_deadline, random.randrange(1 << 20))
    for rank, (message, untouched) in enumerate(results[:-1]):
        seconds, text = message.split(" ", 1)
        assert float(seconds) < 10, message
        assert text.startswith(f"rank {rank} at step 7: barrier channel 0"), text
        assert f"rank(s) [{world - 1}]" in text and "FICCO_TIMEOUT" in text, text
        assert untouched
    assert results[-1] == ("absent", True)


# -- A tensor of ficco.symm_mem.empty outlives ficco.shutdown() ------------------
def _read_after_shutdown(rank, world, seed):
    t = ficco.symm_mem.empty((64, 32), dtype=torch.float32)
    values = torch.randn(64, 32, generator=torch.Generator().manual_seed(seed + rank))
    t.copy_(values)
    view = t[3:9]
    ficco.shutdown()
    import gc
    gc.collect()
    return torch.equal(t, values) and torch.equal(view, values[3:9])


def test_empty_tensor_stays_readable_after_shutdown():
    assert all(harness.pool(2).run(_read_after_shutdown, random.randrange(1 << 20)))


def test_closing_a_cpu_handle_never_unmaps_memory_a_view_holds():
    """The handle's own close(): a view taken before it stays valid (no segfault)."""
    from ficco.backends.cpu import CpuBackend

    backend = CpuBackend()
    h = backend.symm_provider().allocate(4096, None, backend.device())
    t = h.get_buffer(0, (32, 32), torch.float32)
    values = torch.randn(32, 32)
    t.copy_(values)
    h.close()
    h.close()
    import gc
    gc.collect()
    assert torch.equal(t, values)


# -- A rank failing mid-call -------------------------------------------------------
def _failing_mid_call(rank, world, seed, schedule):
    """Rank 1's GEMM raises once during a dma call: every rank raises (rank 1 its error, the
    others the barrier timeout) and returns no data; the next calls, on fresh data, are right
    on every rank (the workspace's pads were not left holding stale flags)."""
    from ficco.backends import get_backend
    from ficco.errors import FiccoError

    from ..cases import fail_next_gemm
    from ..reference import make_inputs, max_row_rel_err

    backend = get_backend()
    shards, bs, _, refs = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    ficco.all_gather_matmul(shards[rank], bs[0], schedule=schedule)   # agree on the shape
    restore = fail_next_gemm(backend) if rank == 1 else (lambda: None)
    try:
        with ficco.config.scope(timeout=2, transport="dma"):
            ficco.all_gather_matmul(shards[rank], bs[0], schedule=schedule)
        failed = "returned"
    except FiccoError as exc:
        failed = f"{type(exc).__name__}: {exc}"
    finally:
        restore()
    errors = []
    for call in range(3):
        shards, bs, _, refs = make_inputs(seed + 1 + call, world, (8, 16), (4,), torch.float32)
        try:
            with ficco.config.scope(transport="dma"):
                out = ficco.all_gather_matmul(shards[rank], bs[0], schedule=schedule)
        except FiccoError:
            # The runtime may refuse a group whose last call failed part-way until
            # every rank called shutdown(); a refusal is never wrong data.
            ficco.shutdown()
            errors.append(None)
            continue
        errors.append(max_row_rel_err(out, refs[0]))
    return failed, errors


@pytest.mark.parametrize("schedule", ["ring", "uniform-fused-1d"])
def test_a_rank_failing_mid_call_makes_every_rank_raise_then_calls_are_right(schedule):
    results = harness.pool(3).run(_failing_mid_call, random.randrange(1 << 20), schedule,
                                  timeout_s=90)
    for rank, (failed, errors) in enumerate(results):
        assert failed != "returned", (rank, results)
        if rank == 1:
            assert "injected GEMM failure" in failed, failed
        assert all(e is None or e <= 1e-4 for e in errors), (rank, results)
        assert errors[-1] is not None, (rank, results)   # runs again, and right


# -- FICCO_SIGNAL_PADS=host: GPU pads in host memory, exercised on CPU ranks ----------------------
class _HostVendor:
    """The three driver calls HostPads makes, as a GPU-less stand-in: 'device' pointers are
    the host addresses moved by a fixed offset (as a driver's mapping would be)."""

    OFFSET = 0x7F00_0000_0000

    def __init__(self):
        self.registered = []

    def host_register(self, address, nbytes):
        self.registered.append((address, nbytes))

    def host_device_pointer(self, address):
        return address + self.OFFSET

    def host_unregister(self, address):
        self.registered = [r for r in self.registered if r[0] != address]


def _host_pads(rank, world, seed):
    """Every rank writes into its slot of every peer's pad by device address; every rank reads
    all of its own slots back; a watchdog-style release is a host store, no stream."""
    from ficco.symm_mem import SIGNAL_CHANNELS
    from ficco.symm_mem.host_pads import HostPads

    vendor = _HostVendor()
    pads = HostPads(vendor, dist.group.WORLD, rank, world)
    slot = lambda owner, ch, writer: pads.device[owner] + 4 * (ch * world + writer)
    for peer in range(world):
        pads.write(slot(peer, 3, rank), seed + rank)
    dist.barrier()
    seen = [pads.read(slot(rank, 3, p)) for p in range(world)]
    registered = len(vendor.registered)
    dist.barrier()
    pads.close()
    return seen, registered, len(vendor.registered), pads.count == SIGNAL_CHANNELS * world


@pytest.mark.parametrize("setting,connections,queues,vendor,on_host", [
    (None, "1", None, "cuda", True), (None, None, None, "cuda", True),
    (None, "8", None, "cuda", True), (None, None, "4", "rocm", True),
    ("auto", "1", None, "cuda", True), ("host", None, None, "rocm", True),
    ("device", None, None, "cuda", False), ("device", "8", None, "cuda", False),
    ("device", None, "4", "rocm", False),
    ("device", "1", None, "cuda", "refused"), ("device", " 1 ", None, "cuda", "refused"),
    ("device", None, "1", "rocm", "refused")])
def test_signal_pads_are_host_memory_unless_device_is_asked_where_it_can_be_rescued(
        monkeypatch, setting, connections, queues, vendor, on_host):
    """The watchdog must reach a stuck barrier's slots without a stream, so
    pads are host-mapped memory by default on CUDA and ROCm alike (not only for
    CUDA_DEVICE_MAX_CONNECTIONS=1); device pads only when asked, refused where every stream
    shares one hardware queue."""
    from ficco.errors import ConfigError
    from ficco.symm_mem import host_pads

    for name, value in (("FICCO_SIGNAL_PADS", setting), ("CUDA_DEVICE_MAX_CONNECTIONS", connections),
                        ("GPU_MAX_HW_QUEUES", queues)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    if on_host == "refused":
        with pytest.raises(ConfigError, match="cannot be used with"):
            host_pads.wanted(vendor)
    else:
        assert host_pads.wanted(vendor) is on_host


def test_host_signal_pads_are_shared_by_every_rank_through_device_addresses():
    seed = random.randrange(1 << 20)
    for seen, registered, left, sized in harness.pool(3).run(_host_pads, seed):
        assert seen == [seed + p for p in range(3)]
        assert registered == 3 and left == 0 and sized


def _expire_on_host_pads(memory: dict, flag: int):
    """The watchdog expiring a flag-mode barrier (call flag ``flag``) whose handle has host
    pads holding ``memory``, through the GPU backend's port (:class:`Rescue`); returns the
    error left in the group's fault. Any stream or vendor call would fail."""
    import numpy as np

    from ficco.backends.gpu.rescue import Rescue
    from ficco.backends.gpu.watchdog import PendingBarrier, Watchdog
    from ficco.symm_mem.barrier import WAIT, Deadline, SignalOp
    from ficco.symm_mem.fault import GroupFault

    fault = GroupFault(0, np.zeros(1, np.int32), None, 0,
                       [np.zeros(1, np.int32), np.zeros(1, np.int32)])
    released_after_raise = []

    class Host:
        read = staticmethod(memory.__getitem__)

        @staticmethod
        def write(slot, value):
            released_after_raise.append(fault.failed() and
                                        all(int(w[0]) == 2 for w in fault.peer_words))
            memory[slot] = value

    class Handle:
        host_pads = Host()

    Handle.fault = fault
    waits = tuple(SignalOp(WAIT, 0x100 + 4 * p, flag, p, True) for p in range(3))
    item = PendingBarrier(None, None, Deadline(0, 1, 4, 2.0, flag, waits, Handle()), None)
    dog = Watchdog(Rescue(torch.device("cpu"), None, None, None, torch.cuda,    # vendor None:
                          operator.attrgetter("cuda_stream")))                 # unused
    dog._expire(item, fault)
    # The call's fence must see the error word raised, and every peer's too (this rank gave
    # up on the group), before any slot is released.
    assert released_after_raise and all(released_after_raise), released_after_raise
    return fault.take()


def test_watchdog_releases_host_pads_without_a_stream():
    """A late peer: its slot is written by the host (the stream moves on), and the one
    timeout message names it."""
    from ficco.errors import CommTimeoutError

    flag = random.randrange(2, 1 << 31)
    memory = {0x100: flag, 0x104: 0, 0x108: flag}
    error = _expire_on_host_pads(memory, flag)
    assert memory == {0x100: flag, 0x104: flag, 0x108: flag}
    assert isinstance(error, CommTimeoutError)
    assert str(error).startswith("rank 0 at step 4: barrier channel 1") and "[1]" in str(error)


def test_watchdog_names_a_peer_in_another_call_as_a_mismatch():
    """A peer's slot holding another call's flag (on GPUs): the barrier is released
    and the error left is a MismatchError (raised alike on every rank), naming that peer."""
    from ficco.errors import MismatchError

    flag = random.randrange(2, 1 << 30)
    memory = {0x100: flag, 0x104: 0, 0x108: flag + 1}
    error = _expire_on_host_pads(memory, flag)
    assert memory == {0x100: flag, 0x104: flag, 0x108: flag}
    assert isinstance(error, MismatchError)
    assert "rank(s) [2]" in str(error) and str(flag + 1) in str(error)


def test_watchdog_peeks_find_a_foreign_flag_before_the_deadline():
    """The watchdog's peek (not the deadline) expires a flag-mode barrier whose slot holds
    another call's flag, and only once a peek is due."""
    from ficco.backends.gpu.watchdog import PendingBarrier, Watchdog
    from ficco.symm_mem.barrier import WAIT, Deadline, SignalOp

    flag = random.randrange(2, 1 << 30)
    memory = {0x100: flag, 0x104: 0}
    waits = tuple(SignalOp(WAIT, 0x100 + 4 * p, flag, p, True) for p in range(2))
    deadline = Deadline(0, 0, 1, 600.0, flag, waits)
    deadline.start(100.0)

    class Port:
        @staticmethod
        def reader(_):
            return memory.__getitem__

    dog = Watchdog.__new__(Watchdog)
    dog.port = Port()
    item = PendingBarrier(None, None, deadline, None)
    assert not dog._foreign(item, 100.001)          # before the first peek
    assert not dog._foreign(item, 100.006)          # a peek: the peer has not arrived
    memory[0x104] = flag ^ 0x40                     # now it arrives from another call
    assert not dog._foreign(item, 100.007)          # the next peek is not due yet
    assert dog._foreign(item, 100.1)
    memory[0x104] = flag                            # the same call: never foreign
    assert not dog._foreign(item, 200.0)


# -- FICCO_SYMM=torch / auto (torch's _symmetric_memory): its steps are bounded store exchanges.
# torch's allocator needs a GPU; these fakes stand in for it (and torch.cuda) so the protocol
# around it runs on the CPU rank pool.
class _UvaVendor(_HostVendor):
    """Host pads whose device address is the host address (unified addressing)."""

    OFFSET, name = 0, "cuda"


def _torch_symm_provider(rank, world, seed, failing_rank, symm, pads="device"):
    from types import SimpleNamespace

    from torch.distributed import _symmetric_memory as torch_symm

    from ficco.symm_mem.agree import SymmAllocationError
    from ficco.symm_mem.torch_symm import AutoSymmProvider

    data = torch.randn(world, 64, generator=torch.Generator().manual_seed(seed))
    rendezvous_entered = []

    def empty(n, dtype, device):
        if rank == failing_rank:
            raise RuntimeError("injected: out of symmetric memory")
        t = torch.zeros(n, dtype=dtype)
        t[:64].copy_(data[rank].view(torch.uint8)[:64])
        return t

    def rendezvous(local, group):
        rendezvous_entered.append(True)
        # A peer's "mapping": its bytes as this fake sees them (same generator on all ranks).
        def get_buffer(p, shape, dtype):
            t = torch.zeros(shape, dtype=dtype)
            t[:64].copy_(data[p].view(torch.uint8)[:64])
            return t
        return SimpleNamespace(get_buffer=get_buffer)

    def properties(device):
        return SimpleNamespace(uuid=f"GPU-{rank}", name="fake", pci_bus_id=rank)

    saved = (torch_symm.empty, torch_symm.rendezvous, torch.cuda.synchronize,
             torch.cuda.get_device_properties)
    torch_symm.empty, torch_symm.rendezvous = empty, rendezvous
    torch.cuda.synchronize, torch.cuda.get_device_properties = (lambda *a: None), properties
    start = time.monotonic()
    try:
        backend = SimpleNamespace(vendor=_UvaVendor(), device=lambda: torch.device("cpu"),
                                  device_module=lambda: torch.cuda)
        with ficco.config.scope(timeout=5, symm=symm, signal_pads=pads):
            handle = AutoSymmProvider(backend).allocate(100, None, "cpu")
        seen = [torch.equal(handle.get_buffer(p, (64,), torch.uint8),
                            data[p].view(torch.uint8)[:64]) for p in range(world)]
        outcome = ("allocated", all(seen), tuple(handle.signal_pad(rank).shape))
    except SymmAllocationError as exc:
        outcome = ("SymmAllocationError", str(exc), None)
    finally:
        (torch_symm.empty, torch_symm.rendezvous, torch.cuda.synchronize,
         torch.cuda.get_device_properties) = saved
    return outcome, bool(rendezvous_entered), time.monotonic() - start


@pytest.mark.parametrize("symm,pads", [("torch", "device"), ("auto", "device"),
                                       ("torch", "host")])
def test_torch_symm_provider_maps_every_peer_through_bounded_exchanges(symm, pads):
    world = 2
    results = harness.pool(world).run(_torch_symm_provider, random.randrange(1 << 30), -1,
                                      symm, pads, timeout_s=60)
    for (kind, all_seen, pad_shape), entered, _ in results:
        assert kind == "allocated" and all_seen and entered, results
        assert pad_shape == (ficco.symm_mem.SIGNAL_CHANNELS, world), results


def test_torch_symm_allocation_failing_on_one_rank_raises_on_every_rank_before_rendezvous():
    results = harness.pool(2).run(_torch_symm_provider, random.randrange(1 << 30), 1, "torch",
                                  timeout_s=60)
    for rank, ((kind, message, _), entered, elapsed) in enumerate(results):
        assert kind == "SymmAllocationError" and "rank 1" in message, results
        assert "injected" in message and not entered, results   # nobody enters rendezvous
        assert elapsed < 5, results


# -- Ranks that ask for workspaces of different sizes ----------------------------
def _disagree_twice_on_cached_shapes(rank, world, seed):
    """Both shapes agreed and cached; then two disagreeing calls in a row: the first caught
    by the barrier, the second refused (the group is poisoned); after ficco.shutdown() on
    every rank, symmetric memory of a different size on each rank, then a call in step."""
    from ..reference import make_inputs, max_row_rel_err

    small = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    large = make_inputs(seed + 1, world, (40, 16), (4,), torch.float32)
    outcomes = []

    def call(inputs):
        shards, bs, _, refs = inputs
        try:
            return ("ok", max_row_rel_err(ficco.all_gather_matmul(shards[rank], bs[0],
                                                                  schedule="ring"), refs[0]))
        except Exception as exc:  # noqa: BLE001 - the test judges every kind
            return (type(exc).__name__, str(exc))

    with ficco.config.scope(transport="dma", timeout=10):
        outcomes += [call(small), call(large)]
        outcomes += [call(small if rank == 0 else large) for _ in range(2)]
        ficco.shutdown()
        try:
            ficco.symm_mem.empty((8 if rank == 0 else 40, 16))
            outcomes.append(("allocated", ""))
        except Exception as exc:  # noqa: BLE001 - the test judges every kind
            outcomes.append((type(exc).__name__, str(exc)))
        outcomes.append(call(small))
    ficco.shutdown()
    return outcomes


def test_ranks_allocating_workspaces_of_different_sizes_all_raise_a_mismatch():
    """Before: rank 1 mapped rank 0's smaller file with its own length: a raw `ValueError:
    mmap length is greater than file size` there, a timeout on rank 0."""
    results = harness.pool(2).run(_disagree_twice_on_cached_shapes, random.randrange(1 << 30))
    for outcomes in results:
        assert outcomes[0][0] == outcomes[1][0] == "ok", results
        assert outcomes[2][0] == "MismatchError", results
        assert outcomes[3][0] == "PoisonedGroupError", results
        assert outcomes[4][0] == "MismatchError" and "bytes" in outcomes[4][1], results
        assert outcomes[5][0] == "ok" and outcomes[5][1] <= 1e-4, results
