"""Timing a call on a device: CUDA events on a GPU, the wall clock on the CPU; and timing
several calls in alternating rounds, whose paired differences cancel the machine's drift.

Example:
    >>> elapsed_ms(torch.device("cpu"), lambda: model(x))
    3.1
    >>> times = timed_rounds(torch.device("cpu"), {"plain": plain, "checkpointed": checkpointed}, 15)
    >>> paired_difference(times, "checkpointed", "plain")
    0.42
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def elapsed_ms(device: torch.device, call: Callable[[], object]) -> float:
    """Milliseconds `call()` takes on `device` (on CUDA, between events around it, after a
    synchronisation).

    Example:
        >>> elapsed_ms(torch.device("cpu"), lambda: torch.randn(256, 256) @ torch.randn(256, 256))
        0.4
    """
    if device.type == "cuda":
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def timed_rounds(device: torch.device, calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each call run once to warm up, then timed in `rounds` rounds, one after another in each:
    its times (ms), round by round.

    Example:
        >>> timed_rounds(torch.device("cpu"), {"a": step_a, "b": step_b}, 7)["a"]
        [12.1, 11.9, 12.3, 12.0, 12.2, 12.4, 12.0]
    """
    for call in calls.values():
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name].append(elapsed_ms(device, call))
    return samples


def paired_difference(times: dict[str, list[float]], slower: str, faster: str) -> float:
    """The median over rounds of `slower`'s time less `faster`'s in the same round: a drift of
    the machine's speed over the rounds cancels, as it would not between two medians.

    Example:
        >>> paired_difference({"a": [3.0, 5.0, 4.0], "b": [2.0, 4.5, 3.0]}, "a", "b")
        1.0
    """
    return statistics.median(a - b for a, b in zip(times[slower], times[faster]))


__all__ = ["elapsed_ms", "paired_difference", "timed_rounds"]
