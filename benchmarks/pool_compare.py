"""Several runs of `benchmarks/compare.py` read together: on a shared machine one run's shares
and prediction errors move by as much as the changes between runs, so this reads the tables
the runs appended to RESULTS.md and gives, per model and budget, each run's measured share of
every block's overhead and their median, the median predicted share, in how many runs the
prediction was within 10% or 2 ms of the clock (and where it lay below or above in all of them),
and whether the median prediction is within 10% or 2 ms of the median measured overhead: one
run's figure moves with the machine's state in that process (its rounds' interval does not
show it), so the medians over runs are the steadier test of the cost model.
Each model and budget is pooled over the runs that measured it, so runs of two models each
(`--models gpt2,gpt`, then `llama,bert`, ...) pool together.

    .venv/bin/python benchmarks/pool_compare.py --runs "2026-11-26 23:08" "2026-11-27 00:48" [--save]

`--runs` names the runs by the time stamps of their RESULTS.md headings ("Planner vs. today's
options (<stamp>; ...)"); each must have run the same planner code, and measured overhead the
same way, for the pooled figures to mean anything (runs stamped 2026-11-27 05:40 and later take
the median of paired per-round differences, those from 2026-11-29 07:24 each step less the two
unplanned steps around it, earlier ones the difference of two medians; see the runs' method
paragraphs). Prints the table; `--save` also appends it to RESULTS.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare_report import SHARE_TARGETS  # noqa: E402
from compare_results import within_tolerance  # noqa: E402
from results import RESULTS, append_results  # noqa: E402

HEADING = "## Planner vs. today's options ("
EVERY_BLOCK = "every block"
PLANNER = "planner auto @ "
COLUMNS = {"configuration": "configuration", "measured": "overhead, measured", "predicted": "overhead, predicted"}
RETIMED = "predicted from the rounds' node times"  # a column of the later runs only


@dataclass(frozen=True)
class Row:
    """One configuration of one model in one run: overheads in ms."""

    measured_ms: float
    predicted_ms: float
    retimed_ms: float | None = None  # predicted from the rounds' node times, where the run gives it


def read_run(text: str, stamp: str) -> dict[tuple[str, str], Row]:
    """(model title, configuration) -> its row, for the run whose heading carries `stamp`: the
    every-block row and each planner row that ran.

    Example:
        >>> read_run(Path("benchmarks/RESULTS.md").read_text(), "2026-11-27 03:02")[("Hugging Face GPT-2", "60%")]
        Row(measured_ms=103.0, predicted_ms=87.0, retimed_ms=88.0)
    """
    sections = [part for part in text.split("\n## ") if part.startswith(HEADING[3:] + stamp)]
    if len(sections) != 1:
        raise SystemExit(f"{len(sections)} compare runs in {RESULTS.name} are stamped {stamp!r}; name one")
    rows: dict[tuple[str, str], Row] = {}
    model, index = "", {}
    for line in sections[0].splitlines():
        if line.startswith("### "):
            model = line[4:].split(" (")[0]
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == COLUMNS["configuration"]:
            missing = [name for name in COLUMNS.values() if name not in cells]
            if missing:
                raise SystemExit(f"the run stamped {stamp!r} has no column {missing[0]!r}: it predates what this pools")
            index = {key: cells.index(name) for key, name in COLUMNS.items()}
            if RETIMED in cells:
                index["retimed"] = cells.index(RETIMED)
            continue
        if not index or not (cells[0] == EVERY_BLOCK or cells[0].startswith(PLANNER)):
            continue
        measured, predicted = cells[index["measured"]], cells[index["predicted"]]
        if measured == "-" or predicted == "-":  # infeasible at that budget: not run
            continue
        label = cells[0].removeprefix(PLANNER)
        retimed = cells[index["retimed"]] if "retimed" in index else "-"
        rows[(model, label)] = Row(float(measured.split()[0]), float(predicted.split()[0]),
                                   None if retimed == "-" else float(retimed.split()[0]))
    return rows


@dataclass(frozen=True)
class Pooled:
    """`pooled_table`'s result: the markdown table, and its tallies of predictions within 10% or
    2 ms: run by run (`within` of `made`), and as medians over runs (`medians_within` of `plans`)."""

    table: str
    within: int
    made: int
    medians_within: int
    plans: int


def pooled_table(runs: list[dict[tuple[str, str], Row]]) -> Pooled:
    """The markdown table over `runs` (each plan over the runs that hold it) and its tallies.

    Example:
        >>> text = RESULTS.read_text()
        >>> pooled = pooled_table([read_run(text, "2026-12-04 13:58"), read_run(text, "2026-12-04 16:08")])
        >>> pooled.within, pooled.made
        (16, 16)
    """
    lines = ["| model | budget | measured share, each run | median | predicted (median) | target "
             "| predictions within 10% or 2 ms | overhead, medians over runs: measured / predicted "
             "(from the rounds' node times) | medians within 10% or 2 ms |", "|---|---|---|---|---|---|---|---|---|"]
    # Each plan is pooled over the runs that measured it: a run may hold some of the models only.
    keys = list(dict.fromkeys(key for run in runs for key in run if key[1] != EVERY_BLOCK))
    within_total = made = medians_within = 0
    for model, label in keys:
        holding = [run for run in runs if (model, label) in run]
        every = [run[(model, EVERY_BLOCK)] for run in holding]
        rows = [run[(model, label)] for run in holding]
        shares = [row.measured_ms / base.measured_ms for row, base in zip(rows, every)]
        predicted = [row.predicted_ms / base.predicted_ms for row, base in zip(rows, every)]
        within = sum(within_tolerance(row.predicted_ms, row.measured_ms) for row in rows)
        within_total, made = within_total + within, made + len(rows)
        side = ""
        if all(row.predicted_ms < row.measured_ms for row in rows):
            side = " (below in every run)"
        elif all(row.predicted_ms > row.measured_ms for row in rows):
            side = " (above in every run)"
        measured_ms = statistics.median(row.measured_ms for row in rows)
        predicted_ms = statistics.median(row.predicted_ms for row in rows)
        retimed = [row.retimed_ms for row in rows if row.retimed_ms is not None]
        retimed_text = f" ({statistics.median(retimed):.0f})" if len(retimed) == len(rows) else ""
        medians_ok = within_tolerance(predicted_ms, measured_ms)
        medians_within += medians_ok
        target = SHARE_TARGETS.get(label)
        lines.append(f"| {model} | {label} | {' / '.join(f'{s:.2f}' for s in shares)} | {statistics.median(shares):.2f} "
                     f"| {statistics.median(predicted):.2f} | {'-' if target is None else target} "
                     f"| {within}/{len(rows)}{side} | {measured_ms:.0f} / {predicted_ms:.0f}{retimed_text} ms "
                     f"| {'yes' if medians_ok else 'no'} |")
    return Pooled("\n".join(lines), within_total, made, medians_within, len(keys))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="time stamps of the runs' RESULTS.md headings")
    parser.add_argument("--save", action="store_true", help="append the table to RESULTS.md")
    args = parser.parse_args()
    text = RESULTS.read_text()
    pooled = pooled_table([read_run(text, stamp) for stamp in args.runs])
    body = (f"{pooled.table}\n\nRuns: {', '.join(args.runs)}. Shares are each plan's measured overhead over every "
            f"block's in the same run; {pooled.within} of {pooled.made} predictions were within 10% or 2 ms of the "
            f"clock in their own run; the median prediction over the runs was within 10% or 2 ms of the median "
            f"measured overhead for {pooled.medians_within} of {pooled.plans} plans (model and budget).")
    print(body)
    if args.save:
        runs = " ".join(f'"{stamp}"' for stamp in args.runs)
        append_results("compare.py runs pooled", f"python benchmarks/pool_compare.py --runs {runs}", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
