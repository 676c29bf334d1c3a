"""Plans checked against the model's own planned step, where it runs on the plan's device.

`planner.eager_check` keeps free what the model's unplanned step holds beyond the traced graph.
A planned step can hold more than that: its peak moves (into a recomputation, or to another
point of backward), and what the model's own code allocates there the graph does not show. On
an H100, with the unplanned step's 320 MiB kept free, GPT-2's and Llama's plans at every
block's peak still measured 96-160 MiB above their predictions, and over budget
(benchmarks/RESULTS.md, 2026-11-27 08:27-08:29). So where the whole step runs here, `plan()`
and `replan()` measure the plan's own step (`fit_to_measured`): where it peaks above the
budget, its excess over the predicted peak is kept free as a static term, `BEYOND_PLAN`, and
the plan is solved again, up to `REFITS` times. A plan the check finds under budget is left as
it was: on the CPU, where predictions match measured peaks to the byte, that is every plan.

Example:
    >>> fitted = fit_to_measured(planned, lambda extra: solve_keeping_free(extra),
    ...                          lambda p: measured_peak(p.module(), sample, device))
"""
from __future__ import annotations

import warnings
from typing import Callable, Protocol, TypeVar

from solvers import format_bytes

BEYOND_PLAN = "planned step beyond the traced graph (measured)"
REFITS = 3  # solves again at most this many times


class _Sized(Protocol):
    @property
    def budget_bytes(self) -> int: ...

    @property
    def predicted_peak_bytes(self) -> int: ...


PlanT = TypeVar("PlanT", bound=_Sized)


def fit_to_measured(plan: PlanT, solve_keeping_free: Callable[[int], PlanT],
                    measured_peak: Callable[[PlanT], int]) -> tuple[PlanT, int]:
    """`plan` where its own step (`measured_peak(plan)`) stays within its budget; else the plan
    `solve_keeping_free(extra)` solves with `extra` bytes more kept free, `extra` the measured
    excess over the predicted peak (summed over tries), checked again, up to `REFITS` times.
    Returns the plan and its step's measured peak. Warns with the figures where it solves
    again, and where the last plan is still above its budget. `solve_keeping_free` raises
    `InfeasibleBudget` where no plan fits with that much kept free.

    Example:
        >>> fitted, measured = fit_to_measured(planned, solve_keeping_free, lambda p: 120 << 20)
    """
    extra = 0
    for _ in range(REFITS):
        measured = measured_peak(plan)
        if measured <= plan.budget_bytes:
            return plan, measured
        excess = max(1, measured - plan.predicted_peak_bytes)
        extra += excess
        warnings.warn(f"the plan's own training step peaked at {format_bytes(measured)}, above its budget of "
                      f"{format_bytes(plan.budget_bytes)} and {format_bytes(excess)} above its predicted "
                      f"{format_bytes(plan.predicted_peak_bytes)}: memory the traced graph does not show; solving "
                      f"again with {format_bytes(extra)} kept free (static term {BEYOND_PLAN!r})", stacklevel=3)
        plan = solve_keeping_free(extra)
    measured = measured_peak(plan)
    if measured > plan.budget_bytes:
        warnings.warn(f"after {REFITS} tries the plan's own training step still peaks at {format_bytes(measured)}, "
                      f"above its budget of {format_bytes(plan.budget_bytes)}: lower budget_gb by the difference, "
                      "or check the plan with p.verify()", stacklevel=3)
    return plan, measured


__all__ = ["BEYOND_PLAN", "REFITS", "fit_to_measured"]
