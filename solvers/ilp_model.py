"""The CP-SAT model of the simulator's peak, with per-node decisions (used by `solvers.ilp`).

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
"""
from __future__ import annotations

import math
import dataclasses
from functools import reduce
from typing import Any

from solvers.problem import Problem
from solvers.region_scan import scan_regions
from solvers.structure import Structure


def load_cp_model() -> Any:
    try:
        from ortools.sat.python import cp_model
    except ImportError as error:  # pragma: no cover - ortools is a dependency
        raise ImportError(
            "solver 'ilp' needs OR-Tools: pip install ortools (or use method='dp')"
        ) from error
    return cp_model


@dataclasses.dataclass
class IlpModel:
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
    stop_costs: list[int] = dataclasses.field(default_factory=list)  # scaled NodeCost.stop_cost_ms per node


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


def build_model(
    problem: Problem,
    live_budget: int | None,
    upper_live: int,
    max_region_nodes: int | None = None,
    long_starts: frozenset[int] = frozenset(),
) -> IlpModel:
    """The CP-SAT model; `live_budget` None means: minimise the peak instead of recompute.
    `max_region_nodes` restricts regions to that many nodes, except those that start in
    `long_starts` (a smaller model whose plans are plans of the full one, for warm starts)."""
    cp_model = load_cp_model()
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
    stop_costs = [round(node.stop_cost_ms * objective_scale) for node in nodes]
    region_cost = round(problem.region_overhead_ms * objective_scale)
    # member[a][a]: node a starts its region; each region pays checkpoint's fixed cost once.
    starts = [member[a][a] for a in range(n) if a in member[a]] if region_cost else []
    if live_budget is None:
        objective = budget
    else:
        objective = (sum(cost * var for cost, var in _recompute_terms(model, problem, member, in_region, costs,
                                                                     stop_costs) if cost)
                     + sum(region_cost * start for start in starts))
    model.minimize(objective)
    return IlpModel(model, member, in_region, alive, kept, prefix, objective_scale, budget, costs, objective,
                  region_cost, problem, stop_costs)


def _recompute_terms(model: Any, problem: Problem, member: list[dict[int, Any]], in_region: list[Any],
                     costs: list[int], stop_costs: list[int]) -> list[tuple[int, Any]]:
    """(scaled cost, 0/1 variable) terms whose sum is what recomputation costs
    (`Problem.region_recompute_ms`). Recomputation reaches a saving node whenever it is in a
    region, and another node where its region goes on to a saving node; a reached saving node
    costs its `stop_costs` and, where its region goes on past it, the rest of its time (the
    variables are bounded below only: the objective pushes them down)."""
    n = len(problem.nodes)
    reached: list[Any] = [0] * (n + 1)
    terms: list[tuple[int, Any]] = []
    for i in reversed(range(n)):
        if not member[i]:
            continue
        goes_on = None if isinstance(reached[i + 1], int) else reached[i + 1] - member[i + 1].get(i + 1, 0)
        if problem.nodes[i].saves_for_backward:
            reached[i] = in_region[i]
            terms.append((stop_costs[i], in_region[i]))
            if goes_on is not None and costs[i] > stop_costs[i]:
                past = model.new_bool_var(f"recomputed_past_{i}")
                model.add(past >= goes_on)
                terms.append((costs[i] - stop_costs[i], past))
        elif goes_on is not None:
            reached[i] = model.new_bool_var(f"recomputed_{i}")
            model.add(reached[i] >= goes_on)
            terms.append((costs[i], reached[i]))
    return terms


def scaled_cost(built: IlpModel, regions: tuple[range, ...]) -> int:
    """A plan's objective value in the model's scaled units."""
    assert built.problem is not None
    total = built.region_cost * len(regions)
    for region in regions:
        recomputed = built.problem.recomputed(region)
        if recomputed:
            total += sum(built.costs[i] for i in recomputed[:-1]) + built.stop_costs[recomputed.stop - 1]
    return total


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


def bound_by_optimum(built: IlpModel, regions: tuple[range, ...]) -> int:
    """Add `objective >= cost of regions - slack`, where `regions` is a plan proven optimal on
    the same decision space (dp's OPTIMAL plans: every contiguous region with a startable start,
    judged by the same simulator, which is what this model encodes too). The slack covers the
    rounding of each node's time to the integer scale (< 1/2 each) and float sums; it is
    returned so the solver can stop once its gap is within it."""
    value = scaled_cost(built, regions)
    slack = len(built.costs) + math.ceil(1e-9 * value) + 1
    built.model.add(built.objective >= value - slack)
    return slack


def hint_plan(built: IlpModel, problem: Problem, regions: tuple[range, ...]) -> bool:
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
