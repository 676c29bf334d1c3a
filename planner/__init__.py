"""Automatic activation-checkpoint placement for PyTorch models.

Example:
    >>> from planner import plan
    >>> p = plan(model, sample, budget_gb=80)
    >>> print(p)
    >>> p.apply(model)            # in place; planner.remove_plan(model) undoes it
"""
from planner.api import Plan, load_plan, plan
from planner.apply.checkpoints import remove_plan
from planner.measure.steps import Verification
from planner.measure.targets import (
    targets,  # planner.targets() lists the GPUs a plan can be for
)
from planner.throughput.search import plan_throughput
from planner.trace.tracing import TraceError
from solvers import InfeasibleBudget

__all__ = ["InfeasibleBudget", "Plan", "TraceError", "Verification", "load_plan", "plan", "plan_throughput",
           "remove_plan", "targets"]
