"""Each block's own forward, backward and recomputation time inside a training step, read off
hooks (`planner.block_price` reads checkpoint's cost per block with them).

A step's time difference between two configurations carries the noise of the whole step; a
block's own segments carry only theirs, and two blocks of one step share the machine's load.
Forward: from the block's forward pre-hook to its forward hook. Backward: from the gradient of
its output (a tensor hook) to the gradient of its input, which for blocks in sequence is
complete once the block's own backward nodes have run (and, for a checkpointed block, its
recomputation). Recomputation: a clock around a checkpointed block's own forward inside
checkpoint (`apply.CheckpointedForward.original`), whose second call in a step is the
recomputation; it runs the forward without `__call__`, so it fires no forward hook. On CUDA
each mark is an event on the stream, so the times are the GPU's, not the host's launches.

Example:
    >>> segments = BlockSegments(model, ["h.0", "h.1"], torch.device("cpu"))
    >>> training_step(model, sample)
    >>> segments.take()
    {'h.0': (28.7, 30.5, None), 'h.1': (28.4, 58.6, 27.9)}
    >>> segments.remove()
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from planner.apply import CheckpointedForward

Mark = Any  # a perf_counter reading (CPU) or a recorded torch.cuda.Event (CUDA)
Segment = tuple[float, float | None, float | None]  # forward, backward, recomputation (ms)


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a (nested) tuple, list or dict, or None.

    Example:
        >>> first_tensor(((), {"x": torch.ones(1)}))
        tensor([1.])
    """
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        if (found := first_tensor(item)) is not None:
            return found
    return None


class BlockSegments:
    """Hooks on `module`'s submodules `names` (each called once per forward) that time each
    one's forward, backward and, where `module` checkpoints it, recomputation (ms) in the steps
    that follow; `take()` returns the last step's and starts over; `remove()` takes the hooks
    off."""

    def __init__(self, module: nn.Module, names: list[str], device: torch.device):
        if len(set(names)) != len(names):
            raise ValueError(f"each block must be named once: {names}")
        self.names = list(names)
        self.cuda = device.type == "cuda"
        self.marks: dict[tuple[str, str], Mark] = {}
        self.recomputed: dict[str, list[tuple[Mark, Mark]]] = {}
        self.handles: list[Any] = []
        self.clocked: dict[str, CheckpointedForward] = {}  # checkpointed blocks, by name
        for name in self.names:
            block = module.get_submodule(name)
            self.handles.append(block.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._post(name), with_kwargs=True))
            forward = block.__dict__.get("forward")
            if isinstance(forward, CheckpointedForward):
                forward.original = self._clocked(name, forward.original)  # (an instance attribute: `remove` drops it)
                self.clocked[name] = forward

    def _now(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _ms(self, start: Mark, end: Mark) -> float:
        return start.elapsed_time(end) if self.cuda else 1000 * (end - start)

    def _mark(self, name: str, event: str) -> None:
        self.marks[name, event] = self._now()

    def _on_grad(self, name: str, event: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._mark(name, event)
        return hook

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(block: nn.Module, args: Any, kwargs: Any) -> None:
            self._mark(name, "forward starts")
            tensor = first_tensor((args, kwargs))
            if tensor is not None and tensor.requires_grad:
                tensor.register_hook(self._on_grad(name, "backward ends"))
        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(block: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            self._mark(name, "forward ends")
            tensor = first_tensor(output)
            if tensor is not None and tensor.requires_grad:
                tensor.register_hook(self._on_grad(name, "backward starts"))
        return hook

    def _clocked(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = self._now()
            try:
                return original(*args, **kwargs)
            finally:  # (recomputation may end by raising at its last saving node)
                self.recomputed.setdefault(name, []).append((started, self._now()))
        return timed

    def take(self) -> dict[str, Segment]:
        """Per block, the last step's (forward, backward, recomputation) in ms: backward None
        where the block's input needs no gradient (nothing marks its end), recomputation None
        where the block is not checkpointed. Raises RuntimeError where a block did not run, or
        a checkpointed one ran other than once and recomputed once.

        Example:
            >>> segments.take()["h.1"]
            (28.4, 58.6, 27.9)
        """
        if self.cuda:
            torch.cuda.synchronize()

        def between(name: str, start: str, end: str) -> float | None:
            if (name, start) not in self.marks or (name, end) not in self.marks:
                return None
            return self._ms(self.marks[name, start], self.marks[name, end])

        found = {}
        for name in self.names:
            forward = between(name, "forward starts", "forward ends")
            if forward is None:
                raise RuntimeError(f"{name} did not run in the step")
            recomputation = None
            if name in self.clocked:
                calls = self.recomputed.get(name, [])
                if len(calls) != 2:
                    raise RuntimeError(f"checkpointed {name} ran its forward {len(calls)} times in the step, "
                                       "not once and once more to recompute")
                recomputation = self._ms(*calls[1])
            found[name] = (forward, between(name, "backward starts", "backward ends"), recomputation)
        self.clear()
        return found

    def clear(self) -> None:
        """Forget what was marked so far (steps not to be read)."""
        self.marks.clear()
        self.recomputed.clear()

    def remove(self) -> None:
        """Take the hooks and clocks off."""
        for handle in self.handles:
            handle.remove()
        for forward in self.clocked.values():
            forward.__dict__.pop("original", None)
        self.handles.clear()
        self.clocked.clear()


__all__ = ["BlockSegments", "Segment", "first_tensor"]
