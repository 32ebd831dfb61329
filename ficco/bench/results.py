"""The benchmark result schema: JSON lines (the source of truth) plus a flat CSV.

A sweep writes one record per scenario x (schedule, transport); the fields are listed in
:data:`SWEEP_FIELDS` with their meaning and are stable: a new field may be added, none is
renamed or removed without bumping :data:`SWEEP_SCHEMA`. ``docs/benchmarks.md`` documents the
same table. Example::

    records = read_jsonl("bench/results/sweep-cpu-20261122/results.jsonl")
    validate(records[0])                        # raises ValueError naming what is wrong
    selector_accuracy(records)["paper"]["accuracy"]
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import socket
import subprocess
from pathlib import Path
from statistics import median

SWEEP_SCHEMA = "ficco.bench.sweep/1"
CHARACTERIZE_SCHEMA = "ficco.bench.characterize/1"
TIMELINE_SCHEMA = "ficco.bench.timeline/1"
SELECTORS = ("paper", "model")
#: a pick within this fraction of the best measured time counts as right (paper §VI-C)
PICK_TOLERANCE = 0.05

# name -> meaning. The CSV has exactly these columns, in this order; the JSON record has
# them too, plus ``times_s`` (list), ``picks`` / ``pick_speedups`` (dicts) and ``env`` (dict).
SWEEP_FIELDS = {
    "schema": "record format, ficco.bench.sweep/1",
    "scenario": "scenario name: g1..g16, llama-<model>-<proj>, or MxNxK",
    "source": "scenario set: paper, llama or shape",
    "big_m": "M actually measured: rows per rank x world (rounded down from the scenario's M)",
    "n": "columns of B on each rank (the GEMM measured)", "k": "K, the inner dimension",
    "n_layer": "the scenario's N: Table I gives the layer's N and each rank holds N / world",
    "m": "rows of each rank's shard", "dtype": "element type", "world": "ranks in the group",
    "schedule": "ficco schedule name, or a baseline: serial (over ccl), torch-fused",
    "transport": "dma, ccl, or symm_mem for torch's fused op",
    "kind": "schedule (a selector may pick it) or baseline",
    "status": "ok, skipped (reason says why) or error (reason holds the error)",
    "reason": "why skipped or failed; empty when ok",
    "warmup": "untimed iterations before measuring", "repeat": "timed iterations",
    "median_s": "median over iterations of the slowest rank's time (all-reduce MAX)",
    "p10_s": "10th percentile of the same", "p90_s": "90th percentile of the same",
    "speedup": "reference_s / median_s",
    "reference_s": "median time of serial over ccl, the paper's baseline",
    "gemm_s": "the whole GEMM alone on one rank (median)",
    "comm_s": "the all-gather alone over the process group (median, slowest rank)",
    "gemm_comm_ratio": "gemm_s / comm_s, the x axis of Fig. 13",
    "ideal_speedup": "(gemm_s + comm_s) / max(gemm_s, comm_s): perfect overlap, no DIL/CIL",
    "max_abs_err": "max abs(C - ref) on the first call, over up to 8192 rows "
                   "(ref: all_gather + matmul)",
    "picked_by": "selectors whose pick is this schedule, joined by +",
    "pick_paper": "the paper selector's pick for this scenario",
    "pick_paper_speedup": "measured speedup of that pick over the dma transport",
    "pick_model": "the model selector's pick for this scenario",
    "pick_model_speedup": "measured speedup of that pick over the dma transport",
    "best_schedule": "fastest measured schedule over dma (kind=schedule) of the scenario",
    "best_speedup": "its speedup",
    "env_device": "device name", "env_driver": "driver / runtime versions",
    "env_backend": "ficco backend target", "env_torch": "torch version",
    "env_ficco": "ficco version", "env_world": "world size",
    "env_topology": "FICCO_TOPOLOGY or auto", "env_host": "host name",
    "env_time": "UTC time the sweep started",
}
REQUIRED = ("schema", "scenario", "big_m", "n", "k", "dtype", "world", "schedule", "transport",
            "kind", "status", "env")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]: ``percentile([1, 2, 3], 50) == 2``."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def timing_summary(times_s: list[float]) -> dict:
    """``{"median_s", "p10_s", "p90_s"}`` of a list of per-iteration times."""
    return {"median_s": median(times_s) if times_s else None,
            "p10_s": percentile(times_s, 10) if times_s else None,
            "p90_s": percentile(times_s, 90) if times_s else None}


def _run_quietly(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else ""
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


def environment(world: int, backend_target: str = "", device=None) -> dict:
    """Where the numbers came from: device, driver, torch, ficco version, world, topology.

    >>> environment(2, "cpu")["env_world"]
    2
    """
    import torch

    from .. import config

    device_name = platform.processor() or platform.machine()
    driver = f"python {platform.python_version()}"
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        device_name = torch.cuda.get_device_name(device)
        if torch.version.hip:
            driver = f"hip {torch.version.hip}"
        else:
            smi = _run_quietly(["nvidia-smi", "--query-gpu=driver_version",
                                "--format=csv,noheader"])
            driver = f"cuda {torch.version.cuda}" + (f", driver {smi}" if smi else "")
    else:
        device_name = f"{device_name} ({os.cpu_count()} cpus)"
    try:
        topology = config.topology() or "auto"
    except Exception as exc:  # noqa: BLE001 - a bad FICCO_TOPOLOGY must not lose a sweep
        topology = f"invalid ({exc})"
    return {"env_device": device_name, "env_driver": driver, "env_backend": backend_target,
            "env_torch": torch.__version__, "env_ficco": ficco_version(), "env_world": world,
            "env_topology": topology, "env_host": socket.gethostname(),
            "env_time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def ficco_version() -> str:
    import ficco

    version = getattr(ficco, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib.metadata import version as dist_version

        return dist_version("ficco")
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source tree)
        return "unknown"


# -- reading and writing --------------------------------------------------------------------
def write_jsonl(path, records: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for rec in records:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
    return path


def read_jsonl(path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def flatten(record: dict) -> dict:
    """One sweep record as a CSV row: env, picks and pick speedups spread into columns."""
    row = {k: v for k, v in record.items() if k in SWEEP_FIELDS}
    row.update(record.get("env", {}))
    for sel in SELECTORS:
        row[f"pick_{sel}"] = record.get("picks", {}).get(sel, "")
        row[f"pick_{sel}_speedup"] = record.get("pick_speedups", {}).get(sel, "")
    row["picked_by"] = "+".join(record.get("picked_by", []))
    return row


def write_csv(path, records: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(SWEEP_FIELDS), extrasaction="ignore")
        writer.writeheader()
        for rec in records:
            writer.writerow({k: "" if v is None else v for k, v in flatten(rec).items()})
    return path


def validate(record: dict) -> None:
    """Raise ValueError naming every problem of one sweep record (missing keys, bad types)."""
    problems = [f"missing {key!r}" for key in REQUIRED if key not in record]
    if record.get("schema") != SWEEP_SCHEMA:
        problems.append(f"schema is {record.get('schema')!r}, expected {SWEEP_SCHEMA!r}")
    if record.get("status") not in ("ok", "skipped", "error"):
        problems.append(f"status {record.get('status')!r} not in ok/skipped/error")
    if record.get("status") == "ok":
        times = record.get("times_s")
        if not isinstance(times, list) or not times or min(times) < 0:
            problems.append(f"times_s must be a non-empty list of times; got {times!r}")
        for key in ("median_s", "p10_s", "p90_s"):
            if not isinstance(record.get(key), (int, float)):
                problems.append(f"{key} must be a number; got {record.get(key)!r}")
    elif not record.get("reason"):
        problems.append(f"status {record.get('status')!r} needs a reason")
    missing_env = [k for k in SWEEP_FIELDS if k.startswith("env_")
                   and k not in record.get("env", {})]
    if missing_env:
        problems.append(f"env lacks {missing_env}")
    if problems:
        raise ValueError(f"sweep record {record.get('scenario')}/{record.get('schedule')}: "
                         + "; ".join(problems))


# -- per-scenario summaries -----------------------------------------------------------------
def _ok(records):
    return [r for r in records if r.get("status") == "ok" and r.get("median_s")]


def finalize_scenario(records: list[dict], picks: dict[str, str], transport: str = "dma") -> None:
    """Fill speedup, best schedule and each selector's pick (and its measured speedup) into
    every record of ONE scenario, in place. The reference is serial over ccl, the paper's
    baseline; without it (skipped or failed) serial over ``transport`` stands in."""
    ok = _ok(records)
    ref = next((r for r in ok if r["schedule"] == "serial" and r["transport"] == "ccl"), None) \
        or next((r for r in ok if r["schedule"] == "serial"), None)
    reference_s = ref["median_s"] if ref else None
    for r in records:
        r["reference_s"] = reference_s
        r["speedup"] = reference_s / r["median_s"] if reference_s and r in ok else None
    candidates = [r for r in ok if r["kind"] == "schedule" and r["transport"] == transport]
    best = min(candidates, key=lambda r: r["median_s"], default=None)
    by_name = {r["schedule"]: r for r in candidates}
    pick_speedups = {sel: by_name[name]["speedup"] if name in by_name else None
                     for sel, name in picks.items()}
    for r in records:
        r["best_schedule"] = best["schedule"] if best else None
        r["best_speedup"] = best["speedup"] if best else None
        r["picks"] = dict(picks)
        r["pick_speedups"] = pick_speedups
        r["picked_by"] = sorted(sel for sel, name in picks.items()
                                if name == r["schedule"] and r["transport"] == transport
                                and r["kind"] == "schedule")


def selector_accuracy(records: list[dict], tolerance: float = PICK_TOLERANCE) -> dict:
    """Per selector: over scenarios where its pick was measured, how often the pick is within
    ``tolerance`` of the best measured schedule, and the mean fraction of the best speedup it
    loses when it misses (the paper reports 81% right and 14% lost).

    >>> recs = [dict(scenario="s", status="ok", kind="schedule", transport="dma", schedule=n,
    ...              median_s=t, picks={"paper": "a"}) for n, t in (("a", 2.0), ("b", 1.0))]
    >>> selector_accuracy(recs)["paper"]["accuracy"]
    0.0
    """
    scenarios: dict[str, list[dict]] = {}
    for r in records:
        scenarios.setdefault(r["scenario"], []).append(r)
    out = {}
    for sel in SELECTORS:
        hits, misses, losses = 0, 0, []
        for recs in scenarios.values():
            cands = {r["schedule"]: r for r in _ok(recs) if r["kind"] == "schedule"
                     and r["transport"] == "dma"}
            pick = next((r.get("picks", {}).get(sel) for r in recs if r.get("picks")), None)
            if not cands or pick not in cands:
                continue
            best_s = min(r["median_s"] for r in cands.values())
            if cands[pick]["median_s"] <= best_s * (1 + tolerance):
                hits += 1
            else:
                misses += 1
                losses.append(1 - best_s / cands[pick]["median_s"])
        total = hits + misses
        out[sel] = {"scenarios": total, "hits": hits,
                    "accuracy": hits / total if total else None,
                    "mean_loss_when_missed": sum(losses) / len(losses) if losses else 0.0}
    return out
