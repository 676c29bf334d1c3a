"""Each block's own forward and backward time inside a training step, read off hooks.

A step's time difference between two configurations carries the noise of the whole step; a
block's own segments carry only theirs, so one block's reading is tighter than the step's (summed
over all blocks, the blocks' own noise from round to round remains: benchmarks/RESULTS.md,
session notes of 2026-12-04 05:05-). Forward: from the block's
forward pre-hook to its forward hook. Backward: from the gradient of its output (a tensor hook)
to the gradient of its input, which for blocks in sequence is complete once the block's own
backward nodes have run (and, for a checkpointed block, its recomputation). Recomputation runs
the block's forward without `__call__`, so it fires no forward hook.

Example:
    >>> segments = BlockSegments(model, ["h.0", "h.1"])
    >>> training_step(model, sample)
    >>> segments.take()
    {'h.0': (28.7, 30.5), 'h.1': (28.4, 30.6)}
    >>> segments.remove()
"""
from __future__ import annotations

import time
from typing import Any


def _first_tensor(value: Any):
    """The first tensor in a (nested) tuple, list or dict, or None."""
    import torch

    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        if (found := _first_tensor(item)) is not None:
            return found
    return None


class BlockSegments:
    """Hooks on `module`'s submodules `names` that time each one's forward and backward (ms)
    in the steps that follow; `take()` returns the last step's and starts over."""

    def __init__(self, module, names: list[str]):
        self.names = list(names)
        self.marks: dict[tuple[str, str], float] = {}
        self.handles = []
        for name in self.names:
            block = module.get_submodule(name)
            self.handles.append(block.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._post(name), with_kwargs=True))

    def _mark(self, name: str, event: str) -> None:
        self.marks[name, event] = time.perf_counter()

    def _on_grad(self, name: str, event: str):
        def hook(grad):
            self._mark(name, event)
        return hook

    def _pre(self, name: str):
        def hook(block, args, kwargs):
            self._mark(name, "forward starts")
            tensor = _first_tensor((args, kwargs))
            if tensor is not None and tensor.requires_grad:
                tensor.register_hook(self._on_grad(name, "backward ends"))
        return hook

    def _post(self, name: str):
        def hook(block, args, kwargs, output):
            self._mark(name, "forward ends")
            tensor = _first_tensor(output)
            if tensor is not None and tensor.requires_grad:
                tensor.register_hook(self._on_grad(name, "backward starts"))
        return hook

    def take(self) -> dict[str, tuple[float, float | None]]:
        """Per block, the last step's (forward, backward) in ms; backward None where the
        block's input needs no gradient (nothing marks its end)."""
        def between(name: str, start: str, end: str) -> float | None:
            if (name, start) not in self.marks or (name, end) not in self.marks:
                return None
            return 1000 * (self.marks[name, end] - self.marks[name, start])

        found = {}
        for name in self.names:
            forward = between(name, "forward starts", "forward ends")
            if forward is None:
                raise RuntimeError(f"{name} did not run in the step")
            found[name] = (forward, between(name, "backward starts", "backward ends"))
        self.marks.clear()
        return found

    def clear(self) -> None:
        """Forget what was marked so far (steps not to be read)."""
        self.marks.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
