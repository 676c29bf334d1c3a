"""Reading figures off regions timed in the model's step. Two figures at once from two sets of
regions (`fit_two`): what each region costs beyond its recomputation, split into a cost per
region and a cost per unit of what it holds (saved tensors for checkpoint calls, recorded ATen
calls for runs). And whether the step says the node times are too high (`node_times_high`), and
by how much to scale them down then (`node_time_scale`, `scaled_node_times`).

Each set gives one equation, measured_ms - predicted_ms = regions * a + units * b; the two
sets differ in units per region (norms save few tensors, blocks many; short runs record few
calls, long runs many), so the two equations fix both figures. Neither falls below its floor:
where one would, it is held there and the other fitted alone, by least squares over both sets.

Example:
    >>> fit_two([(13, 26, 8.0), (6, 120, 9.6)], floors=(0.0, 0.0))  # 13 norms, 6 blocks
    (0.506, 0.0547)
"""
from __future__ import annotations

from dataclasses import replace

from solvers import Problem

Row = tuple[float, float, float]  # (regions, units, measured beyond what is already priced), ms

# Recomputing every block costs a step at least its nodes' forward times (on this CPU 7-13% more,
# on an H100 about as much): a step that measured this share less says the node times are high.
NODE_TIMES_HIGH = 0.15


def fit_two(rows: list[Row], floors: tuple[float, float]) -> tuple[float, float]:
    """The per-region and per-unit figures (a, b) that fit both rows, each at least its floor.

    Example:
        >>> fit_two([(2, 2, 3.0), (2, 24, 7.4)], floors=(0.0, 0.0))
        (1.3, 0.2)
    """
    (n1, s1, m1), (n2, s2, m2) = rows
    floor_a, floor_b = floors
    determinant = n1 * s2 - n2 * s1  # 0 where both sets hold as many units per region
    if determinant:
        a = (m1 * s2 - m2 * s1) / determinant
        b = (n1 * m2 - n2 * m1) / determinant
        if a >= floor_a and b >= floor_b:
            return a, b
    if not determinant or b < floor_b:  # the per-region figure alone beyond the units' floor
        return max(floor_a, _least_squares(rows, 0, 1, floor_b)), floor_b
    return floor_a, max(floor_b, _least_squares(rows, 1, 0, floor_a))


def _least_squares(rows: list[Row], fitted: int, held: int, value: float) -> float:
    """The figure in column `fitted` that best fits the rows with column `held`'s at `value`."""
    denominator = sum(row[fitted] ** 2 for row in rows)
    if not denominator:
        return 0.0
    return sum(row[fitted] * (row[2] - row[held] * value) for row in rows) / denominator


def node_times_high(recompute_ms: float, measured_ms: float, blocks: int) -> str | None:
    """A warning where checkpointing `blocks` blocks measured `measured_ms` in the model's step,
    more than `NODE_TIMES_HIGH` below `recompute_ms`, what their nodes' forward times say their
    recomputation costs; else None. (On this CPU, ViT planned while the machine was busy had
    node times summing to a 400 ms forward, against 218 ms on a quiet one.)

    Example:
        >>> node_times_high(285.0, 166.0, 6) is not None
        True
    """
    if recompute_ms <= 0 or measured_ms >= (1 - NODE_TIMES_HIGH) * recompute_ms:
        return None
    return (f"checkpointing every one of the {blocks} blocks added {measured_ms:.1f} ms to the model's step, "
            f"{1 - measured_ms / recompute_ms:.0%} less than the {recompute_ms:.1f} ms its graph nodes' forward "
            "times give for recomputing them: those times are too high here (the machine was busy while they were "
            "measured, or the graph's operations differ from the model's own).")


def node_time_scale(recompute_ms: float, measured_ms: float, checkpoint_ms: float) -> float:
    """What to multiply node times by where checkpointing blocks whose nodes' forward times give
    `recompute_ms` measured `measured_ms` in the model's step, of which checkpoint's own figures
    account for `checkpoint_ms`: so that the blocks' predicted overhead is what was measured
    (at most 1: this only scales down, where `node_times_high` says the times are high; 1 where
    the step leaves nothing for recomputation, which says nothing about how much to scale).

    Example:
        >>> node_time_scale(285.0, 166.0, 6.0)
        0.5614035087719298
    """
    left = measured_ms - checkpoint_ms
    if recompute_ms <= 0 or left <= 0:
        return 1.0
    return min(1.0, left / recompute_ms)


def scaled_node_times(problem: Problem, scale: float) -> Problem:
    """`problem` with every node's forward time (and the part recomputation that stops at it
    spends) multiplied by `scale`.

    Example:
        >>> scaled_node_times(problem, 0.5).nodes[0].compute_ms == 0.5 * problem.nodes[0].compute_ms
        True
    """
    if scale == 1.0:
        return problem
    nodes = tuple(replace(node, compute_ms=scale * node.compute_ms,
                          stop_ms=None if node.stop_ms is None else scale * node.stop_ms) for node in problem.nodes)
    return replace(problem, nodes=nodes)


__all__ = ["NODE_TIMES_HIGH", "Row", "fit_two", "node_time_scale", "node_times_high", "scaled_node_times"]
