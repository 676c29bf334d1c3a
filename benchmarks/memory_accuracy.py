"""Memory truth on the CPU, with the call users make: does each plan's measured peak stay under
its budget, and how close is its prediction?

For each model: measure the unplanned step's peak, then plan at 30/50/70/90% of it with
`plan(model, sample, budget_gb=X)` (every other argument at its default) and measure the planned
module (`Plan.verify`). A budget refused as infeasible is planned again at the minimum the
refusal names, which must then fit. Targets: every plan under budget, every prediction within
1%, and the CNN example reaches 37.03 MiB (to 0.01 MiB), the smallest budget the earlier
replacement graph reached (plans then cut the graph anywhere; now they run in the model's own
forward).

    .venv/bin/python -m benchmarks.memory_accuracy [--replan] [--results]

`--replan` takes the faster route: `plan(..., budget_gb=80)` once, then `replan(budget_gb=X)`.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from benchmarks.results import set_section, write_run
from planner import InfeasibleBudget, plan
from planner.api import GIB
from planner.examples import cnn, gpt, mlp, skip_transformer
from planner.measure.steps import steady_peak
from solvers.solution import format_bytes

MODELS = {
    "transformer (built-in GPT, 8 blocks)": lambda: gpt(batch=8, length=128),
    "MLP (16 blocks of 512-1024-512, tanh)": lambda: mlp(width=512, depth=16, batch=1024),
    "CNN with BatchNorm (the README's example)": lambda: cnn(batch=32, size=32),
    "U-Net-shaped transformer": lambda: skip_transformer(batch=8, length=128),
}
FRACTIONS = (0.3, 0.5, 0.7, 0.9)
TOLERANCE = 0.01
CNN_REACH_BYTES = int(37.03 * 2**20)  # the replacement graph's smallest budget for the CNN example


def planned_at(model: torch.nn.Module, sample: Any, budget: int, replan_from=None, **options: Any):
    """(plan, budget, asked) at `budget`, else at the minimum its refusal names (asked: the first);
    `options` go to `plan()`."""
    make = (lambda size: replan_from.replan(budget_gb=size / GIB)) if replan_from is not None else (
        lambda size: plan(model, sample, budget_gb=size / GIB, **options))
    try:
        return make(budget), budget, None
    except InfeasibleBudget as error:
        return make(error.minimum_bytes), error.minimum_bytes, budget


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per plan (default 2)")
    parser.add_argument("--replan", action="store_true", help="plan at 80 GB once, then replan (the faster route)")
    parser.add_argument("--results", action="store_true", help="write the table to benchmarks/RESULTS.md")
    args = parser.parse_args()

    rows = ["| model | budget | regions | planning | predicted peak | measured peak | error | under budget "
            "| verified in planning | grads match |", "|" + "---|" * 10]
    records, misses = [], []
    reached = CNN_REACH_BYTES
    for name, factory in MODELS.items():
        torch.manual_seed(0)
        model, sample = factory()
        unplanned = steady_peak(model, sample, torch.device("cpu"))
        base = plan(model, sample, budget_gb=80) if args.replan else None
        budgets = [(f"{fraction:.0%}", int(fraction * unplanned)) for fraction in FRACTIONS]
        if name.startswith("CNN"):
            budgets.append(("37.03 MiB (reach)", CNN_REACH_BYTES))
        for label, budget in budgets:
            started = time.perf_counter()
            p, planned_budget, asked = planned_at(model, sample, budget, base)
            seconds = time.perf_counter() - started
            record = p.verify(steps=args.steps)
            refused = f" (asked {format_bytes(asked)}: infeasible)" if asked is not None else ""
            of = f" of {format_bytes(unplanned)}" if label.endswith("%") else ""  # (the measured unplanned peak)
            rows.append(f"| {name} | {label}{of} = {format_bytes(planned_budget)}{refused} | {len(p.checkpoints)} "
                        f"| {seconds:.1f} s | {format_bytes(record.predicted_peak_bytes)} "
                        f"| {format_bytes(record.planned_peak_bytes)} | {100 * record.peak_error:+.2f}% "
                        f"| {'yes' if record.within_budget else 'NO'} | {'yes' if p.verified else 'no'} "
                        f"| {'yes' if record.gradients_match else 'NO'} |")
            print(rows[-1], flush=True)
            records.append({"model": name, "label": label, "budget": planned_budget, "asked": asked,
                            "unplanned": unplanned, "regions": len(p.checkpoints), "seconds": seconds,
                            "predicted": record.predicted_peak_bytes, "measured": record.planned_peak_bytes,
                            "within_budget": record.within_budget, "gradients_match": record.gradients_match})
            if not record.within_budget or not record.gradients_match:
                misses.append(f"{name} at {label}: {'over budget' if not record.within_budget else 'gradients differ'}")
            if abs(record.peak_error) > TOLERANCE:
                misses.append(f"{name} at {label}: error {100 * record.peak_error:+.2f}%")
            # (the target is a figure to 0.01 MiB: a minimum that rounds to it reaches it)
            if label.endswith("(reach)"):
                reached = planned_budget
                if round(planned_budget / 2**20, 2) > 37.03:
                    misses.append(f"{name}: 37.03 MiB not reached (smallest budget {format_bytes(planned_budget)})")
    verdict = ("Every plan measured under its budget, within 1% of its prediction, with the original's gradients; "
               f"the CNN example reaches 37.03 MiB (its smallest budget {format_bytes(reached)})." if not misses else "Misses:\n" + "\n".join(f"- {m}" for m in misses))
    table = "\n".join(rows)
    print(table + "\n\n" + verdict)
    command = "python -m benchmarks.memory_accuracy" + (" --replan" if args.replan else "")
    print(f"records: {write_run('memory_accuracy', {'command': command, 'records': records})}")
    if args.results:
        set_section("memory_accuracy", "Memory accuracy (CPU, the default call)", command, f"{table}\n\n{verdict}")
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())
