"""The planner's predictions again, from node times measured in the timing rounds.

A plan's `recompute_ms` is predicted from node times measured once, as `plan()` runs. On a
shared machine the speed of one stretch of seconds differs from the next by several percent,
so a prediction can miss a step time measured minutes later although its cost model is right.
`NodeRetimer` times every graph node once per round, between the configurations' steps (the
planner's own `TimingInterpreter` pass over the traced graph), and predicts each plan again
from the per-node medians: the cost model's error, the machine's drift removed. The cost
model's other terms (per checkpoint call, per recorded call, ...) stay as `plan()` measured them.

Example:
    >>> retimer = NodeRetimer(base)           # base = plan(model, sample, ...)
    >>> for _ in range(rounds):
    ...     time_every_configuration(); retimer.measure()
    >>> retimer.predict(planned)              # planned = base.replan(...)
"""
from __future__ import annotations

import dataclasses
import statistics


class NodeRetimer:
    def __init__(self, base) -> None:
        from planner.trace import split_sample

        self.base = base
        args, kwargs = split_sample(base.sample)
        self.inputs = base.traced.graph_inputs(args, kwargs)
        self.times: dict[str, list[float]] = {}
        self.stop_times: dict[str, list[float]] = {}
        self.launch_ms: dict[str, float] = {}

    def measure(self) -> None:
        """One pass over the traced graph, autograd on, each node timed (the model's state,
        BatchNorm statistics and RNG, restored after it)."""
        import torch
        from planner.memory import preserved_state
        from planner.timing import TimingInterpreter

        gm = self.base.traced.gm
        device = self.inputs[0].device if self.inputs else torch.device("cpu")
        with preserved_state(gm, [device]), torch.enable_grad():
            timer = TimingInterpreter(gm, self.times, device, self.stop_times, self.launch_ms)
            timer.run(*self.inputs)
            timer.collect()

    def problem(self):
        """The plan's problem with node times (and times to the last save) as medians over the rounds."""
        nodes = []
        for node in self.base.problem.nodes:
            if node.name not in self.times:
                nodes.append(node)
                continue
            compute = statistics.median(self.times[node.name])
            stop = node.stop_ms
            if node.name in self.stop_times:
                stop = min(compute, statistics.median(self.stop_times[node.name]))
            nodes.append(dataclasses.replace(node, compute_ms=compute, stop_ms=stop))
        return dataclasses.replace(self.base.problem, nodes=tuple(nodes))

    def predict(self, planned) -> float | None:
        """`planned.recompute_ms` with the rounds' node times (None before any round)."""
        if not self.times:
            return None
        solution = planned.solution
        return self.problem().recompute_ms(solution.regions, solution.kept)
