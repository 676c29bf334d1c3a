"""What each decision space buys, on the same measurements: for each model of
`benchmarks/compare.py`, the cheapest plan's predicted overhead as a share of checkpointing
every block, at every block's own predicted peak and at 40/60/80% of the unplanned predicted
peak, over five spaces:
- the planner's: regions that are submodule calls, each keeping nodes under a selective policy
  (`Problem.keep_choices`: any of up to 8 keepable nodes, or in a block its 5 costliest, its k
  costliest for every k or all but a run of consecutive ones), and runs of nodes inside a
  submodule call recomputed alone (`Problem.run_spans`, `planner.apply.runs`);
- the planner's, with every subset of a submodule call's keepable nodes as a keep choice where
  it holds at most 10 (`decision_space.every_keep_subset`): what wrapping calls reaches at all;
- whole submodule calls only (the same problem with nothing keepable and no runs);
- whole regions on any run of graph nodes (`dp` with no allowed regions and nothing keepable;
  with keep choices too it takes minutes per budget), runs across submodule calls included,
  which the planner applies only in a model's own forward of at most 200 nodes, and without the
  runs' recording cost;
- the lower bound for every plan of whole graph nodes (`solvers.bound.recompute`): no plan,
  however its regions fall, costs less at that budget.

Predicted figures only (the planner's measurements, solved by `dp`): where the clock is too
noisy to compare plans (this shared CPU), this shows what each decision space gives.

Usage:
    .venv/bin/python -m benchmarks.diagnostics.keep_gain [--models gpt gpt2 ...]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.compare_models import SPECS, block_names
from benchmarks.cpu_memory import retain_freed_memory
from benchmarks.decision_space import (
    EVERY_KEEP_LIMIT,
    any_run,
    every_keep_subset,
    without_keeps,
)

ROOT = Path(__file__).resolve().parents[1]

FRACTIONS = (0.4, 0.6, 0.8)


def bound_cell(problem, budget: int, every_ms: float) -> str:
    from solvers.bound.recompute import recompute_lower_bound

    bound = recompute_lower_bound(problem, budget)
    if not bound.fits:
        return "no plan fits"
    return f"{bound.recompute_ms / every_ms:.2f} ({bound.recompute_ms:.0f} ms)"


def cell(problem, budget: int, every_ms: float) -> tuple[str, float | None]:
    from solvers import InfeasibleBudget, solve

    try:
        solution = solve(problem, budget, method="dp")
    except InfeasibleBudget as error:
        return f"infeasible (min {error.minimum_bytes / 2**20:.1f} MiB)", None
    share = solution.recompute_ms / every_ms
    kept = f", {len(solution.kept)} kept" if solution.kept else ""
    return f"{share:.2f} ({solution.recompute_ms:.0f} ms{kept}, {solution.status.value})", share


def main() -> int:
    import torch

    from planner import plan

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(SPECS), choices=list(SPECS))
    args = parser.parse_args()
    retain_freed_memory()  # node times measured as the timing benchmarks measure steps
    torch.set_num_threads(1)
    rows = ["| model | budget | planner (submodule calls with keeps, runs inside calls): share (ms) "
            f"| the same, every keep subset of calls of up to {EVERY_KEEP_LIMIT} keepable nodes "
            "| whole submodule calls only "
            "| any run of nodes, whole regions | lower bound, any plan |", "|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    started = time.perf_counter()
    for key in args.models:
        spec = SPECS[key]
        torch.manual_seed(0)
        model, sample, _ = spec.build(False)
        model.train()
        base = plan(model, sample, budget_gb=80, repeats=3)
        every = base.with_submodules(block_names(spec, model))
        problem = base.problem
        whole = without_keeps(problem)
        unplanned = base.baseline_peak_bytes
        budgets = [("every block's peak", every.predicted_peak_bytes)]
        budgets += [(f"{f:.0%}", int(f * unplanned)) for f in FRACTIONS]
        for label, budget in budgets:
            keeping, _ = cell(problem, budget, every.recompute_ms)
            every_keep, _ = cell(every_keep_subset(problem), budget, every.recompute_ms)
            plain, _ = cell(whole, budget, every.recompute_ms)
            anywhere, _ = cell(any_run(problem), budget, every.recompute_ms)
            bound = bound_cell(problem, budget, every.recompute_ms)
            row = (f"| {spec.title} | {label} ({budget / 2**20:.1f} MiB) | {keeping} | {every_keep} | {plain} "
                   f"| {anywhere} | {bound} |")
            rows.append(row)
            print(row, flush=True)
    body = "\n".join(rows) + (
        f"\n\nShares of every block's predicted overhead (`Plan.with_submodules(blocks)`), predicted by the "
        "planner on one set of measurements, solved by `dp` (status in brackets) with keep choices and runs "
        "inside submodule calls, with every keep subset of the calls of up to "
        f"{EVERY_KEEP_LIMIT} keepable nodes too (`decision_space.every_keep_subset`), with whole submodule calls only, and with whole regions on any run of nodes; the lower bound is "
        "`solvers.bound.recompute.recompute_lower_bound` (an integer program relaxing every plan of whole graph nodes: recomputation and each region's checkpoint call); budgets are every block's predicted peak and fractions of the unplanned predicted "
        f"peak. {time.perf_counter() - started:.0f} s.")
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
