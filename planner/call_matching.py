"""Which submodule calls the model's own forward makes as the traced graph does, ATen call for
ATen call (`planner.holds` runs both): a selective policy finds a node's calls only where the
calls it may cache match (`KEEPABLE_OPS`), and a run counts calls only where all of them do,
from its window's first hook on.

Example:
    >>> unmatched, differing, starts = unmatched_regions(gm, calls_of, eager_calls, by_path, False)
    >>> matched_span(40, module_calls(gm), differing, starts)
    (8, 43)
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch.fx as fx

from planner.graph import ModuleCall, compute_nodes, module_calls

logger = logging.getLogger("planner.holds")  # (what it logs is part of holds' report)

# The compute-intensive ATen ops whose outputs a region may keep (a selective-checkpoint policy
# caches them): matrix products, convolution and fused attention, as this PyTorch dispatches
# nn.Linear (addmm; mm on inputs it must copy or without bias), matmul in attention (bmm),
# F.scaled_dot_product_attention and nn.Conv2d. Everything else is cheaper to recompute.
KEEPABLE_OPS = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten.convolution.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
})


def keepable_calls(names: Sequence[str]) -> list[str]:
    return [name for name in names if name in KEEPABLE_OPS]


def checked_calls(names: Sequence[str]) -> list[str]:
    """The calls a policy's occurrences depend on: all but torch.export's metadata asserts
    (`aten._assert_tensor_metadata`), which the model's forward does not make; a policy counts
    each func's calls on its own, so leaving out other funcs changes no occurrence."""
    return [name for name in names if not name.startswith("aten._assert")]


def first_difference(what: str, model: list[str], graph: list[str]) -> str:
    """Where two call lists first differ: "call 3 is aten.mul.Tensor in the model, none in the graph"."""
    at = next((i for i, (a, b) in enumerate(zip(model, graph)) if a != b), min(len(model), len(graph)))
    return (f"{what} {at} is {model[at] if at < len(model) else 'none'} in the model, "
            f"{graph[at] if at < len(graph) else 'none'} in the graph")


def unmatched_regions(gm: fx.GraphModule, calls_of: dict[str, Sequence[str]], eager_calls: list[str],
                      calls_by_path: Callable[[list[str]], dict[str, list[range]]], broken: bool
                      ) -> tuple[list[range], list[range], dict[range, int]]:
    """The node ranges of the regions (submodule calls, `planner.graph.module_calls`) whose
    `KEEPABLE_OPS` calls, and those whose calls of any op, are not the same, in order, in the
    graph run and in the module's one call in the model's forward; logs the first kind and why.
    And for those of the second kind called once, where their calls match from a submodule call
    inside them to their end (`matched_from`): that call's first node."""
    nodes = compute_nodes(gm)
    regions = module_calls(gm)
    by_path = calls_by_path([call.path for call in regions])
    unmatched: list[range] = []
    differing: list[range] = []
    starts: dict[range, int] = {}
    why: list[str] = []
    differ: list[str] = []
    for call in regions:
        graph_calls = checked_calls([name for i in call.nodes for name in calls_of[nodes[i].name]])
        graph = keepable_calls(graph_calls)
        found = by_path.get(call.path, [])
        if len(found) != 1:
            unmatched.append(call.nodes)
            differing.append(call.nodes)
            why.append(f"{call.path} (called {len(found)} times in the model's forward, once in the graph)")
            continue
        eager = checked_calls(eager_calls[found[0].start:found[0].stop])
        if eager != graph_calls:
            differing.append(call.nodes)
            differ.append(f"{call.path} ({first_difference('call', eager, graph_calls)})")
            start = matched_from(call, regions, [len(checked_calls(calls_of[nodes[i].name])) for i in call.nodes],
                                 eager, graph_calls)
            if start is not None:
                starts[call.nodes] = start
        model = keepable_calls(eager)  # (the asserts left out are no keepable calls)
        if model != graph:
            unmatched.append(call.nodes)
            why.append(f"{call.path} ({first_difference('keepable call', model, graph)})")
    if broken:
        logger.info("the model's submodule calls were not recorded: its module hooks did not nest")
    if why:
        logger.info("no region may keep a node of %d submodule calls: the model's forward does not make their "
                    "matrix product, convolution and attention calls as the graph does, so a selective policy "
                    "would not find them: %s", len(why), "; ".join(why))
    if differ:
        logger.info("%d of %d submodule calls make other ATen calls in the model's forward than in the graph: "
                    "they keep only matrix products, convolutions and attention: %s", len(differ), len(regions),
                    "; ".join(differ[:4]) + ("; ..." if len(differ) > 4 else ""))
    return unmatched, differing, starts


def matched_from(call: ModuleCall, regions: list[ModuleCall], node_calls: list[int], eager: list[str],
                  graph: list[str]) -> int | None:
    """The first node of the first submodule call inside `call` from which the model's forward
    makes the same calls as the graph to the end of `call` (the two lists' common tail: a
    stack's blocks, after a prefix that differs, such as an attention mask made another way);
    None where no call inside starts there. A run recorded from such a call's hooks counts
    the calls it sees as the graph has them."""
    tail = next((n for n, (a, b) in enumerate(zip(reversed(eager), reversed(graph))) if a != b),
                min(len(eager), len(graph)))
    first_call = len(graph) - tail
    position = 0
    for offset, count in enumerate(node_calls):
        if position >= first_call:
            starts = sorted(inner.nodes.start for inner in regions if inner.nodes != call.nodes
                            and call.nodes.start + offset <= inner.nodes.start and inner.nodes.stop <= call.nodes.stop)
            return starts[0] if starts else None
        position += count
    return None


def matched_span(index: int, calls: list[ModuleCall], differing: list[range],
                  starts: dict[range, int]) -> tuple[int, int] | None:
    """(start, stop) of the largest submodule call holding node `index` that, with every
    smaller one holding it, makes the same calls in the model's forward (not in `differing`),
    or does from the node `starts` gives it, at or before `index`, to its end (`matched_from`)."""
    span = None
    for call in sorted((call for call in calls if index in call.nodes), key=lambda call: len(call.nodes)):
        if call.nodes in differing and index < starts.get(call.nodes, call.nodes.stop):
            break
        span = (call.nodes.start, call.nodes.stop)
    return span


__all__ = ["KEEPABLE_OPS", "checked_calls", "first_difference", "keepable_calls", "matched_from",
           "matched_span", "unmatched_regions"]
