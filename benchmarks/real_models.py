"""Real models through the planner: graph size, frontend, leaves, and the plan at 50% of the
unplanned peak, verified by measurement. Prints a table and appends it to RESULTS.md.

    .venv/bin/python benchmarks/real_models.py [--no-save]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# This folder holds solvers.py (the solver benchmark): put the project first so that
# `import solvers` finds the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import warnings

import torch

from planner import InfeasibleBudget, plan
from planner.api import GIB
from solvers import format_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from benchmarks.results import append_results  # noqa: E402
from test_real_models import MODELS  # noqa: E402  (the small configs the tests use)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows = ["| model | graph nodes | frontend | leaves kept whole | unplanned peak | budget (50%) "
            "| solver | regions | predicted peak | measured peak | gradients match |", "|" + "---|" * 11]
    for name, factory in MODELS.items():
        torch.manual_seed(0)
        model, sample = factory()
        model.train()
        p = plan(model, sample, budget_gb=80, solver=args.solver)
        budget = 0.5 * p.baseline_peak_bytes
        head = (f"| {name} | {len(p.problem)} | {p.frontend} | {', '.join(p.leaves) or 'none'} "
                f"| {format_bytes(p.baseline_peak_bytes)} | {format_bytes(budget)} ")
        try:
            q = p.replan(budget_gb=budget / GIB)
        except InfeasibleBudget as error:
            rows.append(head + f"| {args.solver} | infeasible: minimum {format_bytes(error.minimum_bytes)} | | | |")
        else:
            record = q.verify(steps=2)
            rows.append(head + f"| {q.solver} | {len(q.checkpoints)} | {format_bytes(q.predicted_peak_bytes)} "
                        f"| {format_bytes(record.planned_peak_bytes)} | {'yes' if record.gradients_match else 'NO'} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(table)
    if not args.no_save:
        append_results("Real models at 50% of the unplanned peak",
                       f"python benchmarks/real_models.py --solver {args.solver}", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
