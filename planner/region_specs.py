"""Which `ModuleCheckpoint` applies each region of a solution: its submodule call's, keeping
the calls of the nodes the solution keeps there; the one that records every planned run inside
a call; the one that cuts every planned slice of a Sequential's children.

Example:
    >>> specs = region_specs(gm, problem, solution, wrapped)
    >>> specs[solution.regions[0]].module
    'blocks.0'
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch.fx as fx

from planner.apply import ModuleCheckpoint
from planner.graph import run_checkpoints, saved_calls
from solvers import Problem, Solution


def region_specs(gm: fx.GraphModule, problem: Problem, solution: Solution,
                 wrapped: dict[range, ModuleCheckpoint]) -> dict[range, ModuleCheckpoint]:
    """`wrapped` (what each allowed region checkpoints, keeping nothing) with the solution's
    regions replaced by how the plan applies them.

    Example:
        >>> region_specs(gm, problem, solution, wrapped)[range(8, 43)].saved_calls
        (('aten.addmm.default', 0), ('aten.addmm.default', 2))
    """
    keeping = {region: replace(wrapped[region], saved_calls=saved_calls(gm, region, solution.kept))
               for region in solution.regions if region in wrapped}
    runs = run_checkpoints(gm, problem, solution.regions, wrapped, solution.kept)
    return {**wrapped, **keeping, **runs, **merged_segments(solution.regions, wrapped)}


def merged_segments(regions: Sequence[range], wrapped: dict[range, ModuleCheckpoint]) -> dict[range, ModuleCheckpoint]:
    """For each of `regions` that is a slice of a Sequential's children (`sequential_segments`),
    the one spec that applies every planned slice of that Sequential.

    Example:
        >>> merged_segments([range(4, 7), range(6, 8)], wrapped)[range(4, 7)].segments
        ((0, 3, False), (3, 5, False))
    """
    chosen: dict[str, list[range]] = {}
    for region in regions:
        spec = wrapped.get(region)
        if spec is not None and spec.segments:
            chosen.setdefault(spec.module, []).append(region)
    found = {}
    for inside in chosen.values():
        specs = [wrapped[region] for region in sorted(inside, key=lambda region: region.start)]
        merged = replace(specs[0], random=any(spec.random for spec in specs),
                         written_buffers=tuple(sorted({name for spec in specs for name in spec.written_buffers})),
                         segments=tuple(segment for spec in specs for segment in spec.segments))
        found.update({region: merged for region in inside})
    return found


__all__ = ["merged_segments", "region_specs"]
