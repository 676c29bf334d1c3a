"""The CP-SAT model of the simulator's peak, with per-node decisions (used by `solvers.ilp.solve`).

Decisions, per node i: `member[i][a]` = 1 iff node i is in the region that starts at node a
(for the starts a <= i that could hold i under the budget; at most one is 1, `in_region[i]` is
their sum, and `member[i][a] <= member[i - 1][a]` keeps regions contiguous). `prefix[k, i]`
(k's region starts at or before i) is the running sum of member[k][.]: an order encoding that
makes "k's region starts after j" a linear expression.

Outputs held into backward (see `solvers.structure`): `alive[j][i]` = output j is held at the
backward of node i, for i from j to j's last possible keeper, or past the last saving node of
a region that may keep it (from there on it is `into_backward[j]`).
It is monotone in i and bounded below by every keeper: `alive[j][k] >= 1 - in_region[k]` for
a saver k, and `alive[j][i] >= prefix[k, i] - prefix[k, j]` for a consumer k and i in (j, k]
(k's region starts in (j, i], so j is that region's input, held from its start's backward on).
Where runs may be chosen, a consumer only passed j (a submodule call's argument it does not
read) keeps it only in an allowed region: the sum of those regions' exact choices.
Memory only grows with `alive`, so lower bounds are all the model needs.

Kept nodes (selective checkpointing, `keep[j][s]`): see `solvers.ilp.keep`, which adds their
tensors where the plan holds them longer and splits the recomputation constraint of a region
that may keep by steps.

Memory: linear constraints, no big-M:

* forward step t: outputs still read (a constant) + outputs held into backward past their
  last read + saved tensors of earlier nodes outside regions or kept + node t's saved tensors
  and temporaries;
* backward of i: held outputs + saved tensors of nodes <= i outside regions + gradients in
  flight + sum over a of member[s][a] * RL(a, i), the region's own recomputed tensors, where s
  is the first node >= i that saves a tensor: a region recomputes up to its last such node,
  just before that node's backward (`Problem.recomputed`), so the backward of a node after it
  runs before the recomputation and holds none of them;
* recomputation at a saving node i: what the backward of i holds from earlier nodes +
  gradients in flight then + sum over a of (member[i][a] - member[s'][a]) * W(a, i), the
  region's own recomputation peak, for the regions whose last saving node is i (s' is the next
  saving node after i). Where W(a, i) does not fit (and, where the region may keep, no choice
  of kept nodes does), a region from a holding i must reach s'.

Cost: a node's time counts where it is recomputed and not kept: `recomputed[i]` is
in_region[i] for a saving node, and for another node at least recomputed[i + 1] unless a
region starts at i + 1; a region that keeps pays its policy, and a run inside a submodule call
(`Problem.run_spans`: a region that is no allowed one) its recording (`solvers.ilp.parts`).

Valid inequalities: on graphs whose nodes save their own outputs (the literature's), two nodes
of a producer-consumer triangle can both have their outputs freed only if they share a region
(`add_triangle_cuts`); the LP relaxation misses this, and the cuts tighten it.

RL and W come from `solvers.region_scan.scan_regions` (`solvers.ilp.parts.region_tables`).
Starts that cannot hold node i (its backward would not fit with only the region's inputs
held), regions that cannot end at i for the same reason, and starts at memoryless nodes
(`Structure.useful_start`) are left out. Byte sizes are divided by their gcd, compute times
scaled by a power of two to integers (so multiples of 1/2^k ms stay exact).
"""
from __future__ import annotations

import dataclasses
import math
from functools import reduce
from typing import Any, Collection

from solvers.ilp.keep import (
    add_keep_variables,
    held_saved,
    keep_ends,
    kept_of,
    recompute_loads,
)
from solvers.ilp.parts import (
    add_triangle_cuts,
    objective_scale,
    recompute_terms,
    region_tables,
    rng_states,
    run_terms,
    selective_terms,
)
from solvers.problem import Problem
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
    into_backward: dict[int, Any]  # output j held into backward: its alive row's last value
    prefix: dict[tuple[int, int], Any]  # (k, i): k's region starts at or before i
    objective_scale: float
    budget: Any  # scaled live bytes: an int, or the variable minimised in minimum-peak mode
    costs: list[int]  # scaled compute time per node: the objective is their sum over recomputed
    objective: Any  # the objective expression (recompute mode) or the peak variable
    region_cost: int = 0  # scaled fixed cost per region, added for every region start
    problem: Problem | None = None
    stop_costs: list[int] = dataclasses.field(default_factory=list)  # scaled NodeCost.stop_cost_ms per node
    keep: dict[int, dict[int, Any]] = dataclasses.field(default_factory=dict)  # keep[j][s]: see solvers.ilp.keep
    keep_region_cost: int = 0  # scaled Problem.keep_region_ms: per region that keeps
    call_costs: list[int] = dataclasses.field(default_factory=list)  # scaled keep_call_ms per node's ATen calls
    pack_costs: list[int] = dataclasses.field(default_factory=list)  # scaled saved_tensor_ms per node in a region
    kept_cost: int = 0  # scaled Problem.kept_node_ms: per kept node


def build_model(
    problem: Problem,
    live_budget: int | None,
    upper_live: int,
    max_region_nodes: int | None = None,
    long_starts: frozenset[int] = frozenset(),
    keeps: bool = True,
) -> IlpModel:
    """The CP-SAT model; `live_budget` None means: minimise the peak instead of recompute.
    `max_region_nodes` restricts regions to that many nodes, except those that start in
    `long_starts`, and `keeps` False keeps no node inside regions (smaller models whose plans
    are plans of the full one, for warm starts).

    Example:
        >>> built = build_model(problem, live_budget, live_budget)
        >>> hint_plan(built, problem, solution.regions, solution.kept)
        True
    """
    cp_model = load_cp_model()
    structure = Structure.of(problem)
    n = structure.n
    nodes = problem.nodes
    model = cp_model.CpModel()

    sizes = [v for node in nodes for v in (node.output_bytes, node.saved_bytes, node.transient_bytes,
                                           node.stop_transient, node.buffer_bytes, node.forward_held_bytes)]
    sizes += [*structure.gradient_backward, *structure.gradient_recompute, upper_live, problem.rng_state_bytes,
              problem.loss_scratch_bytes]
    unit = reduce(math.gcd, [v for v in sizes if v], 0) or 1

    def scaled(value: int) -> int:
        return value // unit  # every memory term is a multiple of unit; budgets round down

    limit = upper_live if live_budget is None else live_budget
    backward_table, recompute_table = region_tables(problem, structure, limit, max_region_nodes, long_starts)
    ends = keep_ends(problem, structure, backward_table, limit) if keeps else [{} for _ in range(n)]
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
    keep = add_keep_variables(model, problem, member, in_region, ends)

    # prefix[k, i] = 1 iff node k's region starts at or before i (order encoding of the start).
    prefix: dict[tuple[int, int], Any] = {}
    for k in range(n):
        if not structure.uses_before[k] or not member[k]:
            continue
        earliest = structure.uses_before[k][0]
        # One long sum per prefix, not a chain prefix[k, a] = prefix[k, a - 1] + member[k][a]:
        # the chain presolves faster, but CP-SAT's LP then takes far longer to give any bound on
        # wide DAGs.
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

    calls_holding: dict[int, list[tuple[int, int]]] = {}  # k -> the allowed regions holding it

    def call_region_starts_within(k: int, low: int, high: int) -> Any:
        """1 iff node k is in a region that starts in (low, high] and is an allowed region (no
        run): the region [a, e) is chosen iff e - 1 is in the region from a and e is not."""
        if k not in calls_holding:
            calls_holding[k] = [(r.start, r.stop) for r in problem.allowed_regions or () if r.start <= k < r.stop]
        chosen: Any = 0
        for a, e in calls_holding[k]:
            if low < a <= high and a in member[e - 1]:
                chosen = chosen + member[e - 1][a] - (member[e].get(a, 0) if e < n else 0)
        return chosen

    # Outputs held in backward: alive[j][i] for i from j to its last possible keeper, where it
    # equals into_backward[j]. A saver k outside regions keeps j from the backward of k on; a
    # region starting at a in (j, k] that contains a consumer k keeps it from the backward of a
    # on; a region keeping j whose last saving node is s, from the backward of s + 1 on.
    alive: list[dict[int, Any]] = []
    alive_until: list[int] = []
    into_backward: dict[int, Any] = {}
    for j in range(n):
        last = structure.keep_until[j]
        if j in keep:
            last = max(last, j, min(max(keep[j]) + 1, n - 1))
        row = {}
        if last >= 0:
            for i in range(j, last + 1):
                row[i] = model.new_bool_var(f"alive_{j}_{i}")
                if i > j:
                    model.add_implication(row[i - 1], row[i])
            into_backward[j] = row[last]
            for k in structure.savers[j]:
                model.add(row[k] >= 1 - in_region[k])
            for k in structure.consumers[j]:
                if not member[k]:
                    continue
                passed_only = problem.run_spans and j not in structure.reads_before[k]
                for i in range(max(j + 1, min(member[k])), k + 1):
                    # (j only passed to k's submodule call: a run keeps no such input, a call region does)
                    model.add(row[i] >= (call_region_starts_within(k, j, i) if passed_only
                                         else starts_within(k, j, i)))
            for s, var in keep.get(j, {}).items():
                if s + 1 < n:
                    model.add(row[s + 1] >= var)
        alive.append(row)
        alive_until.append(last)

    def held_output(j: int, i: int) -> Any:
        """Output j held at the backward of i (j <= i)."""
        row = alive[j]
        if not row:
            return 0
        return row[min(i, alive_until[j])]

    # A consumer k shares j's region iff k's region starts at or before j.
    add_triangle_cuts(model, structure, held_output, lambda j, k: starts_by(k, j))

    rngs = rng_states(problem, member, unit)

    saved_outside = [0]
    for t in range(n):
        saved_outside.append(saved_outside[-1] + scaled(nodes[t].saved_bytes) * (1 - in_region[t]))
    kept_saved, window_saved = held_saved(keep, problem, scaled)  # (see solvers.ilp.keep)

    # Forward steps: outputs still read, outputs held into backward past their last read (a kept
    # node's too: its alive row says so, except where its region's last saving node is n - 1 and
    # recomputes before any backward step), saved tensors.
    for t in range(n):
        fixed = (nodes[t].saved_bytes + nodes[t].transient_bytes + structure.unhooked_through[t]
                 + structure.forward_held_through[t])  # (whatever the plan)
        held_terms = []
        for j in range(t + 1):
            if structure.forward_until[j] >= t:
                fixed += nodes[j].output_bytes
            elif j in into_backward and nodes[j].output_bytes:
                held = into_backward[j] + keep.get(j, {}).get(n - 1, 0)
                held_terms.append(scaled(nodes[j].output_bytes) * held)
        model.add(scaled(fixed) + sum(held_terms) + saved_outside[t] + kept_saved[t] + rngs[t] <= budget)
    if n and problem.loss_scratch_bytes:
        # The loss's step, after the last forward step: the last node's temporaries are gone, and
        # so are the outputs no plan keeps for backward, except those the graph returns.
        last = n - 1
        fixed = (problem.loss_scratch_bytes + structure.unhooked_through[last] + structure.forward_held_through[last]
                 + sum(node.output_bytes for node in nodes if node.is_output))
        held_terms = [scaled(nodes[j].output_bytes) * (into_backward[j] + keep.get(j, {}).get(last, 0))
                      for j in into_backward if nodes[j].output_bytes and not nodes[j].is_output]
        last_kept_saved = kept_saved[last] + scaled(nodes[last].saved_bytes) * kept_of(keep, last)
        model.add(scaled(fixed) + sum(held_terms) + saved_outside[n] + last_kept_saved + rngs[last] <= budget)

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
        ) + saved_outside[i + 1] + window_saved[i] + rngs[i]
        own = sum(scaled(value) * member_of(next_saver[i], a) for a, value in backward_table[i].items() if value)
        model.add(held + scaled(structure.gradient_backward[i]) + own <= budget)
        for a, var in member[i].items():
            reaches_no_saver = next_saver[a] is None or next_saver[a] > i  # ruled out above
            fits = a in recompute_table[i] or (a in ends[i] and ends[i][a].fits)
            if problem.allows_region(a, i + 1) and (fits or reaches_no_saver):
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
        for load in recompute_loads(i, stop, member, recompute_table, ends, keep, problem, scaled):
            model.add(held + scaled(structure.gradient_recompute[i + 1]) + load <= budget)

    scale = objective_scale(problem, bool(keep))
    costs = [round(node.compute_ms * scale) for node in nodes]
    stop_costs = [round(node.stop_cost_ms * scale) for node in nodes]
    region_cost = round(problem.region_overhead_ms * scale)
    keep_region_cost = round(problem.keep_region_ms * scale) if keep else 0
    kept_cost = round(problem.kept_node_ms * scale) if keep else 0
    call_costs = [round(node.aten_calls * problem.keep_call_ms * scale) if keep else 0 for node in nodes]
    pack_costs = [round(node.saved_tensors * problem.saved_tensor_ms * scale) for node in nodes]
    runs, start_shares = run_terms(model, problem, member, scale) if live_budget is not None else ([], {})
    # member[a][a]: node a starts its region; each region pays checkpoint's fixed cost once (and
    # its share of its runs' recording).
    starts = [(region_cost + start_shares.get(a, 0), member[a][a]) for a in range(n) if a in member[a]]
    if live_budget is None:
        objective = budget
    else:
        terms = recompute_terms(model, problem, member, in_region, costs, stop_costs, keep)
        terms += selective_terms(model, member, in_region, keep, keep_region_cost, call_costs)
        terms += [(kept_cost, kept_of(keep, j)) for j in keep] if kept_cost else []
        terms += [(cost, in_region[i]) for i, cost in enumerate(pack_costs)]  # checkpoint's hooks
        terms += runs + starts
        objective = sum(cost * var for cost, var in terms if cost)
    model.minimize(objective)
    return IlpModel(model, member, in_region, alive, into_backward, prefix, scale, budget, costs,
                    objective, region_cost, problem, stop_costs, keep, keep_region_cost, call_costs, pack_costs,
                    kept_cost)


def scaled_cost(built: IlpModel, regions: tuple[range, ...], kept: Collection[int] = ()) -> int:
    """A plan's objective value in the model's scaled units.

    Example:
        >>> scaled_cost(built, (range(2, 5),), (3,)) / built.objective_scale
        4.0
    """
    problem = built.problem
    assert problem is not None
    kept = frozenset(kept)
    total = built.region_cost * len(regions)
    for region in regions:
        total += sum(built.pack_costs[i] for i in region) if built.pack_costs else 0
        total += round(problem.run_ms(region) * built.objective_scale)  # (0 where it is no run)
        recomputed = problem.recomputed(region)
        if recomputed:
            last = recomputed.stop - 1
            total += sum(built.costs[i] for i in recomputed[:-1] if i not in kept)
            total += 0 if last in kept else built.stop_costs[last]
        if kept.intersection(region):  # its selective-checkpoint policy
            total += built.keep_region_cost + sum(built.call_costs[i] for i in (*region, *recomputed))
            total += built.kept_cost * len(kept.intersection(region))
    return total


def bound_by_optimum(built: IlpModel, regions: tuple[range, ...], kept: Collection[int] = ()) -> int:
    """Add `objective >= cost of the plan - slack`, where `regions` and `kept` are a plan proven
    optimal on the same decision space (dp's OPTIMAL plans: every contiguous region with a
    startable start and every choice of its keep candidates, judged by the same simulator,
    which is what this model encodes too). The slack covers the rounding of each cost term to
    the integer scale (< 1/2 each, at most five per node) and float sums; it is returned so the
    solver can stop once its gap is within it.

    Example:
        >>> slack = bound_by_optimum(built, dp.regions, dp.kept)
    """
    value = scaled_cost(built, regions, kept)
    slack = 3 * len(built.costs) + math.ceil(1e-9 * value) + 1
    built.model.add(built.objective >= value - slack)
    return slack


__all__ = ["IlpModel", "bound_by_optimum", "build_model", "load_cp_model", "scaled_cost"]
