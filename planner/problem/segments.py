"""Regions of consecutive children of an `nn.Sequential` (a conv stage's BatchNorm, ReLU and
next convolution): each applied as one checkpoint call around those children in the
Sequential's own loop (`planner.apply.sequential`), where a run recomputed alone
(`planner.apply.runs`) would record every ATen call of the stage's forward.

Example:
    >>> segments, sequentials = sequential_segments(model, gm, wrapped)
    >>> segments[range(18, 21)].segments  # children 1 to 3 of a stage, drawing no random numbers
    ((1, 4, False),)
"""
from __future__ import annotations

from dataclasses import replace

import torch.fx as fx
from torch import nn

from planner.core import ModuleCheckpoint
from planner.problem.graph import MAX_RUN_NODES, casts_uncached, module_checkpoint
from planner.trace.structure import ModuleCall, compute_nodes


def plain_sequential(module: nn.Module) -> bool:
    """Whether `module` runs `nn.Sequential`'s own forward (not a subclass's, not one patched on it)."""
    return (isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward
            and "forward" not in module.__dict__)


def sequential_segments(model: nn.Module, gm: fx.GraphModule, wrapped: dict[range, ModuleCheckpoint]
                        ) -> tuple[dict[range, ModuleCheckpoint], tuple[range, ...]]:
    """For each call of a plain `nn.Sequential` in `wrapped` (the plan's submodule calls; the
    model's own forward too, where the model is one) of 3 children or more, each a call of one
    graph node (a convolution, a norm, an activation): how each slice of 2 to `MAX_RUN_NODES` of
    its children, short of all, is checkpointed, by node range; and the calls of those
    Sequentials, inside which slices replace runs recomputed alone (every such run is a slice
    there).

    Example:
        >>> segments, sequentials = sequential_segments(model, gm, wrapped)
        >>> sequentials
        (range(3, 8), range(10, 15))
    """
    region_of = {spec.module: region for region, spec in wrapped.items()}
    calls = dict(wrapped)
    everything = range(len(compute_nodes(gm)))
    if plain_sequential(model) and everything not in calls and (root := module_checkpoint(
            gm, ModuleCall("", "", everything), type(model).__name__, casts_uncached(gm))) is not None:
        # (a model that is itself a Sequential has no nodes of its own, so no call of its own
        # forward: its slices are checkpointed in its loop all the same)
        calls[everything] = root
    segments: dict[range, ModuleCheckpoint] = {}
    sequentials = []
    for region, spec in calls.items():
        if not plain_sequential(module := model.get_submodule(spec.module)):
            continue
        names = list(module._modules)
        prefix = spec.module + "." if spec.module else ""
        if len(names) < 3 or len(region) != len(names) or any(
                region_of.get(prefix + name) != range(region.start + k, region.start + k + 1)
                for k, name in enumerate(names)):
            continue
        sequentials.append(region)
        for start in range(len(names)):
            for stop in range(start + 2, min(len(names), start + MAX_RUN_NODES) + 1):
                if stop - start < len(names):
                    call = ModuleCall(spec.module, spec.module_class, range(region.start + start, region.start + stop))
                    found = module_checkpoint(gm, call, spec.module_class, spec.uncached)
                    if found is not None:
                        segments[call.nodes] = replace(found, segments=((start, stop, found.random),))
    return segments, tuple(sequentials)


__all__ = ["plain_sequential", "sequential_segments"]
