"""Read computation graphs from the rematerialization literature into a Problem.

Two networkx node-link JSON formats are understood (see ../shared/data/remat-graphs/README.md):

* Checkmate training graphs (`"backward"` on every node): the forward nodes become the Problem.
  `cost_cpu` is compute_ms (the file's time units), `cost_ram` the output bytes (and the
  gradient bytes), forward links give `uses`, and an output that any backward node reads is
  saved by its own node (`j in saves[j]`).
* Random layered DAGs (Moccasin; links `{"0": source, "1": target}`): `duration` is compute_ms,
  `out_cost` the output (and gradient) bytes, `param_cost` is added to static memory, and every
  output is saved by its own node for backward.

Nodes are renumbered 0..n-1 in a topological order: the file's `graph.order` when it has a
valid one, else networkx's lexicographic topological sort by node id. Nodes with no forward
consumer are the graph's outputs.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from solvers.problem import NodeCost, Problem

logger = logging.getLogger(__name__)


if TYPE_CHECKING:
    import networkx as nx


def load_graph(path: str | Path) -> Problem:
    """Read a Checkmate or Moccasin node-link JSON graph as a Problem.

    Example:
        >>> problem = load_graph("../shared/data/remat-graphs/VGG16_256_224_224_3_train.json")
        >>> len(problem)
        22
    """
    path = Path(path)
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "nodes" not in data or "links" not in data:
        raise ValueError(f"{path}: not a networkx node-link graph (no 'nodes'/'links')")
    nodes = data["nodes"]
    if nodes and all("backward" in node for node in nodes):
        problem = _checkmate(data, path)
    elif all("out_cost" in node for node in nodes):
        problem = _layered(data, path)
    else:
        raise ValueError(
            f"{path}: unknown node fields {sorted(nodes[0]) if nodes else []}; expected Checkmate "
            "('backward', 'cost_cpu', 'cost_ram') or Moccasin ('out_cost', 'duration')"
        )
    logger.debug("loaded %s: %d nodes", path.name, len(problem))
    return problem


def _digraph() -> "nx.DiGraph":
    import networkx as nx  # imported here: only graph files need it

    return nx.DiGraph()


def _order(graph: "nx.DiGraph", declared: list[Any] | None) -> list[Any]:
    import networkx as nx

    if declared is not None and set(declared) == set(graph.nodes) and len(declared) == len(graph):
        position = {node: i for i, node in enumerate(declared)}
        if all(position[source] < position[target] for source, target in graph.edges):
            return list(declared)
        logger.warning("the file's node order is not topological; sorting it instead")
    if not nx.is_directed_acyclic_graph(graph):
        raise ValueError("the forward graph has a cycle")
    return list(nx.lexicographical_topological_sort(graph, key=str))


def _problem(
    graph: "nx.DiGraph",
    order: list[Any],
    compute: dict[Any, float],
    size: dict[Any, int],
    saved_for_backward: set[Any],
    names: dict[Any, str],
    static_bytes: int,
) -> Problem:
    index = {node: i for i, node in enumerate(order)}
    costs = []
    for node in order:
        i = index[node]
        uses = tuple(sorted(index[source] for source in graph.predecessors(node)))
        costs.append(
            NodeCost(
                name=names[node],
                compute_ms=float(compute[node]),
                output_bytes=int(size[node]),
                grad_bytes=int(size[node]),
                uses=uses,
                saves=(i,) if node in saved_for_backward else (),
                is_output=graph.out_degree(node) == 0,
            )
        )
    return Problem(nodes=tuple(costs), static_bytes=static_bytes)


def _checkmate(data: dict[str, Any], path: Path) -> Problem:
    forward = {node["id"]: node for node in data["nodes"] if not node["backward"]}
    graph = _digraph()
    graph.add_nodes_from(forward)
    saved: set[Any] = set()
    for link in data["links"]:
        source, target = link["source"], link["target"]
        if source in forward and target in forward:
            graph.add_edge(source, target)
        elif source in forward:
            saved.add(source)  # a backward node reads this forward output
    order = _order(graph, None)
    return _problem(
        graph,
        order,
        compute={node: forward[node]["cost_cpu"] for node in forward},
        size={node: forward[node]["cost_ram"] for node in forward},
        saved_for_backward=saved,
        names={node: str(forward[node].get("name", node)) for node in forward},
        static_bytes=0,
    )


def _layered(data: dict[str, Any], path: Path) -> Problem:
    nodes = {node.get("id", node.get("name")): node for node in data["nodes"]}
    graph = _digraph()
    graph.add_nodes_from(nodes)
    for link in data["links"]:
        source = link["source"] if "source" in link else link["0"]
        target = link["target"] if "target" in link else link["1"]
        graph.add_edge(source, target)
    declared = data.get("graph", {}).get("order")
    order = _order(graph, declared)
    return _problem(
        graph,
        order,
        compute={node: nodes[node].get("duration", 0) for node in nodes},
        size={node: nodes[node]["out_cost"] for node in nodes},
        saved_for_backward=set(nodes),
        names={node: str(node) for node in nodes},
        static_bytes=sum(int(node.get("param_cost", 0)) for node in nodes.values()),
    )


__all__ = ["load_graph"]
