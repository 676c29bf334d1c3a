"""What a solver answers: a plan of regions and kept nodes (`Solution`), its cost, and how sure
it is (`Status`); and the error every solver raises when no plan fits (`InfeasibleBudget`), with
how sizes are written in it (`format_bytes`).

Example:
    >>> Solution(regions=(range(0, 3),), peak_bytes=1024, recompute_ms=2.5,
    ...          status=Status.OPTIMAL, solver="dp", solve_seconds=0.01, kept=(1,))
    >>> format_bytes(3 * 2**29)
    '1.50 GiB'
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


def format_bytes(size: float) -> str:
    """Human-readable bytes in binary units.

    Example:
        >>> format_bytes(3 * 2**29)
        '1.50 GiB'
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


class InfeasibleBudget(ValueError):
    """No plan fits the budget. Carries the smallest budget that does fit.

    Example:
        >>> raise InfeasibleBudget(budget_bytes=2**29, minimum_bytes=3 * 2**28, static_bytes=2**28)
    """

    def __init__(
        self, budget_bytes: int, minimum_bytes: int, static_bytes: int, solver: str = "", proven: bool = True
    ):
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        self.static_bytes = static_bytes
        self.solver = solver
        self.proven = proven  # False: minimum_bytes is the smallest peak found, not proven minimal
        activations = minimum_bytes - static_bytes
        dominant = "static memory dominates" if static_bytes >= activations else "activations dominate"
        by = f" for solver {solver!r}" if solver else ""
        # (a solver that does not prove its minimum gives the least peak it reached)
        unproven = "" if proven else ", the least it reached: another solver may fit less"
        self._arguments = (budget_bytes, minimum_bytes, static_bytes, solver, proven)
        super().__init__(
            f"budget {format_bytes(budget_bytes)} is below the minimum {format_bytes(minimum_bytes)}"
            f"{by}{unproven} (parameters+gradients and other static memory {format_bytes(static_bytes)}, "
            f"activations {'at least ' if proven else ''}{format_bytes(activations)}: {dominant})"
        )

    def __reduce__(self) -> tuple[type, tuple[int, int, int, str, bool]]:  # (pickled to other ranks intact)
        return type(self), self._arguments


class Status(str, Enum):
    """How sure a solver is of its answer (like scipy's milp status)."""

    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    TIME_LIMIT = "time_limit"


@dataclass(frozen=True)
class Solution:
    """A plan: which node ranges run under checkpoint, which nodes inside them keep their
    outputs (`kept`, sorted), and what that costs.

    Example:
        >>> Solution(regions=(range(0, 3),), peak_bytes=1024, recompute_ms=2.5,
        ...          status=Status.OPTIMAL, solver="dp", solve_seconds=0.01, kept=(1,))
    """

    regions: tuple[range, ...]
    peak_bytes: int
    recompute_ms: float
    status: Status
    solver: str
    solve_seconds: float
    gap: float | None = None  # ilp: relative gap to the proven bound (0.0 when optimal)
    kept: tuple[int, ...] = ()  # nodes whose outputs their regions keep (selective checkpoint)


__all__ = ["InfeasibleBudget", "Solution", "Status", "format_bytes"]
