"""``auto``'s default mode (``FICCO_AUTO=explore``): a new key's first call runs serial, its
next calls run the shortlist as the real calls, timed, and one exchange of the slowest rank's
times settles the decision. Offline on scripted ranks (threads exchanging through a board),
then on live CPU ranks (rank helpers: tests/explore_cases.py)."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from ficco import config
from ficco.heuristics import auto, choose, explore
from ficco.heuristics.measured import Scripted
from ficco.plan.problem import Problem

from .. import explore_cases, harness
from ..reference import ROW_TOL

MS = 1e-3
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
       "all_to_all_grouped_mm", "grouped_mm_all_to_all")


@pytest.fixture
def fresh(tmp_path):
    auto.CACHE.forget()
    with config.scope(cache_dir=str(tmp_path), auto="explore"):
        yield tmp_path
    auto.CACHE.forget()


class _Board:
    """Scripted ranks in threads that exchange through one board (every rank's value, in rank
    order, once every rank gave its own); counts the exchanges."""

    def __init__(self, world):
        self.world, self.values = world, [None] * world
        self.barrier, self.exchanges = threading.Barrier(world, timeout=30), 0

    def rank(self, rank, seconds):
        board = self

        class Rank(Scripted):
            def everyone(self, value):
                board.values[rank] = value
                board.barrier.wait()
                out = list(board.values)
                if rank == 0:
                    board.exchanges += 1
                board.barrier.wait()
                return out

        return Rank(seconds)


def _explore_on_threads(problem, clocks, root, transports=("dma", "ccl"), shortlist=None):
    """Each rank (a thread, its own scripted clock) explores ``problem`` to the end: per rank
    (what its calls ran, the settled Decision); and the board."""
    board = _Board(len(clocks))
    out: list = [None] * len(clocks)

    def rank_main(rank):
        live = board.rank(rank, clocks[rank])
        with config.scope(cache_dir=root, auto="explore"):
            d = choose(problem, transport=transports, target="cpu", selector="auto", live=live)
            out[rank] = (explore.drive(d.exploring, live), d.exploring.settled)

    real = auto.shortlist
    if shortlist is not None:
        auto.shortlist = lambda choice, via: list(shortlist)
    try:
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(clocks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        auto.shortlist = real
    return out, board


def test_ranks_with_opposite_clocks_run_the_same_calls_and_agree_in_one_exchange(fresh):
    """Rank 0 sees ring at 1 ms and serial at 2 ms, rank 1 ring at 3 ms: alone, rank 0 would
    keep ring and rank 1 serial. Every call ran the same candidate on both, and the slowest
    rank's times decided once: serial (dma), on both."""
    shortlist = [("ring", "dma"), ("serial", "dma"), ("serial", "ccl")]
    def clock(ring):
        return lambda n, v: {"ring": ring, "serial": 2 * MS}.get(n, 3 * MS) * (
            2 if v == "ccl" else 1)

    clocks = [clock(1 * MS), clock(3 * MS)]
    problem = Problem(64, 64, (64,), "float32", 2)
    out, board = _explore_on_threads(problem, clocks, str(fresh), shortlist=shortlist)
    (ran0, d0), (ran1, d1) = out
    assert ran0 == ran1 and set(ran0) == set(shortlist), (ran0, ran1)
    assert (d0.schedule, d0.transport) == (d1.schedule, d1.transport) == ("serial", "dma")
    assert d0.final and d0.measured == d1.measured
    # the cache asked once (second call), the decision agreed in one exchange
    assert board.exchanges == 2, board.exchanges
    rows = {(n, v): s for n, v, _, s, _ in d0.measured}
    assert rows[("ring", "dma")] == 3 * MS and rows[("serial", "dma")] == 2 * MS   # slowest
    # where both ranks see ring faster beyond the margin, ring runs (another key)
    fast = [lambda n, v: {"ring": 1 * MS, "serial": 2 * MS}.get(n, 3 * MS)] * 2
    out, _ = _explore_on_threads(Problem(128, 64, (64,), "float32", 2), fast, str(fresh),
                                 shortlist=shortlist)
    assert [(d.schedule, d.transport) for _, d in out] == [("ring", "dma")] * 2


def test_exploration_keeps_serial_unless_beyond_the_margin_round_by_round(fresh):
    """2% faster than serial (inside the 3% margin): serial; the first call runs serial and
    needs no model; the call order is a pure function of the call count."""
    problem = Problem(64, 64, (64,), "float32", 2)
    shortlist = [("ring", "dma"), ("serial", "dma")]
    near = [lambda n, v: {"ring": 0.98 * MS, "serial": 1 * MS}.get(n, 3 * MS)]
    (ran, d), = _explore_on_threads(problem, near, str(fresh), ("dma",), shortlist)[0]
    assert ran[0] == ("serial", "dma") and (d.schedule, d.transport) == ("serial", "dma")
    assert "inside the 3% margin" in d.reason, d.reason
    auto.CACHE.forget()       # and a new cache directory: the same key explores again
    (again, _), = _explore_on_threads(problem, near, str(fresh / "again"), ("dma",),
                                      shortlist)[0]
    assert again == ran
    assert "explored" in str(d) and "round 1" in str(d)     # explain(): the calls


def test_a_rank_that_cannot_time_at_first_sight_takes_the_model_and_explores_nothing(fresh):
    live = Scripted(lambda n, v: 1 * MS, blocked="torch.compile is tracing")
    problem = Problem(64, 64, (64,), "float32", 2)
    d = choose(problem, transport=("dma", "ccl"), target="cpu", selector="auto", live=live)
    model = choose(problem, transport=("dma", "ccl"), target="cpu", selector="model")
    assert d.exploring is None and not d.final and live.exploring == {} and live.runs == []
    assert (d.schedule, d.transport) == (model.schedule, model.transport)
    assert "torch.compile is tracing" in d.decided_by


def test_a_cache_entry_every_rank_holds_ends_the_exploration_at_the_second_call(fresh):
    problem = Problem(64, 64, (64,), "float32", 2)
    clock = [lambda n, v: {"ring": 1 * MS, "serial": 2 * MS}.get(n, 3 * MS)]
    (ran, d), = _explore_on_threads(problem, clock, str(fresh), ("dma",))[0]
    auto.CACHE.forget()                      # a new process: only the file remembers
    live = Scripted(clock[0])
    first = choose(problem, transport=("dma",), target="cpu", selector="auto", live=live)
    assert first.exploring is not None and first.schedule == "serial"
    ran = explore.drive(first.exploring, live)
    assert len(ran) == 1 and first.exploring.settled.schedule == d.schedule, ran


# -- live CPU ranks ------------------------------------------------------------------------------
@pytest.mark.parametrize("op", OPS)
def test_every_explored_call_is_exact_whichever_schedule_it_ran(tmp_path, op):
    """Forced exploration: every schedule the model priced, over both transports, runs as
    one of the key's calls; every call's result is exact against float64 on every rank, and
    every rank ran the same schedule on every call."""
    results = harness.pool(2).run(explore_cases.forced_exploration, op,
                                  random.randrange(1 << 30), str(tmp_path), timeout_s=240)
    (ran0, err0, d0, _), (ran1, err1, d1, text) = results
    assert ran0 == ran1 and d0 == d1, (ran0, ran1)
    assert max(err0 + err1) <= ROW_TOL[torch.float32], (err0, err1)
    explored = set(ran0)
    assert len(explored) >= 6 and {("serial", "dma"), ("serial", "ccl")} <= explored, explored
    assert "explored" in text and "round 1" in text, text


def test_live_ranks_with_opposite_clocks_agree_on_one_decision(tmp_path):
    results = harness.pool(2).run(explore_cases.opposite_clocks, random.randrange(1 << 30),
                                  str(tmp_path), timeout_s=240)
    (ran0, err0, d0, _, _), (ran1, err1, d1, text, mid) = results
    assert ran0 == ran1 and d0 == d1 == ("serial", "dma"), (ran0, d0, d1)
    # explain() in the middle: not settled, the calls so far and what each ran
    assert "not settled yet" in mid and "3 so far" in mid and "0: serial (dma)" in mid, mid
    assert ("ring", "dma") in ran0 and max(err0 + err1) <= ROW_TOL[torch.float32]
    assert ran0[0] == ("serial", "dma") and ran0[-1] == d0     # first call, then as decided
    assert "3.000 ms" in text, text                            # ring: the slowest rank's


def test_an_interrupted_exploration_starts_again_alike_on_every_rank(tmp_path):
    results = harness.pool(2).run(explore_cases.interrupted, random.randrange(1 << 30),
                                  str(tmp_path), timeout_s=240)
    (ran0, err0, failed0, d0), (ran1, err1, failed1, d1) = results
    assert failed0 and failed1 and [at for at, _ in failed0] == [at for at, _ in failed1]
    assert ran0 == ran1 and d0 == d1, (ran0, ran1)
    after = ran0[failed0[-1][0] + 1:]
    assert after[0] == ("serial", "dma") and ("ring", "dma") in after, after  # from the start
    assert max(err0 + err1) <= ROW_TOL[torch.float32]


def test_nothing_explores_while_torch_compile_traces(tmp_path):
    results = harness.pool(2).run(explore_cases.no_exploring_while_tracing,
                                  random.randrange(1 << 30), str(tmp_path), timeout_s=240)
    assert results[0][:-1] == results[1][:-1] or [r[:4] for r in results[0]] == \
        [r[:4] for r in results[1]], results
    for rows in results:
        first, *eager, traced, last = rows
        assert first[2] is False and first[3] == -1, rows      # no exploration made
        assert all(row[3] == i + 1 for i, row in enumerate(eager)), rows
        assert traced[3] == eager[-1][3] and traced[2] is False, rows   # the count unmoved
        assert "cannot time now: torch.compile is tracing" in traced[5], rows
        assert last[3] == traced[3] + 1, rows
        assert max(row[4] for row in rows) <= ROW_TOL[torch.float32], rows


def test_on_the_fake_gpu_exploring_calls_never_synchronize_and_a_capture_explores_nothing(
        tmp_path):
    """Exploring calls are timed with events read two calls later: none of them blocks the
    host on the device (the settling call waits for old events only); a graph captured in the
    middle runs the model's pick, leaves the key's count where it was and replays exactly."""
    results = harness.pool(3, {"FICCO_TIMEOUT": "20"}).run(
        explore_cases.on_the_fake_gpu, random.randrange(1 << 30), str(tmp_path), timeout_s=240)
    ran = [[row[0] for row in rows] for rows, _ in results]
    assert ran[0] and ran.count(ran[0]) == len(ran), ran      # every rank, every call alike
    for rows, captured in results:
        before, after, invalidated, replayed, why = captured
        assert before == after and invalidated is None and replayed <= 1e-4, captured
        assert "cannot time now" in why and "captured" in why, why
        assert rows[-1][1] is True and len({ran for ran, *_ in rows}) >= 2, rows
        exploring = [waits for ran, final, waits, _, _ in rows[:-1] if not final]
        assert exploring and all("device synchronize" not in w for w in exploring), rows
        assert max(err for *_, err in rows) <= 1e-4, rows


def test_ranks_whose_auto_modes_differ_are_refused_not_left_waiting(tmp_path):
    results = harness.pool(2).run(explore_cases.modes_differ, random.randrange(1 << 30),
                                  str(tmp_path), timeout_s=120)
    for raised, text in results:
        assert raised == "MismatchError" and "auto_mode" in text, results
