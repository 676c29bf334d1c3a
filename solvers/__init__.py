"""Torch-free checkpoint-placement solvers.

Every solver has one signature, `solve_<name>(problem, budget_bytes, **options) -> Solution`,
and is registered in `SOLVERS`. `solve()` picks one by name.

Example:
    >>> from solvers import NodeCost, Problem, solve
    >>> problem = Problem(nodes=(NodeCost("a", 1.0, output_bytes=8, saves=(0,)),))
    >>> solve(problem, budget_bytes=1024, method="sqrt").regions
    ()
"""
from __future__ import annotations

from typing import Callable

from solvers.problem import InfeasibleBudget, NodeCost, Problem, Solution, Status, format_bytes
from solvers.simulate import Timeline, held_after_forward, peak_bytes, simulate
from solvers.sqrt import solve_sqrt

Solver = Callable[..., Solution]

SOLVERS: dict[str, Solver] = {
    "sqrt": solve_sqrt,
}


def solve(problem: Problem, budget_bytes: int, method: str = "auto", **options: object) -> Solution:
    """Solve `problem` under `budget_bytes` with the named method ("auto" picks the best one
    available for the graph's size).

    Example:
        >>> solve(problem, 2**30, method="sqrt").peak_bytes <= 2**30
        True
    """
    if method == "auto":
        method = "sqrt"
    if method not in SOLVERS:
        raise ValueError(f"unknown solver {method!r}; choose one of {sorted(SOLVERS)} or 'auto'")
    return SOLVERS[method](problem, budget_bytes, **options)


__all__ = [
    "InfeasibleBudget",
    "NodeCost",
    "Problem",
    "SOLVERS",
    "Solution",
    "Status",
    "Timeline",
    "format_bytes",
    "held_after_forward",
    "peak_bytes",
    "simulate",
    "solve",
    "solve_sqrt",
]
