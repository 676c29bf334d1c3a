"""A lower bound on the recompute cost of any plan that fits a budget, whatever its regions.

The exact solvers prove a plan the cheapest of their decision space (for the planner: regions
that are whole submodule calls). This bound holds for every plan of whole graph nodes: any runs
of nodes as regions, any nodes kept inside them. It says how much of a plan's cost the budget
itself forces, and so whether a target can be met at all at graph-node granularity.

The relaxation. Let x_j in [0, 1] say how much of node j is recomputed. A node that is not
recomputed (outside every region, kept, or past its region's stop) holds each of its buffers
at least as long as in the unplanned step: a region only ever extends its inputs' lifetimes.
A recomputed node holds at least what backward needs of it: its saved tensors at its own
backward, and its output from the first to the last backward of a node that saved it. Gradients, temporaries and static memory do not
depend on the plan. So at every step s of the unplanned timeline, which every plan also
walks through (recomputation only inserts steps),

    static + fixed(s) + sum_j owned_j(s) * (1 - x_j)  <=  budget,

and a recomputed node costs at least `NodeCost.stop_cost_ms`. The least sum_j stop_cost_j * x_j
under these constraints (a linear program, solved by GLOP) is the bound. Region overheads and
the selective policy's cost only add to a real plan's cost, so they are left out.

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
from solvers.simulate import plan_buffers

# GLOP stops within feasibility tolerances of about 1e-7 per column: shave this share off
# before calling its objective a bound.
BOUND_TOLERANCE = 1e-6


@dataclass(frozen=True)
class RecomputeBound:
    """The least recompute time (ms) any plan of whole graph nodes needs to fit the budget;
    `math.inf` where recomputing every recomputable node would still not fit.

    Example:
        >>> RecomputeBound(12.5).fits
        True
    """

    recompute_ms: float

    @property
    def fits(self) -> bool:
        return self.recompute_ms < math.inf


def recompute_lower_bound(problem: Problem, budget_bytes: int) -> RecomputeBound:
    """Solve the relaxation above for `problem` at `budget_bytes`.

    Example:
        >>> recompute_lower_bound(problem, budget_bytes=10**9).recompute_ms
        0.0
    """
    from ortools.linear_solver import pywraplp

    buffers = plan_buffers(problem, ())
    steps = len(buffers.labels)
    fixed = list(buffers.transient)  # per step: what no plan can drop
    owned: list[dict[int, int]] = [defaultdict(int) for _ in range(steps)]  # step -> owner -> bytes
    savers: dict[int, list[int]] = defaultdict(list)  # owner -> the nodes that save its output
    for k, node in enumerate(problem.nodes):
        for owner in node.saves:
            savers[owner].append(k)
    for owner, kind, size, first, last in buffers.held:
        forced = (_forced_steps(buffers.backward_step, owner, kind, savers.get(owner, []))
                  if owner >= 0 and problem.nodes[owner].recomputable else None)
        for step in range(first, last + 1):
            if forced is not None and step not in forced:
                owned[step][owner] += size
            else:
                fixed[step] += size
    allowance = budget_bytes - problem.static_bytes
    needs = [(step, sum(owned[step].values()) + fixed[step] - allowance) for step in range(steps)]
    needs = [(step, need) for step, need in needs if need > 0]
    if not needs:
        return RecomputeBound(0.0)
    if any(sum(owned[step].values()) < need for step, need in needs):
        return RecomputeBound(math.inf)

    solver = pywraplp.Solver.CreateSolver("GLOP")
    variables: dict[int, object] = {}
    for step, need in needs:
        for owner in owned[step]:
            if owner not in variables:
                variables[owner] = solver.NumVar(0.0, 1.0, f"x{owner}")
        # bytes dropped at this step >= what the step is over by (in units of it: GLOP wants
        # coefficients near 1)
        solver.Add(sum(size / need * variables[owner] for owner, size in owned[step].items()) >= 1.0)
    solver.Minimize(sum(problem.nodes[owner].stop_cost_ms * variable for owner, variable in variables.items()))
    status = solver.Solve()
    if status == pywraplp.Solver.INFEASIBLE:
        return RecomputeBound(math.inf)
    if status != pywraplp.Solver.OPTIMAL:
        raise RuntimeError(f"GLOP could not solve the recompute bound's LP (status {status})")
    return RecomputeBound(max(0.0, solver.Objective().Value() * (1 - BOUND_TOLERANCE)))


def _forced_steps(backward_step: tuple[int, ...], owner: int, kind: str, savers: list[int]) -> range:
    """The unplanned steps at which a buffer of `owner` is alive even if `owner` is recomputed:
    its saved tensors at its own backward, its output from the first to the last backward of a
    node that saved it (`savers`; one recomputed copy serves them all)."""
    if kind == "saved":
        return range(backward_step[owner], backward_step[owner] + 1)
    if not savers:
        return range(0)
    return range(backward_step[max(savers)], backward_step[min(savers)] + 1)
