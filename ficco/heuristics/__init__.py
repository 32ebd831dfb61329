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
from typing import Callable

from .. import config, schedules
from ..errors import ConfigError, InvalidArgumentError
from ..problem import Problem
from . import profiles
from .decision import SELECTORS, Decision, decision_inputs
from .model import model_choice
from .paper import paper_choice
from .tune import tune_choice

log = logging.getLogger("ficco")
_logged: set = set()
_logged_lock = threading.Lock()


def choose(problem: Problem, *, transport: str = "dma", target: str = "cpu",
           selector: str | None = None, forced: str | None = None,
           forced_by: str | None = None,
           measure: Callable[[str], float] | None = None,
           agree: Callable[[bool], bool] | None = None) -> Decision:
    """The Decision for ``problem``: which schedule runs, chosen by whom, and why.

    ``target`` ("cpu", "cuda:sm_90", "rocm:gfx942", …) picks the built-in profile when
    ``FICCO_PROFILE`` is unset; ``FICCO_TOPOLOGY`` overrides the profile's topology.
    ``measure(name) -> seconds`` is required by the ``tune`` selector only; ``agree(flag)``
    (collective: True when every rank passes True) lets it trust a cache file only when every
    rank has the entry.

    >>> from ficco.problem import Problem
    >>> choose(Problem(8, 8, (8,), "float32", 2), forced="ring", forced_by="argument").reason
    'forced by argument'
    """
    if transport not in ("dma", "ccl"):
        raise InvalidArgumentError(f"choose() needs a resolved transport, dma or ccl; got "
                                   f"{transport!r}")
    profile = profiles.resolve(target)
    topology = config.topology() or profile.topology
    inputs = decision_inputs(problem, profile.name, topology)
    if forced is not None:
        schedules.get(forced)   # an unknown name raises with the valid list
        decision = Decision(forced, transport, "forced", inputs, {},
                            f"forced by {forced_by or 'argument'}")
        return _logged_once(problem, decision)
    selector = selector or config.selector()
    if problem.world == 1:
        # Nothing to gather: every schedule is the same plain GEMM; don't simulate or time.
        decision = Decision("serial", transport, selector, inputs, {},
                            "one rank: nothing to gather, a plain GEMM")
        return _logged_once(problem, decision)
    if selector == "paper":
        low, high = config.paper_thresholds()
        if not low < high:
            raise ConfigError(f"FICCO_PAPER_LOW={low} must be below FICCO_PAPER_HIGH={high}")
        name, score, reason = paper_choice(problem, profile, low, high)
        decision = Decision(name, transport, "paper", {**inputs, "paper_score": score},
                            {name: score}, reason)
    elif selector == "model":
        name, scores, reason = model_choice(problem, profile, topology, transport,
                                            config.copy_engines())
        decision = Decision(name, transport, "model", inputs, scores, reason)
    elif selector == "tune":
        name, scores, reason = tune_choice(problem, transport=transport, target=target,
                                           topology=topology, measure=measure, agree=agree)
        decision = Decision(name, transport, "tune", inputs, scores, reason)
    else:
        raise ConfigError(f"selector {selector!r} is not valid; use one of: "
                          f"{', '.join(SELECTORS)}")
    return _logged_once(problem, decision)


def _logged_once(problem: Problem, decision: Decision) -> Decision:
    """``FICCO_LOG=info`` (or debug) logs each decision once per problem key and selector."""
    level = config.log_level()
    if level not in ("info", "debug"):
        return decision
    key = (problem.key(), decision.selector, decision.transport, decision.inputs.get("profile"))
    with _logged_lock:
        if key in _logged:
            return decision
        _logged.add(key)
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO if level == "info" else logging.DEBUG)
    if not log.handlers and not logging.getLogger().handlers:
        # Nobody configured logging: without a handler Python would drop INFO records.
        log.addHandler(logging.StreamHandler())
    log.info("ficco decision for M=%d n=%d K=%d %s W=%d: %s (%s) - %s",
             problem.big_m, problem.n_total, problem.k, problem.dtype, problem.world,
             decision.schedule, decision.selector, decision.reason)
    return decision


__all__ = ["choose", "Decision", "SELECTORS", "profiles"]
