"""Rank-side helpers of tests/engine/test_explore.py: ``auto``'s default mode, which runs the
shortlist as the key's real calls, on live CPU ranks."""
from __future__ import annotations

import torch

import ficco
from ficco.heuristics import auto, explore

from .ep_cases import dispatch_reference, make_case, round_trip_reference
from .reference import max_row_rel_err

MS = 1e-3


def _every_candidate(choice, transports):
    """A shortlist of every schedule the model priced, over every transport (forced
    exploration), the model's pick first."""
    every = [(name, via) for via in transports for name in sorted(choice.per_transport[via])]
    pick = (choice.schedule, choice.transport)
    return [pick, *[c for c in every if c != pick]]


class _Calls:
    """Make one op's calls on fresh data of one key: ``call()`` returns the error against
    float64 of that call's result."""

    def __init__(self, op, rank, world, seed):
        self.op, self.rank, self.world = op, rank, world
        gen = torch.Generator().manual_seed(seed)
        if op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
            self.rows, self.k, self.n = 8, 16, 12
        else:
            self.case = make_case(seed, world, 2, max_rows=12)
        self.gen = gen

    def call(self) -> float:
        rank, world, gen = self.rank, self.world, self.gen
        if self.op == "all_gather_matmul":
            x = torch.randn(world, self.rows, self.k, dtype=torch.float64, generator=gen)
            b = torch.randn(self.k, self.n, dtype=torch.float64, generator=gen)
            ref = x.reshape(-1, self.k) @ b
            ref.scale = x.reshape(-1, self.k).abs() @ b.abs()
            return max_row_rel_err(ficco.all_gather_matmul(x[rank].float(), b.float()), ref)
        if self.op in ("matmul_reduce_scatter", "matmul_all_reduce"):
            full = torch.randn(world * self.rows, self.k, dtype=torch.float64, generator=gen)
            b = torch.randn(self.k, self.n, dtype=torch.float64, generator=gen)
            cols = slice(rank * self.k // world, (rank + 1) * self.k // world)
            ref = full @ b
            ref.scale = full.abs() @ b.abs()
            if self.op == "matmul_reduce_scatter":
                rows = slice(rank * self.rows, (rank + 1) * self.rows)
                got = ficco.matmul_reduce_scatter(full[:, cols].float(), b[cols].float())
                ref, scale = ref[rows], ref.scale[rows]
                ref.scale = scale
                return max_row_rel_err(got, ref)
            return max_row_rel_err(ficco.matmul_all_reduce(full[:, cols].float(),
                                                           b[cols].float()), ref)
        counts, xs, w, w2 = self.case
        local = slice(rank * 2, rank * 2 + 2)
        y, recv = ficco.all_to_all_grouped_mm(xs[rank].float(), counts[rank], w[local].float())
        if self.op == "all_to_all_grouped_mm":
            return max_row_rel_err(y, dispatch_reference(counts, xs, w, rank, 2)[0])
        z = ficco.grouped_mm_all_to_all(y, recv, w2[local].float())
        return max_row_rel_err(z, round_trip_reference(counts, xs, w, w2, rank))


def forced_exploration(rank, world, op, seed, root):
    """Every schedule the model priced for ``op``, over both transports, explored as the
    key's real calls (one round): per call what ran and its error against float64; the
    settled decision. The combine's key explores behind the dispatch's (each of its calls
    runs a dispatch first, settled by then)."""
    from ficco.runtime import path as runtime

    real_shortlist, real_plan = auto.shortlist, explore.EXPLORE
    auto.shortlist = _every_candidate
    explore.EXPLORE = explore.Explore(pieces_per_call=8, rounds=1)
    ran, errors, session = [], [], None
    try:
        ficco.shutdown()          # (the pool's sessions: decisions of earlier tests' keys)
        with ficco.config.scope(selector="auto", auto="explore", cache_dir=root):
            auto.CACHE.forget()
            calls = _Calls(op, rank, world, seed)
            session = ficco.session_of()
            for _ in range(200):
                errors.append(calls.call())
                ran.append(runtime.last_run())
                if session.last.final and len(ran) > 1:
                    break
            decision = session.last
    finally:
        auto.shortlist, explore.EXPLORE = real_shortlist, real_plan
        auto.CACHE.forget()
    return ran, errors, (decision.schedule, decision.transport), str(decision)


def opposite_clocks(rank, world, seed, root):
    """Rank 1's clock sees the opposite of rank 0's for ring against serial (a test hook on
    the backend's watch): rank 0 alone would keep ring, rank 1 serial; the slowest rank's
    times decide, so both keep serial (dma). Per call what ran and its error; the decision."""
    from ficco.backends import get_backend
    from ficco.runtime import path as runtime

    shortlist = [("ring", "dma"), ("serial", "dma"), ("serial", "ccl")]
    planted = {0: {"ring": 1 * MS, ("serial", "dma"): 2 * MS, ("serial", "ccl"): 4 * MS},
               1: {"ring": 3 * MS, ("serial", "dma"): 2 * MS, ("serial", "ccl"): 4 * MS}}[rank]
    ficco.shutdown()          # (the pool's sessions: decisions of earlier tests' keys)
    backend = get_backend()
    real_stopped, real_shortlist = backend.stopped, auto.shortlist
    session = ficco.session_of()

    def stopped(watch):
        real_stopped(watch)
        last = session.last
        return planted.get(last.schedule, planted.get((last.schedule, last.transport)))

    backend.stopped = stopped
    auto.shortlist = lambda choice, transports: list(shortlist)
    ran, errors = [], []
    try:
        with ficco.config.scope(selector="auto", auto="explore", cache_dir=root):
            auto.CACHE.forget()
            calls = _Calls("all_gather_matmul", rank, world, seed)
            for _ in range(200):
                errors.append(calls.call())
                ran.append(runtime.last_run())
                if len(ran) == 3:     # explain() in the middle: local, what ran so far
                    mid = ficco.explain(torch.zeros(calls.rows, calls.k),
                                        torch.zeros(calls.k, calls.n)).decided_by
                if session.last.final and len(ran) > 1:
                    break
            decision = session.last
    finally:
        del backend.stopped
        auto.shortlist = real_shortlist
        auto.CACHE.forget()
    return ran, errors, (decision.schedule, decision.transport), str(decision), mid


def interrupted(rank, world, seed, root):
    """A key's exploration interrupted by a failure on rank 1 (its 6th call raises inside
    the call; rank 0's same call times out waiting for it): both ranks' sessions are
    poisoned, ``ficco.shutdown()`` on both drops them with the exploration, and the key's
    calls explore again from its first. Per call what ran (None: failed) and its error."""
    from ficco.runtime import path as runtime

    real_execute, real_shortlist = runtime.execute_plan, auto.shortlist
    count = [0]

    def failing(*args, **kwargs):
        count[0] += 1
        if rank == 1 and count[0] == 6:
            raise RuntimeError("injected failure of an exploring call")
        return real_execute(*args, **kwargs)

    runtime.execute_plan = failing
    auto.shortlist = lambda choice, transports: [("ring", "dma"), ("serial", "dma")]
    ran, errors, failed = [], [], []
    try:
        ficco.shutdown()          # (the pool's sessions: decisions of earlier tests' keys)
        with ficco.config.scope(selector="auto", auto="explore", cache_dir=root,
                                transport="dma", timeout=4):
            auto.CACHE.forget()
            calls = _Calls("all_gather_matmul", rank, world, seed)
            session = ficco.session_of()
            for _ in range(200):
                try:
                    errors.append(calls.call())
                except Exception as exc:  # noqa: BLE001 - what the test looks at
                    failed.append((len(ran), type(exc).__name__))
                    ran.append(None)
                    ficco.shutdown()
                    torch.distributed.barrier()
                    session = ficco.session_of()
                    continue
                ran.append(runtime.last_run())
                if session.last.final and len(ran) > 1:
                    break
            decision = session.last
    finally:
        runtime.execute_plan, auto.shortlist = real_execute, real_shortlist
        auto.CACHE.forget()
    return ran, errors, failed, (decision.schedule, decision.transport)


def no_exploring_while_tracing(rank, world, seed, root):
    """A call made while torch.compile traces (a test hook on ``is_compiling``) neither
    explores nor moves the key's count: at the key's first sight and in the middle of its
    exploration it runs the model's pick, exact. What ran and each call's count."""
    from ficco.runtime import path as runtime

    real = torch.compiler.is_compiling
    out = []
    ficco.shutdown()
    with ficco.config.scope(selector="auto", auto="explore", cache_dir=root):
        auto.CACHE.forget()
        calls = _Calls("all_gather_matmul", rank, world, seed)
        session = ficco.session_of()

        def traced():
            torch.compiler.is_compiling = lambda: True
            try:
                err = calls.call()
            finally:
                torch.compiler.is_compiling = real
            return err

        def explored() -> int:
            found = list(session.exploring.values())
            return found[0].calls if found else -1

        err = traced()                                  # first sight, tracing
        out.append(("traced first", runtime.last_run(), session.last.final, explored(), err))
        for _ in range(4):
            err = calls.call()
            out.append(("eager", runtime.last_run(), session.last.final, explored(), err))
        err = traced()                                  # mid-exploration, tracing
        out.append(("traced", runtime.last_run(), session.last.final, explored(), err,
                    session.last.decided_by))
        err = calls.call()
        out.append(("eager", runtime.last_run(), session.last.final, explored(), err))
    auto.CACHE.forget()
    return out


def on_the_fake_gpu(rank, world, seed, root):
    """On the fake GPU (dma): a key explored with events and no device synchronize in its
    calls, a graph captured in the middle of it running the model's pick without moving the
    count; every call exact. Per call (what ran, settled, blocking host calls it made, count,
    error); the capture's (count before, count after, invalidated, error after replay)."""
    from ficco.runtime import path as runtime

    from . import fake_gpu
    from .fault_cases import _capture, _inputs, _setup, _warm_up

    device = _setup("cuda", 8)
    _warm_up(rank, world, "ring")
    shards, bs, _, refs = _inputs(seed % 1000 + 3, world, (8, 16), 4)
    a, b = shards[rank].clone(), bs[0].clone()
    rows, captured = [], None
    try:
        with ficco.config.scope(selector="auto", auto="explore", cache_dir=root,
                                transport="dma"):
            auto.CACHE.forget()
            session = ficco.session_of()

            def count() -> int:
                found = list(session.exploring.values())
                return found[0].calls if found else -1

            for i in range(80):
                if i == 5:
                    before = count()
                    with _capture() as graph:
                        out = ficco.all_gather_matmul(a, b)
                    after = count()
                    graph.replay()
                    torch.cuda.synchronize()
                    captured = (before, after, graph.invalidated, max_row_rel_err(out, refs[0]),
                                session.last.decided_by)
                seen = len(device.blocking)
                out = ficco.all_gather_matmul(a, b)
                waits = [what for _, what in device.blocking[seen:]]
                torch.cuda.synchronize()
                rows.append((runtime.last_run(), session.last.final, waits, count(),
                             max_row_rel_err(out, refs[0])))
                if session.last.final and i > 5:
                    break
    finally:
        auto.CACHE.forget()
        ficco.shutdown()
        fake_gpu.uninstall()
    return rows, captured


def modes_differ(rank, world, seed, root):
    """Rank 0 explores, rank 1 measures up front (FICCO_AUTO differs): the call's agreement
    refuses it on both (a MismatchError naming the setting) instead of the two modes' runs
    waiting for each other. What each rank raised."""
    from ficco.errors import MismatchError

    ficco.shutdown()
    mode = "explore" if rank == 0 else "upfront"
    try:
        with ficco.config.scope(selector="auto", auto=mode, cache_dir=root, timeout=10):
            auto.CACHE.forget()
            _Calls("all_gather_matmul", rank, world, seed).call()
    except MismatchError as exc:
        return "MismatchError", str(exc)
    finally:
        ficco.shutdown()
        auto.CACHE.forget()
    return None, ""
