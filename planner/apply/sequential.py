"""Run an `nn.Sequential`'s children with some slices of them under one checkpoint call each:
how a plan applies a region of consecutive children (`ModuleCheckpoint.segments`), which no
single submodule's forward holds.

Example:
    >>> stage = nn.Sequential(nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))
    >>> y = run_segments(stage, x, ((1, 3, False),), lambda run, segment, x: checkpoint(run, x, use_reentrant=False))
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import nn

from planner.core import Segment

# how one slice is checkpointed: (run the slice on an input, the slice, the input)
SliceCheckpoint = Callable[[Callable[[Any], Any], Segment, Any], Any]


def run_segments(module: nn.Sequential, value: Any, segments: Sequence[Segment],
                 checkpoint_slice: SliceCheckpoint) -> Any:
    """`module`'s own forward (each child on the previous child's output), but children
    start..stop-1 of each of `segments` run inside `checkpoint_slice`.

    Example:
        >>> run_segments(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), x, ((0, 2, False),),
        ...              lambda run, segment, x: run(x))  # no checkpoint: the plain forward
    """
    children = list(module)
    starting = {segment[0]: segment for segment in segments}
    index = 0
    while index < len(children):
        if index in starting:
            segment = starting[index]
            value = checkpoint_slice(_chain(children[index:segment[1]]), segment, value)
            index = segment[1]
        else:
            value = children[index](value)
            index += 1
    return value


def _chain(children: list[nn.Module]) -> Callable[[Any], Any]:
    def run(value: Any) -> Any:
        for child in children:
            value = child(value)
        return value
    return run


def buffers_of_children(module: nn.Sequential, names: Sequence[str], start: int, stop: int) -> tuple[str, ...]:
    """Those of `names` (buffers relative to `module`, "1.running_mean") that belong to its
    children start..stop-1."""
    children = set(list(module._modules)[start:stop])
    return tuple(name for name in names if name.split(".", 1)[0] in children)


__all__ = ["SliceCheckpoint", "buffers_of_children", "run_segments"]
