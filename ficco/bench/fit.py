"""Fitting ``characterize`` records into a :class:`~ficco.heuristics.profiles.Profile`:
GEMM efficiency and K-tile overhead (DIL), the copy efficiency curve and latency, and the
contention factors (CIL)."""
from __future__ import annotations

import dataclasses
from statistics import median


def fit_profile(base, recs: list[dict], dtype: str, name: str, measured_on: str):
    """The base profile with the measured numbers put in; ``sources`` notes each one.

    - ``copy_efficiency`` and ``copy_latency_s``: see :func:`fit_copy_curve`.
    - On a CPU target, ``copy_engine_bytes_per_s`` and ``link_bytes_per_s``: the largest 1D
      copy's bandwidth, the rate the curve is a fraction of. A peer's buffer there is shared
      memory in the same RAM, so the copy measured is the copy a peer pull makes (a profile that
      kept the built-in 5 GB/s would price the 55 GB/s a VM measured at a tenth). On a GPU the
      copy measured is local (HBM to HBM, or to pinned host memory with ``--copy-to host``)
      and says nothing about NVLink or a peer copy engine, so the built-in link numbers stay.
    - ``copy_2d_half_row_bytes``: ``w * (1/r - 1)`` (median over row widths ``w``), fitting
      ``r = w / (w + half)`` to the 2D/1D bandwidth ratio ``r``.
    - ``dil.gemm_efficiency``: best whole-GEMM FLOP/s over the profile's peak (the peak is
      raised to the measurement when the measurement beats it).
    - ``cil``: see :func:`fit_cil`.
    - ``host_op_s``: see :func:`fit_host_op` (records of ``--parts enqueue``).
    """
    note = f"measured by ficco bench characterize on {measured_on}"
    # Values of several types (floats, per-size tuples, nested dicts): dataclasses.replace
    # checks each against its Profile field.
    changes: dict[str, object] = {}
    sources = dict(base.sources)
    one_d = sorted((r for r in recs if r["kind"] == "copy" and r["shape"] == "1d"),
                   key=lambda r: r["bytes"])
    if len(one_d) >= 2:
        points = [(r["bytes"], r["time_s"]) for r in one_d]
        latency_s, fractions = fit_copy_curve(points)
        changes["copy_efficiency"] = fractions
        changes["copy_latency_s"] = latency_s
        sources["copy_efficiency"] = sources["copy_latency_s"] = note
        if _on_cpu(recs):
            bandwidth = copy_bandwidth(points)
            changes["copy_engine_bytes_per_s"] = changes["link_bytes_per_s"] = bandwidth
            sources["copy_engine_bytes_per_s"] = sources["link_bytes_per_s"] = (
                f"{note}: the largest 1D copy's bandwidth ({bandwidth / 1e9:.1f} GB/s); on CPU a "
                f"peer's buffer is shared memory in the same RAM")
    halves = [r["width_bytes"] * (1 / r["ratio_to_1d"] - 1) for r in recs
              if r["kind"] == "copy_width" and 0 < r["ratio_to_1d"] < 1]
    if halves:
        changes["copy_2d_half_row_bytes"] = float(median(halves))
        sources["copy_2d_half_row_bytes"] = note
    dil = dict(base.dil)
    rates = gemm_rates(recs, dtype)
    if dtype in rates:
        peak = dict(base.peak_flops)
        best = rates[dtype]
        if best > base.flops(dtype):
            peak[dtype] = best
            sources["peak_flops"] = f"{dtype}: {note} (beat the built-in peak)"
        efficiency = round(min(1.0, best / max(best, base.flops(dtype))), 4)
        dil["gemm_efficiency"] = efficiency
        changes["dil"] = dil
        sources["dil.gemm_efficiency"] = note
        # every other dtype measured keeps its own sustained rate: peak = rate / efficiency
        for other, rate in rates.items():
            if other != dtype:
                peak[other] = rate / efficiency
                sources[f"peak_flops.{other}"] = (f"{note}: the best {other} GEMM rate over "
                                                  f"gemm_efficiency ({efficiency})")
        changes["peak_flops"] = peak
    curves = fit_ccl_curves([r for r in recs if r["kind"] == "ccl"])
    if curves:
        changes["ccl"] = {**base.ccl, **curves}
        sources["ccl.busbw"] = (f"{note}: each collective timed over {curves['busbw_world']} "
                                f"ranks at {len(next(iter(curves['busbw'].values())))} sizes "
                                f"(bench/calibrate.py)")
    peers = [r["bytes_per_s"] for r in recs if r["kind"] == "peer_copy"]
    if peers:
        changes["copy_engine_bytes_per_s"] = float(median(peers))
        sources["copy_engine_bytes_per_s"] = (f"{note}: median over {len(peers)} peer GPUs of one "
                                              f"copy-engine copy's bandwidth")
    cil_fit = fit_cil([r for r in recs if r["kind"] == "cil"])
    if cil_fit:
        cil = {**base.cil, **cil_fit}
        changes["cil"] = cil
        for key in cil_fit:
            sources[f"cil.{key}"] = note
    enqueue = [r for r in recs if r["kind"] == "enqueue"]
    if enqueue:
        changes["host_op_s"] = fit_host_op(enqueue)
        sources["host_op_s"] = (
            f"{note}: `python -m ficco.bench characterize --parts enqueue`, least-squares "
            f"slope through the origin of host enqueue seconds over plan ops, {len(enqueue)} "
            f"eager W = {enqueue[0].get('world', '?')} calls (schedules of "
            f"{', '.join(sorted({r.get('op', 'all_gather_matmul') for r in enqueue}))})")
    return dataclasses.replace(base, name=name, sources=sources, **changes)


def gemm_rates(recs: list[dict], dtype: str) -> dict[str, float]:
    """The best measured GEMM FLOP/s per dtype: whole GEMMs of the DIL part (``dtype``'s) and
    the per-dtype GEMMs of ``calibrate.measure_gemm_rates``.

    >>> gemm_rates([dict(kind="dil", flops_per_s=2.0), dict(kind="gemm_rate", dtype="float16",
    ...             flops_per_s=3.0)], "bfloat16")
    {'bfloat16': 2.0, 'float16': 3.0}
    """
    best: dict[str, float] = {}
    for r in recs:
        if r["kind"] in ("dil", "gemm_rate"):
            d = r.get("dtype", dtype) if r["kind"] == "gemm_rate" else dtype
            best[d] = max(best.get(d, 0.0), r["flops_per_s"])
    return best


def fit_ccl_curves(recs: list[dict]) -> dict:
    """``{"busbw": {kind: {size: busbw}}, "busbw_world": W}`` from ``ccl`` records (the
    profile's per-primitive curves, :mod:`ficco.heuristics.collectives`); ``{}`` without.

    >>> fit_ccl_curves([dict(op="all_gather", bytes=1024, world=2, busbw_bytes_per_s=5e8)])
    {'busbw': {'all_gather': {'1024': 500000000.0}}, 'busbw_world': 2}
    """
    if not recs:
        return {}
    curves: dict[str, dict[str, float]] = {}
    for r in recs:
        curves.setdefault(r["op"], {})[str(int(r["bytes"]))] = float(r["busbw_bytes_per_s"])
    return {"busbw": curves, "busbw_world": int(recs[0]["world"])}


def fit_host_op(recs: list[dict]) -> float:
    """``host_op_s`` from enqueue records (``ops``: runtime calls per warm call, ``enqueue_s``):
    the least-squares slope through the origin, the form the simulator charges (``host_op_s``
    per runtime call), so a call's predicted host time matches the measured one on average.

    >>> fit_host_op([dict(ops=10, enqueue_s=2e-5), dict(ops=100, enqueue_s=2e-4)])
    2e-06
    """
    return sum(r["ops"] * r["enqueue_s"] for r in recs) / sum(r["ops"] ** 2 for r in recs)


def _on_cpu(recs: list[dict]) -> bool:
    return bool(recs) and recs[0].get("env", {}).get("env_backend", "cpu") == "cpu"


def copy_bandwidth(points: list[tuple[int, float]]) -> float:
    """Bytes/s of the largest measured copy: the bandwidth :func:`fit_copy_curve`'s fractions
    are fractions of.

    >>> copy_bandwidth([(1000, 2e-6), (10**6, 1e-3)])
    1000000000.0
    """
    big_bytes, big_s = max(points)
    return big_bytes / big_s


def fit_copy_curve(points: list[tuple[int, float]]) -> tuple[float, dict]:
    """Split measured 1D copies ``(bytes, seconds)`` into the simulator's terms, time =
    latency + bytes / (bandwidth x fraction(bytes)), so that the model gives back every
    measured time. The bandwidth is the largest copy's; the latency is the smallest time any
    other copy has left over beyond that bandwidth (robust to noisy launch costs, which vary
    more than the small copies' transfer time); each fraction follows from its point.

    >>> lat, frac = fit_copy_curve([(1000, 2e-6), (2000, 3e-6), (10**6, 1.001e-3)])
    >>> round(lat * 1e6, 2), frac["1000000"], round(frac["1000"], 2)
    (1.0, 1.0, 1.0)
    """
    points = sorted(points)
    bandwidth = copy_bandwidth(points)
    spare = [t - size / bandwidth for size, t in points[:-1]]
    latency_s = max(0.0, min(spare, default=0.0))
    fractions = {str(size): round(min(1.0, size / ((t - latency_s) * bandwidth)), 4)
                 for size, t in points}
    return latency_s, fractions


def fit_cil(cil_recs: list[dict]) -> dict:
    """Fit the profile's contention model, slowdown = 1 + coef * MT / (MT + mt_half_bytes), to
    the measured CILs: ``dma_gemm`` (GEMM beside copies), ``dma_copy`` (copies beside a GEMM)
    and one shared ``mt_half_bytes``. Least squares over a log grid of ``mt_half_bytes``; each
    coefficient is capped at twice the largest slowdown seen, so points far below
    ``mt_half_bytes`` cannot extrapolate to absurd asymptotes.

    >>> recs = [dict(victim=v, mt_bytes=mt, cil=1 + 0.2 * mt / (mt + 1e6))
    ...         for v in ("gemm", "copy") for mt in (1e5, 1e6, 1e7)]
    >>> fit = fit_cil(recs); round(fit["dma_gemm"], 2), fit["mt_half_bytes"]
    (0.2, 1000000.0)
    """
    series = {key: [(r["mt_bytes"], r["cil"] - 1) for r in cil_recs if r["victim"] == victim]
              for victim, key in (("gemm", "dma_gemm"), ("copy", "dma_copy"))}
    series = {k: pts for k, pts in series.items() if pts}
    if not series:
        return {}
    best = None
    for exponent in range(8 * 4, 11 * 8 + 1):     # 1e4 .. 1e11 bytes, 8 steps per decade
        half = 10 ** (exponent / 8)
        # The form fitted here: s(MT) with exponent 1, felt alike by GEMM and copies.
        fit, sse = {"mt_half_bytes": half, "mt_exp": 1.0, "copy_mt_power": 1.0}, 0.0
        for key, pts in series.items():
            xs = [mt / (mt + half) for mt, _ in pts]
            cap = 2 * max(max(excess for _, excess in pts), 0.0)
            coef = sum(x * y for x, (_, y) in zip(xs, pts)) / max(sum(x * x for x in xs), 1e-30)
            coef = min(max(coef, 0.0), cap)
            sse += sum((coef * x - y) ** 2 for x, (_, y) in zip(xs, pts))
            fit[key] = round(coef, 4)
        if best is None or sse < best[0] - 1e-12:
            best = (sse, fit)
    assert best is not None     # the exponent range is not empty, so the loop set it
    return best[1]
