"""The traced graph's structure: its compute nodes in order (the solvers' node indices), the
submodule each node runs in, and the submodule calls a plan can checkpoint by wrapping a
submodule's forward.

Example:
    >>> [call.path for call in module_calls(gm)][:2]
    ['transformer.h.0', 'transformer.h.0.ln_1']
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

COMPUTE_OPS = ("call_function", "call_method", "call_module")  # fx ops that compute (not inputs, attributes, output)


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's compute nodes in topological order: the solvers' node indices."""
    return [node for node in gm.graph.nodes if node.op in COMPUTE_OPS]


def module_path(node: fx.Node) -> str:
    """The model submodule a node belongs to ("" for the model's own forward).

    Example:
        >>> module_path(node)  # an export-frontend node inside GPT-2's first attention block
        'transformer.h.0.attn'
    """
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if path]
    return paths[-1] if paths else ""


def _module_stack(node: fx.Node) -> list[tuple[str, str, str]]:
    """(call key, path, class name) of each submodule the node runs in, outermost first. The
    key tells calls apart: export marks a module's second call "@1"; an fx leaf call is a node."""
    stack = node.meta.get("nn_module_stack") or {}
    entries = []
    for key, (path, kind) in stack.items():
        if path:
            name = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
            entries.append((str(key), path, name))
    if node.op == "call_module" and (not entries or entries[-1][1] != node.target):
        entries.append((node.name, str(node.target), ""))
    if node.op == "call_module":  # every call of a leaf is a node of its own
        entries[-1] = (node.name, entries[-1][1], entries[-1][2])
    return entries


@dataclass(frozen=True)
class ModuleCall:
    """A submodule call that can be one region: its compute nodes, consecutive."""

    path: str
    module_class: str
    nodes: range


def module_calls(gm: fx.GraphModule) -> list[ModuleCall]:
    """The submodule calls a plan can checkpoint by wrapping the submodule's forward: modules
    called once, whose compute nodes are consecutive. Where nested modules hold the very same
    nodes, the outermost stands for them (the block, not its only child). And the model's own
    forward (path "", its class left "" for the caller to name), where it computes nodes outside
    every submodule call: runs of nodes inside it, across its submodule calls (a residual stage's
    last convolution, the add and ReLU the model's loop makes, the next stage's first), may then
    be recomputed alone.

    Example:
        >>> [call.path for call in module_calls(gm)][:2]
        ['transformer.h.0', 'transformer.h.0.ln_1']
    """
    positions: dict[str, list[int]] = {}
    keys: dict[str, set[str]] = {}
    classes: dict[str, str] = {}
    for index, node in enumerate(compute_nodes(gm)):
        for key, path, name in _module_stack(node):
            positions.setdefault(path, []).append(index)
            keys.setdefault(path, set()).add(key)
            classes.setdefault(path, name)
    calls: dict[range, ModuleCall] = {}
    everything = range(len(compute_nodes(gm)))
    own = any(not _module_stack(node) for node in compute_nodes(gm))
    if own and len(everything) >= 2:
        calls[everything] = ModuleCall("", "", everything)
    for path, found in positions.items():
        nodes = range(found[0], found[-1] + 1)
        if len(keys[path]) != 1 or len(found) != len(nodes) or nodes in calls:
            continue
        calls[nodes] = ModuleCall(path, classes[path] or path.rsplit(".", 1)[-1], nodes)
    return sorted(calls.values(), key=lambda call: (call.nodes.start, -len(call.nodes)))


__all__ = ["COMPUTE_OPS", "ModuleCall", "compute_nodes", "module_calls", "module_path"]
