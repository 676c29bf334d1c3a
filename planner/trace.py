"""Trace a model into an fx graph bound to the sample's argument structure.

Submodules that symbolic tracing cannot follow are retried as leaves (called as one opaque
node), so one untraceable block does not stop the whole model from being planned.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

logger = logging.getLogger(__name__)


class TraceError(RuntimeError):
    """The model could not be traced, not even with its failing submodules kept as leaves."""


@dataclass
class Traced:
    """A traced graph and how to feed it.

    `tensor_names` are the forward arguments that became graph inputs (in order); every other
    argument was fixed to `fixed_args` at trace time.
    """

    gm: fx.GraphModule
    tensor_names: tuple[str, ...]
    fixed_args: dict[str, Any]
    leaves: tuple[str, ...] = field(default_factory=tuple)
    frontend: str = "torch.fx.symbolic_trace"

    def graph_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """Bind a call's arguments to the model's forward and return the graph's inputs."""
        bound = bind_arguments(self.gm.meta["planner.signature"], args, kwargs)
        for name, planned in self.fixed_args.items():
            given = bound.get(name, planned)
            if not _same_fixed_value(given, planned):
                raise ValueError(
                    f"argument {name!r} was {planned!r} when the plan was made and is "
                    f"{given!r} now; make a new plan for this call"
                )
        return [bound[name] for name in self.tensor_names]


def _same_fixed_value(given: Any, planned: Any) -> bool:
    if isinstance(given, torch.Tensor) or isinstance(planned, torch.Tensor):
        return given is planned
    try:
        return bool(given == planned)
    except Exception:  # objects whose == is not a plain bool (arrays, proxies)
        return given is planned


def split_sample(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sample is a Tensor, a tuple/list of positional args, or a dict of keyword args.

    Example:
        >>> split_sample(torch.ones(2))
        ((tensor([1., 1.]),), {})
    """
    if isinstance(sample, torch.Tensor):
        return (sample,), {}
    if isinstance(sample, (tuple, list)):
        return tuple(sample), {}
    if isinstance(sample, dict):
        return (), dict(sample)
    raise TypeError(
        f"sample must be a Tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments for the model's forward, not {type(sample).__name__}"
    )


def bind_arguments(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Map positional and keyword arguments to forward's parameter names, defaults included."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"the sample does not match forward{signature}: {error}") from None
    bound.apply_defaults()
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            value = bound.arguments.get(parameter.name)
            if value:
                raise TypeError(
                    f"forward's *{parameter.name} receives {value!r}; pass those arguments by "
                    "name in a dict sample, the tracer cannot follow variadic arguments"
                )
    return {
        name: value
        for name, value in bound.arguments.items()
        if signature.parameters[name].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }


class _LeafTracer(fx.Tracer):
    """A tracer that keeps named submodules whole and remembers where tracing failed."""

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves
        self.failed_module: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_module is None:  # the innermost module fails first
                self.failed_module = self.path_of_module(m)
            raise


def trace(model: nn.Module, sample: Any, leaves: tuple[str, ...] = ()) -> Traced:
    """Symbolically trace `model` for calls shaped like `sample`.

    Tensor arguments become graph inputs; every other argument (flags, ints, None defaults) is
    fixed to its sample value. A submodule whose forward cannot be traced becomes a leaf and
    tracing is retried; the leaves are reported in `Traced.leaves`.

    Example:
        >>> traced = trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4))
        >>> [n.op for n in traced.gm.graph.nodes]
        ['placeholder', 'call_module', 'call_module', 'output']
    """
    signature = inspect.signature(model.forward)
    args, kwargs = split_sample(sample)
    bound = bind_arguments(signature, args, kwargs)
    tensor_names = tuple(name for name, value in bound.items() if isinstance(value, torch.Tensor))
    if not tensor_names:
        raise TypeError("the sample holds no tensor: pass the model's input tensors as the sample")
    fixed_args = {name: value for name, value in bound.items() if name not in tensor_names}

    auto_leaves: list[str] = []
    while True:
        tracer = _LeafTracer(set(leaves) | set(auto_leaves))
        try:
            graph = tracer.trace(model, concrete_args=dict(fixed_args))
            break
        except Exception as error:
            failed = tracer.failed_module
            if not failed or failed in auto_leaves:
                where = f"submodule {failed!r}" if failed else f"{type(model).__name__}.forward"
                raise TraceError(
                    f"cannot trace {where} of {type(model).__name__}: "
                    f"{type(error).__name__}: {error}"
                ) from error
            logger.info("keeping %s whole: tracing it failed with %s", failed, error)
            auto_leaves.append(failed)

    _drop_fixed_inputs(graph, tensor_names)
    gm = fx.GraphModule(model, graph, class_name=f"Traced{type(model).__name__}")
    gm.meta["planner.signature"] = signature
    return Traced(gm, tensor_names, fixed_args, tuple(auto_leaves))


def _drop_fixed_inputs(graph: fx.Graph, tensor_names: tuple[str, ...]) -> None:
    """Remove placeholders of fixed arguments and the specialisation asserts fx adds for them:
    the planner checks those values itself when the planned module is called."""
    fixed = [n for n in graph.nodes if n.op == "placeholder" and n.target not in tensor_names]
    doomed: list[fx.Node] = []
    frontier = list(fixed)
    while frontier:
        node = frontier.pop()
        if node in doomed:
            continue
        if node.op == "output":
            raise TraceError(f"the graph returns fixed argument {node.name!r} directly")
        doomed.append(node)
        frontier.extend(node.users)
    for node in reversed(list(graph.nodes)):
        if node in doomed:
            graph.erase_node(node)
    graph.lint()
