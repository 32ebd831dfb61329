"""A group's state is its Session's (ficco/runtime/session.py), found from the group object.
Two groups never share a queue, an abort switch or a lock; a new group of an old name starts
clean; a rank's shutdown is local and the group is back in step once every rank called it;
agreed calls pair by number, so a call that failed on one rank never pairs its next call with
a peer's pending one; a local allocation failure is named so and poisons nothing that outlives
a shutdown; two dispatches in flight combine with ``send_counts=`` as they should."""
from __future__ import annotations

import datetime
import gc
import os
import random
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ficco

from .. import harness
from ..reference import ROW_TOL, make_inputs, max_row_rel_err


def _outcome(fn):
    """("ok", value) or (error type name, message)."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the test judges every kind
        return (type(exc).__name__, str(exc))


def _right(inputs, rank, **kwargs):
    shards, bs, _, refs = inputs
    return max_row_rel_err(ficco.all_gather_matmul(shards[rank], bs[0], **kwargs), refs[0])


# -- item 2: two threads, each with its own group -------------------------------------------------
def _two_groups_two_threads(rank, world, seed):
    groups = [dist.new_group(list(range(world))) for _ in range(2)]
    outcomes: dict[int, list] = {0: [], 1: []}

    def worker(index):
        for transport in ("dma", "ccl"):
            with ficco.config.scope(transport=transport, timeout=10):
                for call in range(6):
                    inputs = make_inputs(seed + 100 * index + call, world, (16 + 8 * index, 24),
                                         (12,), torch.float32)
                    outcomes[index].append(_outcome(lambda: _right(
                        inputs, rank, group=groups[index], schedule="uniform-unfused-1d")))

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    ficco.shutdown()
    for group in groups:
        dist.destroy_process_group(group)
    return outcomes[0] + outcomes[1], elapsed


def test_two_threads_each_with_its_own_group_neither_deadlock_nor_get_garbage():
    """Before (dma): the threads' copies and barriers shared the CPU backend's queue threads,
    so one group's barrier held the other's work (a deadlock until FICCO_TIMEOUT), and the
    failing group's abort switch, one per process, made the other's queues skip work: its
    call returned garbage. Now each group's session has queues and an abort switch of its own
    (a backend lane)."""
    results = harness.run_alone(2, _two_groups_two_threads, random.randrange(1 << 30),
                                timeout_s=180)
    for outcomes, elapsed in results:
        assert all(kind == "ok" and err <= ROW_TOL[torch.float32] for kind, err in outcomes), \
            outcomes
        assert elapsed < 60, elapsed     # a bound far above the time the calls take, not a speed


# -- item 3: a new group of an old name; a killed rank's survivors; one rank's shutdown -----------
def _late_plan_on_ccl(rank, world, seed):
    """A ccl call that fails on rank 0 inside the plan's collective (rank 1 is 4 s late to it):
    a process-group collective may be pending, so rank 0's session is poisoned stickily."""
    from ficco.backends.cpu import CpuBackend

    inputs = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    real = CpuBackend.launch
    with ficco.config.scope(transport="ccl"):
        first = _outcome(lambda: _right(inputs, rank, schedule="serial"))
    with ficco.config.scope(transport="ccl", timeout=1):
        if rank == 1:
            def late(self, queue, fn):
                CpuBackend.launch = real
                time.sleep(4)
                return real(self, queue, fn)
            CpuBackend.launch = late
        try:
            failed = _outcome(lambda: _right(inputs, rank, schedule="serial"))
        finally:
            CpuBackend.launch = real
    return first, failed


def _same_name_again(rank, world, seed, init_file):
    gc.disable()          # the old group's object stays around: its finalizer has not run
    try:
        first, failed = _late_plan_on_ccl(rank, world, seed)
        time.sleep(5)                     # (rank 1's late collective completes the pending one)
        old_name = dist.group.WORLD.group_name
        ficco.shutdown()
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        name = dist.group.WORLD.group_name
        outcomes = []
        for transport in ("ccl", "dma", "ccl"):
            inputs = make_inputs(seed + len(outcomes) + 1, world, (8, 16), (4,), torch.float32)
            with ficco.config.scope(transport=transport, timeout=10):
                outcomes.append(_outcome(lambda: _right(inputs, rank)))
            if rank == 0 and len(outcomes) == 1:
                gc.collect()      # the old group's finalizer runs on one rank only, now
    finally:
        gc.enable()
    ficco.shutdown()
    return first, failed, old_name == name, outcomes


def test_a_new_group_of_an_old_name_starts_clean_after_a_failed_ccl_call():
    """Before: after a failed ccl call, shutdown(), destroying the group and making a new one
    (same name) raised PoisonedGroupError from the old group unless a garbage collection ran
    first; and the old group's finalizer, running later on one rank, dropped the new group's
    state by name (the ranks then fell out of step). Now a group's state is found from the
    group object: the new group starts clean, the old one's finalizer touches only its own."""
    fd, init_file = tempfile.mkstemp(prefix="ficco-pg-again-")
    os.close(fd)
    os.unlink(init_file)
    results = harness.run_alone(2, _same_name_again, random.randrange(1 << 30), init_file,
                                timeout_s=180)
    first, failed, same_name, _ = results[0]
    assert first[0] == "ok" and failed[0] == "CommTimeoutError" and same_name, results
    for _, _, _, outcomes in results:
        assert all(kind == "ok" and err <= ROW_TOL[torch.float32] for kind, err in outcomes), \
            results


def _survivors(rank, world, seed, init_file, transport):
    dead = 1
    inputs = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    with ficco.config.scope(transport=transport):
        _right(inputs, rank)
    with ficco.config.scope(transport=transport, timeout=3):
        if rank == dead:
            os._exit(17)
        failed = _outcome(lambda: _right(inputs, rank))
    gc.disable()
    try:
        ficco.shutdown()
        dist.destroy_process_group()
        new_rank = rank if rank < dead else rank - 1
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=new_rank,
                                world_size=world - 1, timeout=datetime.timedelta(seconds=60))
        outcomes = []
        for call, (schedule, mode) in enumerate([("ring", "ccl"), ("serial", "dma"),
                                                  ("hetero-fused-1d", "dma"), ("ring", "ccl")]):
            inputs = make_inputs(seed + call + 1, world - 1, (6, 16), (4,), torch.float32)
            with ficco.config.scope(transport=mode, timeout=10):
                outcomes.append(_outcome(lambda: _right(inputs, new_rank, schedule=schedule)))
            if new_rank == 0 and call == 1:
                gc.collect()      # the dead group's finalizer, on one survivor only
    finally:
        gc.enable()
    ficco.shutdown()
    return failed, outcomes


def test_survivors_of_a_killed_rank_build_a_fresh_group_that_computes_right():
    """Before: a fresh group of the survivors failed in about half the runs (the audit: 29 of
    60): it took the dead group's name, and with it the dead group's state (poison, agreed
    calls, exchange counts, workspace) until a collection ran, on one rank or another. Here
    the rank dies during ccl calls (the survivors' failure poisons the old group for good)
    and the fresh group computes over both transports (bench/campaigns.py kill: both, many
    times)."""
    transport = "ccl"
    fd, init_file = tempfile.mkstemp(prefix="ficco-pg-survivors-")
    os.close(fd)
    os.unlink(init_file)
    results = harness.run_alone(3, _survivors, random.randrange(1 << 30), init_file, transport,
                                timeout_s=180, raw=True)
    assert results[1][0] == "err", results           # the killed rank
    for status, value in (results[0], results[2]):
        assert status == "ok", results
        failed, outcomes = value
        assert failed[0] != "ok", results             # the call the dead rank missed
        assert all(kind == "ok" and err <= ROW_TOL[torch.float32] for kind, err in outcomes), \
            results


def _lonely_shutdown(rank, world, seed, lone_shutdowns):
    out = []
    with ficco.config.scope(transport="dma"):
        out.append(_outcome(lambda: _right(make_inputs(seed, world, (8, 16), (4,),
                                                       torch.float32), rank)))
    with ficco.config.scope(transport="dma", timeout=2):
        if rank == 0:
            for _ in range(lone_shutdowns):
                ficco.shutdown()                   # alone: the others do not
        out.append(_outcome(lambda: _right(make_inputs(seed + 1, world, (8, 16), (4,),
                                                       torch.float32), rank)))
    # The recovery every program makes after an error: ficco.shutdown() on every rank, then
    # call again (the default deadline: ranks come at different times).
    with ficco.config.scope(transport="dma"):
        for round_ in range(3):
            ficco.shutdown()
            inputs = make_inputs(seed + 2 + round_, world, (8, 16), (4,), torch.float32)
            out.append(_outcome(lambda: _right(inputs, rank)))
            if out[-1][0] == "ok":
                break
        out.append(_outcome(lambda: _right(make_inputs(seed + 9, world, (8, 16), (4,),
                                                       torch.float32), rank)))
    ficco.shutdown()
    return out


@pytest.mark.parametrize("lone_shutdowns", [1, 2])
def test_one_rank_alone_calling_shutdown_never_leaves_the_group_out_of_step(lone_shutdowns):
    """Before: ficco.shutdown() counted an epoch per process, so one rank calling it alone
    left the group out of step for good, even after every rank called it. Now it is local:
    the rank's next call waits for its peers to join a new session (an error, never data,
    while they do not); when every rank then resets, their next call says that they reset a
    different number of times (MismatchError, all ranks brought to the highest count), and
    after one more reset on every rank the group is in step: two rounds of the usual
    recovery, however often the one rank reset alone."""
    results = harness.pool(2).run(_lonely_shutdown, random.randrange(1 << 30), lone_shutdowns)
    for out in results:
        assert out[0][0] == "ok" and out[0][1] <= ROW_TOL[torch.float32], results
        assert out[1][0] != "ok", results
        assert out[2][0] == "MismatchError" and "reset" in out[2][1], results
        assert len(out) == 5, results           # the second round of the recovery succeeds
        assert all(kind == "ok" and err <= ROW_TOL[torch.float32] for kind, err in out[3:]), \
            results


# -- item 5: agreed calls pair by number ------------------------------------------------------------
def _refused_then_next(rank, world, seed, transport, op):
    """Every rank makes call A (agreed); then rank 1's next call is refused on its rank (bad
    input) while rank 0 makes call B; then rank 1 makes call C (same signature as B, other
    data). B must not pair with C."""
    with ficco.config.scope(transport=transport):
        if op == "expert":
            from ..ep_cases import make_case

            def call(s, bad=False):
                counts, xs, w, _ = make_case(s, world, 1)
                c = counts[rank] if not bad else [counts[rank][0] + 1, *counts[rank][1:]]
                y, _ = ficco.all_to_all_grouped_mm(xs[rank], c, w[rank:rank + 1])
                return y
        elif op == "all_reduce":
            def call(s, bad=False):
                gen = torch.Generator().manual_seed(s)
                a = torch.randn(world, 5, 12, generator=gen, dtype=torch.float64)
                b = torch.randn(world, 12, 4, generator=gen, dtype=torch.float64)
                ref = sum(a[q] @ b[q] for q in range(world))
                mine = a[rank].to(torch.int64) if bad else a[rank].float()
                got = ficco.matmul_all_reduce(mine, b[rank].float(), schedule="two-shot")
                return float((got.double() - ref).abs().max() / ref.abs().max())
        else:
            def call(s, bad=False):
                shards, bs, _, refs = make_inputs(s, world, (8, 16), (4,), torch.float32)
                a = shards[rank].to(torch.int64) if bad else shards[rank]
                return max_row_rel_err(ficco.all_gather_matmul(a, bs[0], schedule="ring"),
                                       refs[0])
        out = [_outcome(lambda: call(seed))]
        with ficco.config.scope(timeout=3):
            if rank == 1:
                out.append(_outcome(lambda: call(seed + 1, bad=True)))    # refused here
                out.append(_outcome(lambda: call(seed + 2)))              # C
            else:
                out.append(_outcome(lambda: call(seed + 2)))      # B: pairs with the refused
    ficco.shutdown()
    return out


@pytest.mark.parametrize("transport, op", [("dma", "dense"), ("ccl", "dense"),
                                           ("dma", "all_reduce"), ("ccl", "all_reduce"),
                                           ("dma", "expert"), ("ccl", "expert")])
def test_a_call_refused_on_one_rank_never_pairs_its_next_call_with_a_peers_pending_one(
        transport, op):
    """Before: rank 1's call C (after its call refused by bad input, before communicating)
    paired with rank 0's call B, waiting for the refused one: B and C returned data made of
    each other's inputs (dense and expert ops; matmul_all_reduce too, found later: its front
    end did not take the number). Now a refused call still takes its number in the group's
    sequence, which travels with every check (the dma barriers' flag, the ccl check, the
    expert counts exchange): B and C raise, never return data."""
    results = harness.pool(2).run(_refused_then_next, random.randrange(1 << 30), transport, op)
    zero, one = results
    assert zero[0][0] == one[0][0] == "ok", results
    assert one[1][0] == "InvalidArgumentError", results
    assert zero[1][0] != "ok" and one[2][0] != "ok", results
    assert "MismatchError" in (zero[1][0], one[2][0]), results       # said at once, not timed out


def _refused_while_tracing(rank, world, seed, transport, fullgraph, groups):
    """A compiled step of ``groups`` all_gather_matmul calls (one group: the world; two: two
    groups of every rank), the last one with a bias; a bad bias (one value too many) refuses it
    while dynamo traces. First every rank's step is refused, then every rank's next step
    runs; then rank 1's step alone is refused while rank 0 runs its step, and rank 1 makes its
    next call: the step again (one group), or the first group's call alone (two groups).
    Each outcome: ("ok", worst row error against float64) or the error."""
    torch._dynamo.reset()
    pgs = [None] if groups == 1 else [dist.new_group(list(range(world))) for _ in range(groups)]

    def step(a, w, bias):
        return [ficco.all_gather_matmul(a, w, group=pg, schedule="ring",
                                        bias=bias if i == len(pgs) - 1 else None)
                for i, pg in enumerate(pgs)]

    def first(a, w, bias):
        return [ficco.all_gather_matmul(a, w, group=pgs[0], schedule="ring")]

    compiled = torch.compile(step, fullgraph=fullgraph, backend="eager")
    compiled_first = torch.compile(first, fullgraph=fullgraph, backend="eager")

    def call(s, bad=False, fn=compiled):
        gen = torch.Generator().manual_seed(s)
        shards = torch.randn(world, 8, 16, generator=gen, dtype=torch.float64)
        w = torch.randn(16, 4, generator=gen, dtype=torch.float64)
        bias = torch.randn(4, generator=gen, dtype=torch.float64)
        full = shards.reshape(-1, 16)
        given = torch.cat([bias, bias[:1]]) if bad else bias
        outs = fn(shards[rank].float(), w.float(), given.float())
        refs = [full @ w for _ in outs]
        if fn is compiled:
            refs[-1] = refs[-1] + bias
        for ref in refs:
            ref.scale = full.abs() @ w.abs() + bias.abs()
        return max(max_row_rel_err(out, ref) for out, ref in zip(outs, refs))

    out = []
    with ficco.config.scope(transport=transport, timeout=5):
        out.append(_outcome(lambda: call(seed)))
        out.append(_outcome(lambda: call(seed + 1, bad=True)))      # refused on every rank
        out.append(_outcome(lambda: call(seed + 2)))
        if rank == 1:
            out.append(_outcome(lambda: call(seed + 3, bad=True)))  # refused here only
            out.append(_outcome(lambda: call(seed + 4, fn=compiled if groups == 1 else
                                             compiled_first)))
        else:
            out.append(_outcome(lambda: call(seed + 3)))    # pairs with the refused call
    ficco.shutdown()
    torch._dynamo.reset()
    for pg in pgs:
        if pg is not None:
            dist.destroy_process_group(pg)
    return out


@pytest.mark.parametrize("transport, fullgraph, groups", [
    ("dma", True, 1), ("ccl", True, 1), ("dma", False, 1), ("ccl", True, 2)])
def test_a_call_refused_while_torch_compile_traces_it_still_takes_its_number(
        transport, fullgraph, groups):
    """Before, under torch.compile(fullgraph=True): rank 1's call refused while dynamo traced
    its fake kernel (a bias of the wrong length) took no number, so its next call paired with
    rank 0's call of the step before, and both returned data made of two steps' inputs (rank
    0's call erred 0.83 of its scale against float64, rank 1's 0.56). Now the refusal takes
    the number, and a fullgraph refusal also takes the numbers of the ficco calls the trace met
    before it (two groups: the first group's call ran on rank 0 alone); without fullgraph,
    dynamo runs the call eagerly, which takes it, once (two groups: before, rank 1's next call
    of the first group paired with rank 0's of the refused step). Refused on every rank, the
    ranks stay in step and the next call is right."""
    results = harness.pool(2).run(_refused_while_tracing, random.randrange(1 << 30), transport,
                                  fullgraph, groups)
    tol = ROW_TOL[torch.float32]
    for out in results:
        assert out[0][0] == "ok" and out[0][1] <= tol, results
        assert out[1][0] == "InvalidArgumentError", results
        assert out[2][0] == "ok" and out[2][1] <= tol, results       # still in step
        # never data made of two steps' inputs: every call returns right or raises
        assert all(kind != "ok" or err <= tol for kind, err in out[3:]), results
    zero, one = results
    assert one[3][0] == "InvalidArgumentError", results
    assert zero[3][0] != "ok" and one[4][0] != "ok", results
    assert "MismatchError" in (zero[3][0], one[4][0]), results        # said at once


def _timed_out_then_torch_collective(rank, world, seed):
    inputs = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    with ficco.config.scope(transport="ccl"):
        first = _outcome(lambda: _right(inputs, rank, schedule="serial"))
    with ficco.config.scope(transport="ccl", timeout=2):
        extra = ("skipped", None)
        if rank == 0:      # one call more than rank 1 (rank 1 skipped it)
            extra = _outcome(lambda: _right(inputs, rank, schedule="serial"))
        else:
            time.sleep(3)
    t = torch.arange(5, dtype=torch.float32) + 10 * rank
    out = torch.empty(world * 5)
    dist.all_gather_into_tensor(out, t)   # an ordinary collective of the group, another size
    ficco.shutdown()
    return first, extra, out.tolist()


def test_a_timed_out_ccl_rank_survives_its_peer_going_on_to_a_torch_collective():
    """Before: rank 0's extra call left its call check (a collective) pending in the process
    group after it timed out; rank 1, which saw no error, made an ordinary all-gather of
    another size, which paired with it: rank 0 died of SIGABRT. Now a ccl call check goes
    through the store: a check that times out leaves nothing pending in the group."""
    results = harness.run_alone(2, _timed_out_then_torch_collective, random.randrange(1 << 30),
                                timeout_s=120, raw=True)
    want = [float(x + 10 * r) for r in range(2) for x in range(5)]
    for status, value in results:
        assert status == "ok", results
        first, _, gathered = value
        assert first[0] == "ok" and gathered == want, results
    assert results[0][1][1][0] == "CommTimeoutError", results


# -- item 8: two dispatches in flight, then their combines with send_counts= -----------------------
def _two_dispatches_then_combines(rank, world, seed):
    from ..ep_cases import round_trip_reference

    gen = torch.Generator().manual_seed(seed)
    k, n, n2 = 8, 6, 5
    w = torch.randn(world, k, n, generator=gen)
    w2 = torch.randn(world, n, n2, generator=gen)
    # Rank 0 sends and receives the same in both dispatches; rank 1 sends other rows to
    # expert 1: only rank 1 can tell the two routings apart from its own counts.
    routings = [[[2, 1], [3, 1]], [[2, 1], [3, 4]]]
    xs = [[torch.randn(sum(row), k, generator=gen) for row in counts] for counts in routings]
    local = slice(rank, rank + 1)
    dispatched = [ficco.all_to_all_grouped_mm(xs[d][rank], routings[d][rank], w[local])
                  for d in range(2)]
    out = []
    for d in range(2):
        y, recv = dispatched[d]
        out.append(_outcome(lambda: max_row_rel_err(
            ficco.grouped_mm_all_to_all(y, recv, w2[local], send_counts=routings[d][rank]),
            round_trip_reference(routings[d], xs[d], w, w2, rank))))
    ficco.shutdown()
    return out


def test_two_dispatches_in_flight_then_their_combines_with_send_counts():
    """Before: a false MismatchError: the process remembered one routing per (send, receive)
    pair of its own, so rank 0 took the second dispatch's routing for the first combine.
    Now combine skips the counts exchange only when every rank can tell the dispatch apart
    (alike on every rank); here every rank exchanges, and both combines are right."""
    for out in harness.pool(2).run(_two_dispatches_then_combines, random.randrange(1 << 30)):
        assert all(kind == "ok" and err <= ROW_TOL[torch.float32] for kind, err in out), out


# -- item 9: a local allocation failure -------------------------------------------------------------
def _allocation_fails(rank, world, seed):
    from ficco.ops.all_gather_matmul.spec import SPEC

    inputs = make_inputs(seed, world, (8, 16), (4,), torch.float32)
    out = []
    with ficco.config.scope(transport="ccl"):
        out.append(_outcome(lambda: _right(inputs, rank, schedule="ring")))   # agreed
    with ficco.config.scope(transport="ccl", timeout=2):
        if rank == 1:
            real = SPEC.buffers

            def no_memory(*args, **kwargs):
                SPEC.buffers = real
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                                   "can't allocate memory: you tried to allocate 1024 bytes")
            SPEC.buffers = no_memory
        out.append(_outcome(lambda: _right(inputs, rank, schedule="ring")))
    ficco.shutdown()
    # (the default deadline: rank 1 resets at once, rank 0 only when its own wait expired)
    with ficco.config.scope(transport="ccl"):
        out.append(_outcome(lambda: _right(inputs, rank, schedule="ring")))
    ficco.shutdown()
    return out


def test_a_local_allocation_failure_is_named_local_and_shutdown_clears_it():
    """Before: a TransportError (blaming the transport for this rank's memory), and on ccl the
    group stayed poisoned after ficco.shutdown() (as after a pending collective). Now the
    buffers are made before the call check: the failure is this rank's own (FiccoError naming
    the allocation), nothing is pending in the group, and shutdown on every rank clears it."""
    results = harness.pool(2).run(_allocation_fails, random.randrange(1 << 30))
    zero, one = results
    assert zero[0][0] == one[0][0] == "ok", results
    kind, message = one[1]
    assert kind == "FiccoError" and "allocat" in message and "rank 1" in message, results
    assert zero[1][0] != "ok", results
    for out in results:
        assert out[2][0] == "ok" and out[2][1] <= ROW_TOL[torch.float32], results
