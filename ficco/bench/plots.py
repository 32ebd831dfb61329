"""Paper-style PNG plots of benchmark records (matplotlib, Agg: no display needed).

Sweep plots take the records of :mod:`ficco.bench.results`; characterize plots take the
``dil`` / ``copy`` / ``cil`` records that ``characterize`` writes. Example::

    from ficco.bench import plots, results
    recs = results.read_jsonl("bench/results/sweep-cpu-20261122-191934/results.jsonl")
    plots.sweep_plots(recs, "/tmp/replot")   # -> list of PNG paths
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

from .results import PICK_TOLERANCE, SELECTORS, selector_accuracy

SELECTOR_MARKERS = {"paper": ("v", "tab:red"), "model": ("o", "tab:green")}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(rec: dict) -> str:
    if rec["kind"] == "baseline" or rec["transport"] != "dma":
        return f"{rec['schedule']} ({rec['transport']})"
    return rec["schedule"]


def _scenarios(records):
    return list(dict.fromkeys(r["scenario"] for r in records))


def ideal_speedup(ratio: float) -> float:
    """Perfect overlap of a GEMM and an all-gather whose times have ``ratio`` = gemm/comm:
    ``(g + c) / max(g, c)``, 2x at ratio 1 (paper Fig. 13's bell).

    >>> ideal_speedup(1.0), ideal_speedup(4.0)
    (2.0, 1.25)
    """
    return (1 + ratio) / max(1.0, ratio)


#: widest figure drawn, inches (x 110 dpi: 1320 px, readable on a screen and in a doc)
MAX_WIDTH_IN = 12.0
#: bars per subplot row of ``speedup.png``; more scenarios wrap onto further rows
BARS_PER_ROW = 56


def plot_speedups(records: list[dict], path, where: str | None = None) -> Path:
    """Fig. 12b: speedup over serial (ccl) of every schedule per scenario; each selector's
    pick marked above its bar. Scenarios wrap onto rows of at most :data:`BARS_PER_ROW` bars,
    so the figure keeps a readable width however many scenarios a sweep has."""
    plt = _pyplot()
    ok = [r for r in records if r.get("status") == "ok" and r.get("speedup")]
    scenarios = _scenarios(ok)
    labels = list(dict.fromkeys(_label(r) for r in ok))
    per_row = max(1, min(len(scenarios), BARS_PER_ROW // max(len(labels), 1)))
    chunks = [scenarios[i:i + per_row] for i in range(0, len(scenarios), per_row)] or [[]]
    width = 0.8 / max(len(labels), 1)
    fig_w = min(MAX_WIDTH_IN, max(6.0, 0.2 * per_row * max(len(labels), 4)))
    fig, axes = plt.subplots(len(chunks), 1, squeeze=False,
                             figsize=(fig_w, 2.8 * len(chunks) + 1.4))
    cmap = plt.get_cmap("tab20")
    top = max((r["speedup"] for r in ok), default=1.0)
    for ax, chunk in zip(axes[:, 0], chunks):
        for i, label in enumerate(labels):
            xs, ys = [], []
            for j, sc in enumerate(chunk):
                rec = next((r for r in ok if r["scenario"] == sc and _label(r) == label), None)
                if rec is None:
                    continue
                x = j - 0.4 + width * (i + 0.5)
                xs.append(x)
                ys.append(rec["speedup"])
                for sel in rec.get("picked_by", []):
                    marker, color = SELECTOR_MARKERS.get(sel, ("x", "black"))
                    offset = 0.04 * (1 + list(SELECTORS).index(sel)) if sel in SELECTORS \
                        else 0.04
                    ax.plot(x, rec["speedup"] + offset * top, marker=marker, color=color,
                            markersize=5, linestyle="none")
            ax.bar(xs, ys, width=width, label=label, color=cmap(i % 20))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(chunk)), chunk)
        ax.set_xlim(-0.5, per_row - 0.5)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("speedup over serial (ccl)", fontsize=8)
    for sel, (marker, color) in SELECTOR_MARKERS.items():
        axes[0, 0].plot([], [], marker=marker, color=color, linestyle="none",
                        label=f"{sel} selector pick")
    axes[0, 0].set_title("Schedules per scenario (cf. FiCCO Fig. 12b)")
    handles, names = axes[0, 0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, fontsize=7, ncol=min(5, len(names)), loc="lower center")
    legend_in = 0.2 * math.ceil(len(names) / 5) + 0.25
    fig.tight_layout(rect=(0, legend_in / fig.get_figheight(), 1, 1))
    return save_figure(fig, path, tight=False, where=where)


def measured_ideal(rec: dict) -> float | None:
    """The ideal speedup against what the plot's speedups are measured over: the measured
    serial (ccl) call, ``reference_s``, over the longer of the GEMM and the all-gather alone.
    It equals ``(g + c) / max(g, c)`` only when serial takes exactly ``g + c``; a serial call
    that pays more (launches, synchronisation, tiny CPU problems) lifts it above the curve.

    >>> measured_ideal({"reference_s": 3.0, "gemm_s": 1.0, "comm_s": 1.0})
    3.0
    """
    longer = max(rec.get("gemm_s") or 0.0, rec.get("comm_s") or 0.0)
    return rec["reference_s"] / longer if rec.get("reference_s") and longer > 0 else None


#: What the ratio plot says under its axes about points above the curve.
RATIO_NOTE = ("curve: ideal if serial took GEMM + all-gather alone; ticks: ideal over the measured "
              "serial (ccl). A point above the curve but under its tick beat no ideal: serial paid "
              "more than g + c. A point above its tick moved data faster than the ccl all-gather "
              "g/c was timed with (dma copies).")


def plot_ratio(records: list[dict], path, where: str | None = None) -> Path:
    """Fig. 13: speedup against GEMM/communication time ratio, with the ideal curve; the best
    FiCCO schedule and shard-level ``ring`` per scenario; per scenario a tick at the ideal over
    the serial call the speedups are measured against (:func:`measured_ideal`), and a note
    under the axes on why points may sit above the curve (:data:`RATIO_NOTE`)."""
    plt = _pyplot()
    ok = [r for r in records if r.get("status") == "ok" and r.get("speedup")
          and r.get("gemm_comm_ratio")]
    fig, ax = plt.subplots(figsize=(6.5, 5.0))
    ratios = [r["gemm_comm_ratio"] for r in ok]
    if ratios:
        lo, hi = min(ratios + [0.1]) / 2, max(ratios + [10.0]) * 2
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(xs, [ideal_speedup(x) for x in xs], color="black",
                label="ideal, serial = GEMM + all-gather")
    series: dict[str, list[dict]] = {"best ficco": [], "ring": [], "ring-bidir": []}
    ticks = {}
    for sc in _scenarios(ok):
        recs = [r for r in ok if r["scenario"] == sc]
        ficco_recs = [r for r in recs if r["kind"] == "schedule" and "-" in r["schedule"]
                      and not r["schedule"].startswith("ring")]
        if ficco_recs:
            series["best ficco"].append(max(ficco_recs, key=lambda r: r["speedup"]))
        for name in ("ring", "ring-bidir"):
            series[name] += [r for r in recs if r["schedule"] == name and r["transport"] == "dma"]
        ideal = measured_ideal(recs[0])
        if ideal:
            ticks[sc] = (recs[0]["gemm_comm_ratio"], ideal)
    if ticks:
        ax.scatter([x for x, _ in ticks.values()], [y for _, y in ticks.values()], marker="_",
                   s=160, color="black", label="ideal over the measured serial")
    for (name, recs), marker in zip(series.items(), ("o", "s", "^")):
        if recs:
            ax.scatter([r["gemm_comm_ratio"] for r in recs], [r["speedup"] for r in recs],
                       marker=marker, label=name)
            for r in recs if name == "best ficco" else []:
                ax.annotate(r["scenario"], (r["gemm_comm_ratio"], r["speedup"]), fontsize=6)
    ax.set_xscale("log")
    ax.axhline(1.0, color="grey", linewidth=0.6)
    ax.set_xlabel("GEMM time / all-gather time (each alone)")
    ax.set_ylabel("speedup over serial (ccl)")
    ax.set_title("Speedup vs GEMM/comm ratio (cf. FiCCO Fig. 13)")
    _legend(ax, fontsize=7)
    fig.text(0.01, 0.01, textwrap.fill(RATIO_NOTE, 110), fontsize=6, va="bottom")
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    return save_figure(fig, path, tight=False, where=where)


def plot_selector_accuracy(records: list[dict], path, where: str | None = None) -> Path:
    """How often each selector's pick is within 5% of the best measured schedule (left) and,
    per scenario, the best speedup next to each selector's pick's speedup (right)."""
    plt = _pyplot()
    acc = selector_accuracy(records)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2),
                                      gridspec_kw={"width_ratios": [1, 3]})
    names = [s for s in SELECTORS if acc[s]["scenarios"]]
    left.bar(names, [100 * acc[s]["accuracy"] for s in names],
             color=[SELECTOR_MARKERS[s][1] for s in names])
    for i, s in enumerate(names):
        loss = 100 * acc[s]["mean_loss_when_missed"]
        left.annotate(f"{acc[s]['hits']}/{acc[s]['scenarios']}\nloss {loss:.0f}%",
                      (i, 100 * acc[s]["accuracy"]), ha="center", va="bottom", fontsize=7)
    left.set_ylim(0, 119)
    left.set_ylabel(f"picks within {PICK_TOLERANCE:.0%} of best (%)")
    left.set_title("Selector accuracy")
    scenarios = [sc for sc in _scenarios(records)
                 if any(r["scenario"] == sc and r.get("best_speedup") for r in records)]
    width = 0.8 / (1 + len(SELECTORS))
    for i, key in enumerate(["best"] + list(SELECTORS)):
        ys = []
        for sc in scenarios:
            rec = next(r for r in records if r["scenario"] == sc)
            value = rec.get("best_speedup") if key == "best" \
                else rec.get("pick_speedups", {}).get(key)
            ys.append(value or 0.0)
        color = "tab:blue" if key == "best" else SELECTOR_MARKERS[key][1]
        right.bar([j - 0.4 + width * (i + 0.5) for j in range(len(scenarios))], ys, width=width,
                  label=key if key == "best" else f"{key} pick", color=color)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xticks(range(len(scenarios)), scenarios, rotation=45, ha="right")
    right.set_ylabel("speedup over serial (ccl)")
    right.set_title("Best measured vs picked")
    _legend(right, fontsize=7)
    return save_figure(fig, path, where=where)


def sweep_plots(records: list[dict], out_dir) -> list[Path]:
    """All sweep plots into ``out_dir``: speedup.png, ratio.png, selectors.png, each saying on
    the image what was measured where (:func:`measured_where`)."""
    out_dir = Path(out_dir)
    where = measured_where(records)
    return [plot_speedups(records, out_dir / "speedup.png", where),
            plot_ratio(records, out_dir / "ratio.png", where),
            plot_selector_accuracy(records, out_dir / "selectors.png", where)]


def measured_where(records: list[dict]) -> str:
    """The line a sweep image carries: measured, on which backend and device, at which W.

    >>> measured_where([{"env_backend": "cpu", "env_device": "x86 (2 cpus)", "env_world": 4}])
    'measured, cpu (x86 (2 cpus)), W=4'
    """
    if not records:
        return "measured (no records)"
    first = records[0]
    worlds = sorted({int(r["env_world"]) for r in records if r.get("env_world") is not None})
    return (f"measured, {first.get('env_backend', '?')} ({first.get('env_device', '?')}), "
            f"W={','.join(map(str, worlds)) or '?'}")


# -- characterize (paper Figs. 7-9) ---------------------------------------------------------
def plot_dil(records: list[dict], path) -> Path:
    """Fig. 7: slowdown of 8- and 64-way row (M) and column (K) sharded GEMMs vs one GEMM."""
    plt = _pyplot()
    gemms = list(dict.fromkeys(r["gemm"] for r in records))
    variants = list(dict.fromkeys(f"{r['split']} {r['ways']}-way" for r in records))
    width = 0.8 / max(len(variants), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(gemms)), 4))
    for i, variant in enumerate(variants):
        xs, ys = [], []
        for j, g in enumerate(gemms):
            rec = next((r for r in records if r["gemm"] == g
                        and f"{r['split']} {r['ways']}-way" == variant), None)
            if rec:
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(rec["dil"])
        ax.bar(xs, ys, width=width, label=variant)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(gemms)), gemms, rotation=45, ha="right")
    ax.set_ylabel("DIL: sharded time / whole time")
    ax.set_title("GEMM decomposition loss (cf. FiCCO Fig. 7)")
    _legend(ax, fontsize=7)
    return save_figure(fig, path)


def plot_copy_efficiency(records: list[dict], path) -> Path:
    """Fig. 9: achieved copy bandwidth by size, 1D and 2D, as a fraction of the best seen."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for shape in dict.fromkeys(r["shape"] for r in records):
        recs = sorted((r for r in records if r["shape"] == shape), key=lambda r: r["bytes"])
        ax.plot([r["bytes"] for r in recs], [r["efficiency"] for r in recs], marker="o",
                label=shape)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("bytes per copy")
    ax.set_ylabel("bandwidth / best bandwidth")
    ax.set_title("DMA copy efficiency by size (cf. FiCCO Fig. 9)")
    _legend(ax, fontsize=7)
    return save_figure(fig, path)


def plot_cil(records: list[dict], path) -> Path:
    """Fig. 8: slowdown of a GEMM beside copies (left) and of copies beside a GEMM (right)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, victim in zip(axes, ("gemm", "copy")):
        recs = [r for r in records if r["victim"] == victim]
        ax.bar([r["gemm"] for r in recs], [r["cil"] for r in recs],
               color="tab:orange" if victim == "gemm" else "tab:purple")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.tick_params(axis="x", rotation=45)
        ax.set_ylabel("CIL: time beside the other / time alone")
        ax.set_title(f"{victim} slowdown (cf. FiCCO Fig. 8)")
    return save_figure(fig, path)


def _legend(ax, **kwargs) -> None:
    # An all-skipped sweep still draws (empty) plots; matplotlib warns on an empty legend.
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def save_figure(fig, path, tight: bool = True, where: str | None = None) -> Path:
    path = Path(path)
    if where:     # what the numbers are (measured, on what, W), on the image itself
        fig.text(0.99, 0.005, where, ha="right", va="bottom", fontsize=7, color="#444444")
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def geomean(values) -> float:
    """Geometric mean of positive numbers (``nan`` for none)."""
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")
