"""Torch-free checkpoint-placement solvers.

Every solver has one signature, `solve_<name>(problem, budget_bytes, **options) -> Solution`,
and is registered in `SOLVERS`; `solve()` picks one by name (or "auto").

* `sqrt`: the Chen et al. baseline, equal segments.
* `dp`: dynamic programming over region boundaries, exact on chains, CNNs and transformers.
* `ilp`: an exact CP-SAT model of the simulator on any DAG (needs OR-Tools), under a time limit.
* `brute_force`: every plan, for tests (n <= 12).

`solvers.bound.recompute.recompute_lower_bound` says how little any plan can cost at a budget,
whatever its regions; `solvers.graphs.load_graph` reads a graph made elsewhere (networkx
node-link JSON) into a `Problem`.

Example:
    >>> from solvers import NodeCost, Problem, solve
    >>> problem = Problem(nodes=(NodeCost("a", 1.0, output_bytes=8, saves=(0,)),))
    >>> solve(problem, budget_bytes=1024).regions
    ()
"""
from __future__ import annotations

import logging
from typing import Callable

from solvers.brute_force import MAX_NODES as BRUTE_FORCE_MAX_NODES
from solvers.brute_force import minimum_peak_brute_force, solve_brute_force
from solvers.dp.solve import minimum_peak_dp, solve_dp
from solvers.ilp.solve import solve_ilp
from solvers.problem import NodeCost, Problem
from solvers.simulate import peak_bytes, simulate
from solvers.solution import InfeasibleBudget, Solution, Status
from solvers.sqrt import solve_sqrt

logger = logging.getLogger(__name__)

Solver = Callable[..., Solution]

SOLVERS: dict[str, Solver] = {
    "sqrt": solve_sqrt,
    "dp": solve_dp,
    "ilp": solve_ilp,
    "brute_force": solve_brute_force,
}

AUTO_ILP_MAX_NODES = 300
AUTO_ILP_TIME_LIMIT_S = 5.0


def _ortools_available() -> bool:
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def _cheapest(solutions: list[Solution]) -> Solution:
    return min(solutions, key=lambda solution: (solution.recompute_ms, solution.peak_bytes))


def _solve_auto(problem: Problem, budget_bytes: int, time_limit_s: float = AUTO_ILP_TIME_LIMIT_S) -> Solution:
    try:
        dp = solve_dp(problem, budget_bytes)
    except InfeasibleBudget as error:
        if error.proven or len(problem) > AUTO_ILP_MAX_NODES or not _ortools_available():
            raise
        logger.info("auto: dp found no plan and could not prove there is none; trying ilp")
        return solve_ilp(problem, budget_bytes, time_limit_s=time_limit_s, hint=False)
    if dp.status == Status.OPTIMAL:
        return dp
    candidates = [dp]
    if len(problem) <= AUTO_ILP_MAX_NODES and _ortools_available():
        logger.info("auto: dp is not proven optimal here; ilp for up to %.0f s", time_limit_s)
        try:
            candidates.append(solve_ilp(problem, budget_bytes, time_limit_s=time_limit_s, hint=dp.regions,
                                        hint_kept=dp.kept))
        except InfeasibleBudget:  # ilp keeps no block's k costliest or "all but a run": dp's may
            logger.info("auto: ilp found no plan keeping what dp's keeps; dp's plan stands")
    if candidates[-1].status != Status.OPTIMAL:
        try:
            candidates.append(solve_sqrt(problem, budget_bytes))
        except InfeasibleBudget:
            pass
    return _cheapest(candidates)


def solve(problem: Problem, budget_bytes: int, method: str = "auto", **options: object) -> Solution:
    """Solve `problem` under `budget_bytes` with the named method, or "auto".

    The "auto" rule (it picks the best plan it can prove within a few seconds):
      1. run dp. On chains, CNNs and transformer-like graphs (at most 16 outputs referenced
         across any boundary) it is exact: an OPTIMAL dp plan is the answer, and a dp
         InfeasibleBudget is proven;
      2. otherwise (wide DAGs, where dp bounds its search) on graphs of at most 300 nodes with
         OR-Tools installed, run ilp warm-started from dp's plan for `time_limit_s` (option,
         default 5 s); the result is OPTIMAL if CP-SAT proves it, else TIME_LIMIT;
      3. unless a proof was found, sqrt's plan is also tried, and the cheapest plan wins.
    Larger wide graphs thus get dp's bounded search, never worse than sqrt's plan.

    Example:
        >>> solve(problem, 2**30, method="sqrt").peak_bytes <= 2**30
        True
    """
    if method == "auto":
        unknown = set(options) - {"time_limit_s"}
        if unknown:
            raise TypeError(f"solve(method='auto') takes only time_limit_s, got {sorted(unknown)}")
        return _solve_auto(problem, budget_bytes, **options)  # type: ignore[arg-type]
    if method not in SOLVERS:
        raise ValueError(f"unknown solver {method!r}; choose one of {sorted(SOLVERS)} or 'auto'")
    return SOLVERS[method](problem, budget_bytes, **options)


def minimum_peak_bytes(problem: Problem) -> int:
    """The smallest simulated peak over all plans: the smallest budget that any plan fits.

    Exact on graphs where dp's search is (chains, CNNs, transformers; see `solve`) and on
    graphs of at most 12 nodes (enumerated). On wide DAGs it is the smallest peak dp's bounded
    search reaches (to within 2%): a budget some plan does fit, not proven minimal.

    Example:
        >>> minimum_peak_bytes(problem) <= peak_bytes(problem)
        True
    """
    minimum, exact = minimum_peak_dp(problem)
    if not exact and len(problem) <= BRUTE_FORCE_MAX_NODES:
        return minimum_peak_brute_force(problem)
    return minimum


__all__ = ["AUTO_ILP_MAX_NODES", "AUTO_ILP_TIME_LIMIT_S", "InfeasibleBudget", "NodeCost", "Problem", "SOLVERS",
           "Solution", "Solver", "Status", "minimum_peak_bytes", "peak_bytes", "simulate", "solve"]
