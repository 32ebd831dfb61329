"""Measuring on the live group, shared by the selectors that time candidates (``tune`` times
every schedule, ``auto`` the model's shortlist): one way to time, one cache, one agreement.

- :class:`Live` is what the runtime hands such a selector on a live group: run the call once
  with a given schedule and transport and say how long it took on this rank, exchange a small
  value with every rank, and say why this rank cannot time now (a CUDA graph being captured).
- :func:`time_candidates` times candidates in interleaved rounds (each round runs every
  candidate once, in an order shuffled by the round's number, so a drift of the machine is
  shared out and no candidate always follows the same one) and returns the slowest rank's
  median per candidate, agreed: every rank gets the same numbers, so the same argmin.
  :class:`Rounds` says how many rounds; with a budget, slow calls get fewer.
- :class:`Cache` keeps winners in memory and in a JSON file under the cache directory;
  :func:`first_sight` trusts a file entry only when every rank holds the identical entry (ranks
  on other hosts may not share the file, and one rank measuring while another reads its cache
  would deadlock), and tells the caller when some rank cannot time.

Every measurement is collective, so every rank must call these in the same order with the
same candidates; nothing here looks at the rank.

Example, with a scripted group of one rank whose ``ring`` runs take 1 ms::

    >>> live = Scripted(lambda name, via: 1e-3 if name == "ring" else 2e-3)
    >>> timing = time_candidates(live, [("serial", "dma"), ("ring", "dma")], Rounds(most=3))
    >>> timing.seconds[("ring", "dma")], timing.rounds, len(live.runs)
    (0.001, 3, 8)
"""
from __future__ import annotations

import hashlib
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .cache import MAX_ENTRIES, EntryFiles
from .profiles import cache_root

Candidate = tuple[str, str]          # (schedule name, transport)


class Live(Protocol):
    """A live group as a measuring selector sees it (the runtime's, made from the call's
    :class:`~ficco.runtime.session.Session`); ``agreed`` is the group's set of cache entries
    ``(cache file, key)`` every rank of it holds (the session's: dropped with it)."""

    agreed: set
    #: the group's explorations in flight, by cache key (``auto``'s default mode:
    #: :mod:`ficco.heuristics.explore`), and how many calls late their timings are read
    exploring: dict
    lag: int

    def run(self, name: str, transport: str) -> float:
        """Run the call once with schedule ``name`` over ``transport``: this rank's seconds
        from its start to its end on the device (collective: every rank runs it)."""

    def read(self, watch) -> float:
        """Seconds of an exploring call's stopped watch (the backend's)."""

    def everyone(self, value: Hashable) -> list:
        """Every rank's ``value``, in rank order (collective, bounded by FICCO_TIMEOUT)."""

    def cannot_time(self) -> str | None:
        """Why this rank cannot run and time the call now, or None."""


@dataclass
class Scripted:
    """A :class:`Live` of one rank whose runs take ``seconds(name, transport)`` without running
    anything (doctests, and tests that plant timings); ``runs`` lists what was run."""

    seconds: Callable[[str, str], float]
    blocked: str | None = None
    runs: list = field(default_factory=list)
    agreed: set = field(default_factory=set)
    exploring: dict = field(default_factory=dict)
    lag: int = 0

    def run(self, name: str, transport: str) -> float:
        self.runs.append((name, transport))
        return float(self.seconds(name, transport))

    def read(self, watch) -> float:
        return float(watch)

    def everyone(self, value):
        return [value]

    def cannot_time(self) -> str | None:
        return self.blocked


@dataclass(frozen=True)
class Rounds:
    """How candidates are timed: ``warmup`` rounds first (each candidate once, in turn,
    baselines first so they absorb what a transport costs only once, e.g. a workspace), then
    up to ``most`` timed rounds. With ``budget``, the timed rounds stop where they would cost
    more than ``budget`` times the fastest baseline's run or ``floor_s``, whichever is more,
    planned from the first timed round's times: a slow call gets fewer rounds. A call whose
    baseline's warm-up run alone takes ``floor_s`` or more is slow enough for its warm-up
    times to plan the rounds: a candidate whose warm-up run took more than ``prune`` times the
    baseline's is dropped when the budget binds (it cannot win), and where not even one round
    fits, one timed run of each baseline and of the fastest other candidate decides. A fast
    call (baseline's warm-up under ``floor_s``) that got fewer than ``confirm`` timed rounds
    runs its finalists (the baselines and the fastest other candidate) until each has
    ``confirm``, so one late run on a busy machine cannot decide alone."""

    warmup: int = 1
    most: int = 5
    budget: float | None = None
    floor_s: float = 0.0
    prune: float | None = None
    confirm: int = 0
    #: back-to-back pairs in which an overlapped winner meets the best baseline again before
    #: it is kept (:func:`head_to_head`); one for a slow call
    duel: int = 0


@dataclass(frozen=True)
class Timing:
    """What :func:`time_candidates` measured, identical on every rank: ``seconds`` per
    candidate (the slowest rank's median of its timed runs; a candidate dropped after the
    warm-up keeps its warm-up time), ``rounds`` timed rounds, ``dropped`` candidates,
    ``cost_s`` the slowest rank's time spent measuring, ``baseline_s`` the fastest baseline's
    warm-up run (the budget's unit)."""

    seconds: dict
    rounds: int
    dropped: tuple
    cost_s: float
    baseline_s: float


def _slowest(live: Live, values: Sequence[float]) -> list[float]:
    """Each value's largest over the ranks (one exchange)."""
    return [max(column) for column in zip(*live.everyone(tuple(values)))]


def _round(live: Live, candidates: list[Candidate], index: int | None, into: dict) -> None:
    """One run of each candidate: in the given order (``index`` None: a warm-up round), else
    in an order shuffled by ``index``, the same on every rank, so that no candidate always
    runs after the same one (a run may leave the next one work, e.g. a collective's threads
    winding down on a busy CPU)."""
    order = list(candidates)
    if index is not None:
        random.Random(index).shuffle(order)
    for candidate in order:
        into[candidate].append(live.run(*candidate))


def time_candidates(live: Live, candidates: list[Candidate], rounds: Rounds,
                    baselines: Sequence[Candidate] = ()) -> Timing:
    """Time every candidate on the live group (module doc); ``baselines`` are never dropped
    and the fastest of them is the budget's unit (none: the fastest candidate). The phases:
    warm-up (:func:`_warm_up`), a slow call's plan from it (:func:`_plan_slow`), the first
    timed round and a fast call's plan from it (:func:`_plan_fast`), the other rounds, the
    finalists' confirming runs (:func:`_confirm`), and the agreed medians."""
    started = time.perf_counter()
    order = [*baselines, *[c for c in candidates if c not in baselines]]
    first = _warm_up(live, order, rounds)
    base = min(first[c] for c in (baselines or order))
    kept, timed = order, rounds.most
    if rounds.budget is not None and base >= rounds.floor_s:
        kept, timed = _plan_slow(rounds, order, baselines, first, base)
    samples: dict = {c: [] for c in kept}
    timed_from = time.perf_counter()
    _round(live, kept, 0, samples)
    if rounds.budget is not None and timed > 1:
        timed = _plan_fast(live, rounds, kept, baselines, samples, timed,
                           time.perf_counter() - timed_from)
    for index in range(1, timed):
        _round(live, kept, index, samples)
    if timed < rounds.confirm and base < rounds.floor_s:
        _confirm(live, rounds, kept, baselines, samples, timed)
    agreed = _slowest(live, [*[statistics.median(samples[c]) for c in kept],
                             time.perf_counter() - started])
    seconds = dict(first)
    seconds.update(zip(kept, agreed[:-1]))
    return Timing({c: seconds[c] for c in candidates}, timed,
                  tuple(c for c in candidates if c not in kept), agreed[-1], base)


def _warm_up(live: Live, order: list[Candidate], rounds: Rounds) -> dict:
    """The warm-up rounds (in ``order``: baselines first); each candidate's last warm-up
    run, the slowest rank's (one exchange)."""
    warm: dict = {c: [] for c in order}
    for _ in range(rounds.warmup):
        _round(live, order, None, warm)
    return dict(zip(order, _slowest(live, [warm[c][-1] for c in order])))


def _plan_slow(rounds: Rounds, order: list[Candidate], baselines: Sequence[Candidate],
               first: dict, base: float) -> tuple[list[Candidate], int]:
    """``(kept, timed rounds)`` of a slow call, from its warm-up times: its warm-up runs are
    mostly its own work (a first run's extra costs, building the plan, a workspace, are small
    beside it). A candidate slower than ``prune`` times the baseline is dropped when the
    budget binds; where not even one round fits, the baselines and the fastest other
    candidate run once. (A fast call's warm-up says little: :func:`_plan_fast`.)"""
    assert rounds.budget is not None
    budget_s = max(rounds.budget * base, rounds.floor_s)
    kept, timed = order, rounds.most
    if rounds.prune is not None and timed * sum(first.values()) > budget_s:
        kept = [c for c in order if c in baselines or first[c] <= rounds.prune * base]
    timed = _rounds_left(budget_s, sum(first[c] for c in kept), timed)
    if timed < 1:
        others = [c for c in kept if c not in baselines]
        kept = [*baselines, *([min(others, key=lambda c: first[c])] if others else [])]
        timed = 1
    return kept, timed


def _plan_fast(live: Live, rounds: Rounds, kept: list[Candidate],
               baselines: Sequence[Candidate], samples: dict, timed: int,
               elapsed: float) -> int:
    """The timed rounds planned again from the first timed round's steady-state times (a
    warm-up run pays first-use costs), the slowest rank's (one exchange)."""
    assert rounds.budget is not None
    *once, elapsed = _slowest(live, [*[samples[c][0] for c in kept], elapsed])
    elapsed = max(elapsed, sum(once))    # (the runs alone, where no clock ran: Scripted)
    steady = dict(zip(kept, once))
    budget_s = max(rounds.budget * min(steady[c] for c in (baselines or kept)),
                   rounds.floor_s)
    return 1 + _rounds_left(budget_s - elapsed, sum(once), timed - 1)


def _confirm(live: Live, rounds: Rounds, kept: list[Candidate],
             baselines: Sequence[Candidate], samples: dict, timed: int) -> None:
    """A fast call with fewer than ``confirm`` rounds: its finalists (the baselines and the
    fastest other candidate so far, agreed in one exchange) run until each has ``confirm``
    timed runs, so one late run on a busy machine cannot decide alone."""
    others = [c for c in kept if c not in baselines]
    if not (baselines and others):
        return
    interim = dict(zip(kept, _slowest(live, [statistics.median(samples[c]) for c in kept])))
    finalists = [*baselines, min(others, key=lambda c: (interim[c], kept.index(c)))]
    for index in range(timed, rounds.confirm):
        _round(live, finalists, index, samples)


def head_to_head(live: Live, pick: Candidate, base: Candidate, pairs: int
                 ) -> tuple[float, float]:
    """``pick`` against ``base`` in ``pairs`` back-to-back pairs, alternating which runs first
    (base-pick, pick-base, ...): the median over the pairs of pick's time over base's (each run
    the slowest rank's), and the slowest rank's seconds spent, agreed in one exchange. A pair
    shares the machine's state of the moment, so a drift in load (a busy neighbour, a
    collective's threads winding down) moves both sides of it: what a few medians taken
    rounds apart cannot tell, a paired ratio can."""
    started = time.perf_counter()
    runs = []
    for index in range(pairs):
        first, second = (base, pick) if index % 2 == 0 else (pick, base)
        a, b = live.run(*first), live.run(*second)
        runs.append((a, b) if first == base else (b, a))
    *slowest, spent = _slowest(live, [*[t for pair in runs for t in pair],
                                      time.perf_counter() - started])
    ratios = [p / b if b > 0 else 1.0 for b, p in zip(slowest[0::2], slowest[1::2])]
    return statistics.median(ratios), spent


def _rounds_left(budget_s: float, per_round_s: float, most: int) -> int:
    return most if per_round_s <= 0 else min(most, max(int(budget_s // per_round_s), 0))


# -- the cache ----------------------------------------------------------------------------------
def ficco_version() -> str:
    module = sys.modules.get("ficco")
    return str(getattr(module, "__version__", "unknown"))


def digest(entry: dict) -> str:
    """A short, process-independent digest of a cache entry (ranks compare these)."""
    text = json.dumps(entry, sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


class Cache:
    """Measured winners by key: in memory, and one small file per key under
    ``<FICCO_CACHE_DIR>/<name>/`` (:class:`~ficco.heuristics.cache.EntryFiles`: bounded, per
    user, atomic writes, stale entries expired; a cache that cannot be read or written is
    warned about, never a failed call). Every rank may write: entries are identical on every
    rank (agreed numbers only). An entry in memory is used without asking the other ranks
    only by a group that agreed on it (its ``agreed`` set, on the group's session): another
    group's ranks may not all have it."""

    def __init__(self, name: str):
        self.file_name = name
        self.files = EntryFiles(name, cache_root)
        self._memory: dict[str, dict] = {}
        self._lock = threading.Lock()

    def path(self) -> Path:
        """The directory of this cache's entry files."""
        return self.files.directory()

    def remembered(self, key: str, agreed: set | None = None) -> dict | None:
        """The entry for ``key`` in memory: any (``agreed`` None, what ``explain`` may show),
        or only if it is in the group's ``agreed`` set."""
        if agreed is not None and (self.file_name, key) not in agreed:
            return None
        with self._lock:
            return self._memory.get(key)

    def remember(self, key: str, entry: dict, agreed: set | None = None) -> None:
        """Keep ``entry`` in memory; ``agreed``: the set of the group that agreed on it."""
        with self._lock:
            if len(self._memory) >= MAX_ENTRIES:     # bounded in memory too
                self._memory.pop(next(iter(self._memory)))
            self._memory[key] = entry
        if agreed is not None:
            agreed.add((self.file_name, key))

    def on_disk(self, key: str) -> dict | None:
        return self.files.get(key)

    def keep(self, key: str, entry: dict, agreed: set | None, persist: bool = True) -> None:
        """Remember ``entry`` (agreed by the group whose set ``agreed`` is) and, with
        ``persist``, write it to its file (a write that fails is warned about)."""
        self.remember(key, entry, agreed)
        if persist:
            self.write(key, entry)

    def write(self, key: str, entry: dict) -> bool:
        return self.files.put(key, entry)

    def forget(self) -> None:
        """Forget what is in memory (tests; the files stay)."""
        with self._lock:
            self._memory.clear()


def first_sight(cache: Cache, key: str, live: Live | None, valid: Callable[[dict], bool],
                persist: bool = True) -> tuple[dict | None, str | None]:
    """``(entry, why not measurable)`` for ``key`` before measuring it: the entry this group
    agreed on (every rank of it remembered it at the same call, so no exchange is needed;
    without a live group, any this process remembers); else what this process knows (from
    another group, else the file) if it is ``valid`` and every rank holds the identical entry
    (one exchange, which also carries each rank's :meth:`Live.cannot_time`); else
    ``(None, None)`` when the group can measure now, or ``(None, reason)`` when it cannot (no
    live group; a rank that cannot time, named)."""
    entry = cache.remembered(key, None if live is None else live.agreed)
    if entry is not None:
        return entry, None
    if live is None:
        return None, "no live group: explain() and offline choose() never measure"
    found = cache.remembered(key) or (cache.on_disk(key) if persist else None)
    word = digest(found) if found is not None and valid(found) else None
    answers = live.everyone((word, live.cannot_time()))
    if word is not None and all(w == word for w, _ in answers):
        cache.remember(key, found, live.agreed)   # type: ignore[arg-type]  # word: a dict
        return found, None
    blocked = [(rank, why) for rank, (_, why) in enumerate(answers) if why]
    if blocked:
        rank, why = blocked[0]
        return None, f"rank {rank} cannot time now: {why}"
    return None, None
