"""A lower bound on the recompute cost of any plan that fits a budget, whatever its regions.

The exact solvers prove a plan the cheapest of their decision space (for the planner: regions
that are whole submodule calls). This bound holds for every plan of whole graph nodes: any runs
of nodes as regions, any nodes kept inside them. It says how much of a plan's cost the budget
itself forces, and so whether a target can be met at all at graph-node granularity.

The relaxation, over the steps of the unplanned timeline, which every plan also walks through
(recomputation only inserts steps). For each node j, x_j in [0, 1] says how much of it is
recomputed up to its last saved tensor (cost `NodeCost.stop_cost_ms`) and f_j <= x_j how much
in full, output made (the rest of its `compute_ms`). What a plan cannot change:
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

and the least sum_j stop_cost_j x_j + (compute_j - stop_cost_j) f_j (a linear program, solved by
GLOP) is the bound. Without the last rows a bound could free attention's probabilities by
recomputing the softmax alone, as if its input were still there. Region overheads and the
selective policy's cost only add to a real plan's cost, so they are left out.

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

# GLOP stops within feasibility tolerances of about 1e-7 per column: shave this share off
# before calling its objective a bound.
BOUND_TOLERANCE = 1e-6

Droppable = tuple[str, int]  # ("x", node): its saved tensors; ("f", node): its output


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
    fixed, droppable = _split_buffers(problem, buffers)
    dropped_at_most = [sum(bytes_by_key.values()) for bytes_by_key in droppable]
    allowance = budget_bytes - problem.static_bytes
    if all(most + bytes_fixed <= allowance for most, bytes_fixed in zip(dropped_at_most, fixed)):
        return RecomputeBound(0.0)
    kept_inputs = _kept_inputs(problem, buffers)
    end_of_forward = len(problem) - 1
    rows = _memory_rows(fixed, dropped_at_most, kept_inputs, allowance, end_of_forward)
    if any(dropped_at_most[step] < need for step, need in rows):
        return RecomputeBound(math.inf)

    solver = pywraplp.Solver.CreateSolver("GLOP")
    nodes = problem.nodes
    recomputed = {j: solver.NumVar(0.0, 1.0, f"x{j}") for j, node in enumerate(nodes) if node.recomputable}
    in_full = {j: solver.NumVar(0.0, 1.0, f"f{j}") for j in recomputed}
    kept = {i: solver.NumVar(0.0, 1.0, f"a{i}") for i in kept_inputs}
    variables = {"x": recomputed, "f": in_full}
    for j, x in recomputed.items():
        solver.Add(in_full[j] <= x)
        for i in set(nodes[j].uses):
            if i in kept:
                solver.Add(x <= in_full.get(i, 0.0) + kept[i])
    for step, need in rows:
        # bytes dropped at this step, less those kept for recomputation, >= what the step is
        # over by (in units of the largest term: GLOP wants coefficients near 1)
        terms = [(size, variables[kind][owner]) for (kind, owner), size in droppable[step].items()]
        terms += [(-size, kept[i]) for i, (after, size) in kept_inputs.items() if after < step <= end_of_forward]
        scale = max(abs(need), *(abs(size) for size, _ in terms))
        solver.Add(sum(size / scale * variable for size, variable in terms) >= need / scale)
    solver.Minimize(sum(nodes[j].stop_cost_ms * x + (nodes[j].compute_ms - nodes[j].stop_cost_ms) * in_full[j]
                        for j, x in recomputed.items()))
    status = solver.Solve()
    if status == pywraplp.Solver.INFEASIBLE:
        return RecomputeBound(math.inf)
    if status != pywraplp.Solver.OPTIMAL:
        raise RuntimeError(f"GLOP could not solve the recompute bound's LP (status {status})")
    return RecomputeBound(max(0.0, solver.Objective().Value() * (1 - BOUND_TOLERANCE)))


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


def _memory_rows(fixed: list[int], dropped_at_most: list[int], kept_inputs: dict[int, tuple[int, int]],
                 allowance: int, end_of_forward: int) -> list[tuple[int, int]]:
    """(step, bytes over the allowance in the unplanned step) for each step that could go over
    it: over already, or a forward step where keeping every freed output would take it over."""
    kept_after = [0] * (end_of_forward + 1)  # step -> bytes of freed outputs kept through it
    for after, size in kept_inputs.values():
        if after + 1 <= end_of_forward:
            kept_after[after + 1] += size
    for step in range(1, end_of_forward + 1):
        kept_after[step] += kept_after[step - 1]
    rows = []
    for step, bytes_fixed in enumerate(fixed):
        need = dropped_at_most[step] + bytes_fixed - allowance
        if need > 0 or (step <= end_of_forward and need + kept_after[step] > 0):
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
