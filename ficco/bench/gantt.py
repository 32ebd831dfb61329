"""Timelines as PNG: one horizontal lane per queue, one bar per op, coloured by kind.

Used by ``bench simulate`` (predicted) and ``bench timeline`` (measured), so both read alike.
"""
from __future__ import annotations

from pathlib import Path

KIND_COLOURS = {
    "gemm": "#4c72b0", "copy_1d": "#dd8452", "copy_2d": "#c44e52", "gather": "#8172b3",
    "scatter": "#937860", "all_gather": "#55a868", "send_recv": "#64b5cd",
    "barrier": "#7f7f7f", "record": "#cccccc", "wait": "#cccccc",
    "gated_gemm": "#2a9d8f", "signal": "#e9c46a", "gated_tile": "#264653",
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
    return draw_panels([(title, rows)], path)


def draw_panels(panels: list[tuple[str, list[dict]]], path, title: str | None = None) -> Path:
    """Several timelines one above the other on one shared time axis (e.g. a measured call
    above the simulator's prediction of the same Plan), each ``(title, rows)`` in its own
    lanes. One scale makes the two comparable at a glance; two files never were."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = figure(panels, title)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


#: Resolution of the PNGs; label widths are measured at the same resolution.
DPI = 110


def figure(panels: list[tuple[str, list[dict]]], title: str | None = None):
    """The matplotlib Figure :func:`draw_panels` saves (labels already fitted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    all_rows = [r for _, rows in panels for r in rows]
    end_s = max((r["end_s"] for r in all_rows), default=0.0)
    scale, unit = (1e3, "ms") if end_s >= 1e-3 else (1e6, "us")
    lanes = [sorted({r["queue"] for r in rows}, key=_queue_order) for _, rows in panels]
    heights = [max(len(q), 2) for q in lanes]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(11, 0.45 * sum(heights) + 1.2 * len(panels) + 0.4),
                             gridspec_kw={"height_ratios": heights}, dpi=DPI)
    labels = []
    for ax, (panel_title, rows), queues in zip(axes[:, 0], panels, lanes):
        lane = {q: i for i, q in enumerate(queues)}
        for r in rows:
            if r.get("mark"):   # a point event (a gated GEMM's tile starting): a tick, no bar
                ax.plot(r["start_s"] * scale, lane[r["queue"]] + r.get("mark_y", 0.0),
                        marker="|", markersize=9, markeredgewidth=1.5,
                        color=r.get("colour", "black"))
                continue
            width = (r["end_s"] - r["start_s"]) * scale
            colour = KIND_COLOURS.get(r["kind"], "#999999")
            ax.barh(lane[r["queue"]], max(width, end_s * scale * 1e-4),
                    left=r["start_s"] * scale, height=0.7, color=colour, edgecolor="black",
                    linewidth=0.2)
            if r.get("label"):
                text = ax.text((r["start_s"] * scale) + width / 2, lane[r["queue"]],
                               r["label"], ha="center", va="center", fontsize=6,
                               clip_on=True)
                labels.append((ax, text, r["start_s"] * scale, r["start_s"] * scale + width))
        ax.set_yticks(range(len(queues)))
        ax.set_yticklabels(queues, fontsize=8)
        ax.set_ylim(len(queues) - 0.5, -0.5)
        ax.set_title(panel_title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    axes[-1, 0].set_xlim(0, end_s * scale * 1.01 or 1)
    kinds = sorted({r["kind"] for r in all_rows})
    axes[0, 0].legend(handles=[Patch(color=KIND_COLOURS.get(k, "#999999"), label=k)
                               for k in kinds],
                      fontsize=7, loc="upper right", ncol=min(max(len(kinds), 1), 6))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _fit_labels(fig, labels)
    return fig


def _fit_labels(fig, labels) -> None:
    """Keep a bar's label only where its rendered text fits inside the bar: bars of one lane
    never overlap, so neither do the labels that are kept (narrow GEMMs of a fused or unfused
    schedule used to print their labels over each other)."""
    renderer = fig.canvas.get_renderer()
    for ax, text, left, right in labels:
        x0, _ = ax.transData.transform((left, 0))
        x1, _ = ax.transData.transform((right, 0))
        if text.get_window_extent(renderer).width > (x1 - x0) - 2:
            text.remove()


def chrome_trace(panels: list[tuple[str, list[dict]]]) -> dict:
    """The same timelines as a Chrome trace (open in chrome://tracing or ui.perfetto.dev): one
    process per panel, one thread per queue, one complete event per op, times in us.

    >>> t = chrome_trace([("measured rank 0", [{"queue": "compute", "start_s": 0.0,
    ...                    "end_s": 2e-6, "kind": "gemm", "label": "gemm 0"}])])
    >>> [e["ph"] for e in t["traceEvents"]], t["traceEvents"][-1]["dur"]
    (['M', 'M', 'X'], 2.0)
    """
    events = []
    for pid, (name, rows) in enumerate(panels):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": name}})
        queues = sorted({r["queue"] for r in rows}, key=_queue_order)
        tids = {q: i for i, q in enumerate(queues)}
        events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[q],
                    "args": {"name": q}} for q in queues]
        for r in rows:
            if r.get("mark"):   # instant event: marks may overlap, X slices must nest
                events.append({"ph": "i", "s": "t", "name": r.get("label") or r["kind"],
                               "cat": r["kind"], "pid": pid, "tid": tids[r["queue"]],
                               "ts": r["start_s"] * 1e6,
                               "args": {k: v for k, v in r.items() if k not in ("queue",)}})
                continue
            events.append({"ph": "X", "name": r.get("label") or r["kind"], "cat": r["kind"],
                           "pid": pid, "tid": tids[r["queue"]], "ts": r["start_s"] * 1e6,
                           "dur": (r["end_s"] - r["start_s"]) * 1e6,
                           "args": {k: v for k, v in r.items()
                                    if k not in ("start_s", "end_s", "queue")}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
