"""``python -m ficco.bench validate``: hold the simulator against results nobody here measured.

Three checks, all without a GPU:

1. **The paper's picks** (FiCCO paper §VI-C: its rule picks the fastest of its four schedules
   on all 16 GEMMs of Table I, MI300X, W = 8). The ``model`` selector, restricted to those four
   and simulated as the paper ran them (:mod:`ficco.bench.paper_runs`), should pick the same;
   where it does not, the losing margin is the model's own predicted gap.
2. **Published numbers** in ``ficco/bench/validation/published.csv`` (shipped with the
   package, so an installed wheel validates too), one row per figure read in a public source:
   what was measured, on what, the figure, our prediction (:mod:`ficco.bench.predictors`) and
   the relative error; rows off by more than 20% name the mechanism. ``role`` says whether a
   profile number was set from the row (``fit``), or not and the row was looked at while the
   model changed (``tune``), or not and it was held out (``holdout``); ``family`` groups rows
   for the targets (all-gather, reduce-scatter, all-to-all, baselines, async-tp, paper); ``op``
   and ``kind`` say which op a row times and whether it is one shape (``point``) or an
   aggregate. Rows whose hardware has no profile are listed, not predicted; ``versus`` names
   the publication's serial row where a row times an overlapped implementation. ``--write`` refreshes the prediction and
   error columns; ``--write-bands`` regenerates the selector's error bands from the residuals
   (:mod:`ficco.heuristics.bands`).
3. **Fit data**: the H100 GEMM timings in ``bench/results`` that the H100 GEMM model was
   fitted to (a checkout only; reported apart, since a fit agrees with its data by construction).

Each row's ``quantity`` names a predictor in :data:`PREDICTORS`; ``shapes`` gives its inputs
as ``key=value`` pairs. A published range ``lo..hi`` counts as exact inside the range.
"""
from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from ..heuristics import bands, gemm, profiles
from ..ops import of_collective as collective_ops
from ..plan.problem import ALL_GATHER, REDUCE_SCATTER
from . import predictors, validate_g13_g16
from .paper_runs import (  # noqa: F401
    GRAPHS,
    PAPER_FOUR,
    as_paper_implemented,
    fig7_orderings,
    load_profile,
    paper_picks,
)
from .predictors import PREDICTORS, fit_fig8_cil, row_class

EXAMPLES = """examples:
  python -m ficco.bench validate                  # picks, published rows, fit data
  python -m ficco.bench validate --write          # also refresh the table's prediction columns
  python -m ficco.bench validate --write-bands    # also regenerate the selector's error bands
  python -m ficco.bench validate --fit-cil mi300x # the contention constants Fig. 8 implies
"""
#: The published rows ship inside the package (package data), next to their README.
TABLE = Path(__file__).with_name("validation") / "published.csv"
ROOT = Path(__file__).resolve().parents[2]
GEMM_FIT = ROOT / "bench" / "results" / "characterize-cuda-sm_90-20261122-192742" \
    / "characterize.jsonl"
COLUMNS = ("id", "source", "hardware", "profile", "op", "kind", "family", "shapes", "quantity",
           "role", "versus", "published", "prediction", "rel_error", "mechanism", "note")
#: Rows off by more than this must name the mechanism behind the error.
EXPLAIN_ABOVE = 0.20
#: the ops the published rows time: those whose GEMM gathers its rows or reduce-scatters
OPS = collective_ops(ALL_GATHER, REDUCE_SCATTER)


def add_arguments(parser) -> None:
    parser.add_argument("--table", default=str(TABLE), help="published-results CSV")
    parser.add_argument("--write", action="store_true",
                        help="write the predictions and errors back into the table")
    parser.add_argument("--write-bands", action="store_true",
                        help=f"regenerate the selector's error bands ({bands.BANDS_FILE.name}) "
                             f"from the unfitted rows' residuals")
    parser.add_argument("--fit-cil", metavar="PROFILE", default=None,
                        help="print the contention constants that reproduce the paper's Fig. 8 "
                             "geomeans on PROFILE (what its cil block holds), and stop")


def main(args) -> int:
    if args.fit_cil:
        fitted = fit_fig8_cil(load_profile(args.fit_cil + GRAPHS))
        print(f"cil constants reproducing FiCCO Fig. 8 on {args.fit_cil}: "
              f"{json.dumps(fitted, sort_keys=True)}")
        return 0
    report_picks()
    validate_g13_g16.report()   # g13-g16 priced as all-to-all (expert parallelism)
    rows = evaluate(read_table(args.table))
    report_rows(rows, args.table)
    fit = gemm_fit_errors()
    if fit:
        abs_fit = [abs(e) for e, _ in fit]
        bad = max(fit, key=lambda x: abs(x[0]))
        print(f"fit data, H100 GEMMs ({GEMM_FIT.relative_to(ROOT)}): {len(fit)} timings, median "
              f"|error| {statistics.median(abs_fit):.1%}, worst {bad[0]:+.1%} ({bad[1]})")
    else:
        print("fit data: bench/results is not in this install (a checkout has it)")
    if args.write:
        write_table(args.table, rows)
        print(f"wrote {args.table}")
    if args.write_bands:
        path = bands.write(bands.from_rows(rows))
        print(f"wrote {path}")
    return 0


def report_picks() -> None:
    picks = paper_picks()
    agree = sum(r["agree"] for r in picks)
    print(f"Table I picks, MI300X, W=8, among {', '.join(PAPER_FOUR)} (as the paper ran them)")
    for r in picks:
        mark = "=" if r["agree"] else f"x  paper's pick {r['margin']:+.1%} slower (predicted)"
        print(f"  {r['gemm']:4} paper {r['paper']:18} model {r['model']:18} {mark}")
    worst_margin = max((r["margin"] for r in picks if not r["agree"]), default=0.0)
    print(f"agreement {agree}/{len(picks)}; worst losing margin {worst_margin:.1%}")
    own = paper_picks(as_paper_ran=False)
    print(f"(ficco's own plans, no gathers, real 2D copies: "
          f"{sum(r['agree'] for r in own)}/{len(own)} agree)")
    held, total, missed = fig7_orderings()
    print(f"Fig. 7 DIL orderings held on MI300X: {held}/{total}"
          + (f" (missed: {', '.join(missed)})" if missed else "") + "\n")


def report_rows(rows: list[dict], table) -> None:
    """Every row with its error (and mechanism when over :data:`EXPLAIN_ABOVE`), the rows
    without a profile, the medians per family and role against their targets, and what the
    ``model`` selector picks where a publication measured overlap losing."""
    print(f"published results ({table}):")
    predicted = [r for r in rows if r["prediction"]]
    for row in predicted:
        print(f"  {row['id']:4} {row['role']:7} {row['family']:14} {row['quantity']:24} "
              f"published {row['published']:>10} predicted {row['prediction']:>9} "
              f"error {row['rel_error']:>7}  {row['hardware']}")
        if abs(float(row["rel_error"])) > EXPLAIN_ABOVE:
            print(f"       mechanism: {row['mechanism'] or 'NOT GIVEN'}")
    unpriced = [r for r in rows if not r["prediction"]]
    if unpriced:
        print("listed, not predicted (no profile for the hardware, or not a ficco schedule):")
        for row in unpriced:
            print(f"  {row['id']:4} {short_op(row['op']):6} published {row['published']:>10} "
                  f"({row['shapes']}) on {row['hardware']}: {row['mechanism']}")
    for label, chosen in summaries(predicted):
        errors = [abs(float(r["rel_error"])) for r in chosen]
        worst = max(chosen, key=lambda r: abs(float(r["rel_error"])))
        print(f"{label}: median |error| {statistics.median(errors):.1%} over {len(errors)} rows; "
              f"worst {float(worst['rel_error']):+.1%} ({worst['id']})")
    print("where a publication measured overlap losing to serial, the model selector picks:")
    for row, serial, loss, pick in picks_where_overlap_lost(rows):
        print(f"  {row['id']:4} overlap {loss:+.0%} against {serial['id']} ({serial['shapes']}): "
              f"{pick or 'not a ficco op'}")
    print()


#: The families targets are set for, and the targets (median |error| of unfitted point rows).
FAMILIES = ("all-gather", "reduce-scatter", "all-to-all", "baselines", "async-tp", "decode")
TARGET_ALL, TARGET_FAMILY = 0.08, 0.10
#: Roles of rows no profile number was set from: ``tune`` rows were looked at while the model
#: changed, ``holdout`` rows were not (they measure how it generalises).
UNFITTED = bands.UNFITTED


def summaries(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """(label, rows) of every summary line: the unfitted point rows, per family against the
    targets, the held-out ones alone, then fits and all rows; empty groups are left out."""
    points = [r for r in rows if r["kind"] == "point" and r["role"] in UNFITTED]
    held = [r for r in points if r["role"] == "holdout"]
    groups = [(f"point rows nobody fitted (target <= {TARGET_ALL:.0%})", points)]
    groups += [(f"  family {f} (target <= {TARGET_FAMILY:.0%})",
                [r for r in points if r["family"] == f]) for f in FAMILIES]
    groups.append(("held-out point rows (never looked at while the model changed)", held))
    groups += [(f"  held out, family {f}", [r for r in held if r["family"] == f])
               for f in FAMILIES]
    groups.append(("fits (rows a profile number was set from)",
                   [r for r in rows if r["role"] == "fit"]))
    groups.append(("all rows", rows))
    return [(label, chosen) for label, chosen in groups if chosen]


def family_errors(rows: list[dict]) -> dict[str, float]:
    """Median |error| of the unfitted point rows, ``"all"`` and per family (validated rows)."""
    points = [r for r in rows if r["prediction"] and r["kind"] == "point"
              and r["role"] in UNFITTED]
    out = {"all": statistics.median(abs(float(r["rel_error"])) for r in points)}
    for f in FAMILIES:
        chosen = [abs(float(r["rel_error"])) for r in points if r["family"] == f]
        if chosen:
            out[f] = statistics.median(chosen)
    return out


def picks_where_overlap_lost(rows: list[dict]):
    """(row, serial row, loss, pick) for every row whose publication measured an overlapped
    implementation (``published``) slower than its serial (the row ``versus`` names): the
    ``model`` selector's pick on the serial row's shape and profile (None where that row is
    not one of ficco's ops)."""
    from ..heuristics import model

    by_id = {r["id"]: r for r in rows}
    for row in rows:
        serial = by_id.get(row["versus"])
        if serial is None:
            continue
        loss = float(row["published"]) / float(serial["published"]) - 1
        if loss <= 0:
            continue
        pick = None
        if serial["quantity"] == "schedule_us" and serial["profile"]:
            args = dict(item.split("=", 1) for item in serial["shapes"].split())
            problem = predictors.problem_of(args)
            prof = load_profile(serial["profile"])
            width, cls = bands.band(problem, prof)
            pick = model.banded_choice(problem, prof, None, ("dma", "ccl"), None,
                                       lambda via: None, width, cls).schedule
        yield row, serial, loss, pick


def short_op(op: str) -> str:
    return {"all_gather_matmul": "AG+MM", "matmul_reduce_scatter": "MM+RS"}.get(op, op)


# -- the table -----------------------------------------------------------------------------------
def read_table(path) -> list[dict]:
    with open(path, newline="") as handle:
        return [dict(row) for row in csv.DictReader(handle)]


def write_table(path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: row.get(k, "") for k in COLUMNS} for row in rows)


def evaluate(rows: list[dict]) -> list[dict]:
    """Rows with ``prediction`` and ``rel_error`` filled in; a row without a profile (its
    hardware has none) keeps both empty."""
    out = []
    for row in rows:
        if not row["profile"]:
            out.append(dict(row, prediction="", rel_error=""))
            continue
        args = dict(item.split("=", 1) for item in row["shapes"].split()) if row["shapes"] else {}
        prof = load_profile(row["profile"])
        predicted = PREDICTORS[row["quantity"]](prof, **args)
        out.append(dict(row, prediction=f"{predicted:.4g}",
                        rel_error=f"{relative_error(predicted, row['published']):+.3f}",
                        **{"class": row_class(row["quantity"], prof, **args)}))
    return out


def relative_error(predicted: float, published: str) -> float:
    """(predicted - published) / published; a range ``lo..hi`` is exact inside."""
    if ".." in published:
        lo, hi = (float(x) for x in published.split(".."))
        if lo <= predicted <= hi:
            return 0.0
        edge = lo if predicted < lo else hi
        return (predicted - edge) / edge
    return predicted / float(published) - 1


# -- 3. fit data ---------------------------------------------------------------------------------
def gemm_fit_errors(path: Path = GEMM_FIT) -> list[tuple[float, str]]:
    """(relative error, label) of the H100 GEMM model on every timing in ``path``: whole
    GEMMs and their 8/64-way row pieces (``ways`` launches of M/ways rows) and column pieces
    (``ways`` launches over K/ways, all but the first accumulating)."""
    if not path.is_file():
        return []
    prof = profiles.load("h100")
    seen, out = set(), []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") != "dil":
            continue
        m, n, k, ways = r["M"], r["N"], r["K"], r["ways"]
        if (m, n, k) not in seen:
            seen.add((m, n, k))
            out.append((gemm.gemm_seconds(prof, "bfloat16", [m], n, k, 2) / r["whole_s"] - 1,
                        f"{r['gemm']} whole"))
        if r["split"] == "row":
            t = ways * gemm.gemm_seconds(prof, "bfloat16", [m // ways], n, k, 2)
        else:
            t = gemm.gemm_seconds(prof, "bfloat16", [m], n, k // ways, 2) \
                + (ways - 1) * gemm.gemm_seconds(prof, "bfloat16", [m], n, k // ways, 2, True)
        out.append((t / r["sharded_s"] - 1, f"{r['gemm']} {r['split']} x{ways}"))
    return out
