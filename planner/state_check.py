"""Whether a model matches the one a plan was made for: its state dict's keys, shapes and dtypes.

Example:
    >>> planned = state_shapes(model)
    >>> check_state(fresh_model, planned, "GPT2LMHeadModel")  # ValueError naming the first difference
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn


def state_shapes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Shape and dtype of each tensor in `model.state_dict()`, by key.

    Example:
        >>> state_shapes(nn.Linear(2, 3))["weight"]
        {'shape': [3, 2], 'dtype': 'float32'}
    """
    return {
        key: {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
        for key, tensor in model.state_dict().items()
        if isinstance(tensor, torch.Tensor)
    }


def check_state(model: nn.Module, planned: dict[str, dict[str, Any]], planned_for: str) -> None:
    """Raise ValueError naming the first state-dict key that `model` lacks, has in another
    shape, or has beyond the `planned` ones (`state_shapes` of the planned model); warn where
    only a dtype differs (the regions still apply, the predicted peaks do not).

    Example:
        >>> check_state(fresh_model, state_shapes(model), "GPT")
    """
    state = state_shapes(model)
    name = type(model).__name__
    mismatch = f"{name} does not match the plan (made for {planned_for})"
    for key, saved in planned.items():
        if key not in state:
            raise ValueError(f"{mismatch}: it has no {key!r} in its state dict")
        if state[key]["shape"] != saved["shape"]:
            raise ValueError(f"{mismatch}: {key!r} has shape {tuple(state[key]['shape'])} here and "
                             f"{tuple(saved['shape'])} in the plan")
    extra = [key for key in state if key not in planned]
    if extra:
        raise ValueError(f"{mismatch}: {extra[0]!r} is not in the plan's state dict")
    changed = [key for key in planned if state[key]["dtype"] != planned[key]["dtype"]]
    if changed:
        key = changed[0]
        warnings.warn(f"{key!r} is {state[key]['dtype']} here and was {planned[key]['dtype']} when the plan was "
                      "made: the regions still apply, the predicted peaks do not", stacklevel=3)


__all__ = ["check_state", "state_shapes"]
