"""The regions of a plan written by hand (`Plan.with_submodules`, `Plan.with_regions`): named
submodules or first and last node names, checked against what the plan may recompute."""
from __future__ import annotations

from typing import Sequence

from planner.apply import ModuleCheckpoint
from solvers import Problem


def submodule_regions(wrapped: dict[range, ModuleCheckpoint], modules: Sequence[str]) -> tuple[range, ...]:
    """The node ranges of the submodule calls `modules` (qualified names), in order.

    Example:
        >>> submodule_regions(p.wrapped, ["blocks.0", "blocks.1"])
        (range(3, 27), range(27, 51))
    """
    region_of = {spec.module: region for region, spec in wrapped.items() if not spec.segments}
    for module in modules:
        if module not in region_of:
            raise ValueError(f"{module!r} is not a submodule call this plan can checkpoint (called once per "
                             f"forward, traced): try one of {', '.join(sorted(region_of)[:6])}")
    return tuple(sorted({region_of[module] for module in modules}, key=lambda region: region.start))


def named_regions(problem: Problem, regions: Sequence[tuple[str, str]]) -> tuple[range, ...]:
    """The node ranges from each region's first to last fx node name, in order; each must be a
    region `problem` allows.

    Example:
        >>> named_regions(p.problem, [("blocks_0_norm2", "blocks_0_mlp_1")])
        (range(51, 58),)
    """
    index = {node.name: i for i, node in enumerate(problem.nodes)}
    found = []
    for first, last in regions:
        if first not in index or last not in index:
            raise ValueError(f"{first if first not in index else last!r} is not a compute node of the graph")
        region = range(index[first], index[last] + 1)
        if not problem.allows_region(region.start, region.stop):
            raise ValueError(f"{first}..{last} is neither a submodule call nor a run inside one that this plan "
                             "may recompute (calls matched in the model's forward, no buffer writes)")
        found.append(region)
    return tuple(sorted(found, key=lambda region: region.start))


__all__ = ["named_regions", "submodule_regions"]
