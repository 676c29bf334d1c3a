"""Parts of the CP-SAT model of `solvers.ilp.model`: the tables of the regions it may choose,
the cost terms of its objective (recomputation, selective policies, runs' recording), the RNG
states regions keep, and the triangle cuts.

Example:
    >>> terms = recompute_terms(model, problem, member, in_region, costs, stop_costs, {})
    >>> model.minimize(sum(cost * var for cost, var in terms))
"""
from __future__ import annotations

import math
from typing import Any

from solvers.ilp.keep import kept_of
from solvers.problem import Problem
from solvers.region_scan import scan_regions
from solvers.structure import Structure


def region_tables(
    problem: Problem,
    structure: Structure,
    limit: int,
    max_region_nodes: int | None = None,
    long_starts: frozenset[int] = frozenset(),
) -> tuple[list[dict[int, int]], list[dict[int, int]]]:
    """RL(a, i) and W(a, e) (see `solvers.ilp.model`) for the regions that can be part of a
    plan under `limit` live bytes (and of at most `max_region_nodes` nodes, except regions
    that start in `long_starts`); W where the region [a, e] holds a saving node and fits its
    recomputation (which runs at its last saving node) keeping nothing. Node i can be in a
    region starting at a only if its backward fits with just the region's inputs held (they
    are kept until the region's backward ends), and, where a region from a reaching i's next
    saving node recomputes its tensors first, with those too; then so can every node between
    a and i. Keeping nodes never lowers a backward step, so dropping these is exact (and
    tightens the LP).

    Example:
        >>> backward, recompute = region_tables(problem, Structure.of(problem), live_budget)
        >>> 0 in backward[0]  # a region from node 0 may hold node 0
        True
    """
    n = structure.n
    out = structure.output_bytes
    saver = structure.saves_for_backward
    backward: list[dict[int, int]] = [{} for _ in range(n)]
    recompute: list[dict[int, int]] = [{} for _ in range(n)]
    for a in range(n):
        if not structure.useful_start[a]:
            continue
        inputs: set[int] = set()
        inputs_bytes = 0
        last_stop = problem.last_region_stop(a)
        blocked = False  # a node since the last saver cannot hold its tensors: no later saver fits
        last_saver = -1
        # Regions that are runs replay their calls and hold less (`scan_regions`'s `replayed`).
        replays = scan_regions(structure, problem, a, replayed=True) if problem.run_spans else None
        for e, region_backward, region_recompute in scan_regions(structure, problem, a):
            if replays is not None:
                replay_recompute = next(replays)[2]
                if problem.run_span_of(range(a, e + 1)) is not None:
                    region_recompute = replay_recompute
            if max_region_nodes is not None and e - a >= max_region_nodes and a not in long_starts:
                break
            if e >= last_stop:  # no allowed region from a reaches e
                break
            # (where runs may be chosen, only what e reads: a run's tape keeps no more, so no
            # region from a that holds less is cut)
            for j in structure.reads_before[e] if problem.run_spans else structure.uses_before[e]:
                if j < a and j not in inputs:
                    inputs.add(j)
                    inputs_bytes += out[j]
            if structure.gradient_backward[e] + inputs_bytes > limit or (saver[e] and blocked):
                break
            full = region_backward + structure.gradient_backward[e] + inputs_bytes > limit
            if saver[e] and full:
                break
            blocked = blocked or full
            backward[e][a] = region_backward
            if saver[e]:
                last_saver = e
            at = structure.gradient_recompute[last_saver + 1]
            if last_saver >= 0 and region_recompute + at + inputs_bytes <= limit:
                recompute[e][a] = region_recompute
    return backward, recompute


def objective_scale(problem: Problem, keeps: bool) -> float:
    """The power of two that scales times in ms to the model's integer costs: the largest that
    keeps the objective under 2^40 (each node's time, its region's fixed costs and, where
    regions may keep, the selective policy's per region and per call, twice; where runs may be
    chosen, a run's recording)."""
    n = len(problem.nodes)
    largest = max([node.compute_ms for node in problem.nodes] + [problem.region_overhead_ms, 1e-12]
                  + [node.saved_tensors * problem.saved_tensor_ms for node in problem.nodes])
    terms_per_node = 3
    if problem.run_spans:  # a run's recording: once per region, at most the whole graph's calls
        calls = sum(node.aten_calls for node in problem.nodes)
        largest = max(largest, abs(problem.run_region_ms) + (problem.run_call_ms + problem.recorded_call_ms) * calls)
        terms_per_node += 1
    if keeps and (problem.keep_region_ms or problem.keep_call_ms or problem.kept_node_ms):
        most_calls = max(node.aten_calls for node in problem.nodes)
        largest = max(largest, problem.keep_region_ms, 2 * most_calls * problem.keep_call_ms, problem.kept_node_ms)
        terms_per_node = 6
    return 2.0 ** math.floor(math.log2((2**40 / max(1, terms_per_node * n)) / largest))


def recompute_terms(model: Any, problem: Problem, member: list[dict[int, Any]], in_region: list[Any],
                    costs: list[int], stop_costs: list[int],
                    keep: dict[int, dict[int, Any]]) -> list[tuple[int, Any]]:
    """(scaled cost, 0/1 expression) terms whose sum is what recomputation costs
    (`Problem.region_recompute_ms`). Recomputation reaches a saving node whenever it is in a
    region, and another node where its region goes on to a saving node; a reached saving node
    costs its `stop_costs` and, where its region goes on past it, the rest of its time; a kept
    node (`keep`, see solvers.ilp.keep) costs nothing. The variables are bounded below only:
    the objective pushes them down."""
    n = len(problem.nodes)
    reached: list[Any] = [0] * (n + 1)
    terms: list[tuple[int, Any]] = []

    def unless_kept(i: int, recomputed: Any) -> Any:
        """1 iff node i is recomputed and not kept: a variable of its own where it may be kept,
        so that every objective coefficient stays positive (the LP's objective then has no
        cancelling terms, which cost it its exact 0 on plans that recompute nothing)."""
        if i not in keep:
            return recomputed
        paid = model.new_bool_var(f"recomputed_not_kept_{i}")
        model.add(paid >= recomputed - kept_of(keep, i))
        return paid

    for i in reversed(range(n)):
        if not member[i]:
            continue
        goes_on = None if isinstance(reached[i + 1], int) else reached[i + 1] - member[i + 1].get(i + 1, 0)
        if problem.nodes[i].saves_for_backward:
            reached[i] = in_region[i]
            terms.append((stop_costs[i], unless_kept(i, in_region[i])))
            if goes_on is not None and costs[i] > stop_costs[i]:
                past = model.new_bool_var(f"recomputed_past_{i}")
                model.add(past >= goes_on - kept_of(keep, i))
                terms.append((costs[i] - stop_costs[i], past))
        elif goes_on is not None:
            reached[i] = model.new_bool_var(f"recomputed_{i}")
            model.add(reached[i] >= goes_on)
            terms.append((costs[i], unless_kept(i, reached[i])))
    return terms


def selective_terms(model: Any, member: list[dict[int, Any]], in_region: list[Any], keep: dict[int, dict[int, Any]],
                    region_cost: int, call_costs: list[int]) -> list[tuple[int, Any]]:
    """(scaled cost, 0/1 variable) terms whose sum is what the selective-checkpoint policies of
    the regions that keep cost (`Problem.selective_ms`): `region_cost` per such region, and
    `call_costs[k]` for each node k in one and again where it recomputes k.

    `keeps[s]`: the region whose last saving node is s keeps (at least each keep[j][s]);
    `recomputing[k]`: k is recomputed by a region that keeps (from s down to its start, where
    a region starts); `inside[k]`: k is in a region that keeps (those, and on up while the
    next node shares k's region). Bounded below only: the objective pushes them down."""
    if not keep or not (region_cost or any(call_costs)):
        return []
    n = len(member)
    terms: list[tuple[int, Any]] = []
    keeps: dict[int, Any] = {}
    for s in sorted({s for row in keep.values() for s in row}):
        keeps[s] = model.new_bool_var(f"keeps_{s}")
        for row in keep.values():
            if s in row:
                model.add(keeps[s] >= row[s])
        if region_cost:
            terms.append((region_cost, keeps[s]))
    if not any(call_costs):
        return terms
    first = min(min(member[j]) for j in keep)
    recomputing: dict[int, Any] = {}
    for k in reversed(range(first, max(keeps) + 1)):
        lower = [keeps[k]] if k in keeps else []
        if k + 1 in recomputing:
            lower.append(recomputing[k + 1] - member[k + 1].get(k + 1, 0))
        if member[k] and lower:
            recomputing[k] = model.new_bool_var(f"selective_recomputing_{k}")
            for bound in lower:
                model.add(recomputing[k] >= bound)
    inside: dict[int, Any] = {}
    for k in range(first, n):
        lower = [recomputing[k]] if k in recomputing else []
        if k - 1 in inside:  # k shares k - 1's region iff k is in one that starts before k
            lower.append(inside[k - 1] + in_region[k] - member[k].get(k, 0) - 1)
        if member[k] and lower:
            inside[k] = model.new_bool_var(f"selective_inside_{k}")
            for bound in lower:
                model.add(inside[k] >= bound)
    for k, cost in enumerate(call_costs):
        if cost:
            terms += [(cost, found[k]) for found in (inside, recomputing) if k in found]
    return terms


def run_terms(model: Any, problem: Problem, member: list[dict[int, Any]],
              scale: float) -> tuple[list[tuple[int, Any]], dict[int, int]]:
    """(scaled cost, 0/1 variable) terms whose sum, with each region start's share, is what
    recording the plan's runs inside submodule calls costs (`Problem.run_ms`), and per start the
    share its region pays on `member[a][a]` (at most 0; added to checkpoint's cost per region).

    A run's cost can be below 0 (`Problem.run_region_ms`, down to minus checkpoint's cost per
    call), so each start pays the least of its runs' costs, and each region [a, e] from it what
    it costs beyond that, on a variable `ends` at least "node e is in the region from a and node
    e + 1 is not": every coefficient of the objective stays at least 0, which lets CP-SAT read
    its lower bound (dp's cost, `bound_by_optimum`) off the objective at once."""
    if not problem.run_spans:
        return [], {}
    n = len(member)
    regions: dict[tuple[int, int], int] = {}  # (a, e) -> scaled run cost (0: an allowed region)
    for e in range(n):
        for a in member[e]:
            if problem.allows_region(a, e + 1):
                regions[a, e] = round(problem.run_ms(range(a, e + 1)) * scale)
    shares: dict[int, int] = {}
    for (a, _), cost in regions.items():
        shares[a] = min(shares.get(a, 0), cost)
    terms: list[tuple[int, Any]] = []
    for (a, e), cost in sorted(regions.items()):
        extra = cost - shares[a]
        if extra:
            ends = model.new_bool_var(f"run_cost_{a}_{e}")
            model.add(ends >= member[e][a] - (member[e + 1].get(a, 0) if e + 1 < n else 0))
            terms.append((extra, ends))
    return terms, {a: share for a, share in shares.items() if share}


def rng_states(problem: Problem, member: list[dict[int, Any]], unit: int) -> list[Any]:
    """Per node t, rng_state_bytes (in `unit`s) times the number of regions that start at or before t and
    draw random numbers: each keeps an RNG state from the forward of its start to the backward
    of its start. A region starting at a is random iff it holds the first random node >= a."""
    n = len(problem.nodes)
    if not problem.rng_state_bytes:
        return [0] * n
    first_random: list[int | None] = [None] * (n + 1)
    for a in reversed(range(n)):
        first_random[a] = a if problem.nodes[a].random else first_random[a + 1]
    states: list[Any] = []
    running: Any = 0
    for t in range(n):
        r = first_random[t]
        if r is not None and t in member[r]:
            running = running + problem.rng_state_bytes // unit * member[r][t]
        states.append(running)
    return states


def add_triangle_cuts(model: Any, structure: Structure, held: Any, same_region: Any) -> None:
    """Valid inequalities that the LP relaxation misses, one per triangle u -> v -> w with
    u -> w in the graph (read edges: a run keeps no input it is only passed), where each node
    saves its own output (as in the literature graphs).

    An output freed before the backward of w (`1 - held(u, w)`) needs its node in a region
    (its own saver would keep it otherwise) and each consumer up to w outside regions or in
    the same region (a later region reading it would keep it). So two nodes of the triangle can
    both be freed only if they share a region, and
    `sum of freed over {u, v, w} <= 1 + same(u, v) + same(v, w)` (u and w share a region
    only if v does too). A node a region keeps is freed later, never earlier: still valid.
    The LP meets it with halves (two regions at one half each free three halves); the cuts
    raise the LP bound towards the optimum and steer it to the optimum's long regions."""
    for u in range(structure.n):
        if u not in structure.savers[u]:
            continue
        for v in structure.readers[u]:
            if v not in structure.savers[v]:
                continue
            for w in structure.readers[v]:
                if w not in structure.savers[w] or w not in structure.readers[u]:
                    continue
                freed = 3 - held(u, w) - held(v, w) - held(w, w)
                model.add(freed <= 1 + same_region(u, v) + same_region(v, w))


__all__ = ["add_triangle_cuts", "objective_scale", "recompute_terms", "region_tables", "rng_states", "run_terms",
           "selective_terms"]
