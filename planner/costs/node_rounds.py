"""Node times read in the same stretch of time as the steps they are compared with.

`plan()` first times every node in a few passes of the traced graph, back to back: a second or
two. On a shared machine the speed moves within seconds, so those times can all be high or
all low together, and every figure later read off the model's steps (a recomputation's cost
beyond its nodes' times) then carries that error. `NodeRounds` times every node once more in
each round of those steps, one whole pass of the graph per round, and the problem is priced
with each node's mean over the rounds (`with_node_times`): node times and step readings from
the same stretch of time. `benchmarks/retime.py` does the same between the benchmark's steps.

Means, not medians: a node's times are skewed (most passes fast, a few slowed by whatever else
the machine runs), and a step, hundreds of nodes long, pays every node's slow passes in
proportion, so its recomputation costs the sum of its nodes' means. The sum of their medians
leaves the slow passes out, and prices plans below what they measure.

Example:
    >>> rounds = NodeRounds(traced.gm, inputs, torch.device("cpu"))
    >>> for _ in range(9):
    ...     time_the_steps(); rounds.measure()
    >>> problem = with_node_times(problem, rounds.means())
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Sequence

import torch
import torch.fx as fx

from planner.measure.memory import preserved_state
from planner.measure.profile import TimingInterpreter
from solvers import Problem

# a node's forward time and the time to its last saved tensor (None: it saves none), in ms
NodeTimes = dict[str, tuple[float, float | None]]


class NodeRounds:
    """Every compute node of `gm` timed once per `measure()`: one pass of the graph on `inputs`,
    autograd on, as `planner.measure.profile` times them (`TimingInterpreter`); the graph's
    buffers and the RNG are left as they were."""

    def __init__(self, gm: fx.GraphModule, inputs: Sequence[torch.Tensor], device: torch.device) -> None:
        self.gm = gm
        self.inputs = list(inputs)
        self.device = device
        self.times: dict[str, list[float]] = {}
        self.stop_times: dict[str, list[float]] = {}
        self.launch_ms: dict[str, float] = {}  # (on CUDA: how far ahead to queue each node, as profile does)
        self.passes = 0

    def measure(self) -> None:
        """One pass over the graph, each compute node timed."""
        with preserved_state(self.gm, [self.device]), torch.enable_grad():
            timer = TimingInterpreter(self.gm, self.times, self.device, self.stop_times, self.launch_ms)
            timer.run(*self.inputs)
            timer.collect()
        self.passes += 1

    def forward_totals(self) -> list[float]:
        """The graph's forward time in each pass so far: the sum of its nodes' times (ms).

        Example:
            >>> rounds.forward_totals()
            [212.4, 196.7, 266.3]
        """
        return [sum(times[index] for times in self.times.values() if len(times) == self.passes)
                for index in range(self.passes)]

    def described(self, timing: str) -> str:
        """`timing` (how node times were read) with how far the passes' forward times spread:
        the clock's noise that the plan's times (means over the passes) carry.

        Example:
            >>> rounds.described("time.perf_counter")
            'time.perf_counter; means of 10 passes between training steps, whose forwards took 196.7-266.3 ms'
        """
        totals = self.forward_totals()
        if len(totals) < 2:
            return timing
        return (f"{timing}; means of {len(totals)} passes between training steps, whose forwards took "
                f"{min(totals):.1f}-{max(totals):.1f} ms")

    def means(self) -> NodeTimes:
        """Each timed node's mean forward time and time to its last save over the passes (means:
        what a step of many nodes pays for each, its slow passes included; see the module's
        docstring).

        Example:
            >>> rounds.means()["linear"]
            (0.41, 0.39)
        """
        return {name: (statistics.fmean(times), statistics.fmean(self.stop_times[name])
                       if name in self.stop_times else None) for name, times in self.times.items()}


def with_node_times(problem: Problem, times: NodeTimes) -> Problem:
    """`problem` with the forward time (`NodeCost.compute_ms`) and the time to the last save
    (`stop_ms`, at most the forward time) of each node named in `times`; others as they were.

    Example:
        >>> with_node_times(problem, {"linear": (0.4, 0.3)}).nodes[1].compute_ms
        0.4
    """
    if not times:
        return problem
    nodes = []
    for node in problem.nodes:
        if node.name in times:
            compute, stop = times[node.name]
            node = replace(node, compute_ms=compute, stop_ms=node.stop_ms if stop is None else min(compute, stop))
        nodes.append(node)
    return replace(problem, nodes=tuple(nodes))


__all__ = ["NodeRounds", "NodeTimes", "with_node_times"]
