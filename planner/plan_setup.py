"""What a plan is for besides its budget (`Setup`), and the checks of what the user gives: sizes
in GiB, a model to train, a sample's tensors."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from planner.measure import PlanDevice
from planner.trace import split_sample


@dataclass(frozen=True)
class Setup:
    """What the plan is for besides the budget: the device (and target GPU), how the run holds
    static memory (FSDP2 ranks, optimizer) and the resulting static memory per rank, by term,
    and how planning may measure (`measure`: "no-run" runs no step, not even the plan's own)."""

    where: PlanDevice
    world_size: int = 1
    optimizer: str | float | None = None
    static_breakdown: dict[str, int] | None = None
    measure: str = "auto"

    def with_reserve(self, reserved_bytes: int) -> "Setup":
        return replace(self, static_breakdown={**(self.static_breakdown or {}), "reserved": reserved_bytes})


def sample_tensors(sample: Any) -> list[torch.Tensor]:
    """The tensors a sample passes to forward directly (positional and keyword arguments).

    Example:
        >>> sample_tensors({"input_ids": torch.ones(2), "use_cache": False})
        [tensor([1., 1.])]
    """
    args, kwargs = split_sample(sample)
    return [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]


def check_trainable(model: nn.Module) -> None:
    """Refuse a model with nothing to train; warn where it is in eval mode.

    Example:
        >>> check_trainable(model.train())
    """
    if not model.training:
        warnings.warn("the model is in eval mode; the plan is for training, where dropout and "
                      "BatchNorm behave differently: call model.train() first", stacklevel=3)
    if not any(parameter.requires_grad for parameter in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no trainable parameters: a training step "
                         "keeps no activations for them, so there is nothing to plan; unfreeze the "
                         "parameters you train (requires_grad=True) first")


def check_gb(name: str, value: Any, allow_zero: bool = False) -> float:
    """Validate a size in GiB given by the user; raise ValueError naming the argument.

    Example:
        >>> check_gb("budget_gb", 4)
        4.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of GiB, not {value!r}")
    value = float(value)
    if math.isnan(value) or math.isinf(value) or value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "more than zero"
        raise ValueError(f"{name} must be a finite number of GiB {bound}, not {value!r}")
    return value


__all__ = ["Setup", "check_gb", "check_trainable"]
