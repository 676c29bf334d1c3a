"""What each kind of region buys, on the compare models (`benchmarks/compare_models.py`): the
cheapest plan's predicted overhead, as a share of checkpointing every block's predicted overhead,
with every region kind the planner has and with one kind taken away, at every block's own
predicted peak and at 60% of the unplanned peak; and what each costs in planning time.

The region kinds: submodule calls (always), kept nodes (a region keeping some outputs under a
selective policy), runs of nodes recomputed alone inside a submodule call, slices of an
`nn.Sequential`'s children. Shares are predictions (the cost model's), not measurements: the
measured shares of the default plans are in the compare benchmark's sections. Planning time of
a kind: the solver's time with it less without it, and, for kept nodes and runs, the time
planning spends timing a selective policy and run recording on one block (they need the ATen
calls of the model's own forward, recorded in any case for its holds).

    .venv/bin/python -m benchmarks.mechanisms [--models gpt,gpt2,llama,bert,cnn,vit] [--results]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from benchmarks.compare_models import SPECS, block_names
from benchmarks.results import set_section, write_run

KINDS = ("kept nodes", "runs inside a call", "slices of a Sequential")


def without(problem: Any, kind: str) -> Any:
    """`problem` with one region kind taken away."""
    if kind == "kept nodes":
        return dataclasses.replace(problem, nodes=tuple(dataclasses.replace(node, keepable=False)
                                                        for node in problem.nodes))
    if kind == "runs inside a call":
        return dataclasses.replace(problem, run_spans=())
    slices = set(problem.segment_regions)
    return dataclasses.replace(problem, segment_regions=(),
                               allowed_regions=tuple(r for r in problem.allowed_regions if r not in slices))


def cheapest(problem: Any, budget: int) -> tuple[float | None, float]:
    """(predicted overhead of the cheapest plan, or None where none fits; solve seconds)."""
    from solvers import InfeasibleBudget, solve

    started = time.perf_counter()
    try:
        solution = solve(problem, budget, method="dp")
    except InfeasibleBudget:
        return None, time.perf_counter() - started
    return solution.recompute_ms, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(SPECS))
    parser.add_argument("--results", action="store_true", help="write the table to benchmarks/RESULTS.md")
    args = parser.parse_args()

    import torch

    from planner import plan

    rows = ["| model | budget | all kinds | " + " | ".join(f"without {kind}" for kind in KINDS) + " |",
            "|" + "---|" * (3 + len(KINDS))]
    seconds_rows = ["| model | planning (at 80 GB, every kind) | block readings (policy, recording) | "
                    + " | ".join(f"solve time of {kind}" for kind in KINDS) + " |", "|" + "---|" * (3 + len(KINDS))]
    records, planning = [], []
    for key in args.models.split(","):
        spec = SPECS[key]
        torch.manual_seed(0)
        model, sample, _ = spec.build(False)
        model.train()
        steps: list[tuple[str, float]] = []
        started = time.perf_counter()
        p = plan(model, sample, budget_gb=80, selective=True,  # (every kind, kept nodes too)
                 progress=lambda message: steps.append((message, time.perf_counter())))
        planning_s = time.perf_counter() - started
        block_s = next((later - at for (message, at), (_, later) in zip(steps, steps[1:])
                        if message.startswith("timing checkpoint, a selective policy")), 0.0)
        every = p.with_submodules(block_names(spec, model))
        budgets = [("every block's peak", every.predicted_peak_bytes), ("60%", int(0.6 * p.baseline_peak_bytes))]
        solve_s = {kind: 0.0 for kind in KINDS}
        for label, budget in budgets:
            full_ms, full_s = cheapest(p.problem, budget)
            shares = []
            record = {"model": key, "budget": label, "every_block_ms": every.recompute_ms, "all": full_ms}
            for kind in KINDS:
                ms, seconds = cheapest(without(p.problem, kind), budget)
                solve_s[kind] += full_s - seconds
                record[kind] = ms
                shares.append("infeasible" if ms is None else f"{ms / every.recompute_ms:.3f}")
            full = "infeasible" if full_ms is None else f"{full_ms / every.recompute_ms:.3f}"
            rows.append(f"| {key} | {label} | {full} | " + " | ".join(shares) + " |")
            records.append(record)
            print(rows[-1], flush=True)
        planning.append({"model": key, "planning_s": planning_s, "block_readings_s": block_s, "solve_s": solve_s})
        seconds_rows.append(f"| {key} | {planning_s:.1f} s | {block_s:.1f} s | "
                            + " | ".join(f"{solve_s[kind]:+.2f} s" for kind in KINDS) + " |")
        print(seconds_rows[-1], flush=True)
    table = ("Predicted overhead of the cheapest plan (dp), as a share of every block's predicted overhead:\n\n"
             + "\n".join(rows) + "\n\nWhat each kind costs in planning time (solve time at both budgets, with "
             "the kind less without it; the block readings serve kept nodes and runs):\n\n" + "\n".join(seconds_rows))
    print(table)
    print(f"records: {write_run('mechanisms', {'records': records, 'seconds': planning})}")
    if args.results:
        set_section("mechanisms", "What each region kind buys (predicted) and costs", "python -m benchmarks.mechanisms",
                    table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
