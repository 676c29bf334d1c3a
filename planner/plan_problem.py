"""The measuring half of `plan()`: trace the model, measure it, and build the `solvers.Problem`
the solvers see, priced with what checkpoint calls, selective policies and runs cost on the
plan's device. `planner.api` solves it and wraps the answer in a `Plan`."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from planner.apply import ModuleCheckpoint
from planner.block_costs import MAX_BLOCK_ROUNDS, selective_overhead_for_plan
from planner.call_costs import small_call_cost
from planner.eager_check import keep_free_beyond_graph
from planner.graph import build_problem, module_calls, module_checkpoint, run_checkpoints, saved_calls
from planner.measure import PlanDevice, measure_model
from planner.memory import preserved_state
from planner.node_rounds import NodeRounds
from planner.overhead import FINE_ROUNDS, checkpoint_overhead_ms
from planner.profile_records import GraphProfile
from planner.segments import sequential_segments
from planner.static import static_breakdown
from planner.step_costs import step_residuals
from planner.plan_setup import sample_tensors
from planner.trace import Traced, split_sample, trace
from planner.verify import training_loss
from solvers import Problem


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


EFFORTS = ("normal", "thorough")


def check_effort(effort: Any) -> str:
    """Validate `effort=`: "normal" or "thorough".

    Example:
        >>> check_effort("thorough")
        'thorough'
    """
    if effort not in EFFORTS:
        raise ValueError(f"effort must be one of {', '.join(repr(e) for e in EFFORTS)}; not {effort!r}")
    return effort


def measure_problem(model: nn.Module, sample: Any, where: PlanDevice, reserved_bytes: int,
                    optimizer: str | float | None, world_size: int, leaves: tuple[str, ...], frontend: str,
                    repeats: int, measure: str, say: Callable[[str], None], effort: str = "normal") -> MeasuredProblem:
    """Trace and measure `model` on `sample` where `where` says, leaving the model as it was.
    The arguments are `plan()`'s, already checked. With `effort="thorough"`, where the whole
    step runs here, what checkpoint calls and runs cost is also read off the model's own
    training steps (`planner.call_costs`, `planner.step_costs`: a minute or more on a CPU).

    Example:
        >>> model, tokens = planner.examples.gpt()
        >>> measured = measure_problem(model, tokens, plan_device([*model.parameters(), tokens], None),
        ...                            0, None, 1, (), "auto", 1, "no-run", print)
        >>> len(measured.problem.nodes)
        290
    """
    args, kwargs = split_sample(sample)
    say("tracing")
    on_meta = any(t.device.type == "meta" for t in (*model.parameters(), *sample_tensors(sample)))
    traced = trace(model, sample, leaves, frontend, fake_device=where.profile_device if on_meta else None)
    inputs = traced.graph_inputs(args, kwargs)
    with preserved_state(model, [where.device] if where.local else []):
        summary = measure_model(traced.gm, inputs, where, measure, repeats, say,
                                loss=lambda result: training_loss(traced.model_output(result)),
                                model_call=(model, args, kwargs))
    breakdown = static_breakdown(model, summary.buffer_bytes, summary.input_bytes,
                                 where.device, optimizer, world_size, reserved_bytes, summary.loss_bytes)
    wrapped = {call.nodes: spec for call in module_calls(traced.gm)
               if (spec := module_checkpoint(traced.gm, call, type(model).__name__)) is not None}
    # Measured where the plan runs; for a GPU elsewhere, this CPU's (checkpoint's own work is
    # mostly on the host), an estimate like the target's node times.
    overhead_device = where.device if where.local else torch.device("cpu")
    overhead_ms, saved_tensor_ms = checkpoint_overhead_ms(overhead_device)
    segments, sequentials = sequential_segments(model, traced.gm, wrapped)
    problem = build_problem(traced.gm, sum(breakdown.values()), tuple(wrapped), overhead_ms, summary.rng_state_bytes,
                            summary.gradients, saved_tensor_ms, tuple(segments), sequentials)
    if where.local and not on_meta:
        say("timing checkpoint, a selective policy and run recording on one of the model's blocks")
    costs = selective_overhead_for_plan(
        model, problem, wrapped, overhead_device, where.local and not on_meta, lambda: model(*args, **kwargs),
        lambda region, kept: saved_calls(traced.gm, region, kept),
        MAX_BLOCK_ROUNDS if effort == "thorough" else FINE_ROUNDS)
    problem = replace(problem, **asdict(costs))
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
            lambda module: training_loss(module(*args, **kwargs)).backward(), where.device,
            node_rounds=node_rounds)
        problem = residuals.priced(problem)
        summary = replace(summary, timing=node_rounds.described(summary.timing))
    if whole_step and world_size == 1:  # (FSDP2's per-rank terms are not what one unsharded step holds)
        say("measuring the model's own step against the traced graph")
        problem, breakdown = keep_free_beyond_graph(model, sample, problem, breakdown, where.device, where.name)
    return MeasuredProblem(traced, summary, problem, breakdown, {**wrapped, **segments})
