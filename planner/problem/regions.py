"""The regions of a solution as a plan applies and shows them: which `ModuleCheckpoint` applies
each (`region_specs`: its submodule call's, keeping the calls of the nodes the solution keeps
there; the one that records every planned run inside a call; the one that cuts every planned
slice of a Sequential's children), what each recomputes, frees and costs (`Checkpoint`), and
the regions of a plan written by hand (`submodule_regions`, `named_regions`).

Example:
    >>> specs = region_specs(gm, problem, solution, wrapped)
    >>> specs[solution.regions[0]].module
    'blocks.0'
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Collection, Sequence

import torch.fx as fx

from planner.core import ModuleCheckpoint
from planner.problem.graph import run_checkpoints, saved_calls
from solvers import Problem, Solution
from solvers.simulate import held_after_forward


@dataclass(frozen=True)
class Checkpoint:
    """One recomputed region as a plan shows it: its fx nodes, the submodule of each, what it
    recomputes (ms) and frees at the end of forward (bytes), the submodule whose forward runs
    under checkpoint (`wrapped`), and the nodes whose outputs it keeps (a selective policy)."""

    nodes: tuple[str, ...]
    recompute_ms: float
    freed_bytes: int
    node_modules: tuple[str, ...] = ()  # ("" for the model's own forward)
    wrapped: ModuleCheckpoint | None = None
    kept: tuple[str, ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        """The submodules the nodes belong to, each once, in order of first appearance."""
        return tuple(dict.fromkeys(self.node_modules))

    @property
    def name(self) -> str:
        """The submodule it checkpoints, or for a slice or a run its first and last nodes' submodules."""
        if self.wrapped is not None and not self.wrapped.segments and not self.wrapped.runs:
            return self.wrapped.module or "(model)"
        if not self.node_modules:
            return ""
        first, last = (module or "(model)" for module in (self.node_modules[0], self.node_modules[-1]))
        return first if first == last else f"{first} .. {last}"


def describe_checkpoints(problem: Problem, regions: tuple[range, ...], modules: Sequence[str],
                         wrapped: dict[range, ModuleCheckpoint] | None = None,
                         kept: Collection[int] = ()) -> tuple[Checkpoint, ...]:
    """Each region as a plan shows it (`Checkpoint`); `modules` holds one submodule path per node,
    `wrapped` the checkpoint of each region, by range, and `kept` the nodes the plan keeps.

    Example:
        >>> describe_checkpoints(p.problem, p.solution.regions, [""] * len(p.problem))[0].nodes
    """
    unplanned = held_after_forward(problem)
    checkpoints = []
    for region in regions:
        keeps = tuple(i for i in sorted(kept) if i in region)
        checkpoints.append(Checkpoint(
            nodes=tuple(problem.nodes[i].name for i in region),
            node_modules=tuple(modules[i] for i in region),
            recompute_ms=problem.recompute_ms((region,), keeps),
            freed_bytes=unplanned - held_after_forward(problem, (region,), keeps),
            wrapped=(wrapped or {}).get(region),
            kept=tuple(problem.nodes[i].name for i in keeps),
        ))
    return tuple(checkpoints)


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


__all__ = ["Checkpoint", "describe_checkpoints", "merged_segments", "named_regions", "region_specs", "submodule_regions"]
