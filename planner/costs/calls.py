"""What a checkpoint call costs on the model's own smallest repeated submodule, where the
model runs (`Problem.region_overhead_ms`).

The price of a call and of a saved tensor comes from tiny linear + tanh modules
(`planner.costs.overhead`) and from a block (`planner.costs.block`). Real small submodules cost
more per call, for two reasons: a checkpoint call of a real submodule costs more beyond its
forward than a tiny module's, and a checkpoint call's forward costs more inside the model's
forward than alone, as other Python work does there (a selective policy per ATen call,
`planner.costs.block`).

So both are measured on every call of the repeated submodule that recomputes least
(`planner.costs.step.small_calls`: a norm): alone, those calls in one step on the first one's
captured input, checkpointed as the plan applies it and not, less their recomputation as the
problem prices it (its node times); and in the model's forward, the model with all of them
checkpointed against the unplanned one, forwards alone, less the same calls' forwards alone
checkpointed and not. Their sum, per call, is what such a call costs the step beyond its
recomputation; less its saved tensors at the problem's figure, it is the cost per call, where
the rounds tell it from the figure held so far (`planner.measure.clock.reading_or_price`).
Forwards alone are a third of a step and far less noisy than the model's whole steps (whose
readings `planner.costs.step` takes), so they can tell a call's cost from its price.

Example:
    >>> per_call = small_call_cost(model, problem, wrapped, torch.device("cpu"), lambda m: m(x))
    >>> problem = dataclasses.replace(problem, region_overhead_ms=per_call)
"""
from __future__ import annotations

import logging
import statistics
from typing import Any, Callable

import torch
from torch import nn

from planner.apply.checkpoints import apply_plan, shallow_clone
from planner.core import ModuleCheckpoint
from planner.costs.block import backward_from, captured_call, fresh_inputs
from planner.costs.step import small_calls
from planner.measure.clock import (
    READING_LEVEL,
    holds,
    median_interval,
    reading_or_price,
    timed_until_decided,
)
from solvers import Problem

logger = logging.getLogger(__name__)

# Rounds of the model's forwards and the calls alone, and half as many more at a time while the
# reading cannot be told from its price: a few calls' reading at the planner's 99.5% level stays
# wider than its distance from the price for tens of rounds. At most 80: a reading still
# undecided by then may stay so for many more rounds, each a share of the planning's time.
CALL_ROUNDS = 40
MAX_CALL_ROUNDS = 80
# The read's time at most, its next batch of rounds included (`clock.timed_until_decided`).
MAX_READ_S = 45.0
# Calls that recompute more than this many times the figure so far are not read: the noise of
# their recomputation swamps a call's cost, and their steps alone take long (a CNN whose least
# recomputing repeated submodule is a residual stage).
RECOMPUTE_LIMIT = 10.0


def small_call_cost(model: nn.Module, problem: Problem, wrapped: dict[range, ModuleCheckpoint],
                    device: torch.device, forward_of: Callable[[nn.Module], Any]) -> float:
    """The cost of a checkpoint call (`Problem.region_overhead_ms`) as read on every call of
    the model's repeated submodule that recomputes least, alone and in the model's forward
    (`forward_of(module)`, with gradients on), beyond their recomputation (the problem's node
    times) and their saved tensors (`Problem.saved_tensor_ms`); the problem's figure where the
    rounds cannot tell the two apart, where the model has no such calls, or where each
    recomputes more than `RECOMPUTE_LIMIT` times that figure. The caller restores the model's
    state (buffers, RNG).

    Example:
        >>> small_call_cost(model, problem, wrapped, torch.device("cpu"), lambda m: m(x))
        0.62
    """
    calls = small_calls(problem, wrapped)
    if not calls:
        return problem.region_overhead_ms
    recompute_ms = statistics.median(map(problem.region_recompute_ms, calls))
    if recompute_ms > RECOMPUTE_LIMIT * problem.region_overhead_ms:
        logger.info("checkpoint's cost per call not read on %s: each call recomputes %.2f ms, over %g times the "
                    "figure so far (%.3f ms)", wrapped[calls[0]].module, recompute_ms, RECOMPUTE_LIMIT,
                    problem.region_overhead_ms)
        return problem.region_overhead_ms
    try:
        return _read_on_calls(model, problem, wrapped, calls, device, forward_of)
    except RuntimeError as error:  # a submodule that cannot run alone under checkpoint
        logger.warning("checkpoint's cost per call could not be read on %s (%s); the figure so far, %.3f ms, stands",
                       wrapped[calls[0]].module, error, problem.region_overhead_ms)
        return problem.region_overhead_ms


def _read_on_calls(model: nn.Module, problem: Problem, wrapped: dict[range, ModuleCheckpoint], calls: list[range],
                   device: torch.device, forward_of: Callable[[nn.Module], Any]) -> float:
    """`small_call_cost` read on `calls`, every call of one submodule class."""
    spec = wrapped[calls[0]]
    planned = apply_plan(shallow_clone(model), [wrapped[region] for region in calls])
    args, kwargs = captured_call(model, spec.module, lambda: forward_of(model))
    # (the calls alone on a clone of their own: their count would set off the plan's warning
    # that a submodule ran more than once in the planned clone's next forward)
    alone = model.get_submodule(spec.module)
    checkpointed = apply_plan(shallow_clone(model), [spec]).get_submodule(spec.module)
    count = len(calls)

    def step(module: nn.Module) -> Callable[[], None]:  # every call, then backward through all
        def run() -> None:
            backward_from(module, [module(*fresh_inputs(args), **kwargs) for _ in range(count)])
        return run

    def forwards(module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            for _ in range(count):
                module(*fresh_inputs(args), **kwargs)
        return run

    steps = {"model": lambda: forward_of(model), "model checkpointed": lambda: forward_of(planned),
             "alone": step(alone), "alone checkpointed": step(checkpointed),
             "forwards": forwards(alone), "forwards checkpointed": forwards(checkpointed)}
    recompute_ms = sum(map(problem.region_recompute_ms, calls))
    saved = sum(problem.nodes[i].saved_tensors for region in calls for i in region)

    def per_round(times: dict[str, list[float]]) -> list[float]:
        # a call's cost beyond its recomputation alone, plus what its forward costs more in the model
        return [((a_c - a - recompute_ms) + (m_c - m) - (f_c - f)) / count for a_c, a, m_c, m, f_c, f in zip(
            times["alone checkpointed"], times["alone"], times["model checkpointed"], times["model"],
            times["forwards checkpointed"], times["forwards"])]

    price_ms = problem.region_overhead_ms + problem.saved_tensor_ms * saved / count
    times = timed_until_decided(device, steps, CALL_ROUNDS, CALL_ROUNDS // 2,
                                lambda so_far: holds(median_interval(per_round(so_far), READING_LEVEL), price_ms),
                                MAX_CALL_ROUNDS, MAX_READ_S)
    values = per_round(times)
    cost_ms = reading_or_price(statistics.median(values), median_interval(values, READING_LEVEL), price_ms,
                               f"checkpoint of {count} calls like {spec.module} alone and in the model's forward, "
                               "beyond their recomputation, per call")
    per_call = max(problem.region_overhead_ms, cost_ms - problem.saved_tensor_ms * saved / count)

    def each(slower: str, faster: str) -> float:  # the median paired difference, per call
        return statistics.median(a - b for a, b in zip(times[slower], times[faster])) / count

    logger.info("%d calls like %s (%d saved tensors each), %d rounds: alone +%.3f ms each checkpointed against "
                "%.3f recomputation (node times); forwards +%.3f in the model, +%.3f alone: %.3f ms each beyond "
                "recomputation, %.3f ms per checkpoint call (figure so far %.3f)", count, spec.module, saved // count,
                len(values), each("alone checkpointed", "alone"), recompute_ms / count,
                each("model checkpointed", "model"), each("forwards checkpointed", "forwards"),
                statistics.median(values), per_call, problem.region_overhead_ms)
    return per_call


__all__ = ["CALL_ROUNDS", "MAX_CALL_ROUNDS", "MAX_READ_S", "RECOMPUTE_LIMIT", "small_call_cost"]
