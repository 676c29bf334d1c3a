"""The unplanned step's memory, step by step, as the recompute bound (`solvers.bound.recompute`)
reads it: what no plan can drop, what a plan drops by recomputing a node, which outputs a
recomputation may keep past their last forward use, and the steps that could go over a budget.

Example:
    >>> fixed, droppable = split_buffers(problem, plan_buffers(problem, ()))
"""
from __future__ import annotations

from collections import defaultdict

from solvers.problem import Problem
from solvers.simulate import Buffers

# ("x", node, ()): its saved tensors; ("f", node, savers): its output while those later nodes
# that saved it are still to run their backward (each in its region too, or it holds it)
Droppable = tuple[str, int, tuple[int, ...]]


def split_buffers(problem: Problem, buffers: Buffers) -> tuple[list[int], list[dict[Droppable, int]]]:
    """Per step of the unplanned timeline: the bytes no plan can drop, and the bytes a plan
    may drop by recomputing a node (keyed by the variable that drops them)."""
    nodes = problem.nodes
    fixed = list(buffers.transient)
    # A recomputed node's late gradients reuse what its unpacks free (`NodeCost.late_grad_bytes`,
    # `solvers.simulate.plan_buffers`): at most that much of its backward step is not fixed.
    for k, node in enumerate(nodes):
        if node.recomputable and node.late_grad_bytes:
            unpacked = node.saved_bytes + sum(nodes[j].output_bytes for j in set(node.saves))
            fixed[buffers.backward_step[k]] -= min(node.late_grad_bytes, unpacked)
    droppable: list[dict[Droppable, int]] = [defaultdict(int) for _ in fixed]
    savers: dict[int, list[int]] = defaultdict(list)  # owner -> the nodes that save its output
    forward_until = list(range(len(nodes)))  # owner -> the last step forward references its output
    for k, node in enumerate(nodes):
        for owner in node.saves:
            savers[owner].append(k)
        for owner in (*node.uses, *node.holds, *node.arguments):
            forward_until[owner] = max(forward_until[owner], k)
        if node.is_output:  # (read by the loss)
            forward_until[k] = buffers.loss_step
    for owner, kind, size, first, last in buffers.held:
        if owner < 0 or not nodes[owner].recomputable or kind not in ("output", "saved"):
            for step in range(first, last + 1):
                fixed[step] += size
            continue
        forced = forced_steps(buffers.backward_step, owner, kind, savers.get(owner, []))
        kept_until = forward_until[owner] if kind == "output" else first
        for step in range(first, last + 1):
            # While a later node that saved the output has its backward to come, the output
            # dropped comes back only from a recomputation that goes on past it (in full) and
            # reaches that node; after that, only its own backward needs it, also from a
            # recomputation that stops at it.
            pending = tuple(k for k in savers.get(owner, []) if kind == "output" and k != owner
                            and buffers.backward_step[k] > step)
            if step <= kept_until or step in forced or not all(nodes[k].recomputable for k in pending):
                fixed[step] += size
            else:
                droppable[step][("f", owner, pending) if pending else ("x", owner, ())] += size
    return fixed, droppable


def kept_inputs(problem: Problem, buffers: Buffers) -> dict[int, tuple[int, int]]:
    """Nodes whose output the unplanned step frees before the loss runs, as node -> (the last
    step it is alive, its bytes): kept for a recomputation, it stays until backward."""
    freed: dict[int, tuple[int, int]] = {}
    for owner, kind, size, _first, last in buffers.held:
        if kind == "output" and owner >= 0 and last < buffers.loss_step:
            freed[owner] = (last, size)
    return freed


def held_until(problem: Problem, backward_step: tuple[int, ...],
                kept_inputs: dict[int, tuple[int, int]]) -> dict[int, int]:
    """Kept input i -> the last unplanned step at which a region may still hold it: the
    backward of the last recomputable node that reads it (a region's input stays until the
    region's backward is done)."""
    until: dict[int, int] = {}
    for j, node in enumerate(problem.nodes):
        if node.recomputable:
            for i in {*node.uses, *node.arguments}:
                if i in kept_inputs and i < j:
                    until[i] = max(until.get(i, -1), backward_step[j])
    return until


def memory_rows(fixed: list[int], dropped_at_most: list[int], kept_inputs: dict[int, tuple[int, int]],
                 held_until: dict[int, int], allowance: int, loss_step: int) -> list[tuple[int, int]]:
    """(step, bytes over the allowance in the unplanned step) for each step that could go over
    it: over already, or a step where keeping every freed output a plan may keep would."""
    kept_after = [0] * (len(fixed) + 1)  # step -> bytes of freed outputs a plan may keep there
    for i, (after, size) in kept_inputs.items():
        last = max(loss_step, held_until.get(i, -1))
        kept_after[after + 1] += size
        kept_after[last + 1] -= size
    for step in range(1, len(fixed)):
        kept_after[step] += kept_after[step - 1]
    rows = []
    for step, bytes_fixed in enumerate(fixed):
        need = dropped_at_most[step] + bytes_fixed - allowance
        if need > 0 or need + kept_after[step] > 0:
            rows.append((step, need))
    return rows


def forced_steps(backward_step: tuple[int, ...], owner: int, kind: str, savers: list[int]) -> set[int]:
    """The unplanned steps at which a buffer of `owner` is alive even if `owner` is recomputed:
    its saved tensors at its own backward, its output at the backward of each node that saved it
    (`savers`). Between two of those it may be gone: savers in different regions, or outside
    any, each keep their own copy."""
    if kind == "saved":
        return {backward_step[owner]}
    return {backward_step[k] for k in savers}


__all__ = ["Droppable", "forced_steps", "held_until", "kept_inputs", "memory_rows", "split_buffers"]
