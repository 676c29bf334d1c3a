"""Solver benchmark: sqrt, dp and ilp on the built-in transformer and the literature's graphs.

For every graph and every budget (30/50/70/90% of the unplanned peak, static memory included)
it prints each solver's recompute cost, status and solve time, and the ratio to sqrt's cost,
then checks its targets (dp under 2 s on the 1000-node graph; ilp optimal or within 1% on graphs
up to 300 nodes; dp and ilp never above sqrt).

Usage:
    .venv/bin/python -m benchmarks.solvers --results   # full run (about half an hour on 2 cores)
    .venv/bin/python -m benchmarks.solvers --quick     # smoke run: small graphs, short limits
"""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from solvers import InfeasibleBudget, Problem, Solution, peak_bytes, solve
from solvers.graphs import load_graph

ROOT = Path(__file__).resolve().parents[1]

GRAPHS = ROOT.parent / "shared" / "data" / "remat-graphs"
FRACTIONS = (0.3, 0.5, 0.7, 0.9)
SOLVER_NAMES = ("sqrt", "dp", "ilp")


@dataclass
class Result:
    solver: str
    cost_ms: float | None  # None: no plan
    seconds: float
    cpu_seconds: float
    status: str  # optimal / feasible / time_limit / infeasible / skipped
    gap: float | None = None
    minimum_fraction: float | None = None  # infeasible: smallest peak found, / unplanned peak


def transformer() -> Problem:
    from planner.examples import gpt
    from planner.measure.profile import profile
    from planner.problem.graph import build_problem
    from planner.trace.tracing import trace

    model, x = gpt()
    traced = trace(model, x)
    summary = profile(traced.gm, traced.graph_inputs((x,), {}))
    static = summary.parameter_bytes + summary.gradient_bytes + summary.buffer_bytes + summary.input_bytes
    # Any run of nodes may be a region here (a solver benchmark, not a plan to apply).
    return build_problem(traced.gm, static, rng_state_bytes=summary.rng_state_bytes,
                         loss_scratch_bytes=summary.loss_scratch_bytes)


def planned_transformer() -> Problem:
    """The same model as `plan` sees it: regions limited to submodule calls, and the nodes a
    region may keep (selective checkpointing: `Problem.keep_choices` for dp, subsets of
    `keep_candidates` for ilp)."""
    from planner import plan
    from planner.examples import gpt

    model, x = gpt()
    return plan(model, x, budget_gb=80, repeats=1).problem


def graph_name(path: Path) -> str:
    """VGG16, MobileNet, ResNet50, random_layered_n100, ..."""
    parts = path.stem.split("_")
    return "_".join(parts[:3]) if path.stem.startswith("random") else parts[0]


def run(problem: Problem, solver: str, budget: int, unplanned: int, time_limit_s: float) -> Result:
    options = {"time_limit_s": time_limit_s} if solver == "ilp" else {}
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        solution: Solution = solve(problem, budget, method=solver, **options)
    except InfeasibleBudget as error:
        return Result(solver, None, time.perf_counter() - wall, time.process_time() - cpu, "infeasible",
                      minimum_fraction=error.minimum_bytes / unplanned)
    return Result(solver, solution.recompute_ms, time.perf_counter() - wall, time.process_time() - cpu,
                  solution.status.value, gap=solution.gap)


def cell(result: Result) -> str:
    if result.status == "skipped":
        return "not run"
    if result.cost_ms is None:
        return f"infeasible (min {result.minimum_fraction:.0%}) {result.seconds:.1f}s"
    status = {"optimal": "opt", "feasible": "feas", "time_limit": "limit"}[result.status]
    gap = f" gap {result.gap:.1%}" if result.gap else ""
    return f"{result.cost_ms:.6g} {status}{gap} {result.seconds:.2f}s"


def ratio(result: Result, baseline: Result) -> str:
    if result.cost_ms is None or baseline.cost_ms is None:
        return "-"
    if baseline.cost_ms == 0:
        return "1.00" if result.cost_ms == 0 else "inf"
    return f"{result.cost_ms / baseline.cost_ms:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small graphs and short time limits; no RESULTS.md")
    parser.add_argument("--time-limit-s", type=float, default=60.0, help="ilp time limit per solve (default 60)")
    parser.add_argument("--ilp-max-nodes", type=int, default=300, help="run ilp only up to this many nodes")
    parser.add_argument("--results", action="store_true", help="write the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    graphs: list[tuple[str, Problem]] = []
    if not args.quick:
        graphs.append(("transformer (planner.examples.gpt)", transformer()))
        graphs.append(("transformer, submodule regions with keeps (plan)", planned_transformer()))
    if GRAPHS.is_dir():
        loaded = [(graph_name(path), load_graph(path)) for path in sorted(GRAPHS.glob("*.json"))]
        loaded.sort(key=lambda item: (len(item[1]), item[0]))
        graphs += [(name, problem) for name, problem in loaded if not args.quick or len(problem) <= 100]
    else:
        print(f"note: {GRAPHS} not found, only the transformer is benchmarked")
    time_limit_s = 5.0 if args.quick else args.time_limit_s

    header = "| graph | nodes | budget | sqrt | dp | ilp | dp/sqrt | ilp/sqrt |"
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    misses: list[str] = []
    dp_cpu_1000: list[float] = []
    for name, problem in graphs:
        unplanned = peak_bytes(problem)
        for fraction in FRACTIONS:
            budget = int(fraction * unplanned)
            results = {}
            for solver in SOLVER_NAMES:
                if solver == "ilp" and len(problem) > args.ilp_max_nodes:
                    results[solver] = Result(solver, None, 0.0, 0.0, "skipped")
                    continue
                results[solver] = run(problem, solver, budget, unplanned, time_limit_s)
            sqrt, dp, ilp = results["sqrt"], results["dp"], results["ilp"]
            line = (f"| {name} | {len(problem)} | {fraction:.0%} | {cell(sqrt)} | {cell(dp)} | {cell(ilp)} "
                    f"| {ratio(dp, sqrt)} | {ratio(ilp, sqrt)} |")
            lines.append(line)
            print(line, flush=True)
            where = f"{name} at {fraction:.0%}"
            if len(problem) >= 1000:
                dp_cpu_1000.append(dp.cpu_seconds)
                if dp.seconds >= 2.0:
                    misses.append(f"dp took {dp.seconds:.2f} s wall ({dp.cpu_seconds:.2f} s CPU) on {where} (target < 2 s)")
            if ilp.status not in ("skipped", "infeasible") and not (
                ilp.status == "optimal" or (ilp.gap is not None and ilp.gap <= 0.01)
            ):
                gap = "unknown" if ilp.gap is None else f"{ilp.gap:.1%}"
                misses.append(f"ilp did not prove optimality on {where}: gap {gap} after {ilp.seconds:.0f} s")
            for result in (dp, ilp):
                if result.cost_ms is not None and sqrt.cost_ms is not None and result.cost_ms > sqrt.cost_ms + 1e-9:
                    misses.append(f"{result.solver} costs more than sqrt on {where}")
                if result.cost_ms is None and result.status == "infeasible" and sqrt.cost_ms is not None:
                    misses.append(f"{result.solver} found no plan on {where} where sqrt did")

    summary = [
        "",
        "Cells: recompute ms (the graph's own time units for the literature graphs), status "
        "(opt = proven optimal, feas = feasible, limit = time limit hit, with the gap to the proven "
        "bound), wall seconds. Budgets are fractions of the unplanned peak; infeasible cells give the "
        "smallest peak that solver reached, as a fraction of the unplanned peak. "
        f"ilp: CP-SAT, 2 workers, {time_limit_s:.0f} s limit, warm-started from dp (or, where dp is not "
        "proven optimal, from the cheapest of dp's plan, a greedy plan of one-node regions and the best "
        "plan of one-node regions from the model restricted to them, and where the LP relaxation opens a long "
        "region or no plan of one-node regions fits, from a search steered by the LP; the LP's objective, raised "
        "by one branch on a node where the search ran, then joins the bound), and "
        "bounded below by dp's cost where dp proves it optimal (same decision space; see solvers/ilp.py).",
        "",
        "Targets:",
        "- dp under 2 s on the 1000-node graph: "
        + ("no graph of 1000 nodes" if not dp_cpu_1000 else f"max CPU {max(dp_cpu_1000):.2f} s"),
        "- ilp proves optimality or a gap <= 1% within the limit on graphs up to 300 nodes",
        "- dp and ilp never cost more than sqrt",
        "",
        "Missed:" if misses else "All targets met.",
        *[f"- {miss}" for miss in misses],
    ]
    print("\n".join(summary))
    if not args.quick:
        from benchmarks.results import set_section, write_run

        write_run("solvers", {"table": "\n".join(lines), "summary": summary})
        if args.results:
            set_section("solvers", "Solvers", "python -m benchmarks.solvers", "\n".join(lines + summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
