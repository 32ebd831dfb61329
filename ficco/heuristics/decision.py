"""What a selector returns: the chosen schedule and why."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..plan.problem import Problem

SELECTORS = ("auto", "paper", "model", "tune")


def decision_inputs(problem: Problem, profile: str, topology: str) -> dict:
    """The inputs every Decision reports: M, n, K, dtype, world, OTB, MT, profile, topology.

    >>> from ficco.plan.problem import Problem
    >>> decision_inputs(Problem(2, 4, (8,), "float32", 2), "cpu", "switch")["M"]
    4
    """
    return {"M": problem.big_m, "n": problem.n_total, "K": problem.k, "dtype": problem.dtype,
            "world": problem.world, "otb": problem.otb, "mt": problem.gemm_bytes,
            "profile": profile, "topology": topology}


#: What the inputs line abbreviates (FiCCO paper §IV-C, §IV-D).
KEY = ("otb = op-to-byte, the GEMM's FLOPs per byte of mt; mt = its static memory traffic "
       "(MK + KN + MN) x itemsize, in bytes")


@dataclass(frozen=True)
class Decision:
    """The schedule a selector picked for one problem, with its inputs and per-candidate scores.

    ``selector`` is ``"auto"``, ``"paper"``, ``"model"``, ``"tune"`` or ``"forced"``.
    ``scores`` maps a schedule name to predicted seconds (model, auto), measured seconds
    (tune) or the paper's normalised OTB·MT score (paper). ``reason`` is one line for humans.
    ``band`` (model, auto) is the validated relative error of predictions in the problem's
    shape class ``band_class``: an overlapped schedule is kept only when its predicted gain
    exceeds it. A measuring selector (auto, tune) fills ``measured``, rows ``(schedule,
    transport, predicted seconds or None, measured seconds, note)``, and says in
    ``decided_by`` whether the measurement or the model decided (and why the model);
    ``final`` is False for a decision made without measuring where the selector measures (no
    live group, a rank that cannot time): the runtime does not keep it, so the next call that
    can time measures; an exploring one (``exploring``) is kept until its exploration settles.

    >>> d = Decision("serial", "dma", "forced", {"M": 8}, {}, "forced by argument")
    >>> print(d)  # doctest: +NORMALIZE_WHITESPACE
    schedule  serial  (transport dma, selector forced)
    reason    forced by argument
    inputs    M=8
    """

    schedule: str
    transport: str
    selector: str
    inputs: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict)
    reason: str = ""
    band: float | None = None
    band_class: str = ""
    measured: tuple = ()
    decided_by: str = ""
    final: bool = True
    #: GPU features off by default until a GPU lease verified them: feature -> why, how to
    #: turn it on (:func:`ficco.heuristics.off_by_default`)
    off: dict = field(default_factory=dict)
    #: lines naming the kernel the pick runs and the published time it is priced against
    #: (``matmul_all_reduce``: :func:`ficco.heuristics.reductions.priced_against`)
    priced: tuple = ()
    #: ``auto``'s exploration of this key (:class:`ficco.heuristics.explore.Exploration`)
    #: while it runs the shortlist as the key's real calls: the runtime keeps such a
    #: decision and asks it, call by call, what runs
    exploring: Any = field(default=None, compare=False, repr=False)
    #: ``auto``'s explored calls of the key, ``(call, schedule, transport, role, seconds or
    #: None)`` (the slowest rank's seconds; None: the call failed)
    explored: tuple = ()

    def ranked(self) -> list[tuple[str, float]]:
        """Scores best first (lowest seconds; for ``paper`` the single score as given)."""
        return sorted(self.scores.items(), key=lambda item: (item[1], item[0]))

    def __str__(self) -> str:
        lines = [(f"schedule  {self.schedule}  (transport {self.transport}, "
                 f"selector {self.selector})"),
                 f"reason    {self.reason}",
                 "inputs    " + " ".join(f"{k}={_fmt(v)}" for k, v in self.inputs.items())]
        if self.decided_by:
            lines.append(f"decided   {self.decided_by}")
        if "otb" in self.inputs:
            lines.append(f"key       {KEY}")
        if self.band is not None:
            lines.append(f"band      \u00b1{self.band:.0%} simulated-time error of "
                         f"{self.band_class} (python -m ficco.bench validate); overlap is kept "
                         f"only above it")
        for feature, why in self.off.items():
            lines.append(f"off       {feature}: {why}")
        for line in self.priced:
            lines.append(f"priced    {line}")
        if self.measured:
            return "\n".join(lines + self._measured_table() + self._explored_table())
        if self.scores:
            seconds = self.selector in ("auto", "model", "tune", "forced")
            best = min(self.scores.values())
            lines.append(f"scores    {'':2}{'schedule':<20} "
                         + (f"{'time':>13}  {'vs best':>7}" if seconds else f"{'score':>10}"))
            for name, value in self.ranked():
                mark = "*" if name == self.schedule else " "
                if seconds:
                    lines.append(f"          {mark} {name:<20} {value * 1e3:10.3f} ms  "
                                 f"{value / best if best > 0 else 1.0:6.2f}x")
                else:
                    lines.append(f"          {mark} {name:<20} {value:10.3f}")
        return "\n".join(lines)


    def _measured_table(self) -> list[str]:
        """The measured candidates beside their predictions, fastest measured first."""
        best = min(row[3] for row in self.measured)
        head = (f"measured  {'':2}{'schedule':<20} {'transport':<9} {'predicted':>11} "
                f"{'measured':>11}  {'vs best':>7}   (* runs; slowest rank)")
        lines = [head]
        for name, via, predicted, seconds, note in sorted(self.measured,
                                                           key=lambda r: (r[3], r[0], r[1])):
            mark = "*" if (name, via) == (self.schedule, self.transport) else " "
            guess = "-" if predicted is None else f"{predicted * 1e3:.3f} ms"
            lines.append(f"          {mark} {name:<20} {via:<9} {guess:>11} "
                         f"{seconds * 1e3:8.3f} ms  {seconds / best if best > 0 else 1.0:6.2f}x"
                         + (f"   {note}" if note else ""))
        return lines


    def _explored_table(self) -> list[str]:
        """Which candidate each explored call ran, its time and what it cost over the pick's
        median (its measured row), in runs of one candidate and role."""
        if not self.explored:
            return []
        pick = next((row[3] for row in self.measured
                     if (row[0], row[1]) == (self.schedule, self.transport)), None)
        lines = [(f"explored  {'call':>6}  {'schedule':<20} {'transport':<9} {'seconds':>11} "
                  f"{'cost':>10}  role")]
        for call, name, via, role, seconds in self.explored:
            took = "failed" if seconds is None else f"{seconds * 1e3:8.3f} ms"
            cost = "" if seconds is None or pick is None or call == 0 else (
                f"{max(seconds - pick, 0.0) * 1e3:7.3f} ms")
            lines.append(f"          {call + 1:>6}  {name:<20} {via:<9} {took:>11} {cost:>10}  "
                         f"{role}")
        return lines


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
