"""`solvers.dp.pareto.merge_fronts` against the definition: of every shifted entry of every slice
under the limits, in order of held bytes, then cost, then stair, those cheaper than all before
them; thinned per bucket, or the first alone."""
import math
import random

import numpy as np
import pytest

from solvers.dp import pareto
from solvers.dp.pareto import Front, merge_fronts


def random_front(rng: random.Random, size: int, name: int) -> Front:
    """A front of up to `size` points, each its own root: its region (name, position, ()) names it."""
    helds = sorted(rng.sample(range(0, 60), size))
    costs = sorted((rng.choice([0.5, 1.0, 1.5, 2.0, 3.25]) * rng.randint(1, 12) for _ in range(size)), reverse=True)
    points, last = [], math.inf
    for held, cost in zip(helds, costs):
        if cost < last:  # a front: cost strictly descending
            points.append((held, cost))
            last = cost
    count = len(points)
    roots = [(None, 0, 0, 0, 0.0, (name, p, ())) for p in range(count)]
    return Front(np.array([h for h, _ in points], dtype=np.int64), np.array([c for _, c in points]), roots,
                 np.arange(count), np.zeros(count, dtype=np.int64))


def by_definition(stairs, cost_limit, feasibility_only, bucket_bytes=0, held_limit=math.inf):
    points = []
    for index, (front, lo, hi, held, cost, region) in enumerate(stairs):
        for position in range(lo, hi):
            if front.helds[position] + held <= held_limit:
                points.append((front.helds[position] + held, front.cost(position) + cost, index,
                               front.sources[position][5], region))
    points.sort(key=lambda p: p[:3])
    survivors, best = [], cost_limit
    for held, cost, _, parent, region in points:
        if cost < best:
            if bucket_bytes and survivors and survivors[-1][0] // bucket_bytes == held // bucket_bytes:
                survivors[-1] = (held, cost, parent, region)
            else:
                survivors.append((held, cost, parent, region))
            best = cost
            if feasibility_only:
                break
    return survivors


@pytest.mark.parametrize("small_merge, slice_entries", [(0, 0), (10**6, 10**6)], ids=["numpy", "tuples"])
@pytest.mark.parametrize("seed", range(300))
def test_merge_fronts_is_the_pareto_front_of_its_stairs(seed, small_merge, slice_entries, monkeypatch):
    monkeypatch.setattr(pareto, "SMALL_MERGE", small_merge)
    monkeypatch.setattr(pareto, "SLICE_ENTRIES", slice_entries)
    rng = random.Random(seed)
    fronts = [random_front(rng, rng.randint(1, 12), name) for name in range(rng.randint(1, 4))]
    stairs = []
    for k in range(rng.randint(1, 6)):
        front = rng.choice(fronts)
        lo = rng.randint(0, len(front))
        hi = rng.randint(lo, len(front))
        stairs.append((front, lo, hi, rng.choice([0, 0, 3, 8, 16]), rng.choice([0.0, 0.5, 1.0, 2.25]), (k, k + 1, ())))
    cost_limit = rng.choice([math.inf, 20.0, 8.0, 3.0])
    held_limit = rng.choice([math.inf, 70, 40])
    feasibility_only = rng.random() < 0.2
    bucket_bytes = rng.choice([0, 0, 4, 16])
    merged = merge_fronts(stairs, cost_limit, feasibility_only, bucket_bytes, held_limit)
    expected = by_definition(stairs, cost_limit, feasibility_only, bucket_bytes, held_limit)
    entries = [merged.entry(i) for i in range(len(merged))]
    got = [(e.held, e.cost, e.parent.region, e.region) for e in entries]
    assert got == expected  # the same points, from the same parents, by the same regions
    assert merged.helds == [h for h, *_ in expected]
    assert merged.negative_costs == [-c for _, c, *_ in expected]


def test_a_point_at_the_end_of_a_long_search_gives_its_whole_plan():
    # (a chain of 5000 boundaries, each passed by a region: deeper than Python's recursion limit)
    front = Front.start()
    for t in range(5000):
        front = merge_fronts([(front, 0, 1, 1, 0.5, (t, t + 1, ()))], math.inf, False)
    entry = front.entry(0)
    assert entry.regions() == tuple(range(t, t + 1) for t in range(5000))
    assert (entry.held, entry.cost) == (5000, 2500.0)
