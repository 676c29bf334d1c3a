"""Rewrite a traced graph so that chosen node ranges run under activation checkpointing.

The returned `CheckpointedModule` registers a shallow clone of the user's module tree: new
module objects (own training flags and hook tables) holding the very same Parameter and buffer
tensors, so `state_dict()` keys and tensors are the original's and the original is never
modified. The rewritten graph lives in an unregistered attribute and reaches the same modules.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.profile import META_KEY
from planner.trace import Traced, graph_module, link_to_root

REGION_PREFIX = "checkpoint_region_"


def shallow_clone(module: nn.Module, memo: dict[int, nn.Module] | None = None) -> nn.Module:
    """A new module tree with the same classes, attributes, Parameters and buffers.

    Example:
        >>> clone = shallow_clone(model)
        >>> clone.fc.weight is model.fc.weight, clone.fc is model.fc
        (True, False)
    """
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    clone = module.__class__.__new__(module.__class__)
    clone.__dict__.update(module.__dict__)
    memo[id(module)] = clone
    for name, value in module.__dict__.items():
        if "hook" in name and isinstance(value, dict):
            clone.__dict__[name] = value.copy()
    clone._parameters = module._parameters.copy()
    clone._buffers = module._buffers.copy()
    clone._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    clone._modules = {
        name: None if child is None else shallow_clone(child, memo)
        for name, child in module._modules.items()
    }
    return clone


@contextlib.contextmanager
def restored_buffers(root: nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """Put the named buffers back as they were afterwards: recomputation must not update
    BatchNorm statistics (or any other buffer the region writes) a second time."""
    saved = {name: root.get_buffer(name).clone() for name in names}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                root.get_buffer(name).copy_(value)


class CheckpointRegion(nn.Module):
    """Runs `body` under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`; the RNG
    state is saved for recomputation only where the body draws random numbers (it costs a
    copy of the generator's state per call, 5 KB on the CPU, and time)."""

    def __init__(self, body: fx.GraphModule, written_buffers: tuple[str, ...], random: bool = True):
        super().__init__()
        self.body = body
        self.written_buffers = written_buffers
        self.random = random

    def _contexts(self) -> tuple[Any, Any]:
        return contextlib.nullcontext(), restored_buffers(self.body, self.written_buffers)

    def forward(self, *args: Any) -> Any:
        if self.written_buffers and not torch.compiler.is_compiling():
            return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=self.random,
                              context_fn=self._contexts)
        # Under torch.compile buffer writes are functionalised and applied once, in forward.
        return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=self.random)


def _extract_region(
    graph_nodes: list[fx.Node], members: set[fx.Node]
) -> tuple[fx.Graph, list[fx.Node], list[fx.Node]]:
    """Copy the region's nodes into a graph of their own; return it, its inputs and outputs."""
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op == "get_attr":  # attributes are free to re-read inside the body
                env[node] = body.get_attr(node.target)
            else:
                env[node] = body.placeholder(node.name)
                inputs.append(node)
        return env[node]

    ordered = [node for node in graph_nodes if node in members]
    for node in ordered:
        env[node] = body.node_copy(node, lookup)
    outputs = [node for node in ordered if any(user not in members for user in node.users)]
    body.output(tuple(env[node] for node in outputs))
    body.lint()
    return body, inputs, outputs


def rewrite(traced: Traced, regions: list[list[str]], clone: nn.Module) -> fx.GraphModule:
    """Build the planned graph module: each region (a list of consecutive compute node names)
    becomes one `CheckpointRegion` call.

    Example:
        >>> gm = rewrite(traced, [["fc1", "relu"]], shallow_clone(model))
    """
    source = traced.gm.graph
    graph_nodes = list(source.nodes)
    by_name = {node.name: node for node in graph_nodes}
    region_of: dict[fx.Node, int] = {}
    for index, names in enumerate(regions):
        for name in names:
            region_of[by_name[name]] = index

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    region_modules: dict[str, nn.Module] = {}
    done: set[int] = set()
    for node in graph_nodes:
        index = region_of.get(node)
        if index is None:
            env[node] = graph.node_copy(node, lambda n: env[n])
            continue
        if index in done:
            continue
        done.add(index)
        members = {n for n, i in region_of.items() if i == index}
        body_graph, inputs, outputs = _extract_region(graph_nodes, members)
        written = tuple(sorted({
            name for n in members if META_KEY in n.meta for name in n.meta[META_KEY].mutated_buffers
        }))
        target = f"{REGION_PREFIX}{index}"
        body = graph_module(clone, body_graph, traced.extras, f"Region{index}")
        random = any(n.meta[META_KEY].random if META_KEY in n.meta else True for n in members)
        region_modules[target] = CheckpointRegion(body, written, random)
        call = graph.call_module(target, tuple(env[n] for n in inputs))
        for position, output in enumerate(outputs):
            env[output] = graph.call_function(_item, (call, position))
    graph.lint()
    planned = graph_module(clone, graph, {**traced.extras, **region_modules}, "Planned")
    # Attribute reads used only inside region bodies are dead here. Nothing else is removed:
    # an in-place call with an unused result (x.mul_(2)) is not dead code.
    for node in list(planned.graph.nodes):
        if node.op == "get_attr" and not node.users:
            planned.graph.erase_node(node)
    planned.recompile()
    return planned


def _item(values: tuple[Any, ...], position: int) -> Any:
    return values[position]


class CheckpointedModule(nn.Module):
    """The planned module: the original's module tree, run through the rewritten graph.

    In training with gradients on, calls go through the planned graph (checkpointed regions);
    in eval mode or under `torch.no_grad()` the original forward runs unchanged.
    """

    def __init__(self, clone: nn.Module, planned: fx.GraphModule, traced: Traced):
        super().__init__()
        # Share the clone's registries: same keys, same tensors, same submodules.
        self._modules = clone._modules
        self._parameters = clone._parameters
        self._buffers = clone._buffers
        self._non_persistent_buffers_set = clone._non_persistent_buffers_set
        self.training = clone.training
        object.__setattr__(self, "_planned", planned)
        object.__setattr__(self, "_eager", clone)
        object.__setattr__(self, "_traced", traced)

    def __getstate__(self) -> dict[str, Any]:
        # forward needs the signature, inputs and output spec of the trace, not its graph: that
        # graph refers to the original model's modules and, with fixed arguments, has pytree code
        # that fx cannot rebuild on unpickling.
        state = self.__dict__.copy()
        state["_traced"] = dataclasses.replace(self._traced, gm=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickling rebuilds each GraphModule from its code with fresh containers: link the
        # planned graph and the region bodies to this module's tree again.
        super().__setstate__(state)
        regions = {name: m for name, m in self._planned._modules.items() if name.startswith(REGION_PREFIX)}
        for gm, extras in [(self._planned, regions), *((region.body, {}) for region in regions.values())]:
            # fx re-traces the code on unpickling and folds input-free ops into new constants
            folded = {name: value for name, value in gm._buffers.items() if name not in self._eager._buffers}
            link_to_root(gm, self._eager, {**self._traced.extras, **extras, **folded})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            self._eager.training = self.training
            return self._eager(*args, **kwargs)
        flat = self._planned(*self._traced.graph_inputs(args, kwargs))
        return self._traced.structure_output(flat)

    @property
    def planned_graph(self) -> fx.GraphModule:
        """The rewritten fx graph module (its regions are `checkpoint_region_<i>` calls)."""
        return self._planned

    def extra_repr(self) -> str:
        regions = sum(1 for name in self._planned._modules if name.startswith(REGION_PREFIX))
        return f"checkpointed regions: {regions}"


def build_module(traced: Traced, regions: list[list[str]], original: nn.Module) -> CheckpointedModule:
    """The planned module for `original`, sharing its parameters and leaving it untouched.

    Example:
        >>> m = build_module(traced, [["fc1", "relu"]], model)
        >>> m.state_dict().keys() == model.state_dict().keys()
        True
    """
    clone = shallow_clone(original)
    return CheckpointedModule(clone, rewrite(traced, regions, clone), traced)
