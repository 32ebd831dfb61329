"""The ``auto`` selector, ficco's default: the model shortlists, the live group decides.

The model (:mod:`ficco.heuristics.model`) is right only as far as its profile and its
validated error band go, and ficco promises never to be slower than serial on the machine it
runs on. So the first time a problem key is seen on a live group, ``auto``:

1. **shortlists** with the model (:func:`shortlist`): its pick; the fastest predicted
   schedule of every other family (:func:`family`) predicted within the band of the fastest
   prediction, where the model cannot tell them apart; ``serial`` on every candidate transport
   (dma and ccl when every rank shares a host);
2. **times** the shortlist on the live group with the call's own operands
   (:func:`ficco.heuristics.measured.time_candidates`, :data:`ROUNDS`): the slowest rank's
   median of interleaved runs, agreed by every rank; CUDA events on GPUs;
3. **keeps the fastest**, never one measured slower than the best serial: an overlapped
   schedule runs only when it measured more than :data:`MARGIN` faster than it, in the rounds
   and again back to back with it (:func:`ficco.heuristics.measured.head_to_head`);
4. **caches** the winner in memory and in ``<FICCO_CACHE_DIR>/auto/`` (:func:`cache_key`:
   like ``tune``'s, plus the device SKU, with the rows bucketed so nearby lengths share one
   measurement). A file entry counts only once every rank holds the identical entry.

The first call's extra cost is bounded by :data:`ROUNDS`: one warm-up run of each
shortlisted schedule (at most six; baselines first), then timed rounds (at most 7) only while
they stay within 5 serial-call times or 50 ms, whichever is more: a slow call gets one round;
when the budget binds, a candidate whose warm-up run took over twice serial's is dropped, and
where not even one round fits, the serials and the fastest other candidate run once more and
decide. A fast call (serial's warm-up run under 50 ms) whose budget allowed fewer than 3
rounds runs its finalists (the serials and the fastest other) until each has 3 timed runs:
one late run on a busy machine must not decide alone. The cost is logged once per key
(``FICCO_LOG=info``) and reported in ``explain()``.

Where the group cannot measure (no live group: ``explain``, offline ``choose``; a rank inside
a CUDA graph capture or a torch.compile trace) a cached decision is used if there is one,
else the model's, marked not final so the next call that can time measures, and the Decision
says so.

Example, offline (no live group: the model's pick, provisional)::

    >>> from ficco.plan.problem import Problem
    >>> from ficco.heuristics import choose
    >>> d = choose(Problem(64, 32, (16,), "float32", 2), target="cpu", selector="auto")
    >>> d.selector, d.final, d.decided_by.startswith("the model")
    ('auto', False, True)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .. import config, logs, schedules
from ..plan.problem import Problem, bucket
from . import measured, sku
from .decision import Decision
from .explore import EXPLORING_KEPT, Exploration, paired
from .measured import Candidate, Live, ficco_version
from .model import BandedChoice

CACHE = measured.Cache("auto")
#: one warm-up round, then up to 7 timed rounds within 5 serial-call times or 50 ms; a
#: candidate slower than twice serial in the warm-up is dropped when the budget binds; a fast
#: call's finalists get at least 3 timed runs; an overlapped winner meets the best serial again
#: in 5 back-to-back pairs (one for a slow call) and runs only if it still wins by the margin
#: (5, not 3: in ``bench default`` on the 2-core VM, 3 pairs once passed a pick that then ran
#: at 1.16x serial's time, and another pair median read 0.73x for a pick that ran at 0.97x)
ROUNDS = measured.Rounds(warmup=1, most=7, budget=5.0, floor_s=0.05, prune=2.0, confirm=3,
                         duel=5)
#: an overlapped schedule must measure this much faster than the best serial to run: within
#: it, the medians of a few runs on a shared machine cannot tell the two apart
MARGIN = 0.03
#: the two serials (one per transport) meet back to back when the slower measured within this
#: fraction of the faster in the rounds
SERIALS_CLOSE = 0.5


#: families named by two words (the rest: the name's first word)
TWO_WORD_FAMILIES = ("by-expert", "one-shot", "two-shot", "rs-ag")


def family(name: str) -> str:
    """The family of a schedule name: its first word (``serial``, ``ring``, ``uniform``,
    ``hetero``, ``gated``, ``chunked``), or its first two for :data:`TWO_WORD_FAMILIES`.

    >>> family("hetero-fused-1d"), family("ring-bidir"), family("one-shot-sm")
    ('hetero', 'ring', 'one-shot')
    """
    for prefix in TWO_WORD_FAMILIES:
        if name.startswith(prefix):
            return prefix
    return name.split("-")[0]


def bucketed(problem):
    """``problem`` as its cache key sees it: rank 0, and the rows of a dense op (a
    :class:`~ficco.plan.problem.Problem`'s ``m``: the shard for an all-gather, all rows for a
    reduce-scatter) rounded up to three significant bits, whole units (at most 25% more: 0-8
    stay, then 10, 12, 14, 16, 20, 24, ...), so a variable-length workload measures once per
    bucket, not once per length. The expert ops' problems bucket their routing already.

    >>> bucketed(Problem(100, 8, (8,), "float32", 2, rank=1)).m
    112
    """
    if not isinstance(problem, Problem):
        return problem
    return replace(problem, m=bucket(problem.m // problem.unit) * problem.unit, rank=0)


def cache_key(problem, transports: tuple[str, ...], target: str, topology: str,
              copy_engines: int | None = None) -> str:
    """The auto cache key, as a readable string: op and candidate transports, the bucketed
    problem's key, the backend target, the device SKU, topology, ficco version (and
    ``FICCO_COPY_ENGINES`` when set).

    >>> cache_key(Problem(100, 8, (8,), "float32", 2), ("dma", "ccl"), "cpu", "switch"
    ...           ).split("|")[:5]
    ['auto', 'all_gather_matmul/dma,ccl', "key=(112, 8, (8,), 'float32', 2)", 'cpu', 'sku=cpu']
    """
    part = sku.sku_of(sku.local_props(target)).id
    key = ["auto", f"{problem.op}/{','.join(transports)}", f"key={bucketed(problem).key()!r}",
           target, f"sku={part}", topology, f"ficco={ficco_version()}"]
    if copy_engines is not None:
        key.append(f"copy_engines={copy_engines}")
    return "|".join(key)


def shortlist(choice: BandedChoice, transports: tuple[str, ...]) -> list[Candidate]:
    """What ``auto`` times (module doc), the model's pick first.

    >>> from ficco.heuristics.model import BandedChoice
    >>> times = {"dma": {"serial": 4.0, "ring": 3.0, "uniform-fused-1d": 2.9,
    ...                  "uniform-fused-2d": 2.95, "hetero-fused-1d": 2.0}}
    >>> pick = BandedChoice("hetero-fused-1d", "dma", times["dma"], "", "hetero-fused-1d", "dma",
    ...                     1.0, 0.5, "x", times)
    >>> shortlist(pick, ("dma",))
    [('hetero-fused-1d', 'dma'), ('uniform-fused-1d', 'dma'), ('ring', 'dma'), ('serial', 'dma')]
    """
    predicted = {(name, via): s for via, times in choice.per_transport.items()
                 for name, s in times.items()}
    fastest = min(predicted.values())
    ordered = sorted(predicted, key=lambda c: (predicted[c], transports.index(c[1]), c[0]))
    best_of: dict[str, Candidate] = {}
    for candidate in ordered:
        best_of.setdefault(family(candidate[0]), candidate)
    picks = [(choice.schedule, choice.transport)]
    picks += [c for f, c in best_of.items() if f not in (family(choice.schedule), "serial")
              and predicted[c] <= fastest * (1 + choice.band)]
    picks += [("serial", via) for via in transports]
    return list(dict.fromkeys(picks))


def _verdict(seconds: dict, candidates: list[Candidate], base: Candidate | None = None
             ) -> tuple[Candidate, str]:
    """(what runs, why) from agreed measured seconds; ``candidates[0]`` is the model's pick.
    ``base``: the serial that won the serials' head-to-head (default: the fastest serial
    measured); the other serials do not run."""
    def ms(c):
        return f"{seconds[c] * 1e3:.3f} ms"

    order = {c: i for i, c in enumerate(candidates)}
    if base is None:
        base = min((c for c in candidates if c[0] == "serial"),
                   key=lambda c: (seconds[c], order[c]))
    best = min((c for c in candidates if c[0] != "serial" or c == base),
               key=lambda c: (seconds[c], order[c]))
    pick = candidates[0]
    if best[0] == "serial":
        fastest = min((c for c in candidates if c[0] == "serial"),
                      key=lambda c: (seconds[c], order[c]))
        if fastest != best:      # the serials' back-to-back pairs overturned the rounds
            return best, (f"serial ({best[1]}) beat serial ({fastest[1]}) back to back "
                          f"({ms(best)} against {ms(fastest)} in the rounds); nothing else "
                          f"measured faster")
        if pick[0] == "serial":
            return best, f"serial ({best[1]}) measured fastest, {ms(best)}"
        return best, (f"the model's pick {pick[0]} ({pick[1]}) measured {ms(pick)}, slower than "
                      f"serial ({best[1]}) at {ms(best)}: serial runs")
    gain = seconds[base] / seconds[best] - 1 if seconds[best] > 0 else 0.0
    if not seconds[best] < seconds[base] * (1 - MARGIN):
        return base, (f"{best[0]} ({best[1]}) measured only {gain:.1%} faster than serial "
                      f"({base[1]}, {ms(base)}), inside the {MARGIN:.0%} margin: serial runs")
    whose = "the model's pick" if best == pick else \
        f"the model picked {pick[0]} ({pick[1]}), {ms(pick)}"
    return best, (f"{best[0]} ({best[1]}) measured fastest, {ms(best)}, {gain:.0%} faster "
                  f"than serial ({base[1]}, {ms(base)}); {whose}")


def _settle_serials(live: Live, timing, candidates: list[Candidate], pairs: int
                    ) -> tuple[Candidate, float, str]:
    """(the serial the rest must beat, the measuring cost so far, what settled it). Where the
    other transport's serial measured within :data:`SERIALS_CLOSE` of the fastest, the two meet
    in ``pairs`` back-to-back pairs and the pairs decide: on the 2-core VM the rounds once
    had serial over ccl 2% ahead of serial over dma, which then ran at 2.4x its time."""
    seconds = timing.seconds
    serials = sorted((c for c in candidates if c[0] == "serial"),
                     key=lambda c: (seconds[c], candidates.index(c)))
    base, cost_s = serials[0], timing.cost_s
    if len(serials) < 2 or not ROUNDS.duel or \
            seconds[serials[1]] > seconds[base] * (1 + SERIALS_CLOSE):
        return base, cost_s, ""
    other = serials[1]
    ratio, spent = measured.head_to_head(live, other, base, pairs)
    winner = other if ratio < 1 else base
    return winner, cost_s + spent, (
        f"; serial ({other[1]}) measured within {SERIALS_CLOSE:.0%} of serial ({base[1]}), "
        f"then took {ratio:.2f}x its time in {_pairs(pairs)}: serial ({winner[1]}) is the "
        f"baseline")


def _pairs(pairs: int) -> str:
    return f"{pairs} back-to-back pair{'s' if pairs > 1 else ''}"


def _measure(problem, live: Live, choice: BandedChoice, transports: tuple[str, ...],
             key: str, persist: bool) -> dict:
    """Time the shortlist, keep the winner (memory and file), log it once; the cache entry."""
    candidates = shortlist(choice, transports)
    timing = measured.time_candidates(live, candidates, ROUNDS,
                                      [c for c in candidates if c[0] == "serial"])
    serial_s = min(s for c, s in timing.seconds.items() if c[0] == "serial")
    pairs = ROUNDS.duel if timing.baseline_s < ROUNDS.floor_s else 1
    # The rounds' medians were taken rounds apart: on a busy machine a drift in load can favour
    # one candidate. So close calls are settled again back to back (measured.head_to_head):
    # first which serial, then whether the overlapped winner beats it.
    base, cost_s, settled = _settle_serials(live, timing, candidates, pairs)
    (name, via), verdict = _verdict(timing.seconds, candidates, base)
    duel = settled
    if name != "serial" and ROUNDS.duel:
        ratio, spent = measured.head_to_head(live, (name, via), base, pairs)
        cost_s += spent
        duel += (f"; then {name} ({via}) against serial ({base[1]}) in {_pairs(pairs)}: "
                 f"{ratio:.2f}x serial's time")
        if not ratio < 1 - MARGIN:
            verdict = (f"{name} ({via}) measured fastest in the rounds ({verdict}), but back "
                       f"to back with serial ({base[1]}) it took {ratio:.2f}x serial's time, "
                       f"not beyond the {MARGIN:.0%} margin: serial runs")
            name, via = base
    how = (f"median of {timing.rounds} interleaved runs each" if timing.rounds > 1 else
           "one timed run each after a warm-up run" if not timing.dropped else
           "a slow call: one warm-up run each, then one timed run of the serials and the "
           "fastest other")
    if timing.rounds < ROUNDS.confirm and timing.baseline_s < ROUNDS.floor_s:
        how += f", {ROUNDS.confirm} of the serials and the fastest other"
    how += duel
    predicted = {(n, v): s for v, times in choice.per_transport.items() for n, s in times.items()}
    entry = {"schedule": name, "transport": via, "model": [choice.schedule, choice.transport],
             "rows": [[n, v, predicted.get((n, v)), timing.seconds[(n, v)],
                       "warm-up run only (dropped)" if (n, v) in timing.dropped else ""]
                      for n, v in candidates],
             "verdict": verdict, "how": how, "rounds": timing.rounds, "cost_s": cost_s,
             "serial_s": serial_s, "measured_key": repr(problem.key()),
             "shortlist": f"the model's pick, the other families within its "
                          f"\u00b1{choice.band:.0%} ({choice.band_class}), serial"}
    CACHE.keep(key, entry, live.agreed, persist)
    if config.log_level() in ("info", "debug"):
        logs.ready().info(
            "ficco auto: first sight of %s %s: measured %d candidates on the live group in "
            "%.3f ms (%.1f serial-call times, %s): %s", problem.op, key, len(candidates),
            cost_s * 1e3, cost_s / serial_s if serial_s > 0 else 0.0, how,
            verdict)
    return entry


def _valid(entry: dict, problem, target: str, transports: tuple[str, ...]) -> bool:
    """A file entry this process can run: its transport a candidate, its schedule offered."""
    via = entry.get("transport")
    return via in transports and entry.get("schedule") in schedules.offered(
        target, via, problem.op, problem) and isinstance(entry.get("rows"), list)


def auto_choice(problem, *, transports: tuple[str, ...], target: str, topology: str,
                copy_engines: int | None, live: Live | None, inputs: dict,
                model: Callable[[], BandedChoice], persist: bool = True,
                mode: str = "explore", pieces: Callable[[], list] | None = None,
                exploring: dict | None = None) -> Decision:
    """The ``auto`` Decision for ``problem`` (module doc); ``model()`` gives the model's
    banded choice (called only when nothing is cached). ``mode``: ``explore`` (a new key's
    first call runs serial and its next calls explore the shortlist,
    :mod:`ficco.heuristics.explore`; ``pieces()``: the model's predictions, one callable
    each) or ``upfront`` (the shortlist is timed before the first call runs). ``exploring``:
    the explorations of the group to report on where no live group is given (``explain``)."""
    key = cache_key(problem, transports, target, topology, copy_engines)
    book = live.exploring if live is not None else exploring
    found = book.get(key) if book is not None else None
    if found is not None:
        return found.settled or (found.current if live is not None else _progress(found))

    def valid(e):
        return _valid(e, problem, target, transports)

    entry: dict | None = None
    if live is not None and mode == "explore":
        # No exchange at the first call: what this group agreed on, else explore (which asks
        # every rank about the cache at its second call); a rank that cannot time takes the
        # model's pick (ranks capture a graph, or trace, alike)
        entry = CACHE.remembered(key, live.agreed)
        if entry is not None:
            return _from_entry(entry, key, False, problem, inputs)
        blocked = live.cannot_time()
        if blocked is None:
            return _explore(problem, live, transports, key, persist, inputs, model, pieces,
                            valid)
        why_not: str | None = f"this rank cannot time now: {blocked}"
    else:
        entry, why_not = measured.first_sight(CACHE, key, live, valid, persist)
    fresh = False
    if entry is None:
        choice = model()
        if live is None or why_not is not None:
            return Decision(choice.schedule, choice.transport, "auto", inputs, choice.scores,
                            f"not measured yet: the model's pick: {choice.reason}",
                            band=choice.band, band_class=choice.band_class,
                            decided_by=f"the model's prediction (not measured: {why_not})",
                            final=False)
        entry, fresh = _measure(problem, live, choice, transports, key, persist), True
    return _from_entry(entry, key, fresh, problem, inputs)


def _from_entry(entry: dict, key: str, fresh: bool, problem, inputs: dict) -> Decision:
    """The Decision a cache entry (either mode's) stands for."""
    rows = tuple((n, v, p, s, note) for n, v, p, s, note in entry["rows"])
    scores = {n if v == entry["transport"] else f"{n} ({v})": s for n, v, _, s, _ in rows}
    when = "at first sight" if fresh else f"at the key's first sight (cache {key})"
    if entry.get("mode") == "explore":
        when = "as the key's calls" if fresh else f"as the key's calls (cache {key})"
    if not fresh and entry["measured_key"] != repr(problem.key()):
        when += f", on the nearby problem {entry['measured_key']} of the same bucket"
    cost = entry["cost_s"] / entry["serial_s"] if entry["serial_s"] > 0 else 0.0
    if entry.get("mode") == "explore":
        spent = (f"no extra runs: the losing candidates' calls took {entry['cost_s'] * 1e3:.3f} "
                 f"ms = {cost:.1f} serial-call times over the winner's, once per key; the "
                 f"model's predictions {entry['model_s'] * 1e3:.3f} ms of host time, in pieces "
                 f"after the early calls")
        explored = tuple(tuple(row) for row in entry["explored"])
    else:
        spent = (f"measuring cost {entry['cost_s'] * 1e3:.3f} ms = {cost:.1f} serial-call "
                 f"times, once per key")
        explored = ()
    return Decision(entry["schedule"], entry["transport"], "auto", inputs, scores,
                    f"measured {when}: {entry['verdict']}", measured=rows,
                    decided_by=(f"measured on the live group ({entry['how']}; slowest rank); "
                                f"shortlist: {entry['shortlist']}; {spent}"),
                    explored=explored)


# -- the default mode: the shortlist explored as the key's real calls ---------------------------
def _explore(problem, live: Live, transports: tuple[str, ...], key: str, persist: bool,
             inputs: dict, model: Callable[[], BandedChoice],
             pieces: Callable[[], list] | None, valid: Callable[[dict], bool]) -> Decision:
    """A new key's exploration (:mod:`ficco.heuristics.explore`), kept on the group's
    session: its exploring Decision (the first call runs serial)."""
    def ask(group: Live) -> Decision | None:
        """At the second call: an entry every rank holds (another group's, the file's)."""
        entry, _ = measured.first_sight(CACHE, key, group, valid, persist)
        if entry is None:
            return None
        group.exploring.pop(key, None)
        return _from_entry(entry, key, False, problem, inputs)

    def finish(exploration: Exploration, agreed: list) -> Decision:
        entry = _explored_entry(problem, exploration, agreed)
        CACHE.keep(key, entry, live.agreed, persist)
        live.exploring.pop(key, None)
        if config.log_level() in ("info", "debug"):
            logs.ready().info(
                "ficco auto: %s %s explored %d candidates in %d of its calls (%s): %s",
                problem.op, key, len(entry["rows"]), len(entry["explored"]), entry["how"],
                entry["verdict"])
        return _from_entry(entry, key, True, problem, inputs)

    def current(exploration: Exploration) -> Decision:
        name, via = exploration.safe
        return Decision(name, via, "auto", inputs, {}, (
            f"exploring: the key's first call runs serial ({via}) and its next calls run the "
            f"shortlisted schedules as the real calls until one exchange settles the "
            f"decision"), decided_by="not settled yet (FICCO_AUTO=explore)", final=False,
                        exploring=exploration)

    book = live.exploring
    while len(book) >= EXPLORING_KEPT:
        book.pop(next(iter(book)))
    exploration = Exploration(key, transports, pieces or list, model,
                              lambda choice: shortlist(choice, transports), finish, live.lag,
                              current, ask)
    book[key] = exploration
    return exploration.current


def _progress(exploration: Exploration) -> Decision:
    """What ``explain()`` shows of an exploration in flight: which candidate each call ran
    (times are agreed only when it settles)."""
    done = ", ".join(f"{i}: {name} ({via})" for i, (name, via), _ in exploration.slots)
    d = exploration.current
    return replace(d, exploring=None, decided_by=(
        f"not settled yet: exploring as the key's real calls, {exploration.calls} so far "
        f"({done or 'none'})"))


def _explored_entry(problem, exploration: Exploration, agreed: list) -> dict:
    """The cache entry an exploration settles on: ``auto``'s rules (:func:`_verdict`, the
    margin, the serials settled where close) on the slowest rank's seconds, the paired
    ratios taken within each round."""
    candidates = exploration.candidates
    assert candidates is not None
    seconds, rounds = exploration.seconds(agreed)
    serials = sorted((c for c in candidates if c[0] == "serial"),
                     key=lambda c: (seconds[c], candidates.index(c)))
    base, settled = serials[0], ""
    if len(serials) > 1 and seconds[serials[1]] <= seconds[base] * (1 + SERIALS_CLOSE):
        ratio = paired(rounds, serials[1], base)
        if ratio is not None:
            winner = serials[1] if ratio < 1 else base
            settled = (f"; serial ({serials[1][1]}) measured within {SERIALS_CLOSE:.0%} of "
                       f"serial ({base[1]}), then took {ratio:.2f}x its time round by round: "
                       f"serial ({winner[1]}) is the baseline")
            base = winner
    (name, via), verdict = _verdict(seconds, candidates, base)
    duel = settled
    if name != "serial":
        ratio = paired(rounds, (name, via), base)
        duel += (f"; {name} ({via}) against serial ({base[1]}) round by round: "
                 f"{'-' if ratio is None else f'{ratio:.2f}'}x serial's time")
        if ratio is None or not ratio < 1 - MARGIN:
            verdict = (f"{name} ({via}) measured fastest in the rounds ({verdict}), but "
                       f"round by round it took {'-' if ratio is None else f'{ratio:.2f}'}x "
                       f"serial ({base[1]})'s time, not beyond the {MARGIN:.0%} margin: "
                       f"serial runs")
            name, via = base
    choice = exploration.choice
    assert choice is not None       # (made when the shortlist was)
    predicted = {(n, v): t for v, times in choice.per_transport.items() for n, t in times.items()}
    winner_s = seconds[(name, via)]
    explored = [[i, n, v, role, t] for (i, (n, v), role), t in zip(exploration.slots, agreed)]
    cost_s = sum(max(t - winner_s, 0.0) for i, _, _, _, t in explored
                 if t is not None and i > 0 and winner_s < float("inf"))
    timed = len(rounds)
    how = (f"explored as the key's calls 2-{len(explored)}: serial while the model "
           f"predicted, a warm-up call of each other candidate, then "
           f"{timed} round{'s' if timed != 1 else ''} of the {len(candidates)} candidates, "
           f"median each{duel}")
    return {"schedule": name, "transport": via, "model": [choice.schedule, choice.transport],
            "rows": [[n, v, predicted.get((n, v)), seconds[(n, v)], ""] for n, v in candidates],
            "verdict": verdict, "how": how, "rounds": timed, "cost_s": cost_s,
            "serial_s": seconds[base], "measured_key": repr(problem.key()),
            "shortlist": f"the model's pick, the other families within its "
                         f"\u00b1{choice.band:.0%} ({choice.band_class}), serial",
            "mode": "explore", "explored": explored, "model_s": exploration.model_s}
