"""What a selector returns: the chosen schedule and why."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..problem import Problem

SELECTORS = ("paper", "model", "tune")


def decision_inputs(problem: Problem, profile: str, topology: str) -> dict:
    """The inputs every Decision reports: M, n, K, dtype, world, OTB, MT, profile, topology.

    >>> from ficco.problem import Problem
    >>> decision_inputs(Problem(2, 4, (8,), "float32", 2), "cpu", "switch")["M"]
    4
    """
    return {"M": problem.big_m, "n": problem.n_total, "K": problem.k, "dtype": problem.dtype,
            "world": problem.world, "otb": problem.otb, "mt": problem.gemm_bytes,
            "profile": profile, "topology": topology}


@dataclass(frozen=True)
class Decision:
    """The schedule a selector picked for one problem, with its inputs and per-candidate scores.

    ``selector`` is ``"paper"``, ``"model"``, ``"tune"`` or ``"forced"``. ``scores`` maps a
    schedule name to predicted seconds (model), measured seconds (tune) or the paper's
    normalised OTB·MT score (paper). ``reason`` is one line for humans.

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

    def ranked(self) -> list[tuple[str, float]]:
        """Scores best first (lowest seconds; for ``paper`` the single score as given)."""
        return sorted(self.scores.items(), key=lambda item: (item[1], item[0]))

    def __str__(self) -> str:
        lines = [f"schedule  {self.schedule}  (transport {self.transport}, "
                 f"selector {self.selector})",
                 f"reason    {self.reason}",
                 "inputs    " + " ".join(f"{k}={_fmt(v)}" for k, v in self.inputs.items())]
        if self.scores:
            seconds = self.selector in ("model", "tune")
            best = min(self.scores.values())
            lines.append("scores    " + ("time        vs best" if seconds else "score"))
            for name, value in self.ranked():
                mark = "*" if name == self.schedule else " "
                if seconds:
                    lines.append(f"  {mark} {name:<20} {value * 1e3:10.3f} ms  "
                                 f"{value / best if best > 0 else 1.0:5.2f}x")
                else:
                    lines.append(f"  {mark} {name:<20} {value:10.3f}")
        return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
