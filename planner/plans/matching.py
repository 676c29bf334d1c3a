"""Check a model against a saved plan (`planner.plans.record.PlanRecord`) before it is applied:
a sample shaped like the planned one (`sample_like`), a trace that must match the saved graph
node for node (`trace_matching`), and a state dict whose keys, shapes and dtypes are the
planned ones (`state_shapes`, `check_state`).

Example:
    >>> sample = sample_like(saved.sample, model)
    >>> traced = trace_matching(saved, model, sample)   # ValueError names the first difference
    >>> check_state(fresh_model, state_shapes(model), "GPT2LMHeadModel")  # likewise, for the state dict
"""
from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from planner.plans.document import (
    UnsupportedValue,
    decode_value,
    describe_node,
    dtype_from_name,
    graph_nodes,
    model_device,
    node_identity,
)
from planner.trace.tracing import Traced, trace

if TYPE_CHECKING:
    from planner.plans.record import PlanRecord


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


FX_FRONTEND = "torch.fx.symbolic_trace"  # the value of Traced.frontend for the fx frontend
EXPORT_FRONTEND = "torch.export"
APPLICABLE_FRONTENDS = (FX_FRONTEND, EXPORT_FRONTEND)


def sample_like(sample_record: dict[str, Any], model: nn.Module) -> Any:
    """Zeros of the saved shapes and dtypes on `model`'s device, and the saved values of the
    fixed arguments: enough to trace with, not meant for measuring.

    Example:
        >>> sample_like(saved.sample, model)
        {'tokens': tensor([[0, 0, ...]])}
    """
    device = model_device(model)
    values: dict[str, Any] = {}
    for argument in sample_record["arguments"]:
        name = argument["name"]
        if "tensor" in argument:
            spec = argument["tensor"]
            tensor = torch.zeros(spec["shape"], dtype=dtype_from_name(spec["dtype"]), device=device)
            values[name] = tensor.requires_grad_() if spec.get("requires_grad") else tensor
        else:
            try:
                values[name] = decode_value(argument["value"])
            except UnsupportedValue as error:
                raise ValueError(
                    f"forward argument {name!r} was fixed to {error} when the plan was made; "
                    "pass that value yourself: apply(model, sample=...)"
                ) from None
    parameters = inspect.signature(model.forward).parameters
    if any(parameters[name].kind == inspect.Parameter.POSITIONAL_ONLY for name in values if name in parameters):
        return tuple(values.values())  # every saved argument, in forward's order
    return values


def trace_matching(saved: "PlanRecord", model: nn.Module, sample: Any) -> Traced:
    """Trace `model` on `sample` with the saved plan's frontend and leaves, and raise ValueError
    unless its tensor arguments, compute nodes (names, ops, targets, in order) and state-dict
    shapes are the saved ones.

    Example:
        >>> trace_matching(saved, fresh_model, saved.sample_for(fresh_model)).gm
    """
    model_name = type(model).__name__
    if saved.frontend not in APPLICABLE_FRONTENDS:
        raise ValueError(
            f"this plan was traced with an unknown frontend {saved.frontend!r} (known: "
            f"{', '.join(APPLICABLE_FRONTENDS)}): make a new plan with planner.plan(model, sample, ...)"
        )
    try:
        traced = trace(model, sample, saved.trace_leaves,
                       frontend="export" if saved.frontend == EXPORT_FRONTEND else "fx")
    except TypeError as error:  # the saved arguments do not bind to this model's forward
        raise ValueError(f"{model_name} does not match the saved plan (made for {saved.model_class}): "
                         f"{error}") from None
    saved_inputs = tuple(a["name"] for a in saved.sample["arguments"] if "tensor" in a)
    if traced.tensor_names != saved_inputs:
        raise ValueError(
            f"{model_name} takes tensor arguments {traced.tensor_names} here but the plan was made "
            f"for {saved_inputs}"
        )
    got = graph_nodes(traced.gm)
    for position, (expected, found) in enumerate(zip(saved.graph, got)):
        if node_identity(expected) != node_identity(found):
            raise ValueError(
                f"{model_name} does not match the saved plan (made for {saved.model_class}): compute "
                f"node {position} is {describe_node(found)} in this model but {describe_node(expected)} in the plan"
            )
    if len(got) != len(saved.graph):
        common = min(len(got), len(saved.graph))
        first = (f"the first extra one is {describe_node(got[common])}" if len(got) > common
                 else f"the first missing one is {describe_node(saved.graph[common])}")
        raise ValueError(
            f"{model_name} does not match the saved plan (made for {saved.model_class}): it has "
            f"{len(got)} compute nodes and the plan {len(saved.graph)}; {first}"
        )
    check_state(model, saved.state, saved.model_class)
    return traced


__all__ = ["APPLICABLE_FRONTENDS", "EXPORT_FRONTEND", "FX_FRONTEND", "check_state", "sample_like", "state_shapes",
           "trace_matching"]
