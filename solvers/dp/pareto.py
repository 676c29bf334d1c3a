"""Pareto fronts of (bytes kept, recompute ms) for the dp solver (`solvers.dp`): one front
per frontier set at a boundary, the merge of shifted front slices into a new front, and the
merge of frontier sets where there are too many (`weaken_states`).

Example:
    >>> start = Front.start()
    >>> front = merge_fronts([(start, 0, 1, 0, 5.0, None), (start, 0, 1, 8, 1.0, (0, 3, ()))], math.inf, False)
    >>> merge_fronts([(front, 0, 2, 4, 0.5, None)], cost_limit=10.0, feasibility_only=False).helds
    [4, 12]
    >>> front.entry(1).regions()
    (range(0, 3),)
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

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
    """The Pareto front of one frontier set: held bytes ascending, cost strictly descending (as
    lists, which the search bisects, and as arrays, which `merge_fronts` slices). Each point
    remembers the stair it came from (`sources[source_of[i]]`: its front and region) and its
    position in that front (`positions`); `entry(i)` turns a point into an `Entry`, its plan, on
    demand (a deep model's search makes millions of points and reads a handful of plans)."""

    __slots__ = ("helds", "negative_costs", "held_array", "cost_array", "sources", "source_of", "positions")

    def __init__(self, held_array: np.ndarray, cost_array: np.ndarray,
                 sources: list["Stair"], source_of: np.ndarray, positions: np.ndarray):
        self.held_array = held_array
        self.cost_array = cost_array
        self.helds: list[int] = held_array.tolist()
        self.negative_costs: list[float] = (-cost_array).tolist()  # ascending
        self.sources = sources
        self.source_of = source_of
        self.positions = positions

    @classmethod
    def start(cls) -> "Front":
        """The front before any node: nothing held, nothing recomputed."""
        nowhere = np.zeros(1, dtype=np.int64)
        return cls(nowhere, np.zeros(1), [(None, 0, 1, 0, 0.0, None)], nowhere, nowhere)

    @classmethod
    def empty(cls) -> "Front":
        """A front without points."""
        nothing = np.zeros(0, dtype=np.int64)
        return cls(nothing, np.zeros(0), [], nothing, nothing)

    def __len__(self) -> int:
        return len(self.helds)

    def cost(self, i: int) -> float:
        """The recompute ms of point i."""
        return -self.negative_costs[i]

    def entry(self, i: int) -> Entry:
        """Point i as an `Entry`, its parents made with it."""
        chain = []
        front: Front | None = self
        while front is not None:
            chain.append((front, i))
            source = front.source_of[i]
            front, i = front.sources[source][0], int(front.positions[i])  # type: ignore[assignment]
        made: Entry | None = None
        for front, i in reversed(chain):
            made = Entry(front.helds[i], front.cost(i), made, front.sources[front.source_of[i]][5])
        assert made is not None
        return made


# A transition applied to a slice of a front: (front, lo, hi, added held, added ms, region).
Stair = tuple[Front, int, int, int, float, "Region | None"]


# Merges of at most SMALL_MERGE entries, or of slices of SLICE_ENTRIES entries or fewer on
# average, sort them as Python tuples: numpy's fixed cost per call and per slice outweighs its
# speed there (wide DAGs merge tens of thousands of fronts of one or two entries).
SMALL_MERGE = 128
SLICE_ENTRIES = 4


def merge_fronts(stairs: list[Stair], cost_limit: float, feasibility_only: bool, bucket_bytes: int = 0,
                 held_limit: float = math.inf) -> Front:
    """Pareto front of the union of shifted front slices: the entries cheaper than `cost_limit`,
    holding at most `held_limit` bytes, that are cheaper than every lighter one; of entries
    alike in held bytes and cost, the one from the earliest stair. `feasibility_only`: the
    lightest of them alone. With `bucket_bytes`, only the cheapest entry per held-bytes bucket
    survives (a thinner front: fewer options, never a wrong one).

    The entries are sorted by held bytes at once and the survivors read off a running minimum of
    cost (with numpy past `SMALL_MERGE` entries in longer slices): a deep model's merges see many
    entries for each one that survives.

    Example:
        >>> front = merge_fronts([(Front.start(), 0, 1, 0, 5.0, None), (Front.start(), 0, 1, 8, 1.0, None)], 9.0, False)
        >>> merge_fronts([(front, 0, 2, 4, 0.5, None)], cost_limit=10.0, feasibility_only=False).helds
        [4, 12]
    """
    entries = sum(hi - lo for _, lo, hi, *_ in stairs)
    if entries <= SMALL_MERGE or entries <= SLICE_ENTRIES * len(stairs):
        return _merged_small(stairs, cost_limit, feasibility_only, bucket_bytes, held_limit)
    taken = [(index, lo, hi) for index, (_, lo, hi, *_) in enumerate(stairs) if lo < hi]
    indexes, firsts, ends = zip(*taken)
    lengths = np.subtract(ends, firsts)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    all_helds = (np.concatenate([stairs[i][0].held_array[lo:hi] for i, lo, hi in taken])
                 + np.repeat(np.array([stairs[i][3] for i in indexes], dtype=np.int64), lengths))
    all_costs = (np.concatenate([stairs[i][0].cost_array[lo:hi] for i, lo, hi in taken])
                 + np.repeat(np.array([stairs[i][4] for i in indexes], dtype=np.float64), lengths))
    order = np.argsort(all_helds, kind="stable")  # ties: stair order, as concatenated
    ordered_costs = all_costs[order]
    below = np.empty_like(ordered_costs)  # what an entry must cost less than: every lighter one
    below[0] = cost_limit
    np.minimum(np.minimum.accumulate(ordered_costs)[:-1], cost_limit, out=below[1:])
    chosen = _last_of_runs(order[ordered_costs < below], all_helds)  # same held: the cheapest
    chosen = chosen[all_helds[chosen] <= held_limit]  # (heavier entries come last: they lower no cost before)
    if feasibility_only:
        chosen = chosen[:1]
    elif bucket_bytes:
        chosen = _last_of_runs(chosen, all_helds // bucket_bytes)
    slices = np.searchsorted(starts, chosen, side="right") - 1
    used, source_of = np.unique(np.array(indexes)[slices], return_inverse=True)
    return Front(all_helds[chosen], all_costs[chosen], [stairs[i] for i in used.tolist()], source_of,
                 np.array(firsts)[slices] + chosen - starts[slices])


def _merged_small(stairs: list[Stair], cost_limit: float, feasibility_only: bool, bucket_bytes: int,
                  held_limit: float) -> Front:
    """`merge_fronts` of a few entries, or of slices of one or two: (held, cost, stair, position)
    tuples, sorted."""
    points = []
    for index, (front, lo, hi, held, cost, _) in enumerate(stairs):
        if hi - lo == 1:
            points.append((front.helds[lo] + held, cost - front.negative_costs[lo], index, lo))
        elif lo < hi:
            helds, negative_costs = front.helds, front.negative_costs
            points.extend((helds[p] + held, cost - negative_costs[p], index, p) for p in range(lo, hi))
    points.sort()
    survivors: list[tuple[int, float, int, int]] = []
    best = cost_limit
    for point in points:
        if point[0] > held_limit:
            break
        if point[1] < best:
            if bucket_bytes and survivors and survivors[-1][0] // bucket_bytes == point[0] // bucket_bytes:
                survivors[-1] = point
            else:
                survivors.append(point)
            best = point[1]
            if feasibility_only:
                break
    used = sorted({p[2] for p in survivors})  # (a front keeps the stairs its points came from, no more)
    source_of = {index: k for k, index in enumerate(used)}
    return Front(np.array([p[0] for p in survivors], dtype=np.int64), np.array([p[1] for p in survivors]),
                 [stairs[i] for i in used], np.array([source_of[p[2]] for p in survivors], dtype=np.int64),
                 np.array([p[3] for p in survivors], dtype=np.int64))


def _last_of_runs(chosen: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The last of each run of `chosen` (indices) alike in `keys[chosen]`."""
    if len(chosen) < 2:
        return chosen
    values = keys[chosen]
    last = np.ones(len(chosen), dtype=bool)
    last[:-1] = values[1:] != values[:-1]
    return chosen[last]


def weaken_states(states: dict[int, list[Stair]], max_states: int,
                  mask_bytes: Callable[[int], int]) -> dict[int, list[Stair]]:
    """Keep the `max_states - 1` frontier sets (bit sets of outputs, `mask_bytes` of them
    kept) with the cheapest entries; merge the others into their common subset, counting the
    members they drop as kept bytes (an over-estimate of memory, so merged plans still fit).

    Example:
        >>> weaken_states(states, 64, search.mask_bytes)
    """

    def rank(key: int) -> tuple[float, int, int]:
        cheapest = min(cost - front.negative_costs[hi - 1] for front, _, hi, _, cost, _ in states[key])
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


__all__ = ["Entry", "Front", "Region", "SLICE_ENTRIES", "SMALL_MERGE", "Stair", "merge_fronts", "weaken_states"]
