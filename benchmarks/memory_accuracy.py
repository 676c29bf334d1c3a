"""Memory truth on CPU: does the planned model's measured peak stay under the budget, and how
close is the predicted peak to the measured one?

For each model: measure the unplanned peak, then plan at 30/50/70/90% of it and measure the
planned module (`Plan.verify`). Prints a table and appends it to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/memory_accuracy.py [--solver auto] [--no-save]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# This folder holds solvers.py (the solver benchmark): put the project first so that
# `import solvers` finds the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.results import append_results  # noqa: E402
from planner import InfeasibleBudget, plan
from planner.api import GIB
from planner.examples import cnn, gpt, mlp, skip_transformer
from solvers.solution import format_bytes

MODELS = {
    "transformer (built-in GPT, 8 blocks)": lambda: gpt(batch=8, length=128),
    "MLP (16 blocks of 512-1024-512, tanh)": lambda: mlp(width=512, depth=16, batch=1024),
    "CNN with BatchNorm": lambda: cnn(batch=32, size=32),
    "U-Net-shaped transformer": lambda: skip_transformer(batch=8, length=128),
}
FRACTIONS = (0.3, 0.5, 0.7, 0.9)
TOLERANCE = 0.03


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()

    header = ("| model | budget | solver | regions | predicted peak | measured peak | error "
              "| under budget | grads match |")
    rows = [header, "|" + "---|" * 9]
    misses = []
    for name, factory in MODELS.items():
        torch.manual_seed(0)
        model, sample = factory()
        unplanned = plan(model, sample, budget_gb=80.0, solver=args.solver)
        baseline = unplanned.verify(steps=args.steps)
        measured_unplanned = baseline.original_peak_bytes
        error = baseline.original_peak_error
        rows.append(f"| {name} | none (unplanned) | - | 0 | {format_bytes(unplanned.baseline_peak_bytes)} "
                    f"| {format_bytes(measured_unplanned)} | {100 * error:+.1f}% | - | - |")
        if abs(error) > TOLERANCE:
            misses.append(f"{name} unplanned: error {100 * error:+.1f}%")
        for fraction in FRACTIONS:
            budget = fraction * measured_unplanned
            label = f"{fraction:.0%} = {format_bytes(budget)}"
            try:
                p = unplanned.replan(budget_gb=budget / GIB)
            except InfeasibleBudget as infeasible:
                rows.append(f"| {name} | {label} | {args.solver} | infeasible: minimum "
                            f"{format_bytes(infeasible.minimum_bytes)} | | | | | |")
                continue
            record = p.verify(steps=args.steps)
            rows.append(
                f"| {name} | {label} | {p.solver} | {len(p.checkpoints)} | {format_bytes(record.predicted_peak_bytes)} "
                f"| {format_bytes(record.planned_peak_bytes)} | {100 * record.peak_error:+.1f}% "
                f"| {'yes' if record.within_budget else 'NO'} | {'yes' if record.gradients_match else 'NO'} |"
            )
            if not record.within_budget:
                misses.append(f"{name} at {fraction:.0%}: measured over budget")
            if abs(record.peak_error) > TOLERANCE:
                misses.append(f"{name} at {fraction:.0%}: error {100 * record.peak_error:+.1f}%")
            print(rows[-1], flush=True)
    table = "\n".join(rows)
    verdict = ("All planned peaks measured under budget and every prediction within 3%."
               if not misses else "Misses:\n" + "\n".join(f"- {miss}" for miss in misses))
    print(table)
    print(verdict)
    if not args.no_save:
        append_results("Memory accuracy", f"python benchmarks/memory_accuracy.py --solver {args.solver}",
                       f"{table}\n\n{verdict}\n")
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())
