"""Choosing a schedule per GEMM (DESIGN §5): device profiles, the paper's rule, a simulator
backed cost model, and two selectors that measure on the live group (``auto``, the default:
the model's shortlist; ``tune``: every schedule), behind one call.

Example::

    >>> from ficco.plan.problem import Problem
    >>> from ficco.heuristics import choose
    >>> d = choose(Problem(32768, 8192, (1024,), "bfloat16", 8), target="rocm:gfx942",
    ...            selector="paper")
    >>> d.schedule, d.selector
    ('hetero-fused-1d', 'paper')

Precedence: a forced schedule (call argument, else ``FICCO_SCHEDULE``; the API resolves which
and passes ``forced``/``forced_by``) > the selector (argument, else ``FICCO_SELECTOR``).
Selectors never look at the rank, so every rank reaches the same decision (what ``auto`` and
``tune`` measure is agreed across ranks before they pick).
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from .. import config, logs, schedules
from ..config import TRANSPORTS
from ..errors import ConfigError, InvalidArgumentError
from ..plan.problem import ALL_GATHER, COLLECTIVES, DEFAULT_OP, Problem
from . import bands, profiles
from .auto import auto_choice
from .decision import SELECTORS, Decision, decision_inputs
from .measured import Live, Scripted
from .model import BandedChoice, banded_choice, predict, predict_all
from .paper import paper_choice
from .tune import NotMeasured, tune_choice

log = logs.log
_logged: set = set()
_logged_lock = threading.Lock()


@dataclass(frozen=True)
class Context:
    """What a selector may look at besides the problem: the same on every rank."""

    profile: profiles.Profile
    topology: str
    transports: tuple[str, ...]          # candidates, preferred first
    target: str
    inputs: dict
    copy_engines: int | None = None
    paper_thresholds: tuple[float, float] = (1.0, 5.0)
    live: Live | None = None     # the live group, for the selectors that measure
    auto_mode: str = "explore"   # FICCO_AUTO: how auto measures a new key
    exploring: dict | None = None  # the group's explorations, for explain (no live group)


def _paper(problem: Problem, ctx: Context) -> Decision:
    if COLLECTIVES.get(problem.op) != ALL_GATHER:   # the paper's rule covers the all-gather only
        decision = _model(problem, ctx)
        return replace(decision, reason=f"the paper's rule covers the all-gather only, so "
                                        f"the model chose: {decision.reason}")
    low, high = ctx.paper_thresholds
    name, score, reason = paper_choice(problem, ctx.profile, low, high)
    return Decision(name, ctx.transports[0], "paper", {**ctx.inputs, "paper_score": score},
                    {name: score}, reason)


def _banded(problem: Problem, ctx: Context) -> BandedChoice:
    """The model weighs every candidate transport (with the transport left to ficco, the
    process group's collectives, few ops, beat a plan of many DMA copies for small GEMMs whose
    launches alone outlast the work) and keeps an overlapped schedule only when its predicted
    gain over the best baseline exceeds the validated error band of the problem's shape class
    (:mod:`ficco.heuristics.bands`)."""
    width, cls = bands.band(problem, ctx.profile, ctx.topology)
    # Optional schedules (gated-*: Triton) only where they run on this target.
    return banded_choice(problem, ctx.profile, ctx.topology, ctx.transports, ctx.copy_engines,
                         lambda via: schedules.offered(ctx.target, via, problem.op, problem),
                         width, cls)


def _model(problem: Problem, ctx: Context) -> Decision:
    choice = _banded(problem, ctx)
    return Decision(choice.schedule, choice.transport, "model", ctx.inputs, choice.scores,
                    choice.reason, band=choice.band, band_class=choice.band_class)


def _pieces(problem: Problem, ctx: Context) -> list:
    """The model's predictions for :func:`_banded`, one callable each (memoised by
    :func:`ficco.heuristics.model.predict`, so ``_banded`` afterwards only reads them): what
    ``auto``'s exploration makes a few at a time, after its early calls."""
    out = []
    for via in ctx.transports:
        names = schedules.offered(ctx.target, via, problem.op, problem)
        for name in (schedules.names(op=problem.op) if names is None else names):
            out.append(functools.partial(predict, name, problem, ctx.profile, ctx.topology, via,
                                         ctx.copy_engines))
    return out


def _auto(problem: Problem, ctx: Context) -> Decision:
    return auto_choice(problem, transports=ctx.transports, target=ctx.target,
                       topology=ctx.topology, copy_engines=ctx.copy_engines, live=ctx.live,
                       inputs=ctx.inputs, model=lambda: _banded(problem, ctx),
                       mode=ctx.auto_mode, pieces=lambda: _pieces(problem, ctx),
                       exploring=ctx.exploring)


def _tune(problem: Problem, ctx: Context) -> Decision:
    try:
        name, scores, reason = tune_choice(problem, transport=ctx.transports[0],
                                           target=ctx.target, topology=ctx.topology,
                                           live=ctx.live)
    except NotMeasured as why:
        model = _model(problem, replace(ctx, transports=ctx.transports[:1]))
        return replace(
            model, selector="tune", final=False, decided_by=f"model, not tuned: {why}",
            reason=f"not tuned yet ({why}; a cache file entry counts once the first call "
                   f"confirmed it with every rank): the model predicts: {model.reason}")
    return Decision(name, ctx.transports[0], "tune", ctx.inputs, scores, reason,
                    decided_by="measured on the live group (every candidate; slowest rank)")


#: Selector name -> function (problem, Context) -> Decision; ``auto`` and ``tune`` measure
#: through ``Context.live``, which the runtime provides on a live group.
SELECTOR_FUNCTIONS: dict[str, Callable[[Problem, Context], Decision]] = {
    "auto": _auto, "paper": _paper, "model": _model, "tune": _tune}


def _forced_prediction(problem: Problem, profile: profiles.Profile, topology: str,
                       transport: str, target: str, forced: str) -> tuple[dict, str]:
    """A forced schedule's predicted time beside the model's candidates over its transport
    (simulated on the profile): ``(scores, the reason's sentence about it)``."""
    if problem.world == 1:
        return {}, "; one rank: a plain GEMM, nothing to predict"
    names = schedules.offered(target, transport, problem.op, problem)
    scores = predict_all(problem, profile, topology, transport, config.copy_engines(),
                         names if forced in names else [*names, forced])
    best = min(scores, key=lambda name: (scores[name], name))
    return scores, (f"; the model predicts {scores[forced] * 1e3:.3f} ms for it over "
                    f"{transport} (its fastest: {best}, {scores[best] * 1e3:.3f} ms), "
                    f"simulated on {profile.name}/{topology}")


def choose(problem: Problem, *, transport: str | tuple[str, ...] = "dma", target: str = "cpu",
           selector: str | None = None, forced: str | None = None,
           forced_by: str | None = None, live: Live | None = None,
           auto_mode: str | None = None, exploring: dict | None = None) -> Decision:
    """The Decision for ``problem``: which schedule runs, over which transport, chosen by whom,
    and why.

    ``transport`` is a resolved transport (``"dma"`` or ``"ccl"``) or a tuple of candidates,
    preferred first: ``model`` and ``auto`` weigh them all, the others take the first.
    ``target`` ("cpu", "cuda:sm_90", "rocm:gfx942", …) picks the built-in profile when
    ``FICCO_PROFILE`` is unset; ``FICCO_TOPOLOGY`` overrides the profile's topology.
    ``live`` (a :class:`~ficco.heuristics.measured.Live`: the runtime's, made from the call's
    session on a live group; :class:`~ficco.heuristics.measured.Scripted` off a group) lets
    ``auto`` and ``tune`` measure; without it they decide from what they measured before
    in this process, else by the model, and say so (``Decision.final`` False).
    ``auto_mode`` (default ``FICCO_AUTO``): how ``auto`` measures a new key, ``explore`` or
    ``upfront`` (:mod:`ficco.heuristics.auto`); ``exploring``: the group's explorations in
    flight, which ``explain`` reports on without a live group.

    >>> from ficco.plan.problem import Problem
    >>> choose(Problem(8, 8, (8,), "float32", 2), forced="ring", forced_by="argument").reason
    'forced by argument; the model predicts ... ms for it over dma (its fastest: ...'
    """
    transports = (transport,) if isinstance(transport, str) else tuple(transport)
    if not transports or any(t not in TRANSPORTS for t in transports):
        raise InvalidArgumentError(f"choose() needs resolved transports from {TRANSPORTS}; got "
                                   f"{transport!r}")
    profile = profiles.resolve(target)
    topology = config.topology() or profile.topology
    inputs = decision_inputs(problem, profile.name, topology)
    if forced is not None:
        schedules.get(forced, op=problem.op)   # an unknown name raises with the valid list
        scores, predicted = _forced_prediction(problem, profile, topology, transports[0],
                                               target, forced)
        decision = Decision(forced, transports[0], "forced", inputs, scores,
                            f"forced by {forced_by or 'argument'}{predicted}")
        return _logged_once(problem, decision, target)
    selector = selector or config.selector()
    if selector not in SELECTOR_FUNCTIONS:
        raise ConfigError(f"selector {selector!r} is not valid; use one of: "
                          f"{', '.join(SELECTORS)}")
    if problem.world == 1:
        # Nothing to gather: every schedule is the same plain GEMM; don't simulate or time.
        decision = Decision("serial", transports[0], selector, inputs, {},
                            "one rank: nothing to gather, a plain GEMM")
        return _logged_once(problem, decision, target)
    low, high = config.paper_thresholds()
    if not low < high:
        raise ConfigError(f"FICCO_PAPER_LOW={low} must be below FICCO_PAPER_HIGH={high}")
    ctx = Context(profile, topology, transports, target, inputs, config.copy_engines(),
                  (low, high), live, auto_mode or config.auto_mode(), exploring)
    return _logged_once(problem, SELECTOR_FUNCTIONS[selector](problem, ctx), target)


def off_by_default(target: str) -> dict[str, str]:
    """The risky GPU features left off on backend ``target`` until a GPU lease verified them
    there (docs/gpu.md), each with why and how to turn it on; {} off GPUs.

    >>> sorted(off_by_default("cuda:sm_90")), off_by_default("cpu")
    (['FICCO_SIGNAL_PADS=device', 'gated-1d, gated-2d'], {})
    """
    from .. import kernels

    if not target.startswith(("cuda", "rocm", "hip")):
        return {}
    off = {}
    gated = kernels.selectable_reason(target)
    if gated is not None:
        off["gated-1d, gated-2d"] = gated
    if config.get("FICCO_SIGNAL_PADS") != "device":
        off["FICCO_SIGNAL_PADS=device"] = (
            "signal pads are host-mapped by default; device pads (lower flag latency) wait "
            "for a GPU lease to verify the watchdog's release through a stream and the "
            "late-peer path on them; set FICCO_SIGNAL_PADS=device to use them")
    return off


def _logged_once(problem: Problem, decision: Decision, target: str) -> Decision:
    """``FICCO_LOG=info`` (or debug) logs each decision once: rank, op, shape, schedule,
    transport and selector. Says what is off by default on GPUs (:func:`off_by_default`)."""
    off = off_by_default(target)
    if off:
        decision = replace(decision, off=off)
    level = config.log_level()
    if level not in ("info", "debug"):
        return decision
    op = getattr(problem, "op", DEFAULT_OP)
    key = (op, problem.key(), problem.rank, decision.selector, decision.schedule,
           decision.transport, decision.inputs.get("profile"))
    with _logged_lock:
        if key in _logged:
            return decision
        _logged.add(key)
    logs.ready().info("ficco decision rank %d: %s M=%d n=%d K=%d %s W=%d -> schedule %s, transport %s, "
             "selector %s - %s", problem.rank, op, problem.big_m, problem.n_total, problem.k,
             problem.dtype, problem.world, decision.schedule, decision.transport,
             decision.selector, decision.reason)
    return decision


__all__ = ["SELECTORS", "Decision", "Live", "Scripted", "choose", "off_by_default", "profiles"]
