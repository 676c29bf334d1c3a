"""Automatic activation-checkpoint placement for PyTorch models.

Example:
    >>> from planner import plan
    >>> p = plan(model, sample, budget_gb=80)
    >>> print(p)
    >>> p.apply(model)            # in place; planner.remove_plan(model) undoes it
"""
from planner.api import Plan, plan
from planner.apply.checkpoints import remove_plan
from planner.measure.targets import targets
from planner.plans.record import SavedPlan, load_plan
from planner.report.text import Checkpoint
from planner.trace.tracing import TraceError
from solvers import InfeasibleBudget

__all__ = ["Checkpoint", "InfeasibleBudget", "Plan", "SavedPlan", "TraceError", "load_plan", "plan", "remove_plan",
           "targets"]
