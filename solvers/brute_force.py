"""Exhaustive search over every plan, judged by the simulator: the reference for tests.

A plan is any set of disjoint, non-empty ranges of consecutive nodes whose starts pass
`Problem.can_start_region`; two adjacent ranges differ from their union. There are F(2n + 1)
of them (Fibonacci), 75 025 for n = 12, so this refuses larger graphs. Each region may also
keep any of its `Problem.keep_choices` (a selective-checkpoint policy).
"""
from __future__ import annotations

import logging
import time
from itertools import chain, product
from typing import Iterator

from solvers.problem import Problem
from solvers.simulate import make_solution, peak_bytes
from solvers.solution import InfeasibleBudget, Solution, Status

logger = logging.getLogger(__name__)

MAX_NODES = 12


def all_plans(problem: Problem) -> Iterator[tuple[range, ...]]:
    """Every plan of `problem`, the empty plan first, in a fixed order.

    Example:
        >>> len(list(all_plans(Problem(nodes=(NodeCost("a", 1.0),)))))
        2
    """
    n = len(problem)
    startable = [problem.can_start_region(i) for i in range(n)]

    def extend(position: int, chosen: tuple[range, ...]) -> Iterator[tuple[range, ...]]:
        yield chosen
        for start in range(position, n):
            if not startable[start]:
                continue
            for stop in range(start + 1, n + 1):
                if problem.allows_region(start, stop):
                    yield from extend(stop, (*chosen, range(start, stop)))

    yield from extend(0, ())


def all_plans_with_keeps(problem: Problem) -> Iterator[tuple[tuple[range, ...], tuple[int, ...]]]:
    """Every plan of `problem` as (regions, kept nodes): each of `all_plans` with every
    choice of what each region keeps (`Problem.keep_choices`).

    Example:
        >>> next(all_plans_with_keeps(problem))
        ((), ())
    """
    for regions in all_plans(problem):
        choices = [problem.keep_choices(region) for region in regions]
        for subsets in product(*choices):
            yield regions, tuple(chain.from_iterable(subsets))


def _check_size(problem: Problem) -> None:
    if len(problem) > MAX_NODES:
        raise ValueError(
            f"brute_force enumerates every plan and refuses graphs over {MAX_NODES} nodes "
            f"(this one has {len(problem)}); use method='dp' or 'ilp'"
        )


def minimum_peak_brute_force(problem: Problem) -> int:
    """The smallest simulated peak over all plans, by enumeration (n <= 12).

    Example:
        >>> minimum_peak_brute_force(problem) <= peak_bytes(problem)
        True
    """
    _check_size(problem)
    return min(peak_bytes(problem, regions, kept) for regions, kept in all_plans_with_keeps(problem))


def solve_brute_force(problem: Problem, budget_bytes: int, **options: object) -> Solution:
    """The cheapest plan under `budget_bytes` by trying all of them (n <= 12; tests only).

    Ties on recompute time go to the lower peak, then to fewer regions (a region that saves
    nothing changes nothing), then to fewer kept nodes, then to the earlier plan in
    `all_plans_with_keeps` order.
    Raises InfeasibleBudget with the true minimum peak when nothing fits.

    Example:
        >>> solve_brute_force(problem, budget_bytes=2**20).status
        <Status.OPTIMAL: 'optimal'>
    """
    if options:
        raise TypeError(f"brute_force takes no options, got {sorted(options)}")
    _check_size(problem)
    started = time.perf_counter()
    best: tuple[float, int, int, int, tuple[range, ...], tuple[int, ...]] | None = None
    minimum: int | None = None
    for regions, kept in all_plans_with_keeps(problem):
        peak = peak_bytes(problem, regions, kept)
        minimum = peak if minimum is None else min(minimum, peak)
        if peak > budget_bytes:
            continue
        cost = problem.recompute_ms(regions, kept)
        if best is None or (cost, peak, len(regions), len(kept)) < best[:4]:
            best = (cost, peak, len(regions), len(kept), regions, kept)
    if best is None:
        raise InfeasibleBudget(budget_bytes, minimum or problem.static_bytes, problem.static_bytes, "brute_force")
    logger.debug("brute_force: best recompute %.6g ms, peak %d bytes", best[0], best[1])
    return make_solution(problem, best[4], budget_bytes, Status.OPTIMAL, "brute_force", started, best[5])


__all__ = ["MAX_NODES", "all_plans", "all_plans_with_keeps", "minimum_peak_brute_force", "solve_brute_force"]
