"""Which of `effort="thorough"`'s figures move the default call's plans?

For a model of `benchmarks/compare.py` at each `--fractions` of its unplanned peak: the default
call `plan(model, sample, budget_gb=X)` and the same call with `effort="thorough"`. Prints both
problems' cost figures (the sum of node times; checkpoint's cost per call and per saved tensor,
runs' and keeping regions' figures), both plans, each plan priced under the other's figures
(`Problem.recompute_ms`), and the default problem with one group of the thorough figures put in
(node times; per call and per tensor; runs; keeps), solved again and priced at the thorough
figures: which group, taken alone, brings the default's plan closest to the thorough one.

Every price here is a prediction; no plan's step is timed against another.

    .venv/bin/python -m benchmarks.diagnostics.thorough_figures --model gpt2 --fractions 0.4,0.6
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import replace

from benchmarks.compare_models import SPECS
from planner import plan
from planner.api import Plan
from solvers import Problem

GIB = 2**30
# The problem's figures beside its node times, in groups that different readings set.
GROUPS: dict[str, tuple[str, ...]] = {
    "per call and per tensor": ("region_overhead_ms", "saved_tensor_ms"),
    "runs": ("run_region_ms", "run_call_ms", "recorded_call_ms"),
    "keeps": ("keep_region_ms", "keep_call_ms", "kept_node_ms"),
}


def figures(problem: Problem) -> str:
    """The problem's time figures in one line (node times summed, the others in microseconds)."""
    parts = [f"{name.removesuffix('_ms')} {1000 * getattr(problem, name):.1f} us"
             for fields in GROUPS.values() for name in fields]
    return f"node times {sum(node.compute_ms for node in problem.nodes):.2f} ms; " + ", ".join(parts)


def described(planned: Plan) -> str:
    solution = planned.solution
    return (f"{len(solution.regions)} regions, {len(solution.kept)} kept, recomputation {solution.recompute_ms:.2f} ms, "
            f"peak {solution.peak_bytes / 2**20:.2f} MiB")


def with_thorough(default: Problem, thorough: Problem, group: str) -> Problem:
    """`default` with one group of `thorough`'s figures ("node times" or a `GROUPS` key)."""
    if group == "node times":
        nodes = tuple(replace(mine, compute_ms=theirs.compute_ms, stop_ms=theirs.stop_ms)
                      for mine, theirs in zip(default.nodes, thorough.nodes))
        return replace(default, nodes=nodes)
    return replace(default, **{name: getattr(thorough, name) for name in GROUPS[group]})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=sorted(SPECS))
    parser.add_argument("--fractions", default="0.6", help="budgets as fractions of the unplanned peak")
    args = parser.parse_args()
    model, sample, _ = SPECS[args.model].build(False)
    unplanned = plan(model, sample, budget_gb=80).baseline_peak_bytes
    for fraction in (float(f) for f in args.fractions.split(",")):
        budget_gb = fraction * unplanned / GIB
        started = time.perf_counter()
        default = plan(model, sample, budget_gb=budget_gb)
        default_s = time.perf_counter() - started
        thorough = plan(model, sample, budget_gb=budget_gb, effort="thorough")
        thorough_s = time.perf_counter() - started - default_s
        mine, theirs = default.problem, thorough.problem
        if len(mine.nodes) != len(theirs.nodes):
            raise RuntimeError("the two plannings traced different graphs")
        print(f"== {args.model} at {fraction:.0%} of {unplanned / 2**20:.2f} MiB; planned in {default_s:.1f} s "
              f"(default) and {thorough_s:.1f} s (thorough)")
        print(f"  default figures:  {figures(mine)}")
        print(f"  thorough figures: {figures(theirs)}")
        print(f"  default plan:  {described(default)}")
        print(f"  thorough plan: {described(thorough)}")
        at_theirs = theirs.recompute_ms(default.solution.regions, default.solution.kept)
        print(f"  at the thorough figures: default plan {at_theirs:.2f} ms, thorough plan "
              f"{thorough.solution.recompute_ms:.2f} ms ({100 * (at_theirs / thorough.solution.recompute_ms - 1):+.1f}%)")
        at_mine = mine.recompute_ms(thorough.solution.regions, thorough.solution.kept)
        print(f"  at the default figures:  default plan {default.solution.recompute_ms:.2f} ms, thorough plan "
              f"{at_mine:.2f} ms")
        for group in ("node times", *GROUPS):
            hybrid = copy.copy(default)  # (setting its problem replaces the copy's record only)
            hybrid.problem = with_thorough(mine, theirs, group)
            solution = hybrid.replan(budget_gb=budget_gb).solution
            print(f"  thorough {group:24s} alone: {len(solution.regions):2d} regions, at the thorough figures "
                  f"{theirs.recompute_ms(solution.regions, solution.kept):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
