"""The LP relaxation of a CP-SAT model, solved with CLP through OR-Tools' pywraplp.

CP-SAT solves this relaxation too, but keeps its solution to itself; `solvers.ilp.solve` wants
it to steer a warm start (which regions the LP would open) and as a bound, and wants the
relaxations of the two halves of a branch (a variable fixed to 0, and to 1) for a stronger
bound. Only the constraint kinds that `solvers.ilp.solve` builds are translated: linear
constraints, implications (`bool_and` with one enforcement literal) and clauses (`bool_or`).

Example:
    >>> relaxation = LinearRelaxation(built.model).solve(time_limit_s=10)
    >>> relaxation.objective <= optimal_objective
    True
"""
from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The LP solvers stop within feasibility tolerances of about 1e-7 per column, so their objective
# can sit slightly above the true LP optimum: shave this share off before calling it a bound.
BOUND_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Relaxation:
    """An optimal LP solution: `values[k]` for CP-SAT variable index k, and its objective (in
    the model's units) lowered by `BOUND_TOLERANCE`: a lower bound on the integer optimum.
    An infeasible LP has no values and objective +inf (no integer solution either)."""

    values: tuple[float, ...]
    objective: float

    @property
    def feasible(self) -> bool:
        return self.objective < math.inf


class LinearRelaxation:
    """The LP relaxation of a CP-SAT model, kept loaded in CLP so that solving it again with
    some variables fixed starts from the last basis: the two halves of a branch then take a
    fraction of what each takes from scratch (with CLP or another LP solver). GLOP, from
    scratch, where CLP gives no answer.

    Example:
        >>> relaxation = LinearRelaxation(built.model)
        >>> root = relaxation.solve(time_limit_s=30)
        >>> down, up = relaxation.solve(30, {k: 0.0}), relaxation.solve(30, {k: 1.0})
        >>> min(down.objective, up.objective) >= root.objective  # each plan is in one half
        True
    """

    def __init__(self, model: Any) -> None:
        self._proto, self._scale = _translate(model)
        self._offset = float(model.proto.objective.offset)
        self._warm: Any = None  # the CLP solver, loaded once

    def solve(self, time_limit_s: float, fixed: Mapping[int, float] | None = None) -> Relaxation | None:
        """The LP with each variable index in `fixed` fixed to its value; None if no answer
        came within `time_limit_s`."""
        from ortools.linear_solver import pywraplp

        deadline = time.perf_counter() + time_limit_s
        fixed = fixed or {}
        for backend in ("CLP", "GLOP"):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            lp = self._warm if backend == "CLP" else None
            if lp is None:
                lp = pywraplp.Solver.CreateSolver(backend)
                if lp is None:
                    continue
                error = lp.LoadModelFromProto(self._proto)
                if error:
                    raise ValueError(f"lp_relaxation: the translated LP was refused: {error}")
                if backend == "CLP":
                    self._warm = lp
            columns = lp.variables()
            for index, value in fixed.items():
                columns[index].SetBounds(value, value)
            lp.SetTimeLimit(max(1, math.floor(remaining * 1000)))
            status = lp.Solve()
            result = None
            if status == pywraplp.Solver.INFEASIBLE:
                result = Relaxation((), math.inf)
            elif status == pywraplp.Solver.OPTIMAL:
                value = lp.Objective().Value() * self._scale + self._offset
                value -= BOUND_TOLERANCE * abs(value)
                result = Relaxation(tuple(column.solution_value() for column in columns), value)
            for index in fixed:  # back to the model's own bounds, for the next solve
                variable = self._proto.variable[index]
                columns[index].SetBounds(variable.lower_bound, variable.upper_bound)
            if result is not None:
                return result
        return None


def _translate(model: Any) -> tuple[Any, float]:
    """The LP relaxation of a CP-SAT model as an OR-Tools MPModelProto, and the factor its
    objective was divided by (to 1 at most: the LP solvers give no answer, even on small
    models, with coefficients as large as 2^38). The model is read back from a file as a
    protobuf message and the LP built field by field: several times faster than reading the
    model's own proto wrapper, or adding the LP's coefficients one call at a time."""
    from ortools.linear_solver import linear_solver_pb2
    from ortools.sat import cp_model_pb2

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.pb")
        if not model.export_to_file(path):
            raise OSError(f"lp_relaxation: could not write the model to {path}")
        with open(path, "rb") as file:
            proto = cp_model_pb2.CpModelProto.FromString(file.read())

    infinity = math.inf
    lp = linear_solver_pb2.MPModelProto()
    for variable in proto.variables:
        domain = list(variable.domain)  # (the proto wrapper does not index from the end)
        lp.variable.add(lower_bound=float(domain[0]), upper_bound=float(domain[-1]))

    def add_row(coefficients: dict[int, float], lower: float, upper: float) -> None:
        row = lp.constraint.add(lower_bound=lower, upper_bound=upper)
        row.var_index.extend(coefficients)
        row.coefficient.extend(coefficients.values())

    def add_clause(literals: list[int]) -> None:
        """sum of literals >= 1, where literal -k - 1 is `not variable k`."""
        coefficients: dict[int, float] = {}
        lower = 1.0
        for literal in literals:
            index = literal if literal >= 0 else -literal - 1
            coefficients[index] = coefficients.get(index, 0.0) + (1.0 if literal >= 0 else -1.0)
            lower -= 0.0 if literal >= 0 else 1.0
        add_row(coefficients, lower, infinity)

    for constraint in proto.constraints:
        enforcement = list(constraint.enforcement_literal)
        kind = constraint.WhichOneof("constraint")
        if kind == "bool_and" and len(enforcement) == 1:
            negated = -enforcement[0] - 1  # e => l  is  (not e) or l
            for literal in constraint.bool_and.literals:
                add_clause([negated, literal])
        elif kind == "bool_or" and not enforcement:
            add_clause(list(constraint.bool_or.literals))
        elif kind == "linear" and not enforcement:
            domain = list(constraint.linear.domain)
            lower = float(domain[0]) if domain[0] > -(2**62) else -infinity
            upper = float(domain[-1]) if domain[-1] < 2**62 else infinity
            indices, values = list(constraint.linear.vars), list(constraint.linear.coeffs)
            if len(set(indices)) == len(indices):  # (always, from solvers.ilp.solve: the fast way)
                row = lp.constraint.add(lower_bound=lower, upper_bound=upper)
                row.var_index.extend(indices)
                row.coefficient.extend(map(float, values))
                continue
            coefficients: dict[int, float] = {}
            for index, coefficient in zip(indices, values):
                coefficients[index] = coefficients.get(index, 0.0) + float(coefficient)
            add_row(coefficients, lower, upper)
        else:
            raise ValueError(f"lp_relaxation: constraint kind not translated: {constraint}")
    scale = float(max((abs(c) for c in proto.objective.coeffs), default=1) or 1)
    for index, coefficient in zip(proto.objective.vars, proto.objective.coeffs):
        lp.variable[index].objective_coefficient += float(coefficient) / scale
    return lp, scale


__all__ = ["BOUND_TOLERANCE", "LinearRelaxation", "Relaxation"]
