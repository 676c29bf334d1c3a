"""The fixed cost of one checkpoint call, measured on the plan's device.

Each region runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`, which costs
work beyond recomputing its nodes: saved-tensor hooks and their holders, the recompute
dispatch, a copy of the RNG state where the region draws random numbers. Plans of many small
regions pay it many times, so the solvers add it per region (`Problem.region_overhead_ms`).

It is measured as the step-time difference of a tiny module run with and without checkpoint
(its recomputation is a few microseconds and is subtracted), in alternating rounds, median.

Example:
    >>> checkpoint_overhead_ms(torch.device("cpu"))
    0.05
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_WIDTH = 8  # the tiny module: recomputation is negligible next to checkpoint's own work
_CALLS = 50  # checkpoint calls per timed step
_ROUNDS = 7


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(_WIDTH, _WIDTH)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.tanh(self.linear(x)))


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    def run(step: Callable[[], None]) -> float:
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        started = time.perf_counter()
        step()
        return (time.perf_counter() - started) * 1000

    return run


def checkpoint_overhead_ms(device: torch.device) -> float:
    """Milliseconds one checkpoint call adds to a training step on `device`, beyond the
    recomputed forward (RNG state preserved, as for a region with dropout; at least 0).

    Example:
        >>> checkpoint_overhead_ms(torch.device("cpu")) > 0
        True
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        return _measure(device)


def _measure(device: torch.device) -> float:
    module = _Tiny().to(device)
    x = torch.randn(4, _WIDTH, device=device, requires_grad=True)

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

    timed = _timer(device)
    samples: dict[str, list[float]] = {"plain": [], "checkpointed": [], "forward": []}
    for step in (plain, checkpointed, forward_only):  # warm-up
        step()
    for _ in range(_ROUNDS):
        for name, step in (("plain", plain), ("checkpointed", checkpointed), ("forward", forward_only)):
            samples[name].append(timed(step))
    extra = statistics.median(samples["checkpointed"]) - statistics.median(samples["plain"])
    return max(0.0, (extra - statistics.median(samples["forward"])) / _CALLS)


__all__ = ["checkpoint_overhead_ms"]
