"""Exact plans for any DAG with OR-Tools CP-SAT over the model of `solvers.ilp.model`.

Bound from dp: when the warm start is dp's plan and dp proved it OPTIMAL (its search was exact:
no frontier sets merged, every boundary and Pareto point kept, saves read by their savers), its
cost is the minimum over the same decision space (contiguous regions in the fixed order whose
starts pass `Problem.can_start_region`, judged by the same simulator), so `objective >= that
cost` (less a rounding slack of about one scaled unit per node) is a valid bound, and CP-SAT
stops once it has a plan within the slack. Status OPTIMAL then means optimal up to that
rounding (n + 1 scale units, under n^2 * 2^-39 of the largest node time, plus 1e-9 relative).
Without it (wide DAGs where dp is only FEASIBLE) the bound is CP-SAT's own, from its LP (solved
at the root in one go, see `cp_sat_solver`), and the warm start is the cheapest of dp's plan, a
greedy plan of one-node regions (`greedy_single_nodes`) and the best plan of one-node regions
from this same model restricted to them (`single_node_optimum`, given at most a tenth of the
time limit; its plans are plans of the full model, so this is a warm start, never a bound).
Where the budget needs a long region (no plan of one-node regions fits) or would gain from one,
neither those warm starts nor CP-SAT's neighbourhood searches place it well: the LP relaxation
(solved apart with CLP, `solvers.ilp.lp_relaxation`; it runs wherever dp is not proven optimal)
says where long regions may start, CP-SAT searches the model restricted to those
(`lp_guided_plan`), and the LP's objective, raised by one branch (the smaller of the LP
objectives with one node forced out of regions and forced in, solved from the LP's basis beside
the search), joins CP-SAT's bound. The warm starts live in `solvers.ilp.warm_start`.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Collection

from solvers.ilp.model import bound_by_optimum, build_model, load_cp_model, scaled_cost
from solvers.ilp.warm_start import (
    SINGLE_NODE_SHARE,
    Plan,
    cp_sat_solver,
    greedy_single_nodes,
    hint_plan,
    lp_guided_plan,
    plan_of_solution,
    single_node_optimum,
)
from solvers.problem import Problem
from solvers.simulate import make_solution, peak_bytes
from solvers.solution import InfeasibleBudget, Solution, Status

logger = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT_S = 60.0
DEFAULT_WORKERS = 2
FINAL_SEARCH_MIN_S = 5.0  # with less left after the LP-guided warm start, skip the full search


def minimum_peak_ilp(
    problem: Problem,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    workers: int = DEFAULT_WORKERS,
    hint: tuple[range, ...] | None = None,
    hint_kept: Collection[int] = (),
) -> tuple[int, bool]:
    """Smallest peak over all plans by CP-SAT, and whether it is proven (else the best found).

    Example:
        >>> peak, proven = minimum_peak_ilp(problem, time_limit_s=10)
        >>> peak <= peak_bytes(problem)
        True
    """
    cp_model = load_cp_model()
    unplanned = peak_bytes(problem)
    live_upper = unplanned - problem.static_bytes
    built = build_model(problem, None, live_upper)
    if hint is not None:
        hint_plan(built, problem, hint, hint_kept)
    solver = cp_sat_solver(time_limit_s, workers)
    status = solver.solve(built.model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return unplanned, False
    return peak_bytes(problem, *plan_of_solution(solver, built)), status == cp_model.OPTIMAL


def solve_ilp(
    problem: Problem,
    budget_bytes: int,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    workers: int = DEFAULT_WORKERS,
    hint: bool | tuple[range, ...] = True,
    hint_kept: Collection[int] = (),
    **options: object,
) -> Solution:
    """The cheapest plan under `budget_bytes` from an exact CP-SAT model of the simulator.

    Options:
        time_limit_s: wall-clock limit (default 60 s); on reaching it the best plan found is
            returned with status TIME_LIMIT and `gap` = (cost - proven bound) / cost.
        workers: CP-SAT workers (default 2). The search is interleaved, so results are
            deterministic whenever CP-SAT finishes; when the time limit stops it, the plan
            returned can depend on how fast the machine was.
        hint: True to warm-start from the dp solver's plan (and, when dp proves it optimal,
            to use its cost as the objective's lower bound; see the module docstring; when it
            does not, from the cheapest of dp's plan, a greedy plan of one-node regions,
            the restricted model's best plan of one-node regions and, where the LP relaxation
            opens a long region or none of those fits, the LP-guided plan; the LP's objective,
            raised by one branch where that plan was searched, joins the bound), a tuple of
            regions to use those (no bound), or False for none.
        hint_kept: with a tuple of regions, the nodes they keep (selective checkpointing).

    The plan chooses its regions among the allowed ones and the runs inside submodule calls
    (`Problem.run_spans`, each paying its recording, `Problem.run_ms`), and which candidates each
    region keeps (any subset of `Problem.keep_candidates`); not a block's k costliest or "all
    but a run" of `Problem.keep_choices`, which `dp` also searches. Where the warm start's dp plan
    keeps one of those and fits where CP-SAT's plans do not, or costs less, that plan is returned
    (optimal where dp proved it).

    Raises InfeasibleBudget with the proven minimum peak when no plan fits.

    Example:
        >>> solution = solve_ilp(problem, budget_bytes=int(0.6 * peak_bytes(problem)), time_limit_s=10)
        >>> solution.status, solution.gap
        (<Status.OPTIMAL: 'optimal'>, 0.0)
    """
    if options:
        raise TypeError(f"ilp got unknown options {sorted(options)}")
    started = time.perf_counter()
    cp_model = load_cp_model()
    if peak_bytes(problem) <= budget_bytes:  # nothing to recompute
        return dataclasses.replace(
            make_solution(problem, (), budget_bytes, Status.OPTIMAL, "ilp", started), gap=0.0
        )
    live_budget = budget_bytes - problem.static_bytes
    built = None if live_budget < 0 else build_model(problem, live_budget, live_budget)
    warm_plan: Plan | None = None
    optimum: Plan | None = None  # a plan dp proved optimal, if any
    dp_plan: Plan | None = None  # dp's plan, which may keep what the model cannot
    lp_bound: float | None = None  # the LP's (with its branch), where the LP-guided warm start ran

    def cheaper(plan: Plan | None) -> bool:
        return plan is not None and (
            warm_plan is None or problem.recompute_ms(*plan) < problem.recompute_ms(*warm_plan)
        )

    if hint is True:
        from solvers.dp.solve import solve_dp

        try:
            warm = solve_dp(problem, budget_bytes)
        except InfeasibleBudget:
            warm = None
        if warm is not None:
            warm_plan = dp_plan = warm.regions, warm.kept
            if warm.status == Status.OPTIMAL:
                optimum = warm_plan
        if optimum is None:  # dp's plan may be far from optimal: try one-node regions too
            greedy = greedy_single_nodes(problem, budget_bytes)
            if greedy is not None and cheaper((greedy, ())):
                warm_plan = greedy, ()
            single = None
            if built is not None:
                share_s = SINGLE_NODE_SHARE * time_limit_s
                single = single_node_optimum(problem, budget_bytes, greedy, share_s, workers)
            if single is not None and cheaper((single, ())):
                warm_plan = single, ()
            if built is not None:  # the LP says whether long regions help, and bounds
                deadline = started + time_limit_s
                guided, lp_bound = lp_guided_plan(
                    problem, budget_bytes, built, time_limit_s, workers, deadline, single is not None
                )
                if cheaper(guided):
                    warm_plan = guided
    elif hint:
        warm_plan = tuple(hint), tuple(hint_kept)
    remaining_s = time_limit_s - (time.perf_counter() - started)
    if lp_bound is not None and warm_plan is not None and remaining_s < FINAL_SEARCH_MIN_S:
        status = cp_model.UNKNOWN  # the LP-guided warm start used the time: the best plan stands
    elif built is not None:
        if warm_plan is not None:
            hint_plan(built, problem, *warm_plan)
        solver = cp_sat_solver(max(0.0, remaining_s), workers)
        if optimum is not None:
            # dp's exact search proved this cost minimal over the same plans: a valid bound.
            slack = bound_by_optimum(built, *optimum)
            solver.parameters.absolute_gap_limit = max(solver.parameters.absolute_gap_limit, float(slack))
        status = solver.solve(built.model)
        logger.debug("ilp: CP-SAT %s in %.2f s", solver.status_name(status), solver.wall_time)
    if (built is None or status == cp_model.INFEASIBLE) and dp_plan is not None:
        return _dp_plan_solution(problem, dp_plan, optimum is not None, budget_bytes, started)  # (it fits)
    if built is None or status == cp_model.INFEASIBLE:
        from solvers.dp.solve import minimum_peak_plan_dp

        dp_minimum, dp_exact, peak_regions, peak_kept = minimum_peak_plan_dp(problem)
        minimum, proven = minimum_peak_ilp(problem, time_limit_s, workers, hint=peak_regions, hint_kept=peak_kept)
        if hint is True and dp_minimum < minimum:
            # dp's plan keeps what the model cannot (a block's k costliest or "all but a run");
            # warm-started from dp, ilp returns such plans at budgets that fit them
            minimum, proven = dp_minimum, dp_exact
        if not proven:
            minimum = min(minimum, dp_minimum)
            logger.warning("ilp: minimum peak %d bytes is the best found, not proven", minimum)
        raise InfeasibleBudget(budget_bytes, minimum, problem.static_bytes, "ilp", proven=proven)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE) and optimum is not None:
        return _dp_plan_solution(problem, optimum, True, budget_bytes, started)  # (CP-SAT found none in time)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if warm_plan is None:
            raise TimeoutError(
                f"ilp: no plan found within {time_limit_s} s and the dp warm start had none; "
                "raise time_limit_s"
            )
        regions, kept = warm_plan
        objective = scaled_cost(built, regions, kept)
        bound = -math.inf
    else:
        regions, kept = plan_of_solution(solver, built)
        objective = solver.objective_value
        bound = solver.best_objective_bound
    if lp_bound is not None:
        bound = max(bound, lp_bound)
    if status == cp_model.OPTIMAL or objective <= 0:
        gap: float | None = 0.0
    else:
        gap = max(0.0, (objective - bound) / objective) if bound > -math.inf else None
    result = Status.OPTIMAL if status == cp_model.OPTIMAL else Status.TIME_LIMIT
    if optimum is not None and problem.recompute_ms(regions, kept) <= problem.recompute_ms(*optimum) + 1e-9:
        result, gap = Status.OPTIMAL, 0.0  # as cheap as dp's plan, proven optimal over more plans
    if dp_plan is not None and problem.recompute_ms(*dp_plan) < problem.recompute_ms(regions, kept) - 1e-9:
        return _dp_plan_solution(problem, dp_plan, optimum is not None, budget_bytes, started)
    solution = make_solution(problem, regions, budget_bytes, result, "ilp", started, kept)
    return dataclasses.replace(solution, gap=gap)


def _dp_plan_solution(problem: Problem, plan: Plan, proven: bool, budget_bytes: int, started: float) -> Solution:
    """ilp's answer where its dp warm start fits and CP-SAT found no plan in time, or only dearer
    ones (dp's plan may keep what the model cannot, a block's k costliest or "all but a run" of
    `Problem.keep_choices`, so that it was no hint). Optimal where dp proved it (over all the
    problem's choices), else with no known gap (CP-SAT's bound covers its own choices only)."""
    logger.info("ilp: dp's plan returned: CP-SAT found none as cheap within the time limit")
    status, gap = (Status.OPTIMAL, 0.0) if proven else (Status.FEASIBLE, None)
    return dataclasses.replace(make_solution(problem, plan[0], budget_bytes, status, "ilp", started, plan[1]), gap=gap)


__all__ = ["DEFAULT_TIME_LIMIT_S", "DEFAULT_WORKERS", "FINAL_SEARCH_MIN_S", "minimum_peak_ilp", "solve_ilp"]
