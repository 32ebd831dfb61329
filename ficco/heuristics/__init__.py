"""Choosing a schedule per GEMM (DESIGN §5): device profiles, the paper's rule, a simulator
backed cost model and measured tuning, behind one call.

Example::

    >>> from ficco.problem import Problem
    >>> from ficco.heuristics import choose
    >>> d = choose(Problem(32768, 8192, (1024,), "bfloat16", 8), target="rocm:gfx942",
    ...            selector="paper")
    >>> d.schedule, d.selector
    ('hetero-fused-1d', 'paper')

Precedence: a forced schedule (call argument, else ``FICCO_SCHEDULE``; the API resolves which
and passes ``forced``/``forced_by``) > the selector (argument, else ``FICCO_SELECTOR``).
Selectors never look at the rank, so every rank reaches the same decision.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from .. import config, schedules
from ..config import TRANSPORTS
from ..errors import ConfigError, InvalidArgumentError
from ..problem import Problem
from . import bands, profiles
from .decision import SELECTORS, Decision, decision_inputs
from .model import banded_choice
from .paper import paper_choice
from .tune import tune_choice

log = logging.getLogger("ficco")
_logged: set = set()
_logged_lock = threading.Lock()


class Live(Protocol):
    """A live group the ``tune`` selector measures on (the runtime gives one made from the
    call's session, :class:`ficco.runtime.Live`): both methods are collective, every rank
    asks the same in the same order."""

    def measure(self, name: str) -> float:
        """The slowest rank's seconds of schedule ``name`` on this call (same on every rank)."""
        ...

    def agree(self, flag: bool) -> bool:
        """True when ``flag`` is True on every rank."""
        ...


@dataclass(frozen=True)
class Timings:
    """A :class:`Live` from plain functions, for tuning off a group (tests, tools):
    ``measure(name) -> seconds``; ``agree`` defaults to trusting this rank alone."""

    timing: Callable[[str], float]
    agreeing: Callable[[bool], bool] | None = None

    def measure(self, name: str) -> float:
        return self.timing(name)

    def agree(self, flag: bool) -> bool:
        return flag if self.agreeing is None else self.agreeing(flag)


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
    live: Live | None = None


def _paper(problem: Problem, ctx: Context) -> Decision:
    if problem.op != "all_gather_matmul":   # the paper's rule covers the all-gather only
        decision = _model(problem, ctx)
        return replace(decision, reason=f"the paper's rule covers all_gather_matmul only, so "
                                        f"the model chose: {decision.reason}")
    low, high = ctx.paper_thresholds
    name, score, reason = paper_choice(problem, ctx.profile, low, high)
    return Decision(name, ctx.transports[0], "paper", {**ctx.inputs, "paper_score": score},
                    {name: score}, reason)


def _model(problem: Problem, ctx: Context) -> Decision:
    """The model weighs every candidate transport (with the transport left to ficco, the
    process group's collectives, few ops, beat a plan of many DMA copies for small GEMMs whose
    launches alone outlast the work) and keeps an overlapped schedule only when its predicted
    gain over the best baseline exceeds the validated error band of the problem's shape class
    (:mod:`ficco.heuristics.bands`)."""
    width, cls = bands.band(problem, ctx.profile, ctx.topology)
    # Optional schedules (gated-*: Triton) only where they run on this target.
    choice = banded_choice(problem, ctx.profile, ctx.topology, ctx.transports, ctx.copy_engines,
                           lambda via: schedules.offered(ctx.target, via, problem.op, problem),
                           width, cls)
    return Decision(choice.schedule, choice.transport, "model", ctx.inputs, choice.scores,
                    choice.reason, band=width, band_class=cls)


def _tune(problem: Problem, ctx: Context) -> Decision:
    name, scores, reason = tune_choice(problem, transport=ctx.transports[0], target=ctx.target,
                                       topology=ctx.topology, live=ctx.live)
    return Decision(name, ctx.transports[0], "tune", ctx.inputs, scores, reason)


#: Selector name -> pure function (problem, Context) -> Decision (``tune`` measures through
#: ``Context.live``, which the runtime provides on a live group).
SELECTOR_FUNCTIONS: dict[str, Callable[[Problem, Context], Decision]] = {
    "paper": _paper, "model": _model, "tune": _tune}


def choose(problem: Problem, *, transport: str | tuple[str, ...] = "dma", target: str = "cpu",
           selector: str | None = None, forced: str | None = None,
           forced_by: str | None = None, live: Live | None = None) -> Decision:
    """The Decision for ``problem``: which schedule runs, over which transport, chosen by whom,
    and why.

    ``transport`` is a resolved transport (``"dma"`` or ``"ccl"``) or a tuple of candidates,
    preferred first: the ``model`` selector weighs them all, the others take the first.
    ``target`` ("cpu", "cuda:sm_90", "rocm:gfx942", …) picks the built-in profile when
    ``FICCO_PROFILE`` is unset; ``FICCO_TOPOLOGY`` overrides the profile's topology.
    ``live`` (a :class:`Live`: the group's session, or :class:`Timings` off a group) is
    required by the ``tune`` selector only: it measures each candidate there, and trusts a
    cache file only when every rank has the entry (``live.agree``).

    >>> from ficco.problem import Problem
    >>> choose(Problem(8, 8, (8,), "float32", 2), forced="ring", forced_by="argument").reason
    'forced by argument'
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
        decision = Decision(forced, transports[0], "forced", inputs, {},
                            f"forced by {forced_by or 'argument'}")
        return _logged_once(problem, decision)
    selector = selector or config.selector()
    if selector not in SELECTOR_FUNCTIONS:
        raise ConfigError(f"selector {selector!r} is not valid; use one of: "
                          f"{', '.join(SELECTORS)}")
    if problem.world == 1:
        # Nothing to gather: every schedule is the same plain GEMM; don't simulate or time.
        decision = Decision("serial", transports[0], selector, inputs, {},
                            "one rank: nothing to gather, a plain GEMM")
        return _logged_once(problem, decision)
    low, high = config.paper_thresholds()
    if not low < high:
        raise ConfigError(f"FICCO_PAPER_LOW={low} must be below FICCO_PAPER_HIGH={high}")
    ctx = Context(profile, topology, transports, target, inputs, config.copy_engines(),
                  (low, high), live)
    return _logged_once(problem, SELECTOR_FUNCTIONS[selector](problem, ctx))


def _logged_once(problem: Problem, decision: Decision) -> Decision:
    """``FICCO_LOG=info`` (or debug) logs each decision once: rank, op, shape, schedule,
    transport and selector."""
    level = config.log_level()
    if level not in ("info", "debug"):
        return decision
    op = getattr(problem, "op", "all_gather_matmul")
    key = (op, problem.key(), problem.rank, decision.selector, decision.schedule,
           decision.transport, decision.inputs.get("profile"))
    with _logged_lock:
        if key in _logged:
            return decision
        _logged.add(key)
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO if level == "info" else logging.DEBUG)
    if not log.handlers and not logging.getLogger().handlers:
        # Nobody configured logging: without a handler Python would drop INFO records.
        log.addHandler(logging.StreamHandler())
    log.info("ficco decision rank %d: %s M=%d n=%d K=%d %s W=%d -> schedule %s, transport %s, "
             "selector %s - %s", problem.rank, op, problem.big_m, problem.n_total, problem.k,
             problem.dtype, problem.world, decision.schedule, decision.transport,
             decision.selector, decision.reason)
    return decision


__all__ = ["SELECTORS", "Decision", "Live", "Timings", "choose", "profiles"]
