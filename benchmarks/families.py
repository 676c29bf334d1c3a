"""Hugging Face families from tiny random configs (`benchmarks.hf_families`): each planned at 70%
of its measured unplanned peak twice, with the default call and with `measure="no-run"` (the
node-by-node path a `meta` model or another GPU takes), and both plans measured (`verify`).

Judged per plan: under its budget; prediction within 3% of the measured peak; a no-run plan
at most 1% over its budget. Where 70% is below the smallest budget, the plan is made at the
minimum the planner names. `--autocast bfloat16`: the step under CPU autocast, planned with
`plan(..., autocast=torch.bfloat16)` and measured under it.

    .venv/bin/python -m benchmarks.families [--families mistral,t5] [--autocast bfloat16] [--results]
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

from benchmarks.hf_families import BATCH, FAMILIES, LENGTH
from benchmarks.memory_accuracy import planned_at
from benchmarks.results import set_section, write_run
from planner.measure.steps import steady_peak

SHARE = 0.7  # of the unplanned step's measured peak: the budget
PATHS = ("auto", "no-run")


def plan_and_verify(family: str, measure: str, autocast: torch.dtype | None = None) -> dict:
    """One family planned with `measure` at SHARE of its measured peak (else at the minimum
    named), and the plan's step measured (both under CPU autocast to `autocast`, if given)."""
    torch.manual_seed(0)
    model, make = FAMILIES[family]()
    model.train()
    sample = make(BATCH, LENGTH)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        unplanned = steady_peak(model, sample, torch.device("cpu"))
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p, budget, asked = planned_at(model, sample, int(SHARE * unplanned), measure=measure, autocast=autocast)
    seconds = time.perf_counter() - start
    record = p.verify(steps=1)
    return {"family": family, "model": type(model).__name__, "measure": measure, "unplanned": unplanned,
            "budget": budget, "at_minimum": asked is not None, "seconds": seconds, "regions": len(p.checkpoints),
            "predicted": record.predicted_peak_bytes, "measured": record.planned_peak_bytes,
            "error": record.peak_error, "over": record.planned_peak_bytes / budget - 1,
            "gradients_match": record.gradients_match,
            "warnings": sorted({str(w.message).split(":")[0][:80] for w in caught})}


def misses_of(row: dict) -> list[str]:
    where = f"{row['family']} ({row['measure']})"
    found = []
    if row["measure"] == "auto" and row["over"] > 0:
        found.append(f"{where}: {100 * row['over']:.2f}% over budget")
    if row["measure"] == "no-run" and row["over"] > 0.01:
        found.append(f"{where}: {100 * row['over']:.2f}% over budget (more than 1%)")
    if abs(row["error"]) > 0.03:
        found.append(f"{where}: prediction off by {100 * row['error']:+.2f}%")
    if not row["gradients_match"]:
        found.append(f"{where}: gradients differ")
    return found


def table(rows: list[dict]) -> str:
    """One row per family: its default plan's figures beside its no-run plan's."""
    lines = ["| family | unplanned peak | default: budget, regions | predicted | measured | error | vs budget "
             "| no-run: budget, regions | predicted | measured | error | vs budget | gradients match |",
             "|" + "---|" * 13]
    by_family: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_family.setdefault(row["family"], {})[row["measure"]] = row
    for family, paths in by_family.items():
        first = next(iter(paths.values()))
        cells = [f"{family} ({first['model']})", f"{first['unplanned']:,} B"]
        for measure in PATHS:
            row = paths.get(measure)
            if row is None:
                cells += [""] * 5
                continue
            budget = f"{row['budget']:,} B{' (minimum)' if row['at_minimum'] else ''}, {row['regions']}"
            cells += [budget, f"{row['predicted']:,} B", f"{row['measured']:,} B", f"{100 * row['error']:+.2f}%",
                      f"{100 * row['over']:+.2f}%"]
        cells.append("yes" if all(row["gradients_match"] for row in paths.values()) else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset")
    parser.add_argument("--autocast", choices=("bfloat16", "float16"), help="the step under CPU autocast")
    parser.add_argument("--results", action="store_true", help="write the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    autocast = getattr(torch, args.autocast) if args.autocast else None
    rows = []
    for family in args.families.split(","):
        for measure in PATHS:
            rows.append(plan_and_verify(family, measure, autocast))
            print(family, measure, f"error {100 * rows[-1]['error']:+.2f}%, {100 * rows[-1]['over']:+.2f}% vs budget",
                  *rows[-1]["warnings"], flush=True)
    misses = [miss for row in rows for miss in misses_of(row)]
    worst = max(rows, key=lambda row: abs(row["error"]))
    verdict = (f"{len(rows)} plans; largest prediction error {100 * worst['error']:+.2f}% ({worst['family']}, "
               f"{worst['measure']}). Budgets: {SHARE:.0%} of the unplanned peak, else the minimum named. "
               + ("Every plan under its budget (no-run: at most 1% over) and within 3% of its prediction."
                  if not misses else "Misses:\n" + "\n".join(f"- {miss}" for miss in misses)))
    command = "python -m benchmarks.families" + ("" if args.families == ",".join(FAMILIES) else
                                                 f" --families {args.families}")
    key, title = "families", f"Hugging Face families at {SHARE:.0%}: the default call and the no-run path"
    if args.autocast:
        command += f" --autocast {args.autocast}"
        key, title = f"families_{args.autocast}", f"{title}, under CPU autocast to {args.autocast}"
    print(f"\n{table(rows)}\n\n{verdict}")
    print(f"records: {write_run(key, {'command': command, 'rows': rows})}")
    if args.results:
        set_section(key, title, command, f"{table(rows)}\n\n{verdict}")
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())
