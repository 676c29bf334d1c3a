"""What a run recomputed alone costs inside the model's own training step, beyond the figures
that price its parts (`Problem.run_region_ms`).

A run's other figures (its nodes' forward times, the recording's cost per ATen call, checkpoint's
per saved tensor) are measured on nodes and on one block with warm caches. Inside a step a run
costs more: its recording's window opens and closes around other work, its replay in backward
reads inputs long out of cache, and what it drops is freed and allocated again. On a block alone
that residual read anywhere from 0.006 to 0.38 ms per run for the same ViT layer in four
plans, and the runs plans picked cost 0.6-0.7 ms each more than predicted in the step. So it is
measured where it is paid: the model's step with one short run in each submodule call of its
repeated blocks (alone in its call, as a plan's runs mostly are), against the unplanned step,
in paired rounds; what that adds beyond the problem's other figures, per run, is the residual.

Example:
    >>> residual = run_region_in_step_ms(model, problem, wrapped, checkpoints_of,
    ...                                  lambda m: training_loss(m(x)).backward(), torch.device("cpu"))
"""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Callable, Sequence

import torch
from torch import nn

from planner.apply import ModuleCheckpoint, apply_plan, shallow_clone
from planner.clock import paired_difference, timed_rounds
from planner.memory import preserved_state
from solvers import Problem

logger = logging.getLogger(__name__)

STEP_ROUNDS = 9  # paired rounds of two whole steps: the residual is read off a difference of steps


def short_runs(problem: Problem, span: range) -> list[range]:
    """Runs of two nodes recomputed alone inside the submodule call `span` (not in a smaller
    one), one after another from its start, each recomputing something: the runs plans pick
    (a norm and the next linear's input, an activation).

    Example:
        >>> short_runs(problem, range(8, 43))
        [range(8, 10), range(11, 13), ...]
    """
    found: list[range] = []
    start = span.start
    while start + 2 <= span.stop:
        run = range(start, start + 2)
        if (problem.allows_region(run.start, run.stop) and problem.run_span_of(run) == span
                and problem.region_recompute_ms(run) > 0):
            found.append(run)
            start += 2
        else:
            start += 1
    return found


def lone_short_runs(problem: Problem, wrapped: dict[range, ModuleCheckpoint]) -> list[range]:
    """One short run (`short_runs`) in each submodule call whose class the model calls more than
    once (its blocks and their parts), none sharing a node with another: each alone in its call.

    Example:
        >>> lone_short_runs(problem, wrapped)  # a 2-block GPT: each block's first run and its MLP's
        [range(8, 10), range(20, 22), range(44, 46), range(56, 58)]
    """
    classes = Counter(wrapped[span].module_class for span in problem.run_spans)
    taken: set[int] = set()
    found = []
    for span in problem.run_spans:
        if classes[wrapped[span].module_class] < 2:
            continue
        run = next((r for r in short_runs(problem, span) if taken.isdisjoint(r)), None)
        if run is not None:
            found.append(run)
            taken.update(run)
    return sorted(found, key=lambda r: r.start)


def run_region_in_step_ms(model: nn.Module, problem: Problem, wrapped: dict[range, ModuleCheckpoint],
                          checkpoints_of: Callable[[Sequence[range]], Sequence[ModuleCheckpoint]],
                          train_step: Callable[[nn.Module], None], device: torch.device,
                          rounds: int = STEP_ROUNDS) -> float | None:
    """What each run costs a training step beyond `problem`'s other figures (at least 0), read
    off the model's own step with `lone_short_runs` recomputed (`checkpoints_of(runs)` applies
    them, on a copy sharing the parameters) against the unplanned step, `train_step(module)`
    each (forward, loss, backward), in `rounds` paired rounds. None where the problem has no
    such runs. The model, its gradients, buffers and the RNG are left as they were.

    Example:
        >>> run_region_in_step_ms(model, problem, wrapped, checkpoints_of,
        ...                       lambda m: training_loss(m(x)).backward(), torch.device("cpu"))
        0.49
    """
    runs = lone_short_runs(problem, wrapped)
    if not runs:
        return None
    planned = apply_plan(shallow_clone(model), tuple(dict.fromkeys(checkpoints_of(runs))))

    def step(module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            train_step(module)
            for parameter in model.parameters():  # zeroed with set_to_none, as a training loop does
                parameter.grad = None
        return run

    with preserved_state(model, [device]):
        times = timed_rounds(device, {"runs": step(planned), "unplanned": step(model)}, rounds)
    measured_ms = paired_difference(times, "runs", "unplanned")
    others = dataclasses.replace(problem, run_region_ms=0.0)
    predicted_ms = sum(others.region_cost_ms(run) for run in runs)
    residual = max(0.0, (measured_ms - predicted_ms) / len(runs))
    logger.info("%d short runs in the model's step measured %+.2f ms against %.2f ms from the other figures: "
                "%.3f ms per run", len(runs), measured_ms, predicted_ms, residual)
    return residual


__all__ = ["STEP_ROUNDS", "lone_short_runs", "run_region_in_step_ms", "short_runs"]
