"""Turn a profiled fx graph into a torch-free `solvers.Problem`."""
from __future__ import annotations

import torch.fx as fx

from planner.profile import COMPUTE_OPS, META_KEY, GraphProfile
from solvers import NodeCost, Problem


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


def build_problem(gm: fx.GraphModule, summary: GraphProfile, reserved_bytes: int = 0) -> Problem:
    """Collect the per-node profiles of `gm` into a Problem (plain ints and floats).

    Example:
        >>> problem = build_problem(gm, profile(gm, inputs))
        >>> len(problem) == len(compute_nodes(gm))
        True
    """
    nodes = compute_nodes(gm)
    index = {node.name: i for i, node in enumerate(nodes)}
    output_node = next(node for node in gm.graph.nodes if node.op == "output")
    returned: set[str] = set()
    for node in output_node.all_input_nodes:
        record = node.meta.get(META_KEY)
        if record is not None and record.output_bytes == 0:
            returned.update(record.uses)  # returns views or a record of tensors made earlier
        returned.add(node.name)
    costs = []
    for node in nodes:
        record = node.meta[META_KEY]
        costs.append(
            NodeCost(
                name=node.name,
                compute_ms=record.forward_ms,
                output_bytes=record.output_bytes,
                grad_bytes=record.grad_bytes,
                saved_bytes=record.saved_bytes,
                transient_bytes=record.transient_bytes,
                param_grad_bytes=record.param_grad_bytes,
                backward_transient_bytes=record.backward_transient_bytes,
                uses=tuple(index[name] for name in record.uses),
                saves=tuple(index[name] for name in record.saves),
                mutates=tuple(index[name] for name in record.mutates),
                is_output=node.name in returned,
            )
        )
    return Problem(nodes=tuple(costs), static_bytes=summary.static_bytes + reserved_bytes)
