"""An exact model of the simulator's peak for OR-Tools CP-SAT, with per-node decisions.

Decisions, per node i: `member[i][a]` = 1 iff node i is in the region that starts at node a
(for the starts a <= i that could hold i under the budget; at most one is 1, `in_region[i]` is
their sum, and `member[i][a] <= member[i - 1][a]` keeps regions contiguous). `prefix[k, i]`
(k's region starts at or before i) is the running sum of member[k][.]: an order encoding that
makes "k's region starts after j" a linear expression.

Outputs held into backward (see solvers/structure.py): `alive[j][i]` = output j is held at the
backward of node i, for i from j to j's last possible keeper (from there on it is `kept[j]`).
It is monotone in i and bounded below by every keeper: `alive[j][k] >= 1 - in_region[k]` for
a saver k, and `alive[j][i] >= prefix[k, i] - prefix[k, j]` for a consumer k and i in (j, k]
(k's region starts in (j, i], so j is that region's input, held from its start's backward on).
Memory only grows with `alive`, so lower bounds are all the model needs.

Memory: linear constraints, no big-M:

* forward step t: outputs still read (a constant) + kept outputs past their last read + saved
  tensors of earlier nodes outside regions + node t's saved tensors and temporaries;
* backward of i: held outputs + saved tensors of nodes <= i outside regions + gradients in
  flight + sum over a of member[s][a] * RL(a, i), the region's own recomputed tensors, where s
  is the first node >= i that saves a tensor: a region recomputes up to its last such node,
  just before that node's backward (`Problem.recomputed`), so the backward of a node after it
  runs before the recomputation and holds none of them;
* recomputation at a saving node i: what the backward of i holds from earlier nodes +
  gradients in flight then + sum over a of (member[i][a] - member[s'][a]) * W(a, i), the
  region's own recomputation peak, for the regions whose last saving node is i (s' is the next
  saving node after i). Where W(a, i) does not fit, a region from a holding i must reach s'.

Cost: a node's time counts where it is recomputed: `recomputed[i]` is in_region[i] for a
saving node, and for another node at least recomputed[i + 1] unless a region starts at i + 1.

Valid inequalities: on graphs whose nodes save their own outputs (the literature's), two nodes
of a producer-consumer triangle can both have their outputs freed only if they share a region
(`_add_triangle_cuts`); the LP relaxation misses this, and the cuts tighten it.

RL and W come from `solvers.structure.scan_regions`. Starts that cannot hold node i (its
backward would not fit with only the region's inputs held), regions that cannot end at i for
the same reason, and starts at memoryless nodes (`Structure.useful_start`) are left out. Byte
sizes are divided by their gcd, compute times scaled by a power of two to integers (so
multiples of 1/2^k ms stay exact).

Bound from dp: when the warm start is dp's plan and dp proved it OPTIMAL (its search was exact:
no frontier sets merged, every boundary and Pareto point kept, saves read by their savers), its
cost is the minimum over the same decision space (contiguous regions in the fixed order whose
starts pass `Problem.can_start_region`, judged by the same simulator), so `objective >= that
cost` (less a rounding slack of about one scaled unit per node) is a valid bound, and CP-SAT
stops once it has a plan within the slack. Status OPTIMAL then means optimal up to that
rounding (n + 1 scale units, under n^2 * 2^-39 of the largest node time, plus 1e-9 relative).
Without it (wide DAGs where dp is only FEASIBLE) the bound is CP-SAT's own, from its LP (solved
at the root in one go, see `_solver`), and the warm start is the cheapest of dp's plan, a
greedy plan of one-node regions (`_greedy_single_nodes`) and the best plan of one-node regions
from this same model restricted to them (`_single_node_optimum`, given at most a tenth of the
time limit; its plans are plans of the full model, so this is a warm start, never a bound).
Where the budget needs a long region (no plan of one-node regions fits) or would gain from one,
neither those warm starts nor CP-SAT's neighbourhood searches place it well: the LP relaxation
(solved apart with CLP, `solvers.lp_relaxation`; it runs wherever dp is not proven optimal)
says where long regions may start, CP-SAT searches the model restricted to those
(`_lp_guided_plan`), and the LP's objective, raised by one branch (the smaller of the LP
objectives with one node forced out of regions and forced in, solved from the LP's basis beside
the search), joins CP-SAT's bound.
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import reduce
from typing import Any

from solvers.problem import InfeasibleBudget, Problem, Solution, Status
from solvers.simulate import make_solution, peak_bytes
from solvers.structure import Structure, scan_regions

logger = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT_S = 60.0
DEFAULT_WORKERS = 2
SINGLE_NODE_SHARE = 0.1  # of the time limit, at most, for the one-node-regions warm start
LP_SHARE = 0.5  # ... for the LP relaxation that guides the long-region warm start
GUIDED_SHARE = 0.3  # ... for the search it guides (twice that on one worker fewer, see below)
FINAL_SEARCH_MIN_S = 5.0  # with less left after the LP-guided warm start, skip the full search
SEARCH_MARGIN_S = 1.0  # the LP-guided search ends this early: CP-SAT overruns a little
GUIDED_SHORT_REGION_NODES = 4  # regions longer than this start only where the LP opens them


def _cp_model() -> Any:
    try:
        from ortools.sat.python import cp_model
    except ImportError as error:  # pragma: no cover - ortools is a dependency
        raise ImportError(
            "solver 'ilp' needs OR-Tools: pip install ortools (or use method='dp')"
        ) from error
    return cp_model


@dataclasses.dataclass
class _Model:
    model: Any
    member: list[dict[int, Any]]  # member[i][a]: node i is in the region that starts at a
    in_region: list[Any]
    alive: list[dict[int, Any]]  # alive[j][i]: output j held at the backward of i
    kept: dict[int, Any]
    prefix: dict[tuple[int, int], Any]  # (k, i): k's region starts at or before i
    objective_scale: float
    budget: Any  # scaled live bytes: an int, or the variable minimised in minimum-peak mode
    costs: list[int]  # scaled compute time per node: the objective is their sum over recomputed
    objective: Any  # the objective expression (recompute mode) or the peak variable
    region_cost: int = 0  # scaled fixed cost per region, added for every region start
    problem: Problem | None = None


def _tables(
    problem: Problem,
    structure: Structure,
    limit: int,
    max_region_nodes: int | None = None,
    long_starts: frozenset[int] = frozenset(),
) -> tuple[list[dict[int, int]], list[dict[int, int]]]:
    """RL(a, i) and W(a, e) (see the module docstring) for the regions that can be part of a
    plan under `limit` live bytes (and of at most `max_region_nodes` nodes, except regions
    that start in `long_starts`); W where the region [a, e] holds a saving node and fits its
    recomputation (which runs at its last saving node). Node i can be in a region starting at a only if its backward fits with just
    the region's inputs held (they are kept until the region's backward ends), and, where a
    region from a reaching i's next saving node recomputes its tensors first, with those too;
    then so can every node between a and i. Dropping these is exact and tightens the LP."""
    n = structure.n
    out = structure.output_bytes
    saver = [node.saves_for_backward for node in problem.nodes]
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
        for e, region_backward, region_recompute in scan_regions(structure, problem, a):
            if max_region_nodes is not None and e - a >= max_region_nodes and a not in long_starts:
                break
            if e >= last_stop:  # no allowed region from a reaches e
                break
            for j in structure.uses_before[e]:
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


def _build(
    problem: Problem,
    live_budget: int | None,
    upper_live: int,
    max_region_nodes: int | None = None,
    long_starts: frozenset[int] = frozenset(),
) -> _Model:
    """The CP-SAT model; `live_budget` None means: minimise the peak instead of recompute.
    `max_region_nodes` restricts regions to that many nodes, except those that start in
    `long_starts` (a smaller model whose plans are plans of the full one, for warm starts)."""
    cp_model = _cp_model()
    structure = Structure.of(problem)
    n = structure.n
    nodes = problem.nodes
    model = cp_model.CpModel()

    sizes = [v for node in nodes for v in (node.output_bytes, node.saved_bytes, node.transient_bytes)]
    sizes += [*structure.gradient_backward, *structure.gradient_recompute, upper_live, problem.rng_state_bytes]
    unit = reduce(math.gcd, [v for v in sizes if v], 0) or 1

    def scaled(value: int) -> int:
        return value // unit  # every memory term is a multiple of unit; budgets round down

    limit = upper_live if live_budget is None else live_budget
    backward_table, recompute_table = _tables(problem, structure, limit, max_region_nodes, long_starts)
    budget = model.new_int_var(0, scaled(upper_live), "peak") if live_budget is None else scaled(live_budget)

    # Region structure: member[i][a] = 1 iff node i is in the region starting at a.
    member: list[dict[int, Any]] = []
    in_region: list[Any] = []
    for i in range(n):
        row = {a: model.new_bool_var(f"member_{i}_{a}") for a in sorted(backward_table[i])}
        for a, var in row.items():
            if a < i:
                model.add_implication(var, member[i - 1][a])  # regions are contiguous
        inside = model.new_bool_var(f"in_region_{i}")
        model.add(inside == sum(row.values()))
        member.append(row)
        in_region.append(inside)

    # prefix[k, i] = 1 iff node k's region starts at or before i (order encoding of the start).
    prefix: dict[tuple[int, int], Any] = {}
    for k in range(n):
        if not structure.uses_before[k] or not member[k]:
            continue
        earliest = structure.uses_before[k][0]
        # One long sum per prefix, not a chain prefix[k, a] = prefix[k, a - 1] + member[k][a]:
        # the chain presolves faster but CP-SAT's LP then took longer than 60 s to give any
        # bound on random_layered_n250 at 70% (the long sums: 14060 after 12 s).
        running: Any = 0
        for a in range(min(member[k]), k + 1):
            if a in member[k]:
                running = running + member[k][a]
            if a >= earliest:
                var = model.new_bool_var(f"prefix_{k}_{a}")
                model.add(var == running)
                prefix[k, a] = var

    def starts_by(k: int, i: int) -> Any:
        """1 iff node k is in a region that starts at or before i."""
        if i < min(member[k], default=k + 1):
            return 0
        return prefix.get((k, min(i, k)), 0)

    def starts_within(k: int, low: int, high: int) -> Any:
        """1 iff node k's region starts in (low, high]."""
        return starts_by(k, high) - starts_by(k, low)

    # Outputs held in backward: alive[j][i] for i from j to its last possible keeper, where it
    # equals kept[j]. A saver k outside regions keeps j from the backward of k on; a region
    # starting at a in (j, k] that contains a consumer k keeps it from the backward of a on.
    alive: list[dict[int, Any]] = []
    kept: dict[int, Any] = {}
    for j in range(n):
        last = structure.keep_until[j]
        row = {}
        if last >= 0:
            for i in range(j, last + 1):
                row[i] = model.new_bool_var(f"alive_{j}_{i}")
                if i > j:
                    model.add_implication(row[i - 1], row[i])
            kept[j] = row[last]
            for k in structure.savers[j]:
                model.add(row[k] >= 1 - in_region[k])
            for k in structure.consumers[j]:
                if not member[k]:
                    continue
                for i in range(max(j + 1, min(member[k])), k + 1):
                    model.add(row[i] >= starts_within(k, j, i))
        alive.append(row)

    def held_output(j: int, i: int) -> Any:
        """Output j held at the backward of i (j <= i)."""
        row = alive[j]
        if not row:
            return 0
        return row[min(i, structure.keep_until[j])]

    # A consumer k shares j's region iff k's region starts at or before j.
    _add_triangle_cuts(model, structure, held_output, lambda j, k: starts_by(k, j))

    rng_states = _rng_states(problem, member, unit)

    saved_outside = [0]
    for t in range(n):
        saved_outside.append(saved_outside[-1] + scaled(nodes[t].saved_bytes) * (1 - in_region[t]))

    # Forward steps: outputs still read, kept outputs past their last read, saved tensors.
    for t in range(n):
        fixed = nodes[t].saved_bytes + nodes[t].transient_bytes
        kept_terms = []
        for j in range(t + 1):
            if structure.forward_until[j] >= t:
                fixed += nodes[j].output_bytes
            elif j in kept and nodes[j].output_bytes:
                kept_terms.append(scaled(nodes[j].output_bytes) * kept[j])
        model.add(scaled(fixed) + sum(kept_terms) + saved_outside[t] + rng_states[t] <= budget)

    # Backward steps, and recomputation at the nodes that save (see the module docstring).
    next_saver: list[int | None] = [None] * (n + 1)  # the first node >= i that saves a tensor
    for i in reversed(range(n)):
        next_saver[i] = i if nodes[i].saves_for_backward else next_saver[i + 1]

    def member_of(k: int | None, a: int) -> Any:
        return 0 if k is None else member[k].get(a, 0)

    # A region that saves nothing recomputes nothing and frees nothing: every region reaches a
    # saving node (this also keeps such no-op regions out of plans where regions cost nothing).
    for a in range(n):
        if a in member[a]:
            if next_saver[a] is not None and a in member[next_saver[a]]:
                model.add_implication(member[a][a], member[next_saver[a]][a])
            else:
                model.add(member[a][a] == 0)

    for i in range(n):
        held = sum(
            scaled(nodes[j].output_bytes) * held_output(j, i)
            for j in range(i + 1)
            if alive[j] and nodes[j].output_bytes
        ) + saved_outside[i + 1] + rng_states[i]
        own = sum(scaled(value) * member_of(next_saver[i], a) for a, value in backward_table[i].items() if value)
        model.add(held + scaled(structure.gradient_backward[i]) + own <= budget)
        for a, var in member[i].items():
            reaches_no_saver = next_saver[a] is None or next_saver[a] > i  # ruled out above
            if problem.allows_region(a, i + 1) and (a in recompute_table[i] or reaches_no_saver):
                continue
            if i + 1 < n and a in member[i + 1]:  # the region [a, i] cannot end at i
                model.add_implication(var, member[i + 1][a])
            else:
                model.add(var == 0)
        if next_saver[i] != i:
            continue
        # Regions whose last saving node is i recompute here; what they keep till the stop
        # depends on where they end, before the next saving node.
        stop = next_saver[i + 1] if next_saver[i + 1] is not None else n
        ending = sum(
            scaled(value) * (member[e][a] - (member[e + 1].get(a, 0) if e + 1 < n else 0))
            for e in range(i, stop)
            for a, value in recompute_table[e].items()
            if value and a <= i
        )
        model.add(held + scaled(structure.gradient_recompute[i + 1]) + ending <= budget)

    largest = max([node.compute_ms for node in nodes] + [problem.region_overhead_ms, 1e-12])
    objective_scale = 2.0 ** math.floor(math.log2((2**40 / max(1, 2 * n)) / largest))
    costs = [round(node.compute_ms * objective_scale) for node in nodes]
    region_cost = round(problem.region_overhead_ms * objective_scale)
    # member[a][a]: node a starts its region; each region pays checkpoint's fixed cost once.
    starts = [member[a][a] for a in range(n) if a in member[a]] if region_cost else []
    if live_budget is None:
        objective = budget
    else:
        recomputed = _recomputed(model, problem, member, in_region)
        objective = (sum(cost * recomputed[i] for i, cost in enumerate(costs) if cost)
                     + sum(region_cost * start for start in starts))
    model.minimize(objective)
    return _Model(model, member, in_region, alive, kept, prefix, objective_scale, budget, costs, objective,
                  region_cost, problem)


def _recomputed(model: Any, problem: Problem, member: list[dict[int, Any]], in_region: list[Any]) -> list[Any]:
    """Per node, 1 where its region recomputes it: a saving node whenever it is in a region,
    another node where its region goes on to a saving node (bounded below only: the objective
    pushes it down)."""
    n = len(problem.nodes)
    recomputed: list[Any] = [0] * (n + 1)
    for i in reversed(range(n)):
        if not member[i]:
            continue
        if problem.nodes[i].saves_for_backward:
            recomputed[i] = in_region[i]
        elif not isinstance(recomputed[i + 1], int):
            var = model.new_bool_var(f"recomputed_{i}")
            model.add(var >= recomputed[i + 1] - member[i + 1].get(i + 1, 0))
            recomputed[i] = var
    return recomputed[:n]


def _scaled_cost(built: _Model, regions: tuple[range, ...]) -> int:
    """A plan's objective value in the model's scaled units."""
    assert built.problem is not None
    recomputed = (i for region in regions for i in built.problem.recomputed(region))
    return sum(built.costs[i] for i in recomputed) + built.region_cost * len(regions)


def _rng_states(problem: Problem, member: list[dict[int, Any]], unit: int) -> list[Any]:
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


def _add_triangle_cuts(model: Any, structure: Structure, held: Any, same_region: Any) -> None:
    """Valid inequalities that the LP relaxation misses, one per triangle u -> v -> w with
    u -> w in the graph, where each node saves its own output (as in the literature graphs).

    An output freed before the backward of w (`1 - held(u, w)`) needs its node in a region
    (its own saver would keep it otherwise) and each consumer up to w outside regions or in
    the same region (a later region reading it would keep it). So two nodes of the triangle can
    both be freed only if they share a region, and
    `sum of freed over {u, v, w} <= 1 + same(u, v) + same(v, w)` (u and w share a region
    only if v does too).
    The LP meets it with halves (two regions at one half each free three halves); on
    random_layered_n250 at 50% these 108 cuts raise the LP bound from 53 291 to 53 792 ms
    (the optimum is 54 470) and steer it to the optimum's long region."""
    for u in range(structure.n):
        if u not in structure.savers[u]:
            continue
        for v in structure.consumers[u]:
            if v not in structure.savers[v]:
                continue
            for w in structure.consumers[v]:
                if w not in structure.savers[w] or w not in structure.consumers[u]:
                    continue
                freed = 3 - held(u, w) - held(v, w) - held(w, w)
                model.add(freed <= 1 + same_region(u, v) + same_region(v, w))


def _bound_by_optimum(built: _Model, regions: tuple[range, ...]) -> int:
    """Add `objective >= cost of regions - slack`, where `regions` is a plan proven optimal on
    the same decision space (dp's OPTIMAL plans: every contiguous region with a startable start,
    judged by the same simulator, which is what this model encodes too). The slack covers the
    rounding of each node's time to the integer scale (< 1/2 each) and float sums; it is
    returned so the solver can stop once its gap is within it."""
    value = _scaled_cost(built, regions)
    slack = len(built.costs) + math.ceil(1e-9 * value) + 1
    built.model.add(built.objective >= value - slack)
    return slack


def _hint(built: _Model, problem: Problem, regions: tuple[range, ...]) -> bool:
    """Hint every variable with the values of a known plan; False if the plan is outside the
    model (a region the budget pruning removed), in which case nothing is hinted."""
    structure = Structure.of(problem)
    n = structure.n
    start_of = [n] * n
    for region in regions:
        for i in region:
            start_of[i] = region.start
    if any(start_of[i] < n and start_of[i] not in built.member[i] for i in range(n)):
        return False
    model = built.model
    for i in range(n):
        for a, var in built.member[i].items():
            model.add_hint(var, start_of[i] == a)
        model.add_hint(built.in_region[i], start_of[i] < n)
    for (k, i), var in built.prefix.items():
        model.add_hint(var, start_of[k] <= i)
    for j, row in enumerate(built.alive):
        if not row:
            continue
        candidates = [k for k in structure.savers[j] if start_of[k] == n]
        candidates += [start_of[k] for k in structure.consumers[j] if j < start_of[k] < n]
        keeper = min(candidates, default=n)
        for i, var in row.items():
            model.add_hint(var, keeper <= i)
    return True


def _greedy_single_nodes(problem: Problem, budget_bytes: int) -> tuple[range, ...] | None:
    """A warm start where dp's bounded search is weak (wide DAGs): one-node regions ("drop
    this output, recompute it alone in backward"), added greedily by peak bytes saved per ms,
    re-scoring lazily, then dropped again, costliest first, while the plan still fits. None if
    one-node regions alone cannot reach the budget. (On random_layered_n250 at 70% it finds
    14 770 ms in 0.4 s where dp's plan costs 31 804 ms and CP-SAT's LP bound is 14 050 ms.)"""

    def plan(chosen: set[int]) -> tuple[range, ...]:
        return tuple(range(j, j + 1) for j in sorted(chosen))

    def score(saved_bytes: int, j: int) -> float:
        return saved_bytes / max(problem.nodes[j].compute_ms, 1e-12)

    peak = peak_bytes(problem)
    chosen: set[int] = set()
    queue = []  # (-score, node): scores only go stale, so re-score the best before taking it
    for j in range(len(problem)):
        if problem.allows_region(j, j + 1):
            saved = peak - peak_bytes(problem, (range(j, j + 1),))
            if saved > 0:
                queue.append((-score(saved, j), j))
    heapq.heapify(queue)
    while peak > budget_bytes and queue:
        _, j = heapq.heappop(queue)
        saved = peak - peak_bytes(problem, plan(chosen | {j}))
        if saved <= 0:
            continue  # no help at the current peak step
        if queue and -queue[0][0] > score(saved, j):
            heapq.heappush(queue, (-score(saved, j), j))
            continue
        chosen.add(j)
        peak -= saved
    if peak > budget_bytes:
        return None
    for j in sorted(chosen, key=lambda j: (-problem.nodes[j].compute_ms, j)):
        if peak_bytes(problem, plan(chosen - {j})) <= budget_bytes:
            chosen.discard(j)
    return plan(chosen)


def _single_node_optimum(
    problem: Problem, budget_bytes: int, hint: tuple[range, ...] | None, time_limit_s: float, workers: int
) -> tuple[range, ...] | None:
    """The cheapest plan of one-node regions, from the same model restricted to them (about a
    quarter of the variables, and an LP that solves in well under a second where the full one
    takes 20 s), or the best found within `time_limit_s`; None if none was found (or none
    exists). A warm start for the full model, never a bound. Of CP-SAT's full-problem workers
    only the LP-guided one (`max_lp`) runs, beside the neighbourhood searches: on
    random_layered_n250 at 70% that proves 14 134 ms optimal in under a second on one core,
    where the default mix of workers needs 17 s."""
    one_node_hint = hint if hint is not None and all(len(region) == 1 for region in hint) else None
    return _search_restricted(problem, budget_bytes, 1, frozenset(), one_node_hint, time_limit_s, workers)[0]


def _search_restricted(
    problem: Problem,
    budget_bytes: int,
    max_region_nodes: int,
    long_starts: frozenset[int],
    hint: tuple[range, ...] | None,
    time_limit_s: float,
    workers: int,
    stop: Future | None = None,
) -> tuple[tuple[range, ...] | None, bool]:
    """The best plan CP-SAT finds within `time_limit_s` in the model restricted to regions of
    at most `max_region_nodes` nodes (except from `long_starts`), None if none, and whether
    it is proven the best of that model. Its plans are plans of the full model. Of the
    full-problem workers only the LP-guided one (`max_lp`) runs, beside the neighbourhood
    searches. The search also stops when `stop` is done. Building the model counts against
    `time_limit_s` too."""
    began = time.perf_counter()
    live_budget = budget_bytes - problem.static_bytes
    built = _build(problem, live_budget, live_budget, max_region_nodes, long_starts)
    if hint is not None:
        _hint(built, problem, hint)
    solver = _solver(max(0.0, time_limit_s - (time.perf_counter() - began)), workers)
    solver.parameters.subsolvers.append("max_lp")
    if stop is not None:
        stop.add_done_callback(lambda _: solver.stop_search())  # (from the thread that did it)
    status = solver.solve(built.model)
    logger.debug(
        "ilp: regions of at most %d nodes (any length from %d starts): CP-SAT %s in %.2f s",
        max_region_nodes, len(long_starts), solver.status_name(status), solver.wall_time,
    )
    cp_model = _cp_model()
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, status == cp_model.INFEASIBLE
    return _regions(solver, built, len(problem)), status == cp_model.OPTIMAL


def _lp_guided_plan(
    problem: Problem,
    budget_bytes: int,
    built: _Model,
    time_limit_s: float,
    workers: int,
    deadline: float,
    short_regions_fit: bool = False,
) -> tuple[tuple[range, ...] | None, float | None]:
    """A warm start for budgets that need a long region, steered by the full model's LP
    relaxation, and a bound from the LP (in the model's scaled units; None if no LP solution).
    Where a plan of one-node regions fits (`short_regions_fit`) and the LP puts no weight on
    a long region, only the LP's bound: the full model's search then proves such plans
    (random_layered_n250 at 70%: the LP in 7 s, then CP-SAT proves 14 134 ms optimal). At 55%
    the LP opens six long starts, and this finds 41 071 ms where the best plan of one-node
    regions costs 55 092 ms and the full model's search found no better in 55 s.

    Regions of at most `GUIDED_SHORT_REGION_NODES` nodes may start anywhere; longer ones only
    where the LP puts weight on one, and CP-SAT searches that restricted model. CP-SAT's own
    neighbourhood searches cannot move a long region: on random_layered_n250 at 50% they stay
    near dp's 67 400 ms, while the LP (with the triangle cuts) puts the optimum's long region
    at 0.87 and this search finds 54 567 ms (the optimum is 54 470).

    The bound is the LP's, raised by one branch (`_branching_node`): every plan has that node
    in a region or not, so the smaller of the two halves' LP objectives is a bound too. On
    that graph the LP mixes 0.87 of a plan that does not fit with 0.13 of one with a far longer
    region (53 792 ms), and the halves give 54 158 and 54 176. The halves are solved (from the
    LP's basis, one after the other, until `deadline`) while the search runs beside them on one
    worker fewer (so with one worker there is no branch), then on all of them, each time for at
    most twice `GUIDED_SHARE` of the limit; the root LP gets at most `LP_SHARE`."""
    from solvers.lp_relaxation import LinearRelaxation

    started = time.perf_counter()
    relaxation = LinearRelaxation(built.model)
    root = relaxation.solve(LP_SHARE * time_limit_s)
    took = time.perf_counter() - started
    logger.debug("ilp: LP relaxation %s in %.2f s", "solved" if root else "not solved", took)
    if root is None or not root.feasible:
        return None, None
    short = GUIDED_SHORT_REGION_NODES
    long_starts = frozenset(
        a
        for i, row in enumerate(built.member)
        for a, var in row.items()
        if i - a == short and root.values[var.index] > 1e-6
    )
    if short_regions_fit and not long_starts:
        return None, root.objective
    node = _branching_node(built, root.values)

    def branch() -> float | None:
        """The smaller LP objective of the two halves of the branch on `node`, if both came."""
        assert node is not None
        index = built.in_region[node].index
        halves = [relaxation.solve(deadline - time.perf_counter(), {index: value}) for value in (0.0, 1.0)]
        logger.debug(
            "ilp: branch on node %d: halves %s at %.2f s", node,
            [half.objective / built.objective_scale if half else None for half in halves],
            time.perf_counter() - started,
        )
        return min(half.objective for half in halves) if halves[0] and halves[1] else None

    def search(hint: tuple[range, ...] | None, workers: int, stop: Future | None = None) -> tuple[Any, bool]:
        share_s = min(2 * GUIDED_SHARE * time_limit_s, deadline - time.perf_counter() - SEARCH_MARGIN_S)
        if share_s < SEARCH_MARGIN_S:
            return None, False
        return _search_restricted(problem, budget_bytes, short, long_starts, hint, share_s, workers, stop)

    # Hinted with the LP's rounded plan, not with the plans found so far: on
    # random_layered_n250 at 50% dp's plan (a 118-node region) led the search to 55 552 ms in
    # 20 s, the LP alone to 54 567 ms. While the halves are solved, on one worker fewer.
    hint = _rounded_plan(built, root.values)
    with ThreadPoolExecutor(max_workers=1) as pool:  # the LP solvers release the GIL
        halves = pool.submit(branch) if node is not None and workers > 1 else None
        plan, proven = search(hint, workers - 1 if halves else workers, halves)
        if halves is not None and halves.done() and not proven:  # the rest of the time: all workers
            plan, _ = search(plan or hint, workers)
        branch_bound = halves.result() if halves is not None else None
    return plan, root.objective if branch_bound is None else max(root.objective, branch_bound)


def _rounded_plan(built: _Model, values: tuple[float, ...]) -> tuple[range, ...]:
    """The regions that an LP solution puts each node in at more than one half (it may not
    fit: a hint for a search, not a plan)."""
    return _regions_of([next((a for a, var in row.items() if values[var.index] > 0.5), None) for row in built.member])


def _branching_node(built: _Model, values: tuple[float, ...]) -> int | None:
    """The node to branch on, None if the LP puts every node wholly in or out of regions.

    Where the LP takes a fraction of a long region, its objective is a mix of plans. The
    region start whose fractional members weigh the most (cost times distance from 0 or 1) is
    that region's, and of its members the costliest node that the LP puts partly in regions
    parts the mix the most: forced out, the long region cannot cover it; forced in, its whole
    cost is paid. (On random_layered_n250 at 50%: node 25 of the region from node 0, halves
    54 158 / 54 176 ms; with HiGHS from scratch, the most fractional node, 238, gave
    54 085 / 54 028, and node 137 of a shorter region 53 940 / 53 797.)"""

    def fraction(var: Any) -> float:
        value = values[var.index]
        return min(value, 1.0 - value) if 1e-6 < value < 1 - 1e-6 else 0.0

    weight: dict[int, float] = {}
    for i, row in enumerate(built.member):
        for a, var in row.items():
            weight[a] = weight.get(a, 0.0) + built.costs[i] * fraction(var)
    if not weight or max(weight.values()) <= 0:
        return None
    start = min(weight, key=lambda a: (-weight[a], a))
    candidates = [
        i
        for i, row in enumerate(built.member)
        if start in row and fraction(row[start]) > 0 and fraction(built.in_region[i]) > 0
    ]
    return min(candidates, key=lambda i: (-built.costs[i], i), default=None)


def _regions(solver: Any, built: _Model, n: int) -> tuple[range, ...]:
    return _regions_of([next((a for a, var in built.member[i].items() if solver.value(var)), None) for i in range(n)])


def _regions_of(start_of: list[int | None]) -> tuple[range, ...]:
    """The regions, given the start of each node's region (None: outside regions)."""
    regions = []
    for i, start in enumerate(start_of):
        if start == i:
            stop = i + 1
            while stop < len(start_of) and start_of[stop] == i:
                stop += 1
            regions.append(range(i, stop))
    return tuple(regions)


def _solver(time_limit_s: float, workers: int) -> Any:
    cp_model = _cp_model()
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(workers)
    solver.parameters.interleave_search = True  # deterministic with several workers
    solver.parameters.random_seed = 0
    # Probing builds hundreds of thousands of binary clauses on these models and costs more
    # than it saves (MobileNet: 14 s -> 0.7 s to optimality without it).
    solver.parameters.cp_model_probing_level = 0
    # Solve the root LP in one go, not in chunks of 2 000 dual simplex iterations between the
    # other interleaved workers: on random_layered_n250 it needs about 20 000, and in chunks
    # no bound arrived within 60 s (at 90%: bound 0 -> proven optimal in 26 s).
    solver.parameters.root_lp_iterations = 200_000
    return solver


def minimum_peak_ilp(
    problem: Problem,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    workers: int = DEFAULT_WORKERS,
    hint: tuple[range, ...] | None = None,
) -> tuple[int, bool]:
    """Smallest peak over all plans by CP-SAT, and whether it is proven (else the best found).

    Example:
        >>> peak, proven = minimum_peak_ilp(problem, time_limit_s=10)
        >>> peak <= peak_bytes(problem)
        True
    """
    cp_model = _cp_model()
    unplanned = peak_bytes(problem)
    live_upper = unplanned - problem.static_bytes
    built = _build(problem, None, live_upper)
    if hint is not None:
        _hint(built, problem, hint)
    solver = _solver(time_limit_s, workers)
    status = solver.solve(built.model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return unplanned, False
    regions = _regions(solver, built, len(problem))
    return peak_bytes(problem, regions), status == cp_model.OPTIMAL


def solve_ilp(
    problem: Problem,
    budget_bytes: int,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    workers: int = DEFAULT_WORKERS,
    hint: bool | tuple[range, ...] = True,
    **options: object,
) -> Solution:
    """The cheapest plan under `budget_bytes` from an exact CP-SAT model of the simulator.

    Options:
        time_limit_s: wall-clock limit (default 60 s); on reaching it the best plan found is
            returned with status TIME_LIMIT and `gap` = (cost - proven bound) / cost.
        workers: CP-SAT workers (default 2). The search is interleaved, so results are
            deterministic whenever CP-SAT finishes; when the time limit stops it, the plan
            returned can depend on how fast the machine was.
        hint: True to warm-start from the dp solver's plan (and, when dp proves it optimal,
            to use its cost as the objective's lower bound; see the module docstring; when it
            does not, from the cheapest of dp's plan, a greedy plan of one-node regions,
            the restricted model's best plan of one-node regions and, where the LP relaxation
            opens a long region or none of those fits, the LP-guided plan; the LP's objective,
            raised by one branch where that plan was searched, joins the bound), a tuple of
            regions to use those (no bound), or False for none.

    Raises InfeasibleBudget with the proven minimum peak when no plan fits.

    Example:
        >>> solution = solve_ilp(problem, budget_bytes=int(0.6 * peak_bytes(problem)), time_limit_s=10)
        >>> solution.status, solution.gap
        (<Status.OPTIMAL: 'optimal'>, 0.0)
    """
    if options:
        raise TypeError(f"ilp got unknown options {sorted(options)}")
    started = time.perf_counter()
    cp_model = _cp_model()
    if peak_bytes(problem) <= budget_bytes:  # nothing to recompute
        return dataclasses.replace(
            make_solution(problem, (), budget_bytes, Status.OPTIMAL, "ilp", started), gap=0.0
        )
    live_budget = budget_bytes - problem.static_bytes
    built = None if live_budget < 0 else _build(problem, live_budget, live_budget)
    hint_regions: tuple[range, ...] | None = None
    optimum: tuple[range, ...] | None = None  # a plan dp proved optimal, if any
    lp_bound: float | None = None  # the LP's (with its branch), where the LP-guided warm start ran

    def cheaper(plan: tuple[range, ...] | None) -> bool:
        return plan is not None and (
            hint_regions is None or problem.recompute_ms(plan) < problem.recompute_ms(hint_regions)
        )

    if hint is True:
        from solvers.dp import solve_dp  # the warm start

        try:
            warm = solve_dp(problem, budget_bytes)
        except InfeasibleBudget:
            warm = None
        if warm is not None:
            hint_regions = warm.regions
            if warm.status == Status.OPTIMAL:
                optimum = warm.regions
        if optimum is None:  # dp's plan may be far from optimal: try one-node regions too
            greedy = _greedy_single_nodes(problem, budget_bytes)
            if cheaper(greedy):
                hint_regions = greedy
            single = None
            if built is not None:
                share_s = SINGLE_NODE_SHARE * time_limit_s
                single = _single_node_optimum(problem, budget_bytes, greedy, share_s, workers)
            if cheaper(single):
                hint_regions = single
            if built is not None:  # the LP says whether long regions help, and bounds
                deadline = started + time_limit_s
                guided, lp_bound = _lp_guided_plan(
                    problem, budget_bytes, built, time_limit_s, workers, deadline, single is not None
                )
                if cheaper(guided):
                    hint_regions = guided
    elif hint:
        hint_regions = tuple(hint)
    remaining_s = time_limit_s - (time.perf_counter() - started)
    if lp_bound is not None and hint_regions is not None and remaining_s < FINAL_SEARCH_MIN_S:
        status = cp_model.UNKNOWN  # the LP-guided warm start used the time: the best plan stands
    elif built is not None:
        if hint_regions is not None:
            _hint(built, problem, hint_regions)
        solver = _solver(max(0.0, remaining_s), workers)
        if optimum is not None:
            # dp's exact search proved this cost minimal over the same plans: a valid bound.
            slack = _bound_by_optimum(built, optimum)
            solver.parameters.absolute_gap_limit = max(solver.parameters.absolute_gap_limit, float(slack))
        status = solver.solve(built.model)
        logger.debug("ilp: CP-SAT %s in %.2f s", solver.status_name(status), solver.wall_time)
    if built is None or status == cp_model.INFEASIBLE:
        from solvers.dp import minimum_peak_plan_dp  # the warm start

        dp_minimum, _, dp_plan = minimum_peak_plan_dp(problem)
        minimum, proven = minimum_peak_ilp(problem, time_limit_s, workers, hint=dp_plan)
        if not proven:
            minimum = min(minimum, dp_minimum)
            logger.warning("ilp: minimum peak %d bytes is the best found, not proven", minimum)
        raise InfeasibleBudget(budget_bytes, minimum, problem.static_bytes, "ilp", proven=proven)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if hint_regions is None:
            raise TimeoutError(
                f"ilp: no plan found within {time_limit_s} s and the dp warm start had none; "
                "raise time_limit_s"
            )
        regions = hint_regions
        objective = _scaled_cost(built, regions)
        bound = -math.inf
    else:
        regions = _regions(solver, built, len(problem))
        objective = solver.objective_value
        bound = solver.best_objective_bound
    if lp_bound is not None:
        bound = max(bound, lp_bound)
    if status == cp_model.OPTIMAL or objective <= 0:
        gap: float | None = 0.0
    else:
        gap = max(0.0, (objective - bound) / objective) if bound > -math.inf else None
    result = Status.OPTIMAL if status == cp_model.OPTIMAL else Status.TIME_LIMIT
    solution = make_solution(problem, regions, budget_bytes, result, "ilp", started)
    return dataclasses.replace(solution, gap=gap)
