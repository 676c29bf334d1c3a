"""How much the same configuration's measured overhead moves from one `benchmarks/compare.py`
run to the next on one machine, read off the tables those runs appended to RESULTS.md.

"Every block" wraps the same regions in every run, so on a quiet machine its overhead would
measure the same each time; its spread across runs is what a single run's measurement can be
trusted to, against issue 14's tolerance of 10% or 2 ms. The planner's own plans are counted
too (within the tolerance or not, per run), though their regions differ between runs.

    python benchmarks/run_spread.py --since 2026-12-02 --machine "torch CPU"
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from compare_results import within_tolerance

RESULTS = Path(__file__).with_name("RESULTS.md")
SECTION = re.compile(r"^## Planner vs\. today's options \((?P<stamp>[^;]+); (?P<machine>[^)]*)\)")
MS = re.compile(r"([+-]?\d+(?:\.\d+)?) ms")


@dataclass(frozen=True)
class Row:
    """One configuration's measured and predicted overhead in one run (ms; predicted None where
    the table gives none)."""

    stamp: str
    model: str
    configuration: str
    measured_ms: float
    predicted_ms: float | None


def _ms(cell: str) -> float | None:
    found = MS.search(cell)
    return float(found.group(1)) if found else None


def rows_of(text: str, since: str, machine: str) -> list[Row]:
    """Every table row with a measured overhead, from compare sections stamped at or after
    `since` on a machine whose description contains `machine`.

    Example:
        >>> rows_of(Path("benchmarks/RESULTS.md").read_text(), "2026-12-03", "torch CPU")[0].configuration
        'none'
    """
    rows: list[Row] = []
    stamp = model = None
    header: list[str] = []
    for line in text.splitlines():
        if line.startswith("## "):
            found = SECTION.match(line)
            stamp = found["stamp"] if found and found["stamp"] >= since and machine in found["machine"] else None
            header = []
        elif line.startswith("### "):
            model, header = line[4:].strip(), []
        elif stamp and model and line.startswith("| configuration"):
            header = [cell.strip() for cell in line.strip("|").split("|")]
        elif stamp and model and header and line.startswith("| ") and not line.startswith("|---"):
            cells = dict(zip(header, (cell.strip() for cell in line.strip("|").split("|"))))
            measured = _ms(cells.get("overhead, measured", ""))
            if measured is not None:
                rows.append(Row(stamp, model, cells["configuration"], measured,
                                _ms(cells.get("overhead, predicted", ""))))
    return rows


def report(rows: list[Row]) -> str:
    """A table per model: every block's measured overhead across runs, its spread, its
    prediction's ratio and how many runs fell within the tolerance; and the planner's plans'."""
    by_model: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        by_model[row.model].append(row)
    lines = ["| model | runs | every block, measured (min / median / max) | spread (max - min) / median | "
             "measured / predicted (median, range) | every block within 10% or 2 ms | planner's plans within |",
             "|---|---|---|---|---|---|---|"]
    for model, model_rows in by_model.items():
        every = [r for r in model_rows if r.configuration == "every block" and r.predicted_ms]
        plans = [r for r in model_rows if r.configuration.startswith("planner") and r.predicted_ms is not None]
        if not every:
            continue
        measured = sorted(r.measured_ms for r in every)
        middle = statistics.median(measured)
        ratios = sorted(r.measured_ms / r.predicted_ms for r in every)
        within = sum(within_tolerance(r.predicted_ms, r.measured_ms) for r in every)
        plans_within = sum(within_tolerance(r.predicted_ms, r.measured_ms) for r in plans)
        lines.append(f"| {model} | {len(every)} | +{measured[0]:.0f} / +{middle:.0f} / +{measured[-1]:.0f} ms | "
                     f"{(measured[-1] - measured[0]) / middle:.0%} | {statistics.median(ratios):.2f} "
                     f"({ratios[0]:.2f}-{ratios[-1]:.2f}) | {within}/{len(every)} | {plans_within}/{len(plans)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--since", default="2026-12-02", help="first section stamp to read (YYYY-MM-DD[ HH:MM])")
    parser.add_argument("--machine", default="torch CPU", help="text the section's machine description contains")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = rows_of(args.results.read_text(), args.since, args.machine)
    if not rows:
        print(f"no compare rows since {args.since} on '{args.machine}' in {args.results}", file=sys.stderr)
        return 1
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
