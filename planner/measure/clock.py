"""Timing a call on a device: CUDA events on a GPU, the wall clock on the CPU; and timing
several calls in alternating rounds, whose paired differences cancel the machine's drift.

A node is timed for what its recomputation adds to a step. On a GPU that is its kernels' time
alone: recomputation runs inside backward, whose queue of kernels hides the host's launch work,
and node times that count the launch work predict far more overhead than plans cost.
`elapsed_ms(..., ahead_ms=...)` times that: a spinning kernel holds the GPU busy while the host
launches the call, so the events around it see the kernels alone.

A machine's speed can change within seconds, so calls are compared in rounds, never one median
against another. `benchmarks/compare.py` measures every configuration against one baseline (the
unplanned step) and times each between two runs of it (`sandwiched_rounds`): a difference of
steps several places apart in a round carries far more of the drift than one against the two
neighbouring steps. The planner's own step readings (`planner.costs.step`) keep paired rounds
(`timed_rounds`): sandwiched rounds make planning much longer without making its readings
narrow enough to matter, and a GPU's steps hardly drift. Paired rounds read each step against
the unplanned ones before and after it, interpolated (`paired_differences`), for one unplanned
step more. A reading replaces the price the figures so far give it only where its interval at
`READING_LEVEL` falls clear of that price (`reading_or_price`).

Example:
    >>> elapsed_ms(torch.device("cpu"), lambda: model(x))
    3.1
    >>> times = timed_rounds(torch.device("cpu"), {"plain": plain, "checkpointed": checkpointed}, 15)
    >>> paired_difference(times, "checkpointed", "plain")
    0.42
"""
from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from typing import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

AHEAD_MS = 1.0  # GPU work queued ahead of a timed node: more than the host's launch of most nodes


def elapsed_ms(device: torch.device, call: Callable[[], object], ahead_ms: float = 0.0) -> float:
    """Milliseconds `call()` takes on `device` (on CUDA, between events around it, after a
    synchronisation). With `ahead_ms` on CUDA, about that much GPU time is queued before it
    (`queue_ahead`), so that the events time its kernels and not the host's launch work,
    provided launching them takes the host less than `ahead_ms`.

    Example:
        >>> elapsed_ms(torch.device("cpu"), lambda: torch.randn(256, 256) @ torch.randn(256, 256))
        0.4
    """
    if device.type == "cuda":
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        if ahead_ms > 0:
            queue_ahead(device, ahead_ms)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def ahead_for(launch_ms: float) -> float:
    """Milliseconds of GPU work to queue ahead of a call whose launch took the host
    `launch_ms`: twice that, and at least `AHEAD_MS`.

    Example:
        >>> ahead_for(0.2)
        1.0
    """
    return max(AHEAD_MS, 2 * launch_ms)


def launch_ms(call: Callable[[], object]) -> float:
    """Milliseconds the host takes to return from `call()` (on CUDA, to launch its kernels).

    Example:
        >>> launch_ms(lambda: model(x))
        0.3
    """
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def queue_ahead(device: torch.device, ms: float) -> None:
    """Queue a kernel that keeps the CUDA GPU `device` busy for about `ms` ms: the host then
    launches what follows while the GPU is still busy, as it does inside backward.

    Example:
        >>> queue_ahead(torch.device("cuda"), 1.0); start.record(); node(); end.record()
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda._sleep(max(1, int(ms * _sleep_cycles_per_ms(index))))


@functools.lru_cache(maxsize=None)
def _sleep_cycles_per_ms(index: int) -> float:
    """The GPU's clock as `torch.cuda._sleep` counts it, measured once per device."""
    device = torch.device("cuda", index)
    cycles = 2_000_000
    with torch.cuda.device(index):
        torch.cuda._sleep(cycles)  # raises the clock from idle before the reading
        ms = min(elapsed_ms(device, lambda: torch.cuda._sleep(cycles)) for _ in range(3))
    return cycles / max(ms, 1e-3)


def timed_rounds(device: torch.device, calls: dict[str, Callable[[], object]], rounds: int,
                 kernels_only: bool = False, closing: str | None = None) -> dict[str, list[float]]:
    """Each call run once to warm up, then timed in `rounds` rounds, one after another in each:
    its times (ms), round by round. `kernels_only` on CUDA times each call's kernels alone, with
    GPU work queued ahead of it for twice the host's launch time of its warm-up (`elapsed_ms`):
    what a cost measured outside the model's step adds inside backward, whose queue hides the
    host's work. `closing` names a call timed once more after the last round (one time more
    than the others): `paired_differences` then reads the calls after it in a round against
    its runs on either side of them.

    Example:
        >>> timed_rounds(torch.device("cpu"), {"a": step_a, "b": step_b}, 7)["a"]
        [12.1, 11.9, 12.3, 12.0, 12.2, 12.4, 12.0]
    """
    ahead: dict[str, float] = {}
    for name, call in calls.items():
        launched = launch_ms(call)
        if kernels_only and device.type == "cuda":
            ahead[name] = ahead_for(launched)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name].append(elapsed_ms(device, call, ahead.get(name, 0.0)))
    if closing is not None:
        samples[closing].append(elapsed_ms(device, calls[closing], ahead.get(closing, 0.0)))
    return samples


_now = time.perf_counter  # (the clock `timed_until_decided` limits its time by; a test sets it)


def until_decided(run_rounds: Callable[[int], object], first: int, more: int, undecided: Callable[[], bool],
                  max_rounds: int, max_s: float = math.inf) -> int:
    """`run_rounds(first)`, then `run_rounds(more)` while `undecided()`, up to `max_rounds` in
    all, and only where the next batch, at the pace of the rounds so far, ends within `max_s`
    seconds of the start (a limit checked before each batch without counting that batch's own
    time would let a reading overrun it by a whole batch). Returns the rounds run.

    Example:
        >>> until_decided(lambda n: steps.extend(run(n)), 20, 10, lambda: wide(steps), 40, max_s=45.0)
        30
    """
    started = _now()
    run_rounds(first)
    done = first
    while undecided() and done < max_rounds:
        if (_now() - started) * (done + more) / done > max_s:
            break
        run_rounds(more)
        done += more
    return done


def timed_until_decided(device: torch.device, calls: dict[str, Callable[[], object]], first: int, more: int,
                        undecided: Callable[[dict[str, list[float]]], bool], max_rounds: int,
                        max_s: float = math.inf) -> dict[str, list[float]]:
    """`timed_rounds` of `calls` (kernels only) for as many rounds as `until_decided` runs, while
    `undecided(times)`.

    Example:
        >>> times = timed_until_decided(torch.device("cpu"), steps, 40, 20, lambda t: wide(t), 80, max_s=45.0)
    """
    times: dict[str, list[float]] = {name: [] for name in calls}

    def run_rounds(count: int) -> None:
        for name, extra in timed_rounds(device, calls, count, kernels_only=True).items():
            times[name].extend(extra)

    until_decided(run_rounds, first, more, lambda: undecided(times), max_rounds, max_s)
    return times


def sandwiched_rounds(calls: dict[str, Callable[[], float]], baseline: str, rounds: int,
                      after_round: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """Each call of `calls` but `baseline` timed in `rounds` rounds, between two runs of the
    baseline (which neighbouring calls share: B a B b B c B), in an order that turns by one each
    round. Each call returns its own time (ms; e.g. `elapsed_ms`), and each runs once untimed
    first. Returns, per call other than the baseline, its time less the mean of its two
    neighbours', round by round: a difference the machine's speed cannot move unless it changes
    within those three calls. `after_round(index)` runs after each round (e.g. to log it).

    Example:
        >>> differences = sandwiched_rounds({"plain": plain, "checkpointed": ckpt}, "plain", 9)
        >>> statistics.median(differences["checkpointed"])
        0.42
    """
    others = [name for name in calls if name != baseline]
    for call in calls.values():
        call()
    differences: dict[str, list[float]] = {name: [] for name in others}
    for index in range(rounds):
        order = others[index % len(others):] + others[:index % len(others)] if others else []
        before = calls[baseline]()
        for name in order:
            took = calls[name]()
            after = calls[baseline]()
            differences[name].append(took - (before + after) / 2)
            before = after
        if after_round is not None:
            after_round(index)
    return differences


def paired_differences(times: dict[str, list[float]], slower: str, faster: str) -> list[float]:
    """`slower`'s time less `faster`'s, round by round, in `timed_rounds`' order of calls (the
    order of `times`). Where `faster` ran before `slower` in each round and once more after the
    last (`timed_rounds(..., closing=faster)`), `faster`'s time is interpolated between its run
    in that round and in the next, by how many calls `slower` ran after it: a drift of the
    machine's speed within the round cancels too, and the differences spread less than those
    paired within the round alone.

    Example:
        >>> paired_differences({"b": [2.0, 4.0, 6.0, 8.0], "a": [4.0, 6.0, 8.0]}, "a", "b")
        [1.0, 1.0, 1.0]
    """
    ahead, behind = times[slower], times[faster]
    names = list(times)
    places = names.index(slower) - names.index(faster)
    if places <= 0 or len(behind) != len(ahead) + 1:
        return [a - b for a, b in zip(ahead, behind)]
    share = places / len(names)
    return [a - ((1 - share) * b + share * after) for a, b, after in zip(ahead, behind, behind[1:])]


def paired_difference(times: dict[str, list[float]], slower: str, faster: str) -> float:
    """The median over rounds of `slower`'s time less `faster`'s in the same round
    (`paired_differences`): a drift of the machine's speed over the rounds cancels, as it would
    not between two medians.

    Example:
        >>> paired_difference({"a": [3.0, 5.0, 4.0], "b": [2.0, 4.5, 3.0]}, "a", "b")
        1.0
    """
    return statistics.median(paired_differences(times, slower, faster))


def paired_interval(times: dict[str, list[float]], slower: str, faster: str,
                    level: float = 0.95) -> tuple[float, float] | None:
    """A `level` interval for `paired_difference` (`median_interval` of the per-round differences).

    Example:
        >>> paired_interval({"a": [3, 5, 4, 6, 4, 5], "b": [2, 4, 3, 4, 3, 4]}, "a", "b")
        (1, 2)
    """
    return median_interval(paired_differences(times, slower, faster), level)


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """A `level` interval for the median of `values`: the order statistics around it (a
    distribution-free interval for a median: the k-th smallest and largest, k the largest with
    P(Binomial(n, 1/2) < k) <= (1 - level) / 2). None where too few values reach `level` (fewer
    than 6 at 95%, than 9 at `READING_LEVEL`).

    Example:
        >>> median_interval([1, 1, 1, 2, 1, 1])
        (1, 2)
        >>> median_interval([3, 1, 4, 1, 5, 9, 2, 6, 5], READING_LEVEL)  # (all nine values: 99.6%)
        (1, 9)
    """
    ordered = sorted(values)
    n = len(ordered)
    below = 0
    while sum(math.comb(n, i) for i in range(below + 1)) / 2 ** n <= (1 - level) / 2:
        below += 1
    if below == 0:
        return None
    return ordered[below - 1], ordered[n - below]


# The level of the interval a reading must fall clear of to replace its price (`reading_or_price`).
# A planning tests about ten readings (`planner.costs.block`, `planner.costs.step`); at 95% each,
# one planning in three may replace a price on noise alone, and the next planning would not repeat
# it. At 99.5% each, at most one in twenty (Bonferroni: 10 x 0.5%). The 9 rounds of the step
# readings then need all nine differences on one side of the price (their range).
READING_LEVEL = 0.995
_LEVEL = f"{100 * READING_LEVEL:g}%%"
# reading_or_price's log messages; their arguments: what, the reading, its interval (not in the last), the price
READING_STOOD = (f"%s measured %+.2f ms ({_LEVEL}: %+.2f to %+.2f), which cannot be told from the %.2f ms the "
                 "figures so far price it at: those stand")
READING_TAKEN = (f"%s measured %+.2f ms ({_LEVEL}: %+.2f to %+.2f), against %.2f ms priced so far: the reading "
                 "replaces it")
READING_TAKEN_ALONE = "%s measured %+.2f ms (too few rounds for an interval), against %.2f ms priced so far: taken"


def holds(interval: tuple[float, float] | None, price_ms: float) -> bool:
    """Whether a reading's `interval` (at `READING_LEVEL`; None: too few rounds for one) holds
    `price_ms`: its rounds cannot tell the reading from that price.

    Example:
        >>> holds((-30.0, 51.0), 20.0)
        True
    """
    return interval is not None and interval[0] <= price_ms <= interval[1]


def reading_or_price(measured_ms: float, interval: tuple[float, float] | None, price_ms: float, what: str) -> float:
    """`measured_ms`, a cost read off timed rounds (a median of paired differences), or
    `price_ms`, what the figures held so far price it at, where that lies inside the reading's
    `interval` (`paired_interval` at `READING_LEVEL`; None: too few rounds for one): the rounds
    cannot tell the two apart, and a figure read off such a difference is the machine's noise
    (on a busy machine, it can change sign from one planning to the next).

    Example:
        >>> reading_or_price(12.0, (-30.0, 51.0), 20.0, "24 runs")  # the price stands
        20.0
        >>> reading_or_price(31.0, (28.0, 35.0), 20.0, "24 runs")
        31.0
    """
    if holds(interval, price_ms):
        logger.info(READING_STOOD, what, measured_ms, *interval, price_ms)
        return price_ms
    if interval is None:
        logger.info(READING_TAKEN_ALONE, what, measured_ms, price_ms)
    else:
        logger.info(READING_TAKEN, what, measured_ms, *interval, price_ms)
    return measured_ms


__all__ = ["AHEAD_MS", "READING_LEVEL", "READING_STOOD", "READING_TAKEN", "READING_TAKEN_ALONE", "ahead_for",
           "elapsed_ms", "holds", "launch_ms", "median_interval", "paired_difference", "paired_differences",
           "paired_interval", "queue_ahead", "reading_or_price", "sandwiched_rounds", "timed_rounds",
           "timed_until_decided", "until_decided"]
