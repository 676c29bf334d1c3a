"""The measuring half of `plan()` (`measure_problem`): trace the model, measure it, and build
the `solvers.Problem` the solvers see, priced with what checkpoint calls, selective policies and
runs cost on the plan's device; what the plan is for besides its budget (`Setup`) and the checks
of what the user gives (sizes in GiB, a model to train, `effort`); and the loop that checks a
plan against its own training step (`fit_to_measured`).

A planned step can hold more than the traced graph shows: its peak moves (into a recomputation,
or to another point of backward), and what the model's own code allocates there the graph does
not show. So wherever the plan's own step can run here, `plan()` and `replan()` run it: where it
peaks above the budget, its excess over the prediction is kept free as a static term,
`BEYOND_PLAN`, and the plan is solved again, up to `REFITS` times; where none of those fits, the
plan that holds least is tried. `planner.api` solves and wraps the answer in a `Plan`.

Example:
    >>> measured = measure_problem(model, tokens, plan_device([*model.parameters(), tokens], None),
    ...                            0, None, 1, (), "auto", 1, "auto", print)
    >>> fitted, peak = fit_to_measured(planned, solve_keeping_free, own_step, frugal)
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Protocol, TypeVar

import torch
import torch.fx as fx
from torch import nn

from planner.core import (
    GraphProfile,
    ModuleCheckpoint,
    check_choice,
    sample_tensors,
    self_checkpointing,
    split_sample,
    training_loss,
    training_step,
)
from planner.apply.checkpoints import applied_plan
from planner.costs.block import MAX_BLOCK_ROUNDS, selective_overhead_for_plan
from planner.costs.calls import small_call_cost
from planner.costs.node_rounds import NodeRounds
from planner.costs.overhead import FINE_ROUNDS, checkpoint_overhead_ms
from planner.costs.step import step_residuals
from planner.measure.device import PlanDevice
from planner.measure.memory import preserved_state
from planner.measure.paths import measure_model
from planner.measure.precision import block_input_casts, inputs_in, parameters_in
from planner.measure.static import collective_copies, fsdp_blocks, reduce_scatter_bytes, static_breakdown
from planner.measure.steps import keep_free_beyond_graph
from planner.problem.fsdp import fsdp_backward
from planner.problem.graph import (
    build_problem,
    casts_uncached,
    module_checkpoint,
    on_time_grid,
    run_checkpoints,
    saved_calls,
)
from planner.problem.segments import sequential_segments
from planner.trace.structure import module_calls
from planner.trace.tracing import Traced, trace
from solvers import InfeasibleBudget, Problem
from solvers.solution import format_bytes


@dataclass(frozen=True)
class Setup:
    """What the plan is for besides the budget: the device (and target GPU), how the run holds
    static memory (FSDP2 ranks, optimizer) and the resulting static memory per rank, by term,
    how planning may measure (`measure`: "no-run" runs no step, not even the plan's own), the
    dtype of the autocast the step runs under, if any, and FSDP2's `param_dtype`, if any."""

    where: PlanDevice
    world_size: int = 1
    optimizer: str | float | None = None
    static_breakdown: dict[str, int] | None = None
    measure: str = "auto"
    autocast: torch.dtype | None = None
    param_dtype: torch.dtype | None = None

    def with_reserve(self, reserved_bytes: int) -> "Setup":
        return replace(self, static_breakdown={**(self.static_breakdown or {}), "reserved": reserved_bytes})


def check_trainable(model: nn.Module) -> None:
    """Refuse a model with nothing to train, one that checkpoints itself or one with a plan
    applied; warn where it is in eval mode.

    Example:
        >>> check_trainable(model.train())
    """
    for wrapper, inner, then in ((nn.parallel.DistributedDataParallel, "module", "wrap it in DDP"),
                                 (nn.DataParallel, "module", "wrap it in DataParallel"),
                                 (torch._dynamo.eval_frame.OptimizedModule, "_orig_mod", "call torch.compile")):
        if isinstance(model, wrapper):
            raise TypeError(f"the model is wrapped in {type(model).__name__}: plan the model inside it "
                            f"(plan(model.{inner}, ...)), apply the plan to it, then {then}")
    if not model.training:
        warnings.warn("the model is in eval mode; the plan is for training, where dropout and "
                      "BatchNorm behave differently: call model.train() first", stacklevel=3)
    if applied_plan(model) is not None:
        raise ValueError(f"{type(model).__name__} has a checkpoint plan applied, which measuring would run as part of "
                         "the model: remove it first (planner.remove_plan(model)), or solve the plan you have for "
                         "another budget (p.replan(budget_gb=...))")
    checkpointing = self_checkpointing(model)
    if checkpointing:
        raise ValueError(f"{type(model).__name__} checkpoints its own layers (Hugging Face gradient checkpointing is "
                         f"on in {checkpointing[0]!r} and {len(checkpointing) - 1} more): the plan chooses what to "
                         "recompute in its place; turn it off first (model.gradient_checkpointing_disable(), in "
                         "transformers 5 activation_checkpointing_disable()) and leave it off in TrainingArguments")
    if not any(parameter.requires_grad for parameter in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no trainable parameters: a training step "
                         "keeps no activations for them, so there is nothing to plan; unfreeze the "
                         "parameters you train (requires_grad=True) first")


def check_gb(name: str, value: Any, allow_zero: bool = False) -> float:
    """Validate a size in GiB given by the user; raise ValueError naming the argument.

    Example:
        >>> check_gb("budget_gb", 4)
        4.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of GiB, not {value!r}")
    value = float(value)
    if math.isnan(value) or math.isinf(value) or value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "more than zero"
        raise ValueError(f"{name} must be a finite number of GiB {bound}, not {value!r}")
    return value


BEYOND_PLAN = "planned step beyond the traced graph (measured)"


REFITS = 3  # solves again at most this many times


class _Sized(Protocol):
    @property
    def budget_bytes(self) -> int: ...

    @property
    def predicted_peak_bytes(self) -> int: ...

    @property
    def problem(self) -> Problem: ...


PlanT = TypeVar("PlanT", bound=_Sized)


def fit_to_measured(plan: PlanT, solve_keeping_free: Callable[[int], PlanT], measured_peak: Callable[[PlanT], int],
                    frugal: Callable[[], PlanT]) -> tuple[PlanT, int]:
    """`plan` where its own step (`measured_peak(plan)`) stays within its budget; else the plan
    `solve_keeping_free(extra)` solves with `extra` bytes more kept free, `extra` the measured
    excess over the predicted peak (summed over tries), checked again, up to `REFITS` times.
    Where none of those fits (or no plan does with that much kept free), the plan that holds
    least, `frugal()`, where its step fits; else `InfeasibleBudget`, naming that step's peak:
    the smallest budget a plan was measured to fit. Returns the plan and its step's measured
    peak; warns with the figures where it solves again.

    Example:
        >>> fitted, measured = fit_to_measured(planned, solve_keeping_free, lambda p: 120 << 20, frugal)
    """
    extra = 0
    for _ in range(REFITS):
        measured = measured_peak(plan)
        if measured <= plan.budget_bytes:
            return plan, measured
        excess = max(1, measured - plan.predicted_peak_bytes)
        extra += excess
        warnings.warn(f"the plan's own training step peaked at {format_bytes(measured)}, above its budget of "
                      f"{format_bytes(plan.budget_bytes)} and {format_bytes(excess)} above its predicted "
                      f"{format_bytes(plan.predicted_peak_bytes)}: memory the traced graph does not show; solving "
                      f"again with {format_bytes(extra)} kept free (static term {BEYOND_PLAN!r})", stacklevel=3)
        try:
            plan = solve_keeping_free(extra)
        except InfeasibleBudget:
            break
    else:
        measured = measured_peak(plan)
        if measured <= plan.budget_bytes:
            return plan, measured
    budget = plan.budget_bytes
    plan = frugal()
    measured = measured_peak(plan)
    if measured > budget:
        raise InfeasibleBudget(budget, measured, plan.problem.static_bytes, proven=False)
    warnings.warn(f"no plan solved with what the steps measured beyond their predictions kept free fits the budget of "
                  f"{format_bytes(budget)}; the plan that holds least does ({format_bytes(measured)} measured), at a "
                  "higher recompute cost", stacklevel=3)
    return plan, measured


@dataclass(frozen=True)
class MeasuredProblem:
    """What `measure_problem` returns: the traced graph, its measurements, the problem built
    from them, static memory per rank by term, and the checkpoint each allowed region applies
    (submodule calls and slices of an nn.Sequential), by node range."""

    traced: Traced
    summary: GraphProfile
    problem: Problem
    breakdown: dict[str, int]
    wrapped: dict[range, ModuleCheckpoint]
    seconds: dict[str, float] = field(default_factory=dict)  # how long each part of measuring took


EFFORTS = ("normal", "thorough")


def check_effort(effort: Any) -> str:
    """Validate `effort=`: "normal" or "thorough".

    Example:
        >>> check_effort("thorough")
        'thorough'
    """
    return check_choice("effort", effort, EFFORTS)


def measure_problem(model: nn.Module, sample: Any, where: PlanDevice, reserved_bytes: int,
                    optimizer: str | float | None, world_size: int, leaves: tuple[str, ...], frontend: str,
                    repeats: int, measure: str, say: Callable[[str], None], effort: str = "normal",
                    selective: bool = False,
                    node_times: Callable[[fx.GraphModule], str] | None = None,
                    param_dtype: torch.dtype | None = None) -> MeasuredProblem:
    """Trace and measure `model` on `sample` where `where` says, leaving the model as it was.
    The arguments are `plan()`'s, already checked. With `effort="thorough"`, where the whole
    step runs here, what checkpoint calls and runs cost is also read off the model's own
    training steps (`planner.costs.calls`, `planner.costs.step`: a minute or more on a CPU).
    With `param_dtype` (FSDP2's mixed precision), the model runs with its parameters and
    floating inputs in it (`planner.measure.precision`).

    Example:
        >>> model, tokens = planner.examples.gpt()
        >>> measured = measure_problem(model, tokens, plan_device([*model.parameters(), tokens], None),
        ...                            0, None, 1, (), "auto", 1, "no-run", print)
        >>> len(measured.problem.nodes)
        290
    """
    sample = inputs_in(sample, param_dtype)  # (FSDP2 casts floating inputs, planner.measure.precision)
    args, kwargs = split_sample(sample)
    clock = _Stopwatch()
    with parameters_in(model, param_dtype):  # (FSDP2's unsharded parameters: in param_dtype)
        say("tracing")
        on_meta = any(t.device.type == "meta" for t in (*model.parameters(), *sample_tensors(sample)))
        traced = trace(model, sample, leaves, frontend, fake_device=where.profile_device if on_meta else None)
        inputs = traced.graph_inputs(args, kwargs)
        clock.lap("tracing")
        with preserved_state(model, [where.device] if where.local else []):
            summary = measure_model(traced.gm, inputs, where, measure, repeats, say,
                                    loss=lambda result: training_loss(traced.model_output(result)),
                                    model_call=(model, args, kwargs), node_times=node_times)
    breakdown = static_breakdown(model, summary.buffer_bytes, summary.input_bytes,
                                 where.device, optimizer, world_size, reserved_bytes, summary.loss_bytes,
                                 param_dtype)  # (of the parameters as FSDP2 shards them: the model's own)
    fsdp = world_size > 1 or param_dtype is not None
    blocks = fsdp_blocks(model) if fsdp else []
    reduced = reduce_scatter_bytes(model, world_size, where.device) if fsdp else {}
    if param_dtype is not None and (casts := block_input_casts(traced.gm, blocks, param_dtype)):
        breakdown = {**breakdown, "block inputs cast to param_dtype (FSDP, estimate)": casts}
    with parameters_in(model, param_dtype):
        uncached = casts_uncached(traced.gm)
        wrapped = {call.nodes: spec for call in module_calls(traced.gm)
                   if (spec := module_checkpoint(traced.gm, call, type(model).__name__, uncached)) is not None}
        clock.lap("measuring" if node_times is None else "sizes")
        # Measured where the plan runs; for a GPU elsewhere, this CPU's (checkpoint's own work is
        # mostly on the host), an estimate like the target's node times.
        overhead_device = where.device if where.local else torch.device("cpu")
        overhead_ms, saved_tensor_ms = checkpoint_overhead_ms(overhead_device)
        segments, sequentials = sequential_segments(model, traced.gm, wrapped)
        problem = build_problem(traced.gm, sum(breakdown.values()), tuple(wrapped), overhead_ms,
                                summary.rng_state_bytes, summary.gradients, saved_tensor_ms, tuple(segments),
                                sequentials, summary.loss_scratch_bytes)
        if fsdp:  # (FSDP2's unsharded gradients and buffers in backward: planner.problem.fsdp)
            problem = fsdp_backward(problem, traced.gm, blocks, reduced,
                                    collective_copies(where.device, world_size))
        blocks_here = where.local and not on_meta and node_times is None
        if blocks_here:
            say("timing checkpoint, a selective policy and run recording on one of the model's blocks")
        costs = selective_overhead_for_plan(
            model, problem, wrapped, overhead_device, blocks_here, lambda: model(*args, **kwargs),
            lambda region, kept: saved_calls(traced.gm, region, kept),
            MAX_BLOCK_ROUNDS if effort == "thorough" else FINE_ROUNDS)
        problem = replace(problem, **asdict(costs))
        clock.lap("checkpoint's costs")
        whole_step = summary.measurement == "whole step" and where.local and not on_meta  # (the step fits here)
        if whole_step and effort == "thorough":
            say("timing checkpoint calls of the model's smallest repeated submodule, alone and in its forward")
            with preserved_state(model, [where.device]):
                problem = replace(problem, region_overhead_ms=small_call_cost(
                    model, problem, wrapped, where.device, lambda module: module(*args, **kwargs)))
            say("timing checkpoint calls and runs in training steps (checkpoint's cost per block within one step "
                "first), and the nodes again in the same rounds")
            node_rounds = NodeRounds(traced.gm, inputs, where.device)
            residuals = step_residuals(
                model, problem, wrapped, lambda runs: run_checkpoints(traced.gm, problem, runs, wrapped).values(),
                lambda keeps: [replace(wrapped[region], saved_calls=saved_calls(traced.gm, region, kept))
                               for region, kept in keeps],
                lambda module: training_step(module, sample), where.device,
                node_rounds=node_rounds)
            problem = residuals.priced(problem)
            summary = replace(summary, timing=node_rounds.described(summary.timing))
            clock.lap("costs in training steps")
        if whole_step and world_size == 1 and param_dtype is None:  # (FSDP2's terms: not one unsharded step's)
            say("measuring the model's own step against the traced graph")
            problem, breakdown = keep_free_beyond_graph(model, sample, problem, breakdown, where.device, where.name)
            clock.lap("the unplanned step")
        if not selective:
            problem = replace(problem, nodes=tuple(replace(node, keepable=False) for node in problem.nodes))
        return MeasuredProblem(traced, summary, on_time_grid(problem), breakdown, {**wrapped, **segments},
                               clock.seconds)


class _Stopwatch:
    """Seconds each part of a planning took, by name, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._since = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._since
        self._since = now


__all__ = ['BEYOND_PLAN', 'REFITS', 'Setup', 'check_gb', 'check_trainable', 'fit_to_measured']
