"""Automatic activation-checkpoint placement for PyTorch models.

Example:
    >>> from planner import plan
    >>> p = plan(model, sample, budget_gb=80)
    >>> print(p)
    >>> p.apply(model)            # in place; planner.remove_plan(model) undoes it
"""
from planner.api import Plan, plan
from planner.report import Checkpoint
from planner.apply import remove_plan
from planner.persist import SavedPlan, load_plan
from planner.targets import targets  # planner.targets() lists the GPUs a plan can be for
from planner.trace import TraceError
from solvers import InfeasibleBudget

__all__ = ["Checkpoint", "InfeasibleBudget", "Plan", "SavedPlan", "TraceError", "load_plan", "plan", "remove_plan",
           "targets"]
