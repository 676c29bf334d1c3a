"""The planner's predictions again, from node times measured in the timing rounds.

A plan's `recompute_ms` is predicted from node times measured as `plan()` runs (in its step
rounds, where the whole step runs there: `planner.costs.node_rounds`). On a shared machine the speed
of one stretch of seconds differs from the next by several percent, so a prediction can miss a
step time measured minutes later although its cost model is right. `NodeRetimer` times every
graph node once per round, between the configurations' steps (`planner.costs.node_rounds.NodeRounds`,
the pass `plan()` makes), and predicts each plan again from the per-node means: the cost
model's error, the machine's drift removed. The cost model's other terms (per checkpoint call,
per recorded call, ...) stay as `plan()` measured them.

Example:
    >>> retimer = NodeRetimer(base)           # base = plan(model, sample, ...)
    >>> for _ in range(rounds):
    ...     time_every_configuration(); retimer.measure()
    >>> retimer.predict(planned)              # planned = base.replan(...)
"""
from __future__ import annotations


class NodeRetimer:
    def __init__(self, base) -> None:
        import torch

        from planner.core import split_sample
        from planner.costs.node_rounds import NodeRounds

        self.base = base
        args, kwargs = split_sample(base.sample)
        inputs = base.traced.graph_inputs(args, kwargs)
        device = inputs[0].device if inputs else torch.device("cpu")
        self.rounds = NodeRounds(base.traced.gm, inputs, device)

    def measure(self) -> None:
        """One pass over the traced graph, autograd on, each node timed (the model's state,
        BatchNorm statistics and RNG, restored after it)."""
        self.rounds.measure()

    def problem(self):
        """The plan's problem with node times (and times to the last save) as means over the rounds."""
        from planner.costs.node_rounds import with_node_times

        return with_node_times(self.base.problem, self.rounds.means())

    def predict(self, planned) -> float | None:
        """`planned.recompute_ms` with the rounds' node times (None before any round)."""
        if not self.rounds.passes:
            return None
        solution = planned.solution
        return self.problem().recompute_ms(solution.regions, solution.kept)
