"""The LP relaxation of a CP-SAT model, solved with HiGHS through OR-Tools' pywraplp.

CP-SAT solves this relaxation too, but keeps its solution to itself; `solvers.ilp` wants it to
steer a warm start (which regions the LP would open) and as a bound. Only the constraint kinds
that `solvers.ilp` builds are translated: linear constraints, implications (`bool_and` with one
enforcement literal) and clauses (`bool_or`).

Example:
    >>> relaxation = solve_relaxation(built.model, time_limit_s=10)
    >>> relaxation.objective <= optimal_objective
    True
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

# The LP solvers stop within feasibility tolerances of about 1e-7 per column, so their objective
# can sit slightly above the true LP optimum: shave this share off before calling it a bound.
BOUND_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Relaxation:
    """An optimal LP solution: `values[k]` for CP-SAT variable index k, and its objective (in
    the model's units) lowered by `BOUND_TOLERANCE`: a lower bound on the integer optimum."""

    values: tuple[float, ...]
    objective: float


def solve_relaxation(model: Any, time_limit_s: float) -> Relaxation | None:
    """Solve the LP relaxation of a CP-SAT model; None if the LP is infeasible, or no optimal
    solution came within `time_limit_s`. HiGHS first (on random_layered_n250's model: 20 s,
    GLOP 45 s); GLOP where HiGHS gives no answer (it reports none on some tiny models).

    Example:
        >>> solve_relaxation(built.model, 10).objective / built.objective_scale
        53792.35...
    """
    from ortools.linear_solver import pywraplp

    deadline = time.perf_counter() + time_limit_s
    for backend in ("HIGHS", "GLOP"):
        remaining = deadline - time.perf_counter()
        lp = pywraplp.Solver.CreateSolver(backend)
        if lp is None or remaining <= 0:
            continue
        if backend == "HIGHS":
            # No banner on stdout (the setter returns False here, yet the option takes effect).
            lp.SetSolverSpecificParametersAsString("output_flag=false")
        columns, objective, scale = _load(lp, model.proto)
        lp.SetTimeLimit(max(1, math.floor(remaining * 1000)))
        status = lp.Solve()
        if status == pywraplp.Solver.INFEASIBLE:
            return None
        if status == pywraplp.Solver.OPTIMAL:
            value = objective.Value() * scale + float(model.proto.objective.offset)
            value -= BOUND_TOLERANCE * abs(value)
            return Relaxation(tuple(column.solution_value() for column in columns), value)
    return None


def _load(lp: Any, proto: Any) -> tuple[list[Any], Any, float]:
    """Translate a CP-SAT model proto into `lp`: its columns, objective and the factor its
    objective was divided by (to 1 at most: both LP solvers gave no answer on small models
    with coefficients of 2^38)."""
    infinity = lp.infinity()
    columns = []
    for variable in proto.variables:
        domain = list(variable.domain)  # (the proto wrapper does not index from the end)
        columns.append(lp.NumVar(float(domain[0]), float(domain[-1]), ""))

    def add_clause(literals: list[int]) -> None:
        """sum of literals >= 1, where literal -k - 1 is `not variable k`."""
        row = lp.Constraint(-infinity, infinity)
        lower = 1.0
        for literal in literals:
            if literal >= 0:
                row.SetCoefficient(columns[literal], row.GetCoefficient(columns[literal]) + 1.0)
            else:
                column = columns[-literal - 1]
                row.SetCoefficient(column, row.GetCoefficient(column) - 1.0)
                lower -= 1.0
        row.SetLb(lower)

    for constraint in proto.constraints:
        enforcement = list(constraint.enforcement_literal)
        if constraint.has_bool_and() and len(enforcement) == 1:
            negated = -enforcement[0] - 1  # e => l  is  (not e) or l
            for literal in constraint.bool_and.literals:
                add_clause([negated, literal])
        elif constraint.has_bool_or() and not enforcement:
            add_clause(list(constraint.bool_or.literals))
        elif constraint.has_linear() and not enforcement:
            domain = list(constraint.linear.domain)
            lower = float(domain[0]) if domain[0] > -(2**62) else -infinity
            upper = float(domain[-1]) if domain[-1] < 2**62 else infinity
            row = lp.Constraint(lower, upper)
            for index, coefficient in zip(constraint.linear.vars, constraint.linear.coeffs):
                row.SetCoefficient(columns[index], float(coefficient))
        else:
            raise ValueError(f"solve_relaxation: constraint kind not translated: {constraint}")
    objective = lp.Objective()
    scale = float(max((abs(c) for c in proto.objective.coeffs), default=1) or 1)
    for index, coefficient in zip(proto.objective.vars, proto.objective.coeffs):
        objective.SetCoefficient(columns[index], float(coefficient) / scale)
    objective.SetMinimization()
    return columns, objective, scale
