"""How much the same configuration's measured overhead moves from one `benchmarks/compare.py`
run to the next on one machine, read off the tables those runs appended to RESULTS.md.

"Every block" wraps the same regions in every run, so on a quiet machine its overhead would
measure the same each time; its spread across runs is what a single run's measurement can be
trusted to, against issue 14's tolerance of 10% or 2 ms. The planner's own plans are counted
too (within the tolerance or not, per run), though their regions differ between runs.

    python benchmarks/run_spread.py --since "2026-12-02 10" --machine "torch CPU"
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare_results import within_tolerance  # noqa: E402
from pool_compare import EVERY_BLOCK, HEADING, Row, read_run  # noqa: E402
from results import RESULTS  # noqa: E402

STAMP = re.compile(re.escape(HEADING) + r"(?P<stamp>[^;]+); (?P<machine>[^)]*)\)")


def runs_of(text: str, since: str, machine: str) -> list[dict[tuple[str, str], Row]]:
    """Each compare run stamped at or after `since` on a machine whose description contains
    `machine`, as `pool_compare.read_run` reads it: (model, configuration) -> its row.

    Example:
        >>> runs_of(Path("benchmarks/RESULTS.md").read_text(), "2026-12-03 19", "torch CPU")[0][("Hugging Face ViT", "every block")]
        Row(measured_ms=192.0, predicted_ms=183.0)
    """
    stamps = [found["stamp"] for found in STAMP.finditer(text)
              if found["stamp"] >= since and machine in found["machine"]]
    return [read_run(text, stamp) for stamp in stamps]


def report(runs: list[dict[tuple[str, str], Row]]) -> str:
    """A table per model: every block's measured overhead across `runs`, its spread, its
    prediction's ratio and how many runs fell within the tolerance; and the planner's plans'."""
    every: dict[str, list[Row]] = defaultdict(list)
    plans: dict[str, list[Row]] = defaultdict(list)
    for run in runs:
        for (model, label), row in run.items():
            (every if label == EVERY_BLOCK else plans)[model].append(row)
    lines = ["| model | runs | every block, measured (min / median / max) | spread (max - min) / median | "
             "measured / predicted (median, range) | every block within 10% or 2 ms | planner's plans within |",
             "|---|---|---|---|---|---|---|"]
    for model, rows in every.items():
        measured = sorted(r.measured_ms for r in rows)
        middle = statistics.median(measured)
        ratios = sorted(r.measured_ms / r.predicted_ms for r in rows)
        within = sum(within_tolerance(r.predicted_ms, r.measured_ms) for r in rows)
        plans_within = sum(within_tolerance(r.predicted_ms, r.measured_ms) for r in plans[model])
        lines.append(f"| {model} | {len(rows)} | +{measured[0]:.0f} / +{middle:.0f} / +{measured[-1]:.0f} ms | "
                     f"{(measured[-1] - measured[0]) / middle:.0%} | {statistics.median(ratios):.2f} "
                     f"({ratios[0]:.2f}-{ratios[-1]:.2f}) | {within}/{len(rows)} | {plans_within}/{len(plans[model])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--since", default="2026-12-02", help="first section stamp to read (YYYY-MM-DD[ HH:MM])")
    parser.add_argument("--machine", default="torch CPU", help="text the section's machine description contains")
    args = parser.parse_args(argv)
    runs = runs_of(RESULTS.read_text(), args.since, args.machine)
    if not runs:
        print(f"no compare runs since {args.since} on '{args.machine}' in {RESULTS}", file=sys.stderr)
        return 1
    print(report(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
