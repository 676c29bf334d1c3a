"""FSDP2's memory in backward, where it is made and freed (`fsdp_backward`).

Under `fully_shard` a parameter's `.grad` is a shard: each step, backward makes the full
(unsharded) gradient anew, and the unit that shards the parameter (a block, or the root for the
rest: `planner.measure.static.fsdp_units`) reduce-scatters its gradients once its backward is
done (its post-backward hook, after the backward of the unit's first node; the root's at the end
of backward). So, at the backward of each node:

* each parameter's unsharded gradient lives from the backward of its last reader (the first to
  run) to its unit's reduce-scatter; a tied parameter's later readers add theirs in place;
* a unit's reduce-scatter input buffer (its gradients, padded, in the reduce dtype) is held
  until the next unit reduce-scatters (FSDP2 keeps one such buffer alive to spare the
  allocator a stream synchronisation); the root's, at the end of backward;
* on CPU ranks, one more block's parameters in a block's backward (its recomputation
  included) beside those static memory counts: gloo's work may hold the block's all-gather
  output past the copy out of it while the next block's is prefetched and copied
  (`planner.measure.static.collective_copies`).

These become the problem's `held_in_backward`, and the nodes' own parameter gradients (counted
as temporaries of their backward, as in a step where `.grad` already holds the sum) shrink to
what a later reader of a tied parameter adds.

Example:
    >>> problem = fsdp_backward(problem, gm, fsdp_blocks(model), reduce_scatter_bytes(model, 8, device))
    >>> problem.held_in_backward[0]  # (first, last, bytes): alive at the backward of nodes first..last
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import torch.fx as fx

from planner.measure.static import fsdp_unit_of
from planner.problem.graph import parameter_gradient_paths
from planner.trace.structure import compute_nodes, module_path
from solvers import Problem


def fsdp_backward(problem: Problem, gm: fx.GraphModule, blocks: Sequence[str],
                  reduce_bytes: Mapping[str, int], copies: int = 0) -> Problem:
    """`problem` with FSDP2's unsharded gradients and reduce-scatter buffers placed in backward,
    and with `copies` (`collective_copies`) more blocks' parameters in a block's backward (see the
    module docstring). `blocks` are the units `fully_shard` is applied to before the root
    (`fsdp_blocks`), `reduce_bytes` each unit's reduce-scatter buffer ("" the root's); `gm`'s
    parameters are the unsharded ones (in FSDP2's `param_dtype`, if any).

    Example:
        >>> sharded = fsdp_backward(problem, gm, ["h.0", "h.1"], {"": 1024, "h.0": 4096, "h.1": 4096})
        >>> len(sharded.held_in_backward) > len(problem.held_in_backward)
        True
    """
    nodes = compute_nodes(gm)
    index = {node.name: i for i, node in enumerate(nodes)}
    in_block = [fsdp_unit_of(module_path(node), blocks) for node in nodes]
    first_node = {"": 0}  # a unit's reduce-scatter follows the backward of its first node
    for i, block in enumerate(in_block):
        first_node.setdefault(block, i)

    sizes = {name: p.numel() * p.element_size() for name, p in gm.named_parameters()}
    spans: list[tuple[int, int, int]] = []
    made = [0] * len(nodes)
    for name, paths in parameter_gradient_paths(nodes, index).items():
        last, earliest = max(paths.values()), min(paths)
        made[last] += sizes[name]
        until = min(first_node.get(fsdp_unit_of(name, blocks), 0), earliest)
        if problem.measured_gradients is not None and len(paths) > 1:
            # measured: a tied parameter's summed gradient is in flight from its last reader to its
            # first (`planner.measure.allocations.backward_memory`); it is `.grad` after that
            last = earliest - 1
        elif problem.measured_gradients is None:
            # derived: another path's gradient for a view of it is a storage of its own until the
            # view hands it on (`planner.problem.graph`'s parameter gradients)
            for entry, maker in paths.items():
                if entry < maker != last:
                    spans.append((entry, maker, sizes[name]))
                    made[maker] += sizes[name]
        if until <= last:
            spans.append((until, last, sizes[name]))
    block_bytes = dict.fromkeys((block for block in first_node if block), 0)
    for name, size in sizes.items():
        if (block := fsdp_unit_of(name, blocks)) in block_bytes:
            block_bytes[block] += size
    block_nodes = [i for i, block in enumerate(in_block) if block]
    if block_nodes:
        spans.append((block_nodes[0], block_nodes[-1], copies * max(block_bytes.values())))
    ordered = sorted((start, block) for block, start in first_node.items() if block)
    for position, (start, block) in enumerate(ordered):
        held_until = ordered[position - 1][0] if position else 0  # (the previous unit's, or the root's at the end)
        spans.append((held_until, start, reduce_bytes.get(block, 0)))
    if reduce_bytes.get("", 0):
        spans.append((0, 0, reduce_bytes[""]))
    costs = []
    for i, node in enumerate(problem.nodes):
        own = max(0, node.param_grad_bytes + sum(size for _, size in node.shared_grads) - made[i])
        costs.append(replace(node, param_grad_bytes=own, late_grad_bytes=min(node.late_grad_bytes, own),
                             shared_grads=()))
    held = tuple(sorted((*problem.held_in_backward, *(span for span in spans if span[2] > 0))))
    return replace(problem, nodes=tuple(costs), held_in_backward=held)


__all__ = ["fsdp_backward"]
