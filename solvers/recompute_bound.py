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
  forward ends); its saved tensors as they are made;
- what backward needs of a recomputed node: its saved tensors at its own backward, its output
  at the backward of each node that saved it.
Past that, a node's saved tensors go only if it is recomputed (x_j); so does its output, but
while the backward of a later node that saved it is still to come, only if it is recomputed in
full (f_j): that node's recomputation reads it, so recomputation does not stop at it.

Recomputation needs its inputs. A node j recomputed reads the output of each node i it uses:
either i is recomputed in full before it, or i's output is kept from forward (a region's input,
or a node the region keeps) and so alive when forward ends. Where the unplanned step frees i's
output during forward, keeping it (a_i) adds its bytes to every forward step after that. So

    static + fixed(s) + sum_j dropped by x_j or f_j (1 - x_j or f_j) + sum_i a_i kept_i(s) <= budget,
    x_j <= f_i + a_i for each i that j uses,

and recomputation costs sum_j stop_cost_j x_j + (compute_j - stop_cost_j) f_j. Without the last
rows a bound could free attention's probabilities by recomputing the softmax alone, as if its
input were still there.

Regions cost more than their recomputation, and on a CPU that can be most of a plan built of
many small regions. Each node is in a region (y_j) where it is recomputed (x_j), kept by the
region's policy (k_j, keepable nodes) or past the region's last saving node (t_j, recomputation
stopped before it): y_j = x_j + k_j + t_j. A region starts (s_j) wherever y_j follows a node
in none, and also where a node recomputed or kept follows one past the last saving node (no
region recomputes beyond its stop). Each start costs at least a checkpoint call (`region_overhead_ms`,
less a run's negative `run_region_ms` where runs are allowed), each node in a region
`saved_tensor_ms` per tensor it saves, each kept node `kept_node_ms` and `keep_call_ms` per ATen
call. A node j in a region that reads an output i from outside it (some node in i+1..j does not
share a region with the one before it, b_m) makes i the region's input: checkpoint keeps it until
the region's backward is done, so a freed output is held at every backward step up to j's too.
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
from collections import defaultdict
from dataclasses import dataclass

from solvers.problem import Problem
from solvers.simulate import Buffers, plan_buffers

# SCIP and GLOP stop within feasibility tolerances of about 1e-7 to 1e-6 per row: shave this
# share off before calling an objective a bound.
BOUND_TOLERANCE = 1e-6
# SCIP stops once its proven bound is within this share of its best plan: the bound it reports
# is valid either way, and closing the last percent can take minutes on a model's graph.
MIP_GAP = 0.02

Droppable = tuple[str, int]  # ("x", node): its saved tensors; ("f", node): its output


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
    fixed, droppable = _split_buffers(problem, buffers)
    dropped_at_most = [sum(bytes_by_key.values()) for bytes_by_key in droppable]
    allowance = budget_bytes - problem.static_bytes
    if all(most + bytes_fixed <= allowance for most, bytes_fixed in zip(dropped_at_most, fixed)):
        return RecomputeBound(0.0)
    kept_inputs = _kept_inputs(problem, buffers)
    held_until = _held_until(problem, buffers.backward_step, kept_inputs)
    rows = _memory_rows(fixed, dropped_at_most, kept_inputs, held_until, allowance, len(problem) - 1)
    if any(dropped_at_most[step] < need for step, need in rows):
        return RecomputeBound(math.inf)
    program = _Program(problem, droppable, kept_inputs, held_until, buffers.backward_step, rows)
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
class _Program:
    """The program of the module docstring, built into an OR-Tools solver."""

    problem: Problem
    droppable: list[dict[Droppable, int]]
    kept_inputs: dict[int, tuple[int, int]]
    held_until: dict[int, int]
    backward_step: tuple[int, ...]
    rows: list[tuple[int, int]]

    def build(self, solver, integral: bool) -> None:
        """Variables, rows and objective into `solver`: 0/1 variables where `integral`, else
        their linear relaxation."""
        self.solver = solver
        self.integral = integral
        nodes = self.problem.nodes
        end_of_forward = len(nodes) - 1
        recomputed = {j: self.variable(f"x{j}") for j, node in enumerate(nodes) if node.recomputable}
        in_full = {j: self.variable(f"f{j}") for j in recomputed}
        kept = {i: self.variable(f"a{i}") for i in self.kept_inputs}
        variables = {"x": recomputed, "f": in_full}
        for j, x in recomputed.items():
            solver.Add(in_full[j] <= x)
            for i in set(nodes[j].uses):
                if i in kept:
                    solver.Add(x <= in_full.get(i, 0.0) + kept[i])
        region_cost = self.regions(recomputed)
        held = self.held_inputs()
        for step, need in self.rows:
            # bytes dropped at this step, less those kept for recomputation, >= what the step
            # is over by (in units of the largest term: the solvers want coefficients near 1)
            terms = [(size, variables[kind][owner]) for (kind, owner), size in self.droppable[step].items()]
            terms += [(-size, kept[i]) for i, (after, size) in self.kept_inputs.items()
                      if after < step <= end_of_forward]
            terms += [(-self.kept_inputs[i][1], alive) for i, alive in held.get(step, {}).items()]
            scale = max(abs(need), *(abs(size) for size, _ in terms))
            solver.Add(sum(size / scale * variable for size, variable in terms) >= need / scale)
        recompute = sum(nodes[j].stop_cost_ms * x + (nodes[j].compute_ms - nodes[j].stop_cost_ms) * in_full[j]
                        for j, x in recomputed.items())
        solver.Minimize(recompute + region_cost)

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
        past_stop = {j: self.variable(f"t{j}") for j in recomputed}
        self.apart: dict[int, object] = {}
        cost = 0.0
        for j, x in recomputed.items():
            y = self.in_region[j]
            solver.Add(y == x + kept.get(j, 0.0) + past_stop[j])
            start = self.bounded(f"s{j}")
            solver.Add(start >= y - self.in_region.get(j - 1, 0.0))
            if j - 1 in past_stop:  # past the stop, the rest of the region is too
                solver.Add(start >= y - past_stop[j] + past_stop[j - 1] - 1)
            self.apart[j] = self.bounded(f"b{j}")
            solver.Add(self.apart[j] >= start)
            solver.Add(self.apart[j] >= 1 - y)
            cost += per_start * start + problem.saved_tensor_ms * nodes[j].saved_tensors * y
        for j, k in kept.items():
            cost += (problem.kept_node_ms + problem.keep_call_ms * nodes[j].aten_calls) * k
        return cost

    def held_inputs(self) -> dict[int, dict[int, object]]:
        """Backward row step -> {kept input i: whether a region still holds it}. A node j in a
        region that reads i from outside it makes i the region's input, which checkpoint keeps
        until the region's backward is done, past j's: alive at every row up to j's backward."""
        solver, nodes = self.solver, self.problem.nodes
        end_of_forward = len(nodes) - 1
        backward_rows = sorted(step for step, _ in self.rows if step > end_of_forward)
        held: dict[int, dict[int, object]] = defaultdict(dict)
        for i, until in self.held_until.items():
            steps = [step for step in backward_rows if step <= until]
            for step in steps:
                held[step][i] = self.bounded(f"h{i}_{step}")
            for earlier, later in zip(steps, steps[1:]):  # held over one interval
                solver.Add(held[earlier][i] >= held[later][i])
        for j, node in enumerate(nodes):
            reached = [step for step in backward_rows if step <= self.backward_step[j]]
            if j not in self.in_region or not reached:
                continue
            for i in {*node.uses, *node.arguments} & self.held_until.keys():
                if i < j:
                    solver.Add(held[reached[-1]][i] >= self.in_region[j] + self.outside(i, j) - 1)
        return held

    def outside(self, i: int, j: int):
        """1 where node i lies in no region with node j (a later node): some node in i+1..j does
        not share a region with the one before it (always so where one of them is in none)."""
        if any(m not in self.apart for m in range(i + 1, j + 1)):
            return 1.0
        outside = self.bounded(f"o{i}_{j}")
        for m in range(i + 1, j + 1):
            self.solver.Add(outside >= self.apart[m])
        return outside


def _split_buffers(problem: Problem, buffers: Buffers) -> tuple[list[int], list[dict[Droppable, int]]]:
    """Per step of the unplanned timeline: the bytes no plan can drop, and the bytes a plan
    may drop by recomputing a node (keyed by the variable that drops them)."""
    nodes = problem.nodes
    end_of_forward = len(nodes) - 1
    fixed = list(buffers.transient)
    droppable: list[dict[Droppable, int]] = [defaultdict(int) for _ in fixed]
    savers: dict[int, list[int]] = defaultdict(list)  # owner -> the nodes that save its output
    forward_until = list(range(len(nodes)))  # owner -> the last step forward references its output
    for k, node in enumerate(nodes):
        for owner in node.saves:
            savers[owner].append(k)
        for owner in (*node.uses, *node.holds, *node.arguments):
            forward_until[owner] = max(forward_until[owner], k)
        if node.is_output:
            forward_until[k] = end_of_forward
    for owner, kind, size, first, last in buffers.held:
        if owner < 0 or not nodes[owner].recomputable or kind not in ("output", "saved"):
            for step in range(first, last + 1):
                fixed[step] += size
            continue
        forced = _forced_steps(buffers.backward_step, owner, kind, savers.get(owner, []))
        kept_until = forward_until[owner] if kind == "output" else first
        # While a later node's backward still needs it, an output dropped comes back only from
        # a recomputation that goes on past it (in full); after that, only its own backward
        # needs it, also from a recomputation that stops at it.
        later_needs = max((buffers.backward_step[k] for k in savers.get(owner, []) if k != owner), default=-1)
        for step in range(first, last + 1):
            if step <= kept_until or step in forced:
                fixed[step] += size
            else:
                key = ("f" if kind == "output" and step < later_needs else "x", owner)
                droppable[step][key] += size
    return fixed, droppable


def _kept_inputs(problem: Problem, buffers: Buffers) -> dict[int, tuple[int, int]]:
    """Nodes whose output the unplanned step frees before forward ends, as node -> (the last
    step it is alive, its bytes): kept for a recomputation, it stays until forward ends."""
    end_of_forward = len(problem) - 1
    freed: dict[int, tuple[int, int]] = {}
    for owner, kind, size, _first, last in buffers.held:
        if kind == "output" and owner >= 0 and last < end_of_forward:
            freed[owner] = (last, size)
    return freed


def _held_until(problem: Problem, backward_step: tuple[int, ...],
                kept_inputs: dict[int, tuple[int, int]]) -> dict[int, int]:
    """Kept input i -> the last unplanned step at which a region may still hold it: the
    backward of the last recomputable node that reads it (a region's input stays until the
    region's backward is done)."""
    until: dict[int, int] = {}
    for j, node in enumerate(problem.nodes):
        if node.recomputable:
            for i in {*node.uses, *node.arguments}:
                if i in kept_inputs and i < j:
                    until[i] = max(until.get(i, -1), backward_step[j])
    return until


def _memory_rows(fixed: list[int], dropped_at_most: list[int], kept_inputs: dict[int, tuple[int, int]],
                 held_until: dict[int, int], allowance: int, end_of_forward: int) -> list[tuple[int, int]]:
    """(step, bytes over the allowance in the unplanned step) for each step that could go over
    it: over already, or a step where keeping every freed output a plan may keep would."""
    kept_after = [0] * (len(fixed) + 1)  # step -> bytes of freed outputs a plan may keep there
    for i, (after, size) in kept_inputs.items():
        last = max(end_of_forward, held_until.get(i, -1))
        kept_after[after + 1] += size
        kept_after[last + 1] -= size
    for step in range(1, len(fixed)):
        kept_after[step] += kept_after[step - 1]
    rows = []
    for step, bytes_fixed in enumerate(fixed):
        need = dropped_at_most[step] + bytes_fixed - allowance
        if need > 0 or need + kept_after[step] > 0:
            rows.append((step, need))
    return rows


def _forced_steps(backward_step: tuple[int, ...], owner: int, kind: str, savers: list[int]) -> set[int]:
    """The unplanned steps at which a buffer of `owner` is alive even if `owner` is recomputed:
    its saved tensors at its own backward, its output at the backward of each node that saved it
    (`savers`). Between two of those it may be gone: savers in different regions, or outside
    any, each keep their own copy."""
    if kind == "saved":
        return {backward_step[owner]}
    return {backward_step[k] for k in savers}
