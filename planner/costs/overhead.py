"""The cost of a checkpoint call beyond its recomputation, measured on the plan's device.

Each region runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`, which costs
work beyond recomputing its nodes: a fixed part per call (the recompute dispatch, a copy of the
RNG state where the region draws random numbers) and a part per tensor its nodes save (the
saved-tensor hooks pack each one in forward, recomputation stores it again, backward unpacks
it, so a block that saves a hundred tensors pays that part a hundred times).
The solvers add both per region (`Problem.region_overhead_ms`, `Problem.saved_tensor_ms`).

They are measured as the step-time difference of tiny modules of two depths run with and
without checkpoint (their recomputation is subtracted), in alternating rounds (the median of
paired differences, `planner.measure.clock`); the line through the two gives both figures.
Both are measured once per device and process. On a GPU they are kernel time alone
(`timed_rounds(..., kernels_only=True)`): inside backward the queue of kernels hides
checkpoint's host work, so plans there cost about what their recomputed nodes' kernels alone
predict. What the model's own step pays beyond that, `planner.costs.step` measures there.

A region that keeps nodes runs under a selective-checkpoint policy: a dispatch mode that sees
every ATen call of its forward and of its recomputation. `selective_overhead_ms` measures what
that adds, per region and per call, from tiny modules of two lengths. Where the model runs
here, `planner.costs.block` measures these costs again on one of the model's own blocks, and
`planner.costs.calls` a call's cost on its smallest repeated submodule.

Example:
    >>> checkpoint_overhead_ms(torch.device("cpu"))    # per call, per saved tensor
    (0.14, 0.011)
    >>> selective_overhead_ms(torch.device("cpu"))
    (0.01, 0.012)
"""
from __future__ import annotations

import functools
import statistics
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from planner.apply.policy import keep_contexts
from planner.measure.clock import paired_difference, timed_rounds

_WIDTH = 8  # the tiny module: recomputation is negligible next to checkpoint's own work
_CALLS = 50  # checkpoint calls per timed step
_ROUNDS = 7
# Where a small difference is read off larger steps (checkpoint's cost per saved tensor, the
# policy's cost per call inside a real submodule), more rounds.
FINE_ROUNDS = 15


class _Layers(nn.Module):
    """`depth` tiny linear + tanh layers, then a dropout if `dropout`: saved tensors and ATen
    calls in proportion to depth."""

    def __init__(self, depth: int, dropout: bool = False) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(_WIDTH, _WIDTH), nn.Tanh()) for _ in range(depth)))
        self.dropout = nn.Dropout(0.1) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.layers(x))


def _line(short: tuple[int, float], long: tuple[int, float]) -> tuple[float, float]:
    """The line through two (count, ms) points: (ms at count 0, ms per count), both at least 0."""
    slope = max(0.0, (long[1] - short[1]) / (long[0] - short[0]))
    return max(0.0, short[1] - slope * short[0]), slope


@functools.lru_cache(maxsize=None)  # a property of the device and this process, not of the model
def checkpoint_overhead_ms(device: torch.device) -> tuple[float, float]:
    """Milliseconds one checkpoint call adds to a training step on `device` beyond the
    recomputed forward (RNG state preserved, as for a region with dropout): per call, and per
    tensor saved inside it (both at least 0).

    Example:
        >>> per_call, per_saved_tensor = checkpoint_overhead_ms(torch.device("cpu"))
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        return _line(_measure(device, 1), _measure(device, 12))


def _saved_tensors(module: nn.Module, x: torch.Tensor) -> int:
    """Tensors autograd saves in one forward of `module` with grad on."""
    count = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return count


def _measure(device: torch.device, depth: int) -> tuple[int, float]:
    """(tensors saved per checkpoint call, ms checkpoint adds per call beyond recomputation)."""
    module = _Layers(depth, dropout=True).to(device)
    x = torch.randn(4, _WIDTH, device=device, requires_grad=True)
    saved = _saved_tensors(module, x)

    def plain() -> None:
        h = x
        for _ in range(_CALLS):
            h = module(h)
        h.sum().backward()

    def checkpointed() -> None:
        h = x
        for _ in range(_CALLS):
            h = checkpoint(module, h, use_reentrant=False)
        h.sum().backward()

    def forward_only() -> None:  # what recomputation itself costs
        with torch.no_grad():
            h = x
            for _ in range(_CALLS):
                h = module(h)

    times = timed_rounds(device, {"plain": plain, "checkpointed": checkpointed, "forward": forward_only}, FINE_ROUNDS,
                         kernels_only=True, closing="plain")
    return saved, (paired_difference(times, "checkpointed", "plain") - statistics.median(times["forward"])) / _CALLS


class _CallCounter(TorchDispatchMode):
    """Names the ATen calls dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def selective_contexts():  # type: ignore[no-untyped-def]
    """The contexts of the policy plans apply (`planner.apply.policy.KeepPolicy`), keeping
    nothing: its Python work per call is what a region pays whatever it keeps."""
    return keep_contexts(())


def forward_calls(module: nn.Module, *args: Any, **kwargs: Any) -> list[str]:
    """The ATen calls of one forward of `module` with grad on, as `NodeCost.aten_calls` counts
    them (`planner.measure.holds`: a no-grad forward may dispatch other kernels). A region's
    policy is charged for twice as many per checkpoint call: the forward's and the
    recomputation's."""
    counter = _CallCounter()
    with counter:
        module(*args, **kwargs)
    return counter.names


@functools.lru_cache(maxsize=None)  # a property of the device and this process, not of the model
def selective_overhead_ms(device: torch.device) -> tuple[float, float]:
    """Milliseconds a selective-checkpoint policy adds to a checkpoint call on `device`: per
    region, and per ATen call it sees (forward and recomputation; both at least 0). Measured as
    the step-time difference between plain and selective checkpoint of tiny modules of two
    lengths, in alternating rounds (paired differences); the line through the two gives both
    figures.

    Example:
        >>> per_region, per_call = selective_overhead_ms(torch.device("cpu"))
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        return _line(_measure_selective(device, 1), _measure_selective(device, 6))


def _measure_selective(device: torch.device, depth: int) -> tuple[int, float]:
    """(ATen calls seen per checkpoint call, ms the policy adds per checkpoint call)."""
    module = _Layers(depth).to(device)
    x = torch.randn(4, _WIDTH, device=device, requires_grad=True)
    seen = 2 * len(forward_calls(module, x))

    def step(selective: bool) -> Callable[[], None]:
        def run() -> None:
            h = x
            for _ in range(_CALLS):
                if selective:
                    h = checkpoint(module, h, use_reentrant=False, context_fn=selective_contexts)
                else:
                    h = checkpoint(module, h, use_reentrant=False)
            h.sum().backward()
        return run

    times = timed_rounds(device, {"plain": step(False), "selective": step(True)}, _ROUNDS, kernels_only=True,
                         closing="plain")
    return seen, paired_difference(times, "selective", "plain") / _CALLS


__all__ = ["FINE_ROUNDS", "checkpoint_overhead_ms", "forward_calls", "selective_contexts", "selective_overhead_ms"]
