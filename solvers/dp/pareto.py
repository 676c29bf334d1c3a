"""Pareto fronts of (bytes kept, recompute ms) for the dp solver (`solvers.dp`): one front
per frontier set at a boundary, the merge of shifted front slices into a new front, and the
merge of frontier sets where there are too many (`weaken_states`).

Example:
    >>> front = Front([Entry(0, 5.0, None, None), Entry(8, 1.0, None, None)])
    >>> merge_fronts([(front, 0, 2, 4, 0.5, (0, 3, ()))], cost_limit=10.0, feasibility_only=False).helds
    [4, 12]
"""
from __future__ import annotations

import bisect
import heapq
import math
from typing import Callable

Region = tuple[int, int, tuple[int, ...]]  # start, stop, the nodes it keeps


class Entry:
    """One Pareto point: bytes kept outside the frontier set, recompute ms, and how we got here
    (`region`: the region (start, stop, kept nodes) that led here from `parent`, if any)."""

    __slots__ = ("held", "cost", "parent", "region")

    def __init__(self, held: int, cost: float, parent: "Entry | None", region: Region | None):
        self.held = held
        self.cost = cost
        self.parent = parent
        self.region = region

    def _path(self) -> list[Region]:
        found = []
        entry: Entry | None = self
        while entry is not None:
            if entry.region is not None:
                found.append(entry.region)
            entry = entry.parent
        return list(reversed(found))

    def regions(self) -> tuple[range, ...]:
        """The plan's regions, in order."""
        return tuple(range(start, stop) for start, stop, _ in self._path())

    def kept(self) -> tuple[int, ...]:
        """The nodes the plan's regions keep, in order."""
        return tuple(node for _, _, keep in self._path() for node in keep)


class Front:
    """The Pareto front of one frontier set: held bytes ascending, cost strictly descending."""

    __slots__ = ("entries", "helds", "negative_costs")

    def __init__(self, entries: list[Entry]):
        self.entries = entries
        self.helds = [entry.held for entry in entries]
        self.negative_costs = [-entry.cost for entry in entries]  # ascending


# A transition applied to a slice of a front: (front, lo, hi, added held, added ms, region).
Stair = tuple[Front, int, int, int, float, "Region | None"]


def merge_fronts(stairs: list[Stair], cost_limit: float, feasibility_only: bool, bucket_bytes: int = 0,
                 held_limit: float = math.inf) -> Front:
    """Pareto front of the union of shifted front slices, materialising only the survivors:
    those cheaper than `cost_limit` and holding at most `held_limit` bytes.

    Each slice is itself a staircase, so after taking an entry the next useful one in the same
    slice is found by bisection on cost instead of walking every dominated entry. With
    `bucket_bytes`, only the cheapest entry per held-bytes bucket survives (a thinner front:
    fewer options, never a wrong one)."""
    heap = []
    for index, (front, lo, hi, held, cost, _) in enumerate(stairs):
        if lo < hi:
            heap.append((front.helds[lo] + held, front.entries[lo].cost + cost, index, lo))
    heapq.heapify(heap)
    best = cost_limit
    survivors: list[Entry] = []
    while heap:
        held, cost, index, position = heapq.heappop(heap)
        if held > held_limit:  # (entries come out lightest first: the rest are heavier still)
            break
        front, _, hi, added_held, added_cost, region = stairs[index]
        if cost < best:
            entry = Entry(held, cost, front.entries[position], region)
            if bucket_bytes and survivors and survivors[-1].held // bucket_bytes == held // bucket_bytes:
                survivors[-1] = entry
            else:
                survivors.append(entry)
            best = cost
            if feasibility_only:
                break
        following = bisect.bisect_right(front.negative_costs, added_cost - best, position + 1, hi)
        if following < hi:
            entry = front.entries[following]
            heapq.heappush(heap, (entry.held + added_held, entry.cost + added_cost, index, following))
    return Front(survivors)


def weaken_states(states: dict[int, list[Stair]], max_states: int,
                  mask_bytes: Callable[[int], int]) -> dict[int, list[Stair]]:
    """Keep the `max_states - 1` frontier sets (bit sets of outputs, `mask_bytes` of them
    kept) with the cheapest entries; merge the others into their common subset, counting the
    members they drop as kept bytes (an over-estimate of memory, so merged plans still fit).

    Example:
        >>> weaken_states(states, 64, search.mask_bytes)
    """

    def rank(key: int) -> tuple[float, int, int]:
        cheapest = min(front.entries[hi - 1].cost + cost for front, _, hi, _, cost, _ in states[key])
        lightest = min(front.helds[lo] + held for front, lo, _, held, _, _ in states[key])
        return cheapest, lightest, key

    order = sorted(states, key=rank)
    kept = {key: states[key] for key in order[: max_states - 1]}
    rest = order[max_states - 1 :]
    common = -1
    for key in rest:
        common &= key
    merged = list(kept.get(common, []))
    for key in rest:
        extra = mask_bytes(key) - mask_bytes(common)
        merged.extend((front, lo, hi, held + extra, cost, region) for front, lo, hi, held, cost, region in states[key])
    kept[common] = merged
    return kept


__all__ = ["Entry", "Front", "Region", "Stair", "merge_fronts", "weaken_states"]
