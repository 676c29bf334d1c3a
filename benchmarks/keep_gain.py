"""What keeping outputs inside regions buys, on the same measurements: for each model of
`benchmarks/compare.py`, the cheapest plan's predicted overhead with keep choices and with
whole regions only (the same problem with nothing keepable), as a share of checkpointing every
block, at every block's own predicted peak and at 40/60/80% of the unplanned predicted peak.

Predicted figures only (the planner's measurements, solved twice by `dp`): where the clock is
too noisy to compare plans (this shared CPU), this shows what the larger decision space gives.

Usage:
    .venv/bin/python benchmarks/keep_gain.py [--models gpt gpt2 ...] [--no-save]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import block_names  # noqa: E402
from benchmarks.compare_models import SPECS  # noqa: E402
from benchmarks.results import append_results  # noqa: E402

FRACTIONS = (0.4, 0.6, 0.8)


def without_keeps(problem):
    """The same problem with nothing keepable: whole regions only."""
    return dataclasses.replace(problem, nodes=tuple(dataclasses.replace(n, keepable=False) for n in problem.nodes))


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
    parser.add_argument("--no-save", action="store_true", help="print only, do not append to RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = ["| model | budget | with keeps: share (ms) | whole regions only: share (ms) |", "|---|---|---|---|"]
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
            plain, _ = cell(whole, budget, every.recompute_ms)
            row = f"| {spec.title} | {label} ({budget / 2**20:.1f} MiB) | {keeping} | {plain} |"
            rows.append(row)
            print(row, flush=True)
    body = "\n".join(rows) + (
        f"\n\nShares of every block's predicted overhead (`Plan.with_submodules(blocks)`), predicted by the "
        "planner on one set of measurements, solved by `dp` (status in brackets) with keep choices and with "
        "nothing keepable; budgets are every block's predicted peak and fractions of the unplanned predicted "
        f"peak. {time.perf_counter() - started:.0f} s.")
    if not args.no_save:
        append_results("What keeping inside regions buys (predicted)", "python benchmarks/keep_gain.py", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
