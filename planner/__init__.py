"""Automatic activation-checkpoint placement for PyTorch models.

Example:
    >>> from planner import plan
    >>> p = plan(model, sample, budget_gb=80)
    >>> print(p)
    >>> m = p.module()
"""
from planner.api import Checkpoint, Plan, plan
from planner.persist import SavedPlan, load_plan
from planner.trace import TraceError
from solvers import InfeasibleBudget

__all__ = ["Checkpoint", "InfeasibleBudget", "Plan", "SavedPlan", "TraceError", "load_plan", "plan"]
