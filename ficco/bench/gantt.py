"""Timelines as PNG: one horizontal lane per queue, one bar per op, coloured by kind.

Used by ``bench simulate`` (predicted) and ``bench timeline`` (measured), so both read alike.
"""
from __future__ import annotations

from pathlib import Path

KIND_COLOURS = {
    "gemm": "#4c72b0", "copy_1d": "#dd8452", "copy_2d": "#c44e52", "gather": "#8172b3",
    "scatter": "#937860", "all_gather": "#55a868", "send_recv": "#64b5cd",
    "barrier": "#7f7f7f", "record": "#cccccc", "wait": "#cccccc",
}


def _queue_order(queue: str) -> tuple:
    """compute first, then copy0, copy1, … in number order, then the rest."""
    base = queue.rsplit("/", 1)[-1]
    prefix = queue[: len(queue) - len(base)]
    if base == "compute":
        return (prefix, 0, 0, base)
    if base.startswith("copy") and base[4:].isdigit():
        return (prefix, 1, int(base[4:]), base)
    return (prefix, 2, 0, base)


def draw_gantt(rows: list[dict], path, title: str) -> Path:
    """Draw ``rows`` (dicts with queue, start_s, end_s, kind, label) to a PNG at ``path``.

    Queues named ``"serial/compute"`` and the like are grouped by their prefix, so two plans
    can share one chart.

    >>> import tempfile, os
    >>> out = draw_gantt([{"queue": "compute", "start_s": 0.0, "end_s": 1e-3, "kind": "gemm",
    ...                    "label": "gemm"}], os.path.join(tempfile.mkdtemp(), "t.png"), "demo")
    >>> out.stat().st_size > 0
    True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    queues = sorted({r["queue"] for r in rows}, key=_queue_order)
    lane = {q: i for i, q in enumerate(queues)}
    end_s = max((r["end_s"] for r in rows), default=0.0)
    scale, unit = (1e3, "ms") if end_s >= 1e-3 else (1e6, "us")
    fig, ax = plt.subplots(figsize=(11, 0.45 * max(len(queues), 2) + 1.4))
    for r in rows:
        width = (r["end_s"] - r["start_s"]) * scale
        colour = KIND_COLOURS.get(r["kind"], "#999999")
        ax.barh(lane[r["queue"]], max(width, end_s * scale * 1e-4), left=r["start_s"] * scale,
                height=0.7, color=colour, edgecolor="black", linewidth=0.2)
        # Label only bars wide enough to hold text; narrow ones would be unreadable clutter.
        if width > end_s * scale * 0.06 and r.get("label"):
            ax.text((r["start_s"] * scale) + width / 2, lane[r["queue"]], r["label"],
                    ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(queues)))
    ax.set_yticklabels(queues, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=9)
    kinds = sorted({r["kind"] for r in rows})
    ax.legend(handles=[Patch(color=KIND_COLOURS.get(k, "#999999"), label=k) for k in kinds],
              fontsize=7, loc="upper right", ncol=min(len(kinds), 6))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
