"""What a solver answers: a plan of regions and kept nodes, its cost, and how sure it is."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


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


__all__ = ["Solution", "Status"]
