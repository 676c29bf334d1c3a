"""`dp`: the cheapest plan under a budget, and the smallest peak any plan reaches, by dynamic
programming over region boundaries (`solvers.dp.search` holds the search and how it works).

Example:
    >>> solve_dp(problem, budget_bytes=int(0.6 * peak_bytes(problem))).status
    <Status.OPTIMAL: 'optimal'>
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from solvers.dp.search import dp_search
from solvers.dp.settings import dp_settings
from solvers.dp.tables import DpTables
from solvers.problem import Problem
from solvers.simulate import make_solution, peak_bytes
from solvers.solution import InfeasibleBudget, Solution, Status
from solvers.structure import Structure

logger = logging.getLogger(__name__)


_BELOW_PROBES = 3  # probes a byte under the last plan found, in a row, before bisecting


def minimum_peak_dp(problem: Problem, above: int | None = None, **options: object) -> tuple[int, bool]:
    """Smallest peak (static included) that dp can reach, and whether that is proven minimal.

    A search on the budget with dp's feasibility check (galloping up, bisection, and a probe a
    byte under each plan found: often the minimum). When dp's search is exact (few frontier sets,
    saves read by their savers) this is the true minimum over all plans; else the peak of a plan
    that exists (an upper bound), to within 2%. `above`: a live budget (static excluded) known
    not to fit; `options` as for `solve_dp`.

    Example:
        >>> minimum_peak_dp(problem)[0] <= peak_bytes(problem)
        True
    """
    peak, exact, _, _ = minimum_peak_plan_dp(problem, above, **options)
    return peak, exact


def minimum_peak_plan_dp(problem: Problem, above: int | None = None, tables: DpTables | None = None,
                         **options: object) -> tuple[int, bool, tuple[range, ...], tuple[int, ...]]:
    """`minimum_peak_dp` plus a plan that reaches that peak; `tables`: those of an earlier search
    of the problem (`solvers.dp.tables`), to reuse.

    Example:
        >>> peak, exact, regions, kept = minimum_peak_plan_dp(problem)
        >>> peak_bytes(problem, regions, kept) == peak
        True
    """
    settings = dp_settings(problem, options)
    if settings.stride > 1:  # big graphs: probe on a coarser grid, it only needs to be quick
        settings = replace(settings, stride=2 * settings.stride)
    cache = problem.__dict__.setdefault("_minimum_peak_dp", {})
    if (settings, above) in cache:  # (a bounded search's result depends on where it starts)
        return cache[settings, above]
    search = dp_search(problem, settings, tables)
    structure = search.structure
    high = peak_bytes(problem) - problem.static_bytes  # the empty plan fits this
    best: tuple[range, ...] = ()
    best_kept: tuple[int, ...] = ()
    low = max([-1, *(value - 1 for value in structure.gradient_backward)])
    if above is not None:
        low = max(low, min(above, high - 1))
    exact = settings.complete and structure.saves_only_what_it_reads
    step = max(1, high // 50)
    # Probe just above `low` first (checks at small budgets are cheap); then a byte under each
    # plan found, often the minimum: a plan found there is probed under again, up to
    # `_BELOW_PROBES` in a row, before bisection takes over (which needs some 25 searches to
    # prove a minimum the probe under it proves in one).
    galloping, below_in_a_row = True, 0
    while high - low > 1:
        if not exact and high - low <= high // 50:
            break
        just_below = 0 < below_in_a_row <= _BELOW_PROBES
        middle = high - 1 if just_below else min(low + step, high - 1) if galloping else (low + high) // 2
        step *= 2
        found, middle_exact = search.run(middle, feasibility_only=True)
        exact = exact and middle_exact
        below_in_a_row = below_in_a_row + 1 if found is not None else 0
        if found is not None:
            best, best_kept = found.regions(), found.kept()
            high = peak_bytes(problem, best, best_kept) - problem.static_bytes  # may land below middle
            galloping = False
        else:
            low = middle
    cache[settings, above] = result = (high + problem.static_bytes, exact, best, best_kept)
    return result


def solve_dp(problem: Problem, budget_bytes: int, cost_bound_ms: float | None = None, **options: object) -> Solution:
    """The cheapest plan under `budget_bytes` by dynamic programming over region boundaries.

    Options (defaults from `DpSettings.for_problem`: exact on narrow graphs up to 1000 nodes,
    bounded on wide DAGs and on longer chains):
        max_states: frontier sets kept per boundary before merging the rest.
        max_front: Pareto points kept per frontier set (None: all).
        stride: regions start and end only at every stride-th node that holds memory.
        max_region_nodes: the longest region considered (None: any).
        boundary_fraction: regions start and end only at nodes that hold at least this share
            of the most any node holds (0: anywhere).
        cost_bound_ms: prune partial plans that cost more (e.g. a known plan's recompute ms).

    Status OPTIMAL when nothing was left out or merged (always on chains, CNNs and
    transformers), FEASIBLE otherwise. Raises InfeasibleBudget when nothing fits, with the
    smallest peak dp can reach (`proven` says whether that is the true minimum).

    Example:
        >>> solution = solve_dp(problem, budget_bytes=int(0.6 * peak_bytes(problem)))
        >>> solution.peak_bytes <= 0.6 * peak_bytes(problem), solution.status
        (True, <Status.OPTIMAL: 'optimal'>)
    """
    settings = dp_settings(problem, options)
    started = time.perf_counter()
    if peak_bytes(problem) <= budget_bytes:  # nothing to recompute
        return make_solution(problem, (), budget_bytes, Status.OPTIMAL, "dp", started)
    live_budget = budget_bytes - problem.static_bytes
    structure = Structure.of(problem)
    tables = DpTables(problem)  # (shared with the search for the minimum, should nothing fit)
    search = dp_search(problem, settings, tables)
    found, exact = None, True
    if live_budget >= 0:
        found, exact = search.run(live_budget, float("inf") if cost_bound_ms is None else cost_bound_ms)
        if found is None and cost_bound_ms is not None:  # the bound, not the budget, may be why
            found, exact = search.run(live_budget)
    if found is None:
        minimum, proven, plan, kept = minimum_peak_plan_dp(problem, max(live_budget, -1), tables, **options)
        if minimum <= budget_bytes:  # the bounded search for the minimum found what the other missed
            return make_solution(problem, plan, budget_bytes, Status.FEASIBLE, "dp", started, kept)
        raise InfeasibleBudget(budget_bytes, minimum, problem.static_bytes, "dp", proven=proven)
    exact = exact and settings.complete and structure.saves_only_what_it_reads
    status = Status.OPTIMAL if exact else Status.FEASIBLE
    logger.debug("dp: %d regions, recompute %.6g ms, %s", len(found.regions()), found.cost, status.value)
    return make_solution(problem, found.regions(), budget_bytes, status, "dp", started, found.kept())


__all__ = ["minimum_peak_dp", "minimum_peak_plan_dp", "solve_dp"]
