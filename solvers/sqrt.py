"""Budget-aware sqrt(N) segmentation (Chen et al. 2016, "Training Deep Nets with Sublinear
Memory Cost"): cut the graph into k segments of similar activation bytes and recompute every
segment but the last, as `torch.utils.checkpoint.checkpoint_sequential` does. Try k = 1, 2, ...
up to `max_segments(n)` and keep the fewest segments whose simulated peak fits the budget.
"""
from __future__ import annotations

import math
import time

from solvers.problem import Problem
from solvers.simulate import held_after_forward, make_solution, peak_bytes
from solvers.solution import InfeasibleBudget, Solution, Status

# On a chain of n equal nodes, k segments hold about n/k + k nodes at the peak, least at
# k = sqrt(n); at 4 sqrt(n) they hold twice that least. Counts beyond are not tried: on large
# graphs, trying every count takes long where no plan fits (auto pays it after dp), and the
# least peak comes at a few segments.
SEGMENTS_PER_SQRT_N = 4
ALL_COUNTS_UP_TO = 64  # (small graphs: every count)


def max_segments(nodes: int) -> int:
    """The most segments `solve_sqrt` tries on a graph of `nodes` nodes.

    Example:
        >>> max_segments(50), max_segments(1000)
        (50, 127)
    """
    return min(nodes, max(ALL_COUNTS_UP_TO, math.ceil(SEGMENTS_PER_SQRT_N * math.sqrt(nodes))))


def segments(problem: Problem, count: int) -> tuple[range, ...]:
    """Split the nodes into at most `count` consecutive segments of similar activation bytes,
    each starting where a region may start.

    Example:
        >>> segments(problem, 3)
        (range(0, 4), range(4, 9), range(9, 12))
    """
    n = len(problem)
    weights = [max(1, node.output_bytes + node.saved_bytes) for node in problem.nodes]
    total = sum(weights)
    starts = [0]
    running = 0
    for i, weight in enumerate(weights[:-1]):
        running += weight
        wanted = len(starts) * total / count
        if running >= wanted and len(starts) < count and problem.can_start_region(i + 1):
            starts.append(i + 1)
    bounds = [*starts, n]
    return tuple(part for a, b in zip(bounds, bounds[1:]) for part in _valid_parts(problem, range(a, b)))


def _valid_parts(problem: Problem, segment: range) -> list[range]:
    """`segment` less the nodes no region may hold, as regions that may be (each starting at
    the first node a region may start at)."""
    parts = []
    start = segment.start
    while start < segment.stop:
        if not problem.can_start_region(start):
            start += 1
            continue
        stop = min(segment.stop, problem.last_region_stop(start))
        if stop > start:
            parts.append(range(start, stop))
        start = max(stop, start + 1)
    return parts


def _freeing_regions(problem: Problem) -> list[range]:
    """The allowed regions that hold less at the end of forward than no plan does."""
    cached = problem.__dict__.get("_freeing_regions")
    if cached is None:
        unplanned = held_after_forward(problem)
        cached = [r for r in problem.allowed_regions or ()
                  if problem.allows_region(r.start, r.stop) and held_after_forward(problem, (r,)) < unplanned]
        object.__setattr__(problem, "_freeing_regions", cached)
    return cached


def allowed_segments(problem: Problem, count: int) -> tuple[range, ...]:
    """With allowed regions (submodule calls): the largest allowed regions of at most
    ceil(n / count) nodes that free memory and do not overlap, chosen largest first, in order
    ("every block" at the right count).

    Example:
        >>> allowed_segments(problem, 4)
        (range(2, 9), range(9, 16), range(16, 23))
    """
    cap = math.ceil(len(problem) / count)
    fitting = [r for r in _freeing_regions(problem) if len(r) <= cap]
    chosen: list[range] = []
    for region in sorted(fitting, key=lambda r: (-len(r), r.start)):
        if all(region.stop <= other.start or other.stop <= region.start for other in chosen):
            chosen.append(region)
    return tuple(sorted(chosen, key=lambda r: r.start))


def solve_sqrt(problem: Problem, budget_bytes: int, **options: object) -> Solution:
    """The baseline solver: fewest equal-bytes segments that fit, all but the last recomputed.
    Up to `max_segments` segments are tried; where none fits, InfeasibleBudget gives the
    smallest peak among them (not proven the least of every plan).

    Example:
        >>> solve_sqrt(problem, budget_bytes=2**30).regions
        (range(0, 5), range(5, 11))
    """
    started = time.perf_counter()
    best_peak: int | None = None
    seen: set[tuple[range, ...]] = set()
    for count in range(0, max_segments(len(problem)) + 1):
        # The last segment would be recomputed as soon as backward starts: never worth it.
        if count == 0:
            regions: tuple[range, ...] = ()  # no plan at all, where the unplanned step fits
        else:
            regions = (segments(problem, count) if problem.allowed_regions is None
                       else allowed_segments(problem, count))[:-1]
        if regions in seen:
            continue
        seen.add(regions)
        peak = peak_bytes(problem, regions)
        if peak <= budget_bytes:
            return make_solution(problem, regions, budget_bytes, Status.FEASIBLE, "sqrt", started)
        best_peak = peak if best_peak is None else min(best_peak, peak)
    raise InfeasibleBudget(budget_bytes, best_peak or problem.static_bytes, problem.static_bytes, "sqrt",
                          proven=False)


__all__ = ["ALL_COUNTS_UP_TO", "SEGMENTS_PER_SQRT_N", "allowed_segments", "max_segments", "segments", "solve_sqrt"]
