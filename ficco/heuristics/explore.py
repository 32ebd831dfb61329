"""``auto``'s default mode (``FICCO_AUTO=explore``): the shortlist runs as the key's real calls.

Timing a shortlist in front of a key's first call stalls the caller (the up-front mode,
:func:`ficco.heuristics.auto._measure`). Here nothing runs that the caller did not ask for:
every call of the key is one full, correct call, and only which schedule it runs changes
while the key explores. Call by call (``i``, the key's calls on this group's session):

1. **call 0** (the first sight) runs ``serial`` over ccl where ccl is a candidate (the
   process group's collective, then the GEMM: what the caller would run without ficco, with
   no workspace to grow), else serial over the one transport. It needs no model (its
   predictions, tens of milliseconds of simulation on the host, would be a stall of their
   own) and no exchange beyond the call's agreement: the decision this group agreed on is
   looked up in memory; whether every rank holds an entry from another group or the cache
   file is asked at call 1, in one exchange (a found entry decides from then on);
2. **calls 1 .. M** run serial (the other transport's serial once, its warm-up), and
   after each call, outside its timer, the model makes :attr:`Explore.pieces_per_call` of its
   predictions (:func:`ficco.heuristics.model.predict`, memoised), so ``M`` is a function of
   how many there are, the same on every rank;
3. then the model's shortlist (:func:`ficco.heuristics.auto.shortlist`, from the now
   memoised predictions) runs: one warm-up call of each candidate not run yet, then
   :attr:`Explore.rounds` rounds, each the shortlist in an order shuffled by the round's
   number (alike on every rank, as the up-front mode's rounds);
4. ``lag`` calls later (the backend's :attr:`~ficco.backends.base.Backend.timing_lag`: GPUs read
   their events two calls late, so no call waits for its own work) the next call **settles**
   before it runs: every call's seconds, this rank's, go to every rank in one exchange; the
   slowest rank's decide by ``auto``'s rules (the fastest, never one measured slower than the
   better serial: an overlapped schedule runs only beyond :data:`~ficco.heuristics.auto.MARGIN`
   of it in the rounds' medians *and* in the median of its per-round ratios to it, the serials
   settled the same way where they measured within
   :data:`~ficco.heuristics.auto.SERIALS_CLOSE`); the decision is cached as the up-front
   mode's (memory and file).

What each call runs is a pure function of ``i`` and of agreed data (the problem, the
candidate transports, the offered schedules, the model's predictions): every rank runs the
same candidate on the same call, with no exchange. Calls are timed by the backend without a
synchronize (:meth:`~ficco.backends.base.Backend.started`: the host clock on CPU, where a call
returns once its work ran; CUDA/HIP events on the compute stream on GPUs). A call whose rank
cannot time (a graph capture, torch.compile tracing) does not explore: it runs the model's pick
and the key's count does not move. A call that failed leaves its slot without a time on its
rank, which the exchange reads as missing on every rank; a failure that poisons the group drops
the session, and the exploration with it, on every rank (``ficco.shutdown()``).

Example, one scripted rank whose ring calls take 1 ms and serial's 2 ms::

    >>> import tempfile
    >>> from ficco import config
    >>> from ficco.heuristics import choose
    >>> from ficco.heuristics.measured import Scripted
    >>> from ficco.plan.problem import Problem
    >>> live = Scripted(lambda name, via: 1e-3 if name == "ring" else 2e-3)
    >>> p = Problem(64, 64, (64,), "float32", 2)
    >>> with config.scope(cache_dir=tempfile.mkdtemp(), auto="explore"):
    ...     d = choose(p, transport=("dma",), target="cpu", selector="auto", live=live)
    ...     ran = drive(d.exploring, live)
    >>> d.schedule, ran[0], ran[1:3], d.exploring.settled.final
    ('serial', ('serial', 'dma'), [('serial', 'dma'), ('serial', 'dma')], True)
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from .decision import Decision
from .measured import Candidate

#: explorations a session holds at once (the oldest is dropped first: every rank meets new
#: keys in the same order, so every rank drops the same one)
EXPLORING_KEPT = 256


@dataclass(frozen=True)
class Explore:
    """How a key explores: ``pieces_per_call`` model predictions after each early call,
    ``rounds`` rounds of the shortlist."""

    pieces_per_call: int = 2
    rounds: int = 7


EXPLORE = Explore()


class Exploration:
    """One key's exploration on one group's session (module doc). ``pieces()``: the model's
    predictions, one callable each (listed at call 1); ``model()``: its banded choice (from those predictions,
    memoised); ``shortlist_of(choice)``: the candidates; ``finish(exploration, seconds)``: the
    final Decision from the agreed seconds (``auto``'s rules, cache and log)."""

    def __init__(self, key: str, transports: tuple[str, ...], pieces: Callable[[], list],
                 model: Callable, shortlist_of: Callable, finish: Callable, lag: int,
                 current: Callable[[Exploration], Decision],
                 ask: Callable | None = None, plan: Explore | None = None):
        plan = plan or EXPLORE
        self.key, self.transports, self.lag, self.plan = key, transports, lag, plan
        serials = [("serial", via) for via in transports]
        self.safe: Candidate = serials[0]
        self.serials = [c for c in serials if c != self.safe] + [self.safe]
        self._pieces: list | None = None
        self._make_pieces = pieces
        #: the calls that run serial while the model predicts (a function of how many
        #: predictions there are, so the same on every rank; known from call 1)
        self.model_calls = 1
        self._model, self._shortlist_of, self._finish = model, shortlist_of, finish
        self.calls = 0                        # the key's calls that ran a candidate
        self.slots: list[tuple[int, Candidate, str]] = []   # (call, candidate, role)
        self.watches: dict[int, object] = {}  # call -> this rank's watch
        self.choice = None                    # the model's banded choice, once made
        self.candidates: list[Candidate] | None = None
        self.order: list[tuple[Candidate, str]] | None = None
        self.model_s = 0.0                    # this rank's host seconds in the model
        self.settled: Decision | None = None
        self._ask = ask
        self.current = current(self)

    # -- what runs ------------------------------------------------------------------------------
    def begin(self, live) -> bool:
        """Before a call runs: whether the key is decided now. At the second call every rank
        is asked about the cache (``ask``: an entry every rank holds, one exchange); once due,
        the exchange that settles it (:meth:`settle`). Collective where it exchanges."""
        if self.settled is None and self.calls == 1 and self._ask is not None:
            ask, self._ask = self._ask, None
            self.settled = ask(live)
        if self.settled is None and self.due():
            self.settle(live)
        return self.settled is not None

    def due(self) -> bool:
        """Whether this call settles the decision (before it runs)."""
        if self.settled is not None or self.calls <= self.model_calls:
            return False
        order = self._order()
        return self.calls >= self.model_calls + 1 + len(order) + self.lag

    def next_call(self) -> tuple[int, Candidate, str]:
        """``(call, candidate, role)`` of this call: what every rank runs now."""
        i = self.calls
        if i == 0:
            candidate, role = self.safe, "first call"
        elif i == 1 or i <= self.model_calls:
            if self._pieces is None:     # (listed at call 1: the first call lists nothing)
                self._pieces = list(self._make_pieces())
                self.model_calls = max(-(-len(self._pieces) //
                                         max(self.plan.pieces_per_call, 1)), 1)
            # (the other transports' serials once each, their warm-up; then the safe one: a
            # loser's call costs, and these calls' times decide nothing)
            candidate = self.serials[i - 1] if i < len(self.serials) else self.safe
            role = "serial while the model predicts"
        else:
            order = self._order()
            j = i - self.model_calls - 1
            candidate, role = order[j] if j < len(order) else (self.safe,
                                                               "the timings not read yet")
        self.calls = i + 1
        self.slots.append((i, candidate, role))
        return i, candidate, role

    def record(self, call: int, watch: object) -> None:
        """This rank's (stopped) watch of ``call``."""
        self.watches[call] = watch

    def after_call(self) -> None:
        """The model's predictions due after this call (outside its timer)."""
        # (after calls 1 .. M: never after the first call, which must cost what a call costs)
        if self._pieces and 2 <= self.calls <= self.model_calls + 1:
            started = time.perf_counter()
            for _ in range(self.plan.pieces_per_call):
                if not self._pieces:
                    break
                self._pieces.pop(0)()
            self.model_s += time.perf_counter() - started

    def model_choice(self):
        """The model's banded choice, its remaining predictions made now."""
        if self.choice is None:
            started = time.perf_counter()
            if self._pieces is None:
                self._pieces = list(self._make_pieces())
            while self._pieces:
                self._pieces.pop(0)()
            self.choice = self._model()
            self.model_s += time.perf_counter() - started
        return self.choice

    def _order(self) -> list[tuple[Candidate, str]]:
        if self.order is None:
            choice = self.model_choice()
            self.candidates = candidates = list(self._shortlist_of(choice))
            ran = {c for _, c, _ in self.slots}
            order = [(c, "warm-up") for c in candidates if c not in ran]
            rounds = self.plan.rounds if len(candidates) > 1 else 0
            for index in range(rounds):
                shuffled = list(candidates)
                random.Random(index + 1).shuffle(shuffled)
                order += [(c, f"round {index + 1}") for c in shuffled]
            self.order = order
        return self.order

    # -- the decision -----------------------------------------------------------------------------
    def settle(self, live) -> Decision:
        """One exchange of every call's seconds (this rank's; missing: a failed call), the
        slowest rank's decide (:meth:`seconds`, then ``finish``). Collective."""
        mine = [live.read(self.watches[i]) if i in self.watches else -1.0
                for i, _, _ in self.slots]
        answers = live.everyone((*mine, self.model_s))
        columns = list(zip(*answers))
        agreed = [None if min(column) < 0 else max(column) for column in columns[:-1]]
        self.model_s = max(columns[-1])
        self.settled = self._finish(self, agreed)
        self.watches.clear()
        return self.settled

    def seconds(self, agreed: list) -> tuple[dict, dict]:
        """From the agreed seconds of every call: ``(median seconds per candidate, per round
        {candidate: seconds})``. A candidate's median is over its rounds; one without a timed
        round (a shortlist of one; failed calls) takes its other calls' but the first, else
        infinity (it cannot win)."""
        assert self.candidates is not None
        rounds: dict[str, dict] = {}
        others: dict[Candidate, list] = {c: [] for c in self.candidates}
        for (i, candidate, role), t in zip(self.slots, agreed):
            if t is None or candidate not in others:
                continue
            if role.startswith("round "):
                rounds.setdefault(role, {})[candidate] = t
            elif i > 0:
                others[candidate].append(t)
        seconds = {}
        for c in self.candidates:
            timed = [row[c] for row in rounds.values() if c in row] or others[c]
            seconds[c] = statistics.median(timed) if timed else float("inf")
        return seconds, rounds


def paired(rounds: dict, pick: Candidate, base: Candidate) -> float | None:
    """The median over rounds of ``pick``'s seconds over ``base``'s in the same round (None:
    no round timed both): two calls of one round share the machine's state of the moment."""
    ratios = [row[pick] / row[base] for row in rounds.values()
              if pick in row and base in row and row[base] > 0]
    return statistics.median(ratios) if ratios else None


def drive(exploration: Exploration, live, calls: int | None = None) -> list[Candidate]:
    """Run ``exploration`` on a scripted group (:class:`~ficco.heuristics.measured.Scripted`:
    each call's seconds are ``live.run``'s) until it settles (or ``calls`` calls): the
    candidates the calls ran, in order. Doctests and unit tests; the runtime drives real
    calls the same way (``ficco.runtime.path``)."""
    ran: list[Candidate] = []
    while exploration.settled is None and (calls is None or len(ran) < calls):
        if exploration.begin(live):
            break
        i, candidate, _ = exploration.next_call()
        exploration.record(i, live.run(*candidate))
        exploration.after_call()
        ran.append(candidate)
    return ran
