"""Turn a profiled fx graph into a torch-free `solvers.Problem`."""
from __future__ import annotations

import torch.fx as fx

from planner.profile import COMPUTE_OPS, META_KEY
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


def build_problem(gm: fx.GraphModule, static_bytes: int) -> Problem:
    """Collect the per-node profiles of `gm` into a Problem (plain ints and floats), with the
    static memory the plan does not change (see `planner.static`).

    Example:
        >>> problem = build_problem(gm, sum(static_breakdown(...).values()))
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
    shared = _shared_gradients(gm, nodes)
    costs = []
    for i, node in enumerate(nodes):
        record = node.meta[META_KEY]
        costs.append(
            NodeCost(
                name=node.name,
                compute_ms=record.forward_ms,
                output_bytes=record.output_bytes,
                grad_bytes=record.grad_bytes,
                saved_bytes=record.saved_bytes,
                transient_bytes=record.transient_bytes,
                param_grad_bytes=record.param_grad_bytes - sum(size for _, size in shared.get(i, ())),
                backward_transient_bytes=record.backward_transient_bytes,
                uses=tuple(index[name] for name in record.uses),
                saves=tuple(index[name] for name in record.saves),
                mutates=tuple(index[name] for name in record.mutates),
                shared_grads=tuple(shared.get(i, ())),
                is_output=node.name in returned,
            )
        )
    return Problem(nodes=tuple(costs), static_bytes=static_bytes)


def _shared_gradients(gm: fx.GraphModule, nodes: list[fx.Node]) -> dict[int, list[tuple[int, int]]]:
    """For parameters read by several nodes (tied weights), what `NodeCost.shared_grads` says:
    by the last reader's index, (first reader's index, gradient bytes). Autograd sums the
    readers' gradients in one buffer before adding it to `.grad`, so the last reader's backward
    (the first to run) creates a buffer that lives until the first reader's has run."""
    sizes = {name: p.numel() * p.element_size() for name, p in gm.named_parameters()}
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node.meta[META_KEY].parameters:
            readers.setdefault(name, []).append(i)
    shared: dict[int, list[tuple[int, int]]] = {}
    for name, users in readers.items():
        if len(users) > 1:
            shared.setdefault(users[-1], []).append((users[0], sizes[name]))
    return shared
