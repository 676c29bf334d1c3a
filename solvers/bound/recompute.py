"""A lower bound on the recompute cost of any plan that fits a budget, whatever its regions.

The exact solvers prove a plan the cheapest of their decision space (for the planner: regions
that are whole submodule calls). This bound holds for every plan of whole graph nodes: any runs
of nodes as regions, any nodes kept inside them. It says how much of a plan's cost the budget
itself forces, and so whether a target can be met at all at graph-node granularity.

The relaxation, over the steps of the unplanned timeline, which every plan also walks through
(recomputation only inserts steps). For each node j, x_j (0 or 1) says whether it is recomputed
up to its last saved tensor (cost `NodeCost.stop_cost_ms`) and f_j <= x_j whether in full,
output made (the rest of its `compute_ms`). What a plan cannot change:
- gradients, temporaries, static memory, and what unrecomputable nodes hold;
- a node's output until its last forward use (the model's code reads it; a graph output until
  the loss has run); its saved tensors as they are made;
- what backward needs of a recomputed node: its saved tensors at its own backward, its output
  at the backward of each node that saved it.
Past that, a node's saved tensors go only if it is recomputed (x_j); so does its output, but
while the backward of a later node that saved it is still to come, only if it is recomputed in
full (f_j) and that node lies in its region: its recomputation reads the output, so does not
stop at it, and a saver in no region holds what it saved from forward, one in another region
holds it as that region's input.

Recomputation needs its inputs. A node j recomputed reads the output of each node i it uses:
either i is recomputed in full before it, or i's output is kept from forward (a region's input,
or a node the region keeps) and so alive when forward ends. Where the unplanned step frees i's
output during forward, keeping it (a_i, at least k_i below) adds its bytes to every forward step
after that. So

    static + fixed(s) + sum_j dropped by x_j or f_j (1 - x_j or f_j) + sum_i a_i kept_i(s) <= budget,
    x_j <= f_i + a_i for each i that j uses,

and recomputation costs sum_j stop_cost_j x_j + (compute_j - stop_cost_j) f_j. Without the last
rows a bound could free attention's probabilities by recomputing the softmax alone, as if its
input were still there.

Regions cost more than their recomputation, and on a CPU that can be most of a plan built of
many small regions. Each node is in a region (y_j) where it is recomputed (x_j), kept by the
region's policy (k_j, keepable nodes) or past the region's last saving node (t_j, recomputation
stopped before it; so it saves nothing): y_j = x_j + k_j + t_j. A region starts (s_j) wherever
y_j follows a node in none, and also where a node recomputed or kept follows one past the last
saving node (no region recomputes beyond its stop). Each start costs at least a checkpoint call
(`region_overhead_ms`, less a run's negative `run_region_ms` where runs are allowed), each node
in a region `saved_tensor_ms` per tensor it saves, each kept node `kept_node_ms`. A region that
keeps a node pays its selective policy (p_j: j lies in one): `keep_region_ms` once, and
`keep_call_ms` per ATen call of each of its nodes in forward and of each its recomputation
reaches. Inside a region, recomputation runs in full every node before the last it reaches (so
at most one node per region is recomputed short of its output, and none it reaches follows a
node past the stop), and a recomputed node reads each input made in its region from that
recomputation or from the policy. A node j in a region that reads an output i from outside it
(some node in i+1..j does not share a region with the one before it, b_m) makes i the region's
input: checkpoint keeps it until the region's backward is done, so a freed output is held at
every backward step up to j's too. Backward recomputes a region at its last node that saves,
so a node the region keeps holds its output until then (at the backward of the nodes past the
region), and from then on what the recomputation made is back: a recomputed node's saved
tensors until its own backward, an output until the backward of the nodes of the region that
saved it (`solvers.bound.backward`, within `REVIVAL_WINDOW` nodes; without these rows, a bound
would count a region's tensors as gone at the backward of its own nodes).
Every real plan maps onto 0/1 values of these variables at no more than its cost, so the least
cost of this integer program is the bound: SCIP's proven bound, once within `MIP_GAP` of its best
plan or at the time limit; the linear relaxation where SCIP finds nothing in time.

Example:
    >>> bound = recompute_lower_bound(problem, budget_bytes=2**30)
    >>> bound.recompute_ms <= solve(problem, 2**30, method="dp").recompute_ms
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from solvers.bound.backward import BackwardHolds
from solvers.bound.rows import (
    Droppable,
    held_until,
    kept_inputs,
    memory_rows,
    split_buffers,
)
from solvers.problem import Problem
from solvers.simulate import plan_buffers

# SCIP and GLOP stop within feasibility tolerances of about 1e-7 to 1e-6 per row: shave this
# share off before calling an objective a bound.
BOUND_TOLERANCE = 1e-6
# SCIP stops once its proven bound is within this share of its best plan: the bound it reports
# is valid either way, and closing the last percent can take minutes on a model's graph.
MIP_GAP = 0.02


@dataclass(frozen=True)
class RecomputeBound:
    """The least recompute time (ms) any plan of whole graph nodes needs to fit the budget;
    `math.inf` where recomputing every recomputable node would still not fit. `exact`: SCIP
    closed the integer program's gap to `MIP_GAP`; False where the time limit stopped it first
    (`recompute_ms` is then the bound it had proven: still a lower bound, a weaker one).

    Example:
        >>> RecomputeBound(12.5).fits
        True
    """

    recompute_ms: float
    exact: bool = True

    @property
    def fits(self) -> bool:
        return self.recompute_ms < math.inf


def recompute_lower_bound(problem: Problem, budget_bytes: int, time_limit_s: float = 20.0) -> RecomputeBound:
    """Solve the integer program above for `problem` at `budget_bytes`, for at most
    `time_limit_s` seconds.

    Example:
        >>> recompute_lower_bound(problem, budget_bytes=10**9).recompute_ms
        0.0
    """
    from ortools.linear_solver import pywraplp

    buffers = plan_buffers(problem, ())
    fixed, droppable = split_buffers(problem, buffers)
    dropped_at_most = [sum(bytes_by_key.values()) for bytes_by_key in droppable]
    allowance = budget_bytes - problem.static_bytes
    if all(most + bytes_fixed <= allowance for most, bytes_fixed in zip(dropped_at_most, fixed)):
        return RecomputeBound(0.0)
    freed = kept_inputs(problem, buffers)
    held_to = held_until(problem, buffers.backward_step, freed)
    rows = memory_rows(fixed, dropped_at_most, freed, held_to, allowance, buffers.loss_step)
    if any(dropped_at_most[step] < need for step, need in rows):
        return RecomputeBound(math.inf)
    program = _Program(problem, droppable, freed, held_to, buffers.backward_step, buffers.loss_step, rows)
    for backend in ("SCIP", "GLOP"):  # GLOP: the linear relaxation, where SCIP found nothing in time
        solver = pywraplp.Solver.CreateSolver(backend)
        solver.SetTimeLimit(int(time_limit_s * 1000))
        program.build(solver, integral=backend == "SCIP")
        parameters = pywraplp.MPSolverParameters()
        parameters.SetDoubleParam(parameters.RELATIVE_MIP_GAP, MIP_GAP)
        status = solver.Solve(parameters)
        if status == pywraplp.Solver.INFEASIBLE:
            return RecomputeBound(math.inf)
        if status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
            exact = backend == "SCIP" and status == pywraplp.Solver.OPTIMAL
            value = solver.Objective().BestBound() if backend == "SCIP" else solver.Objective().Value()
            return RecomputeBound(max(0.0, value * (1 - BOUND_TOLERANCE)), exact)
    raise RuntimeError(f"GLOP could not solve the recompute bound's linear relaxation (status {status})")


@dataclass
class _Program(BackwardHolds):
    """The program of the module docstring, built into an OR-Tools solver."""

    problem: Problem
    droppable: list[dict[Droppable, int]]
    kept_inputs: dict[int, tuple[int, int]]
    held_until: dict[int, int]
    backward_step: tuple[int, ...]
    loss_step: int  # (after forward, before backward: `solvers.simulate.Buffers.loss_step`)
    rows: list[tuple[int, int]]

    def build(self, solver, integral: bool) -> None:
        """Variables, rows and objective into `solver`: 0/1 variables where `integral`, else
        their linear relaxation."""
        self.solver = solver
        self.integral = integral
        self.gone: dict[Droppable, object] = {}
        nodes = self.problem.nodes
        recomputed = {j: self.variable(f"x{j}") for j, node in enumerate(nodes) if node.recomputable}
        self.recomputed = recomputed
        in_full = {j: self.variable(f"f{j}") for j in recomputed}
        kept = {i: self.variable(f"a{i}") for i in self.kept_inputs}
        variables = {"x": recomputed, "f": in_full}
        for j, x in recomputed.items():
            solver.Add(in_full[j] <= x)
            for i in set(nodes[j].uses):
                if i in kept:
                    solver.Add(x <= in_full.get(i, 0.0) + kept[i])
        region_cost = self.regions(recomputed)
        self.inside_regions(recomputed, in_full)
        for i, k in self.keeps.items():  # a policy holds what it keeps until recomputation
            if i in kept:
                solver.Add(kept[i] >= k)
        node_at = self.node_at = {step: j for j, step in enumerate(self.backward_step)}
        held = self.held_inputs()
        self.recomputed_by = self.reached_back()
        for step, need in self.rows:
            # bytes dropped at this step, less those kept for recomputation, >= what the step
            # is over by (in units of the largest term: the solvers want coefficients near 1)
            terms = [(size, self.dropped(key, variables, node_at.get(step)))
                     for key, size in self.droppable[step].items()]
            if step in node_at:
                terms += self.recomputed_saved(node_at[step], self.droppable[step])
            terms += [(-size, kept[i]) for i, (after, size) in self.kept_inputs.items()
                      if after < step <= self.loss_step]
            terms += [(-self.kept_inputs[i][1], alive) for i, alive in held.get(step, {}).items()]
            scale = max(abs(need), *(abs(size) for size, _ in terms))
            solver.Add(sum(size / scale * variable for size, variable in terms) >= need / scale)
        recompute = sum(nodes[j].stop_cost_ms * x + (nodes[j].compute_ms - nodes[j].stop_cost_ms) * in_full[j]
                        for j, x in recomputed.items())
        solver.Minimize(recompute + region_cost)

    def dropped(self, key: Droppable, variables: dict, backward_of: int | None = None) -> object:
        """Whether the bytes of `key` are gone: its node recomputed (x) or recomputed in full
        (f), and each node that saved it and has yet to run its backward in its region (one in
        none holds what it saved from forward, one in another region holds it as its input).
        At the backward of node `backward_of`, such an output is back once its region has been
        recomputed (`recomputed_before`): held until those savers' backward."""
        kind, owner, savers = key
        if not savers:
            return variables[kind][owner]
        found = self.gone.get(key)
        if found is None:
            found = self.gone[key] = self.bounded(f"d{owner}_{len(self.gone)}")
            self.solver.Add(found <= variables[kind][owner])
            for m in range(owner + 1, max(savers) + 1):  # the owner in each saver's region
                self.solver.Add(found <= 1 - self.apart[m] if m in self.apart else found <= 0)
        recomputed_by = None if backward_of is None else self.recomputed_before(owner, backward_of)
        if recomputed_by is None:
            return found
        still_gone = self.bounded(f"d{owner}_{backward_of}")
        self.solver.Add(still_gone <= found)
        self.solver.Add(still_gone <= 1 - recomputed_by)
        return still_gone

    def variable(self, name: str):
        return self.solver.BoolVar(name) if self.integral else self.solver.NumVar(0.0, 1.0, name)

    def bounded(self, name: str):
        """A variable in [0, 1] that rows only push up and nothing rewards: 0/1 at the optimum
        where what pushes it is."""
        return self.solver.NumVar(0.0, 1.0, name)

    def regions(self, recomputed: dict) -> object:
        """Which nodes lie in regions (y), where regions start (s) and where a node does not
        share a region with the one before it (b), and what the regions cost at least beyond
        recomputation (the module docstring): an expression."""
        solver, problem = self.solver, self.problem
        nodes = problem.nodes
        per_start = problem.region_overhead_ms + (min(0.0, problem.run_region_ms) if problem.run_spans else 0.0)
        self.in_region = {j: self.variable(f"y{j}") for j in recomputed}
        kept = {j: self.variable(f"k{j}") for j in recomputed if nodes[j].keepable}
        # (only a node that saves no tensor can be past its region's stop)
        past_stop = {j: self.variable(f"t{j}") for j in recomputed if not nodes[j].saves_for_backward}
        self.apart: dict[int, object] = {}
        self.apart_after: dict[int, list] = {}  # i -> `outside(i, j)` for j = i + 1, i + 2, ...
        self.starts: dict[int, object] = {}
        cost = 0.0
        for j, x in recomputed.items():
            y = self.in_region[j]
            solver.Add(y == x + kept.get(j, 0.0) + past_stop.get(j, 0.0))
            start = self.bounded(f"s{j}")
            solver.Add(start >= y - self.in_region.get(j - 1, 0.0))
            if j - 1 in past_stop:  # past the stop, the rest of the region is too
                solver.Add(start >= y - past_stop.get(j, 0.0) + past_stop[j - 1] - 1)
            self.apart[j] = self.bounded(f"b{j}")
            solver.Add(self.apart[j] >= start)
            solver.Add(self.apart[j] >= 1 - y)
            solver.Add(start >= self.apart[j] + y - 1)  # in a region, apart from j - 1: it starts one
            self.starts[j] = start
            cost += per_start * start + problem.saved_tensor_ms * nodes[j].saved_tensors * y
        self.keeps, self.past_stop = kept, past_stop
        for j, k in kept.items():
            cost += problem.kept_node_ms * k
        if kept and (problem.keep_region_ms or problem.keep_call_ms):
            cost += self.policies(recomputed, kept, past_stop)
        return cost

    def inside_regions(self, recomputed: dict, in_full: dict) -> None:
        """What recomputation inside one region implies. It runs each node it reaches in full
        up to the last one it reaches: g_j says it reaches some node after j in j's region
        (recomputed or kept), and then j is in full (f_j >= x_j + g_j - 1) and not past the
        stop (t_j <= 1 - g_j). At most one node per region is recomputed short of its output,
        so up to any node there are as many region starts. And a recomputed node reads
        each input made inside its region from that recomputation or from the region's
        policy: x_j <= f_i + k_i + (i and j apart)."""
        solver, nodes = self.solver, self.problem.nodes
        goes_on: dict[int, object] = {}
        for j in sorted(recomputed, reverse=True):
            if j + 1 not in recomputed:
                continue
            goes_on[j] = self.bounded(f"g{j}")
            reached = recomputed[j + 1] + self.keeps.get(j + 1, 0.0)
            solver.Add(goes_on[j] >= reached - self.starts[j + 1])
            if j + 1 in goes_on:
                solver.Add(goes_on[j] >= goes_on[j + 1] - self.starts[j + 1] - (1 - self.in_region[j + 1]))
            solver.Add(in_full[j] >= recomputed[j] + goes_on[j] - 1)
            if j in self.past_stop:
                solver.Add(self.past_stop[j] <= 1 - goes_on[j])
        slack = 0.0
        for j in sorted(recomputed):
            slack = slack + self.starts[j] - (recomputed[j] - in_full[j])
            named = solver.NumVar(0.0, solver.infinity(), f"c{j}")
            solver.Add(named == slack)
            slack = named
        for j, x in recomputed.items():
            for i in set(nodes[j].uses):
                # i in no region, or a region starting after it: i and j are apart
                if i < j and all(m in self.starts for m in range(i, j + 1)):
                    from_inside = in_full[i] + self.keeps.get(i, 0.0)
                    solver.Add(x <= from_inside + 1 - self.in_region[i]
                               + sum(self.starts[m] for m in range(i + 1, j + 1)))
                    solver.Add(x <= from_inside + sum(self.apart[m] for m in range(i + 1, j + 1)))

    def policies(self, recomputed: dict, kept: dict, past_stop: dict) -> object:
        """What selective-checkpoint policies cost at least: a region that keeps a node pays
        `keep_region_ms` once and `keep_call_ms` per ATen call of each of its nodes in forward
        and of each it recomputes or keeps. p_j: node j lies in such a region (1 where it keeps
        j, and the same for two nodes not apart); q_j: such a region starts at j; r_j: j is in
        one and reached by its recomputation."""
        solver, problem = self.solver, self.problem
        calls = {j: problem.nodes[j].aten_calls for j in recomputed}
        policy = {j: self.bounded(f"p{j}") for j in recomputed}
        cost = 0.0
        for j, p in policy.items():
            if j in kept:
                solver.Add(p >= kept[j])
            if j - 1 in policy:  # one region, one policy
                solver.Add(p >= policy[j - 1] - self.apart[j])
                solver.Add(policy[j - 1] >= p - self.apart[j])
            starts_policy = self.bounded(f"q{j}")
            solver.Add(starts_policy >= p + self.starts[j] - 1)
            solver.Add(starts_policy >= p - policy.get(j - 1, 0.0))
            reached = self.bounded(f"r{j}")
            solver.Add(reached >= p - past_stop.get(j, 0.0) + self.in_region[j] - 1)
            if j in kept:
                solver.Add(reached >= kept[j])
            cost += problem.keep_region_ms * starts_policy + problem.keep_call_ms * calls[j] * (p + reached)
        return cost


__all__ = ["BOUND_TOLERANCE", "MIP_GAP", "RecomputeBound", "recompute_lower_bound"]
