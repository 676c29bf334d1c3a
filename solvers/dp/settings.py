"""How much of the search space the dp solver keeps (`solvers.dp.solve`): exact settings for
narrow graphs, bounded ones for wide DAGs and very long chains, solver options over them, and
which kept nodes the regions from each boundary try (`region_keeps`).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import combinations

from solvers.problem import MAX_KEEP_CANDIDATES, Problem
from solvers.structure import Structure


@dataclass(frozen=True)
class DpSettings:
    """How much of the search space dp keeps (see the module docstring).

    Example:
        >>> DpSettings.for_problem(problem)
        DpSettings(max_states=64, max_front=None, stride=1)
    """

    max_states: int = 64  # frontier sets kept per boundary before merging the rest
    max_front: int | None = None  # Pareto points kept per set (None: all of them)
    stride: int = 1  # regions start and end only at every stride-th node that holds memory (and at n)
    max_region_nodes: int | None = None  # longest region considered (None: any length)
    boundary_fraction: float = 0.0  # boundaries only at nodes holding this share of the largest

    @staticmethod
    def for_problem(problem: Problem) -> "DpSettings":
        """Exact settings for narrow graphs (chains, CNNs, transformers: frontier <= 16
        outputs, and always room for every set when it is <= 12); bounded ones for wide DAGs,
        so that dp stays a fast heuristic there."""
        structure = Structure.of(problem)
        width = structure.frontier_width
        if structure.n > EXACT_MAX_NODES and width <= EXACT_FRONTIER_WIDTH:
            # Long chains (a 70B transformer: 5 000 nodes): the exact search grows with n^2
            # times its Pareto fronts, and takes minutes on a few thousand nodes. Bounded
            # regions and thinned fronts find plans costing barely more recomputation than
            # longer regions with full fronts do, in a fraction of the time.
            return DpSettings(max_states=max(64, 2**min(width, 12)), max_front=256, max_region_nodes=128,
                              boundary_fraction=0.01)
        if width <= 12:  # room for every frontier set there can be: exact for sure
            return DpSettings(max_states=max(64, 2**width))
        if width <= EXACT_FRONTIER_WIDTH:
            return DpSettings()
        if structure.n <= 150:
            return DpSettings(max_states=32)
        if structure.n <= 300:
            return DpSettings(max_states=16, max_front=64)
        return DpSettings(max_states=2, max_front=16, stride=-(-structure.n // 250))

    @property
    def complete(self) -> bool:
        """No Pareto point or boundary left out (frontier sets may still be merged)."""
        return (self.max_front is None and self.stride == 1 and self.max_region_nodes is None
                and self.boundary_fraction == 0)


EXACT_FRONTIER_WIDTH = 16
EXACT_MAX_NODES = 1000  # longer chains get a bounded search


def dp_settings(problem: Problem, options: dict[str, object]) -> DpSettings:
    """`DpSettings.for_problem`, with the solver options that name its fields instead.

    Example:
        >>> dp_settings(problem, {"max_states": 8}).max_states
        8
    """
    defaults = DpSettings.for_problem(problem)
    unknown = set(options) - {"max_states", "max_front", "stride", "max_region_nodes", "boundary_fraction"}
    if unknown:
        raise TypeError(f"dp got unknown options {sorted(unknown)}")
    return DpSettings(
        max_states=int(options.get("max_states", defaults.max_states)),  # type: ignore[arg-type]
        max_front=options.get("max_front", defaults.max_front),  # type: ignore[arg-type]
        stride=int(options.get("stride", defaults.stride)),  # type: ignore[arg-type]
        max_region_nodes=options.get("max_region_nodes", defaults.max_region_nodes),  # type: ignore[arg-type]
        boundary_fraction=float(options.get("boundary_fraction", defaults.boundary_fraction)),  # type: ignore[arg-type]
    )


def region_boundaries(problem: Problem, stride: int, fraction: float = 0.0) -> list[bool]:
    """Where regions may start and end: everywhere with stride 1 and no `fraction`; else at
    every `stride`-th node that holds memory, at least `fraction` of the most any node holds
    (views, shape queries and asserts make poor boundaries), and at n.

    Example:
        >>> region_boundaries(problem, stride=1)[:3]
        [True, True, True]
    """
    n = len(problem)
    if stride <= 1 and fraction <= 0:
        return [True] * (n + 1)
    held = [node.output_bytes + node.saved_bytes for node in problem.nodes]
    least = max(1, int(fraction * max(held, default=0)))
    holders = [i for i, size in enumerate(held) if size >= least]
    allowed = [False] * (n + 1)
    for i in holders[::stride]:
        allowed[i] = True
    allowed[0] = allowed[n] = True
    return allowed


def region_keeps(problem: Problem, keepable: list[int], t: int, last: int) -> list[tuple[tuple[int, ...], int, bool]]:
    """What the regions [t, b), b <= last, that dp tries keep: (kept nodes, last b, whether only
    that b). With allowed regions, nothing for all at once, then each allowed one's
    `Problem.keep_choices`; without, each subset of the first `MAX_KEEP_CANDIDATES` of the sorted
    `keepable` nodes from t, for the regions holding no more keepable nodes than that
    (`Problem.keep_candidates`).

    Example:
        >>> region_keeps(problem, [], 0, len(problem))
        [((), 5, False)]
    """
    found = [((), last, False)]
    if problem.allowed_regions is not None:
        for b in range(t + 1, last + 1):
            if problem.allows_region(t, b):
                found += [(keep, b, True) for keep in problem.keep_choices(range(t, b))[1:]]
    else:
        first = bisect.bisect_left(keepable, t)
        candidates = keepable[first:bisect.bisect_left(keepable, last, first)]
        stop = candidates[MAX_KEEP_CANDIDATES] if len(candidates) > MAX_KEEP_CANDIDATES else last
        found += [(keep, stop, False) for size in range(1, MAX_KEEP_CANDIDATES + 1)
                  for keep in combinations(candidates[:MAX_KEEP_CANDIDATES], size)]
    return found


__all__ = ["DpSettings", "EXACT_FRONTIER_WIDTH", "EXACT_MAX_NODES", "dp_settings", "region_boundaries", "region_keeps"]
