"""Searches on the CP-SAT model of `solvers.ilp.model` that `solvers.ilp.solve` starts from: the
solver's settings, reading a plan out of a solution, and the warm starts (a greedy plan of
one-node regions, the best plan of one-node regions, and the search over long regions that the
LP relaxation steers), and hinting the model with a known plan (`hint_plan`). See `solvers.ilp.solve`
for when each runs.

Example:
    >>> greedy_single_nodes(problem, budget_bytes)
    (range(3, 4), range(7, 8))
"""
from __future__ import annotations

import heapq
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Collection

from solvers.ilp.keep import keep_hints
from solvers.ilp.model import IlpModel, build_model, load_cp_model
from solvers.problem import Problem
from solvers.simulate import peak_bytes
from solvers.structure import Structure

logger = logging.getLogger(__name__)

Plan = tuple[tuple[range, ...], tuple[int, ...]]  # regions and the nodes they keep

SINGLE_NODE_SHARE = 0.1  # of the time limit, at most, for the one-node-regions warm start
LP_SHARE = 0.5  # ... for the LP relaxation that guides the long-region warm start
GUIDED_SHARE = 0.3  # ... for the search it guides (twice that on one worker fewer, see below)
SEARCH_MARGIN_S = 1.0  # the LP-guided search ends this early: CP-SAT overruns a little
GUIDED_SHORT_REGION_NODES = 4  # regions longer than this start only where the LP opens them


def greedy_single_nodes(problem: Problem, budget_bytes: int) -> tuple[range, ...] | None:
    """A warm start where dp's bounded search is weak (wide DAGs): one-node regions ("drop
    this output, recompute it alone in backward"), added greedily by peak bytes saved per ms,
    re-scoring lazily, then dropped again, costliest first, while the plan still fits. None if
    one-node regions alone cannot reach the budget. (On wide DAGs it finds, in well under a
    second, plans far cheaper than dp's bounded search and near CP-SAT's LP bound.)"""

    def plan(chosen: set[int]) -> tuple[range, ...]:
        return tuple(range(j, j + 1) for j in sorted(chosen))

    def score(saved_bytes: int, j: int) -> float:
        return saved_bytes / max(problem.nodes[j].compute_ms, 1e-12)

    peak = peak_bytes(problem)
    chosen: set[int] = set()
    queue = []  # (-score, node): scores only go stale, so re-score the best before taking it
    for j in range(len(problem)):
        if problem.allows_region(j, j + 1):
            saved = peak - peak_bytes(problem, (range(j, j + 1),))
            if saved > 0:
                queue.append((-score(saved, j), j))
    heapq.heapify(queue)
    while peak > budget_bytes and queue:
        _, j = heapq.heappop(queue)
        saved = peak - peak_bytes(problem, plan(chosen | {j}))
        if saved <= 0:
            continue  # no help at the current peak step
        if queue and -queue[0][0] > score(saved, j):
            heapq.heappush(queue, (-score(saved, j), j))
            continue
        chosen.add(j)
        peak -= saved
    if peak > budget_bytes:
        return None
    for j in sorted(chosen, key=lambda j: (-problem.nodes[j].compute_ms, j)):
        if peak_bytes(problem, plan(chosen - {j})) <= budget_bytes:
            chosen.discard(j)
    return plan(chosen)


def single_node_optimum(
    problem: Problem, budget_bytes: int, hint: tuple[range, ...] | None, time_limit_s: float, workers: int
) -> tuple[range, ...] | None:
    """The cheapest plan of one-node regions, from the same model restricted to them (about a
    quarter of the variables, and an LP that solves far faster than the full one), or the best
    found within `time_limit_s`; None if none was found (or none exists). A warm start for the
    full model, never a bound. Of CP-SAT's full-problem workers only the LP-guided one
    (`max_lp`) runs, beside the neighbourhood searches: that proves such plans optimal many
    times faster than the default mix of workers. A one-node region keeps nothing: kept, its
    node holds at least what it holds outside regions, and costs no less."""
    one_node_hint = (hint, ()) if hint is not None and all(len(region) == 1 for region in hint) else None
    found, _ = search_restricted(problem, budget_bytes, 1, frozenset(), one_node_hint, time_limit_s, workers,
                                 keeps=False)
    return None if found is None else found[0]


def search_restricted(
    problem: Problem,
    budget_bytes: int,
    max_region_nodes: int,
    long_starts: frozenset[int],
    hint: Plan | None,
    time_limit_s: float,
    workers: int,
    stop: Future | None = None,
    keeps: bool = True,
) -> tuple[Plan | None, bool]:
    """The best plan CP-SAT finds within `time_limit_s` in the model restricted to regions of
    at most `max_region_nodes` nodes (except from `long_starts`), None if none, and whether
    it is proven the best of that model. Its plans are plans of the full model. Of the
    full-problem workers only the LP-guided one (`max_lp`) runs, beside the neighbourhood
    searches. The search also stops when `stop` is done. Building the model counts against
    `time_limit_s` too. `keeps` False: its regions keep nothing.

    Example:
        >>> (regions, kept), proven = search_restricted(problem, budget, 4, frozenset(), None, 10.0, 2)
    """
    began = time.perf_counter()
    live_budget = budget_bytes - problem.static_bytes
    built = build_model(problem, live_budget, live_budget, max_region_nodes, long_starts, keeps)
    # Only a plan that fits: CP-SAT 9.15 aborts the process ("Check failed:
    # heuristics.fixed_search != nullptr") on a hinted model that its loading finds
    # infeasible with interleaved workers, and a plan that fits proves the model feasible.
    if hint is not None and peak_bytes(problem, *hint) <= budget_bytes:
        hint_plan(built, problem, *hint)
    solver = cp_sat_solver(max(0.0, time_limit_s - (time.perf_counter() - began)), workers)
    solver.parameters.subsolvers.append("max_lp")
    if stop is not None:
        stop.add_done_callback(lambda _: solver.stop_search())  # (from the thread that did it)
    status = solver.solve(built.model)
    logger.debug(
        "ilp: regions of at most %d nodes (any length from %d starts): CP-SAT %s in %.2f s",
        max_region_nodes, len(long_starts), solver.status_name(status), solver.wall_time,
    )
    cp_model = load_cp_model()
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, status == cp_model.INFEASIBLE
    return plan_of_solution(solver, built), status == cp_model.OPTIMAL


def lp_guided_plan(
    problem: Problem,
    budget_bytes: int,
    built: IlpModel,
    time_limit_s: float,
    workers: int,
    deadline: float,
    short_regions_fit: bool = False,
) -> tuple[Plan | None, float | None]:
    """A warm start for budgets that need a long region, steered by the full model's LP
    relaxation, and a bound from the LP (in the model's scaled units; None if no LP solution).
    Where a plan of one-node regions fits (`short_regions_fit`) and the LP puts no weight on
    a long region, only the LP's bound: the full model's search then proves such plans. Where
    the LP opens long starts, this finds plans far cheaper than the best plan of one-node
    regions, which the full model's search does not improve on within its time.

    Regions of at most `GUIDED_SHORT_REGION_NODES` nodes may start anywhere; longer ones only
    where the LP puts weight on one, and CP-SAT searches that restricted model. CP-SAT's own
    neighbourhood searches cannot move a long region: they stay near dp's plan, while the LP
    (with the triangle cuts) puts most of its weight on the optimum's long region, and this
    search finds a plan near the optimum.

    The bound is the LP's, raised by one branch (`branching_node`): every plan has that node
    in a region or not, so the smaller of the two halves' LP objectives is a bound too. Where
    the LP mixes most of a plan that does not fit with a little of one with a far longer
    region, both halves lie above the LP's objective. The halves are solved (from the
    LP's basis, one after the other, until `deadline`) while the search runs beside them on one
    worker fewer (so with one worker there is no branch), then on all of them, each time for at
    most twice `GUIDED_SHARE` of the limit; the root LP gets at most `LP_SHARE`.

    Example:
        >>> plan, bound = lp_guided_plan(problem, budget, built, 60.0, 2, time.perf_counter() + 60.0)
    """
    from solvers.ilp.lp_relaxation import LinearRelaxation

    started = time.perf_counter()
    relaxation = LinearRelaxation(built.model)
    root = relaxation.solve(LP_SHARE * time_limit_s)
    took = time.perf_counter() - started
    logger.debug("ilp: LP relaxation %s in %.2f s", "solved" if root else "not solved", took)
    if root is None or not root.feasible:
        return None, None
    short = GUIDED_SHORT_REGION_NODES
    long_starts = frozenset(
        a
        for i, row in enumerate(built.member)
        for a, var in row.items()
        if i - a == short and root.values[var.index] > 1e-6
    )
    if short_regions_fit and not long_starts:
        return None, root.objective
    node = branching_node(built, root.values)

    def branch() -> float | None:
        """The smaller LP objective of the two halves of the branch on `node`, if both came."""
        assert node is not None
        index = built.in_region[node].index
        halves = [relaxation.solve(deadline - time.perf_counter(), {index: value}) for value in (0.0, 1.0)]
        logger.debug(
            "ilp: branch on node %d: halves %s at %.2f s", node,
            [half.objective / built.objective_scale if half else None for half in halves],
            time.perf_counter() - started,
        )
        return min(half.objective for half in halves) if halves[0] and halves[1] else None

    def search(hint: Plan | None, workers: int, stop: Future | None = None) -> tuple[Plan | None, bool]:
        share_s = min(2 * GUIDED_SHARE * time_limit_s, deadline - time.perf_counter() - SEARCH_MARGIN_S)
        if share_s < SEARCH_MARGIN_S:
            return None, False
        return search_restricted(problem, budget_bytes, short, long_starts, hint, share_s, workers, stop)

    # Hinted with the LP's rounded plan, not with the plans found so far: a plan with one very
    # long region (dp's) leads the search to dearer plans than the LP's alone does. While the
    # halves are solved, on one worker fewer.
    hint = rounded_plan(built, root.values), ()
    with ThreadPoolExecutor(max_workers=1) as pool:  # the LP solvers release the GIL
        halves = pool.submit(branch) if node is not None and workers > 1 else None
        plan, proven = search(hint, workers - 1 if halves else workers, halves)
        if halves is not None and halves.done() and not proven:  # the rest of the time: all workers
            plan, _ = search(plan or hint, workers)
        branch_bound = halves.result() if halves is not None else None
    return plan, root.objective if branch_bound is None else max(root.objective, branch_bound)


def rounded_plan(built: IlpModel, values: tuple[float, ...]) -> tuple[range, ...]:
    """The regions that an LP solution puts each node in at more than one half, less those the
    problem does not allow (halves of two regions from one start can round to a third, such as
    a run of a call that has none): a plan, which may not fit (a hint for a search)."""
    problem = built.problem
    assert problem is not None
    rounded = regions_of([next((a for a, var in row.items() if values[var.index] > 0.5), None) for row in built.member])
    return tuple(r for r in rounded if problem.allows_region(r.start, r.stop) and problem.can_start_region(r.start))


def branching_node(built: IlpModel, values: tuple[float, ...]) -> int | None:
    """The node to branch on, None if the LP puts every node wholly in or out of regions.

    Where the LP takes a fraction of a long region, its objective is a mix of plans. The
    region start whose fractional members weigh the most (cost times distance from 0 or 1) is
    that region's, and of its members the costliest node that the LP puts partly in regions
    parts the mix the most: forced out, the long region cannot cover it; forced in, its whole
    cost is paid. (The most fractional node, or a node of a shorter region, raises the bound
    less.)"""

    def fraction(var: Any) -> float:
        value = values[var.index]
        return min(value, 1.0 - value) if 1e-6 < value < 1 - 1e-6 else 0.0

    weight: dict[int, float] = {}
    for i, row in enumerate(built.member):
        for a, var in row.items():
            weight[a] = weight.get(a, 0.0) + built.costs[i] * fraction(var)
    if not weight or max(weight.values()) <= 0:
        return None
    start = min(weight, key=lambda a: (-weight[a], a))
    candidates = [
        i
        for i, row in enumerate(built.member)
        if start in row and fraction(row[start]) > 0 and fraction(built.in_region[i]) > 0
    ]
    return min(candidates, key=lambda i: (-built.costs[i], i), default=None)


def plan_of_solution(solver: Any, built: IlpModel) -> Plan:
    """The regions and kept nodes of CP-SAT's solution."""
    regions = regions_of([next((a for a, var in row.items() if solver.value(var)), None) for row in built.member])
    kept = tuple(j for j, row in sorted(built.keep.items()) if any(solver.value(var) for var in row.values()))
    return regions, kept


def regions_of(start_of: list[int | None]) -> tuple[range, ...]:
    """The regions, given the start of each node's region (None: outside regions)."""
    regions = []
    for i, start in enumerate(start_of):
        if start == i:
            stop = i + 1
            while stop < len(start_of) and start_of[stop] == i:
                stop += 1
            regions.append(range(i, stop))
    return tuple(regions)


def cp_sat_solver(time_limit_s: float, workers: int) -> Any:
    cp_model = load_cp_model()
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(workers)
    solver.parameters.interleave_search = True  # deterministic with several workers
    solver.parameters.random_seed = 0
    # Probing builds hundreds of thousands of binary clauses on these models and costs far more
    # than it saves.
    solver.parameters.cp_model_probing_level = 0
    # Solve the root LP in one go, not in chunks of 2 000 dual simplex iterations between the
    # other interleaved workers: a wide DAG's root LP needs tens of thousands, and in chunks no
    # bound arrives within the default time limit.
    solver.parameters.root_lp_iterations = 200_000
    return solver


def hint_plan(built: IlpModel, problem: Problem, regions: tuple[range, ...], kept: Collection[int] = ()) -> bool:
    """Hint every variable with the values of a known plan; False if the plan is outside the
    model (a region the budget pruning removed, or a kept node it cannot keep), in which case
    nothing is hinted.

    Example:
        >>> hint_plan(built, problem, (range(2, 5),), (3,))
        True
    """
    structure = Structure.of(problem)
    n = structure.n
    start_of = [n] * n
    saver_of = [n] * n  # the last saving node of each node's region
    in_run = [False] * n
    for region in regions:
        run = problem.run_span_of(region) is not None
        for i in region:
            start_of[i] = region.start
            saver_of[i] = problem.recomputed(region).stop - 1
            in_run[i] = run
    if any(start_of[i] < n and start_of[i] not in built.member[i] for i in range(n)):
        return False
    kept = frozenset(kept)
    keep_values = keep_hints(built.keep, saver_of, kept)
    if keep_values is None:
        return False
    model = built.model
    for i in range(n):
        for a, var in built.member[i].items():
            model.add_hint(var, start_of[i] == a)
        model.add_hint(built.in_region[i], start_of[i] < n)
    for var, value in keep_values:
        model.add_hint(var, value)
    for (k, i), var in built.prefix.items():
        model.add_hint(var, start_of[k] <= i)
    for j, row in enumerate(built.alive):
        if not row:
            continue
        candidates = [k for k in structure.savers[j] if start_of[k] == n]
        candidates += [start_of[k] for k in structure.consumers[j] if j < start_of[k] < n
                       and not (in_run[k] and j not in structure.reads_before[k])]
        if j in kept:  # held until its region recomputes, before the backward of saver_of[j]
            candidates.append(saver_of[j] + 1)
        keeper = min(candidates, default=n)
        for i, var in row.items():
            model.add_hint(var, keeper <= i)
    return True


__all__ = ["GUIDED_SHARE", "GUIDED_SHORT_REGION_NODES", "LP_SHARE", "Plan", "SEARCH_MARGIN_S", "SINGLE_NODE_SHARE",
           "branching_node", "cp_sat_solver", "greedy_single_nodes", "hint_plan", "lp_guided_plan", "plan_of_solution",
           "regions_of", "rounded_plan", "search_restricted", "single_node_optimum"]
