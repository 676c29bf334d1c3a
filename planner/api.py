"""`plan()`: trace, measure and solve; and the `Plan` it returns, which applies itself to a model.
`load_plan` reads a saved plan back as a `Plan` that holds its record only.

Example:
    >>> p = plan(model, sample, budget_gb=4)
    >>> p.apply(model)
    >>> load_plan(p.save("plan.json")).apply(fresh_model)
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from planner.apply.checkpoints import shallow_clone
from planner.core import GraphProfile, ModuleCheckpoint, sample_tensors, training_sample
from planner.measure.autocast import autocast_name, check_autocast, emulates_cuda, step_autocast
from planner.measure.device import check_measure, measurable_bytes, plan_device
from planner.measure.precision import check_param_dtype, inputs_in, parameters_in
from planner.measure.static import check_optimizer, check_world_size
from planner.measure.steps import (
    Verification,
    held_outside_step,
    steady_peak,
    verify_modules,
)
from planner.measure.targets import target as find_target
from planner.planning import (
    BEYOND_PLAN,
    MeasuredProblem,
    Setup,
    check_effort,
    check_gb,
    check_trainable,
    fit_to_measured,
    measure_problem,
)
from planner.plans.record import PlanRecord, load_record, record_of
from planner.problem.graph import kept_indices
from planner.problem.regions import (
    Checkpoint,
    describe_checkpoints,
    named_regions,
    region_specs,
    submodule_regions,
)
from planner.report.text import format_report
from planner.trace.structure import compute_nodes, module_path
from planner.trace.tracing import Traced
from solvers import InfeasibleBudget, Problem, Solution, Status, minimum_peak_bytes, peak_bytes, solve

logger = logging.getLogger(__name__)

GIB = 2**30
DEFAULT_BUDGET_GB = 80.0  # one 80 GB GPU, where no target says otherwise


@dataclass(frozen=True)
class Measurements:
    """What a plan made here keeps for replanning: the traced graph with each node's profile in
    `node.meta` (`traced`), the whole graph's figures (`summary`), what the plan is for
    (`setup`), the checkpoint that applies each allowed region, by node range (`wrapped`), and
    how long each part of measuring took (`seconds`)."""

    traced: Traced
    summary: GraphProfile
    setup: Setup
    wrapped: dict[range, ModuleCheckpoint]
    seconds: dict[str, float] = field(default_factory=dict)  # how long each part of measuring took


class Plan:
    """A checkpointing plan for one model and input shape: its record (`record`: the problem,
    the solution and everything the report, the JSON file and applying need) and, for a plan
    made here, the model, the sample and the measurements that `replan`, `verify` and `module`
    use. A plan read back with `load_plan` has its record only: it prints, plots, saves and
    applies to a model; `verify(sample, model=...)` checks it on one.

    Example:
        >>> p = plan(model, sample, budget_gb=2.0)
        >>> print(p)
        >>> m = p.module()
    """

    def __init__(self, record: PlanRecord, model: nn.Module | None = None, sample: Any = None,
                 measurements: Measurements | None = None):
        self.record = record
        self._model = model
        self._sample = sample
        self._measurements = measurements
        self._module: nn.Module | None = None

    # -- the record's figures ----------------------------------------------------------------

    @property
    def problem(self) -> Problem:
        """What the solver saw: the graph's nodes and their costs, the static memory."""
        return self.record.problem

    @problem.setter
    def problem(self, problem: Problem) -> None:  # (to replan with other costs, in experiments)
        self.record = replace(self.record, problem=problem)

    @property
    def solution(self) -> Solution:
        return self.record.solution

    @property
    def budget_bytes(self) -> int:
        return self.record.budget_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.record.reserved_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        """Simulated peak of one forward+backward with the plan (static memory included)."""
        return self.record.predicted_peak_bytes

    @property
    def baseline_peak_bytes(self) -> int:
        """Simulated peak of one forward+backward without any checkpointing."""
        return self.record.baseline_peak_bytes

    @property
    def recompute_ms(self) -> float:
        """What the plan adds to every training step: recomputation and checkpoint's own work."""
        return self.record.recompute_ms

    @property
    def forward_ms(self) -> float:
        return self.record.forward_ms

    @property
    def solver(self) -> str:
        return self.record.solver

    @property
    def requested_solver(self) -> str:
        return self.record.requested_solver

    @property
    def solver_options(self) -> dict[str, Any]:
        return dict(self.record.solver_options)

    @property
    def checkpoints(self) -> tuple[Checkpoint, ...]:
        """Each region as the report shows it: its nodes, what it recomputes, frees and keeps."""
        return self.record.checkpoints

    @property
    def module_checkpoints(self) -> tuple[ModuleCheckpoint, ...]:
        """The submodules whose forward runs under checkpoint, in order, each with the ATen
        calls it keeps (`ModuleCheckpoint.saved_calls`) for the plan's kept nodes."""
        return self.record.module_checkpoints

    @property
    def static_breakdown(self) -> dict[str, int]:
        """Static memory per rank, term by term, in bytes (see `planner.measure.static`): parameters,
        gradients, optimizer state, buffers, inputs, FSDP2's unsharded parameters
        and gradients in flight, the reserve. They sum to `problem.static_bytes`."""
        return dict(self.record.static_breakdown or {})

    @property
    def target(self) -> str | None:
        """The name of the GPU the plan was made for (None: the model's own device)."""
        return (self.record.planned_for or {}).get("target")

    @property
    def frontend(self) -> str:
        """The tracer that produced the graph: "torch.fx.symbolic_trace" or "torch.export"."""
        return self.record.frontend

    @property
    def leaves(self) -> tuple[str, ...]:
        """Submodules kept whole because tracing them failed."""
        return self.record.leaves

    @property
    def verification(self) -> Verification | None:
        """The last `verify()`'s measurements (None: not verified)."""
        return self.record.verification

    @property
    def own_step_peak_bytes(self) -> int | None:
        """The measured peak of the plan's own training step, where planning ran it."""
        return self.record.own_step_peak_bytes

    @property
    def verified(self) -> bool:
        """Whether the plan's own training step has run on the plan's device and peaked within
        its budget: in planning (where the device can hold the planned step), or in `verify()`.
        A plan for another device (a `target`, FSDP2 ranks, a model on `meta`) has not: its
        peak is predicted only. `load_plan(path).apply(model)` and `verify()` there close that gap.

        Example:
            >>> plan(model, tokens, budget_gb=0.5).verified
            True
        """
        return self.record.verified

    # -- what a plan made here holds -------------------------------------------------------------

    def _measured(self, what: str) -> Measurements:
        if self._measurements is None:
            raise ValueError(f"{what} needs the measurements of a plan made here with planner.plan(); this plan "
                             f"holds its record only{' (read from ' + self.record.source + ')' if self.record.source else ''}")
        return self._measurements

    @property
    def model(self) -> nn.Module | None:
        """The model this plan was made for (never modified by the planner); None for a loaded plan."""
        return self._model

    @property
    def sample(self) -> Any:
        """The sample the model was measured on; None for a loaded plan."""
        return self._sample

    @property
    def traced(self) -> Traced:
        """The traced graph, with the per-node measurements in `node.meta["planner.profile"]`."""
        return self._measured("the traced graph").traced

    @property
    def profile(self) -> GraphProfile:
        """The whole graph's measured figures (how it was measured, static sizes)."""
        return self._measured("the graph's profile").summary

    @property
    def setup(self) -> Setup:
        """What the plan is for besides its budget: device, ranks, optimizer, static terms."""
        return self._measured("the plan's setup").setup

    @property
    def wrapped(self) -> dict[range, ModuleCheckpoint]:
        """The checkpoint that applies each allowed region, by node range."""
        return self._measured("the allowed regions").wrapped

    # -- other plans from the same measurements ----------------------------------------------

    def replan(self, budget_gb: float | None = None, solver: str | None = None,
               reserved_gb: float | None = None, solver_options: dict[str, Any] | None = None) -> "Plan":
        """Solve again for another budget or solver, reusing the measurements. `solver_options`
        go to the solver (see `solvers.solve`); by default the plan's own, unless `solver`
        names another solver.

        Example:
            >>> tighter = p.replan(budget_gb=1.0)
            >>> proven = p.replan(solver="ilp", solver_options={"time_limit_s": 120})
        """
        measurements = self._measured("replan")
        budget_bytes = int(check_gb("budget_gb", budget_gb) * GIB) if budget_gb is not None else self.budget_bytes
        reserved_bytes = (int(check_gb("reserved_gb", reserved_gb, allow_zero=True) * GIB)
                          if reserved_gb is not None else self.reserved_bytes)
        problem = replace(self.problem, static_bytes=self.problem.static_bytes - self.reserved_bytes + reserved_bytes)
        method = solver or self.requested_solver
        if solver_options is None:
            solver_options = self.solver_options if method == self.requested_solver else {}
        measurements = replace(measurements, setup=measurements.setup.with_reserve(reserved_bytes))
        with step_autocast(measurements.setup.where, measurements.setup.autocast):
            return _solved(self._model, self._sample, measurements, problem, budget_bytes, reserved_bytes, method,
                           solver_options)

    def with_submodules(self, modules: Sequence[str], kept: Sequence[str] = ()) -> "Plan":
        """The same measurements with exactly `modules` checkpointed (qualified names), each
        keeping the outputs of the nodes in `kept` (fx node names) that lie in it, as a plan you
        would write by hand: to predict and verify it beside the solver's. Its budget is this
        plan's, or its own predicted peak where that is higher.

        Example:
            >>> every_block = p.with_submodules([f"blocks.{i}" for i in range(8)])
            >>> every_block.recompute_ms, every_block.predicted_peak_bytes
            >>> selective = p.with_submodules(["blocks.0"], kept=["blocks_0_mlp_0", "blocks_0_mlp_2"])
        """
        regions = submodule_regions(self._measured("with_submodules").wrapped, modules)
        return self._given(regions, kept_indices(self.problem, regions, kept))

    def with_regions(self, regions: Sequence[tuple[str, str]], kept: Sequence[str] = ()) -> "Plan":
        """The same measurements with exactly `regions` recomputed, each given by its first and
        last fx node names: a submodule call, or a run of nodes inside one (`Problem.run_spans`,
        recomputed alone), as a plan you would write by hand; submodule calls keep the outputs
        of the nodes in `kept` that lie in them. Its budget is as `with_submodules`'s.

        Example:
            >>> p.with_regions([("blocks_0_norm2", "blocks_0_mlp_1")]).module_checkpoints[0].runs
            ((51, 57),)
        """
        chosen = named_regions(self.problem, regions)
        return self._given(chosen, kept_indices(self.problem, chosen, kept))

    def _given(self, regions: tuple[range, ...], keep: tuple[int, ...]) -> "Plan":
        peak = peak_bytes(self.problem, regions, keep)
        solution = Solution(regions, peak, self.problem.recompute_ms(regions, keep), Status.FEASIBLE, "given", 0.0,
                            kept=keep)
        return _plan_of(self._model, self._sample, self._measured("a plan by hand"), self.problem, solution,
                        max(self.budget_bytes, peak), self.reserved_bytes, self.requested_solver, self.solver_options)

    # -- running it ------------------------------------------------------------------------------

    def verify(self, sample: Any = None, steps: int = 3, model: nn.Module | None = None) -> Verification:
        """Run real forward+backward steps of the original and the planned module and measure
        both: peaks, step times, whether outputs and gradients match, and the errors of the
        predicted peaks and step overhead (`recompute_ms`), kept and shown in the report. The
        original model is left as it was (gradients, buffers and RNG state are restored). A
        loaded plan needs the `model` (unplanned) and the `sample` to run.

        Example:
            >>> record = p.verify(steps=3)
            >>> record.within_budget, record.overhead_percent
            >>> load_plan("plan.json").verify(tokens, model=model)
        """
        model = self._model if model is None else model
        sample = self._sample if sample is None else sample
        if model is None or sample is None:
            raise ValueError("verify needs the model and a sample: a loaded plan has neither, pass them "
                             "(verify(sample, model=model))")
        sample = training_sample(model, sample)  # (both models run as the planned one trains)
        planned_for = self.record.planned_for or {}
        if self.target is not None and planned_for.get("device") and not _local_target(self.target):
            raise ValueError(f"this plan is for {planned_for['device']}, which is not this machine's device: "
                             "save it and verify it there (load_plan(path).verify(sample, model=model))")
        if any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers())):
            raise ValueError("the model is on the meta device and cannot run: save the plan and apply it to "
                             "the real model (load_plan(path).apply(model)), then train")
        planned = self.module() if model is self._model else self.record.apply(shallow_clone(model))
        dtype = check_autocast(planned_for.get("autocast"))  # (the step the plan is for, on the model's device)
        mixed = contextlib.nullcontext() if dtype is None else step_autocast(
            plan_device([*model.parameters(), *model.buffers(), *sample_tensors(sample)], None), dtype)
        param_dtype = check_param_dtype(planned_for.get("param_dtype"))  # (FSDP2's, without its shards)
        with mixed, parameters_in(model, param_dtype):
            verification = verify_modules(model, planned, inputs_in(sample, param_dtype), steps,
                                          self.predicted_peak_bytes, self.baseline_peak_bytes, self.budget_bytes,
                                          self.recompute_ms)
        self.record = replace(self.record, verification=verification)
        return verification

    def apply(self, model: nn.Module) -> nn.Module:
        """Apply the plan in place, like `gradient_checkpointing_enable()`: each planned
        submodule's forward runs under checkpoint; the model keeps its class, `state_dict()`
        keys and hooks, and any batch and length it accepts. `model` is the planned model or a
        freshly built one of the same architecture; a model that does not match is refused,
        naming the first difference. Returns `model`; `planner.remove_plan(model)` undoes it.

        Example:
            >>> p.apply(model)
            >>> trainer = transformers.Trainer(model=model, ...)
        """
        return self.record.apply(model)

    def module(self) -> nn.Module:
        """A planned copy of the model: the same class, parameters and buffers (shared, not
        copied), with the plan applied; the original is left untouched. Built once.

        Example:
            >>> planned = p.module()
            >>> planned.fc.weight is model.fc.weight
            True
        """
        if self._model is None:
            raise ValueError("a loaded plan has no model: apply it to one (load_plan(path).apply(model))")
        if self._module is None:
            self._module = self.apply(shallow_clone(self._model))
        return self._module

    # -- output ------------------------------------------------------------------------------------

    def report(self, verbose: bool = False) -> str:
        """The report `print(p)` shows; with `verbose`, also the solver, the graph and the cost
        model's figures.

        Example:
            >>> print(p.report(verbose=True))
        """
        return format_report(self.record, verbose)

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Write a PNG of the predicted memory over one step, unplanned and planned, with the
        budget and the regions marked (needs matplotlib). See `planner.report.plot`.

        Example:
            >>> p.plot("memory.png")
        """
        from planner.report.plot import plot_plan

        return plot_plan(self.record, path)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save the plan as JSON; `planner.load_plan(path).apply(model)` re-applies it to a
        freshly built model of the same architecture without measuring again.

        Example:
            >>> p.save("plan.json")
        """
        return self.record.save(path)

    def export(self, path: str | os.PathLike[str]) -> Path:
        """Save the planned copy of the model (`module()`) with `torch.save`; it loads with
        `torch.load(path, weights_only=False)` where `planner` and the model's classes import.
        It is the model's class, with the plan applied (`planner.remove_plan` undoes it).

        Example:
            >>> p.export("planned.pt")
        """
        target = Path(path)
        torch.save(self.module(), target)
        return target

    def __repr__(self) -> str:
        return (f"Plan(model={self.record.model_name!r}, solver={self.solver!r}, regions={len(self.solution.regions)}, "
                f"predicted_peak_bytes={self.predicted_peak_bytes}, recompute_ms={self.recompute_ms:.3f})")

    def __str__(self) -> str:
        return self.report()


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan saved with `Plan.save`: a `Plan` that holds its record. It prints and plots
    without the model; `.apply(model)` applies it to a freshly built model of the same
    architecture, and `.verify(sample, model=model)` runs it there.

    Example:
        >>> from planner import load_plan
        >>> saved = load_plan("plan.json")
        >>> print(saved)
        >>> saved.apply(model)
    """
    return Plan(load_record(path))


def _ranks() -> Any:
    """torch.distributed where a process group of two ranks or more is initialised, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _other_rank() -> bool:
    dist = _ranks()
    return dist is not None and dist.get_rank() != 0


def _share_with_ranks(payload: PlanRecord | Exception) -> None:
    """On rank 0 of a process group: send the plan's record, or the error planning raised, to
    every other rank (`_plan_of_rank_zero` receives it)."""
    dist = _ranks()
    if dist is None:
        return
    if isinstance(payload, Exception):
        try:
            pickle.dumps(payload)
        except Exception:  # (an error that does not survive pickling still says what it was)
            payload = RuntimeError(f"planning on rank 0 failed: {type(payload).__name__}: {payload}")
    dist.broadcast_object_list([payload], src=0)


def _plan_of_rank_zero(model: nn.Module, sample: Any) -> Plan:
    """On another rank: rank 0's plan for `model` (its record, with this rank's model and
    sample), or the error its planning raised. Ranks that recompute different submodules could
    issue their collectives in different orders; and planning once takes the time once."""
    dist = _ranks()
    received: list[Any] = [None]
    dist.broadcast_object_list(received, src=0)
    if isinstance(received[0], Exception):
        raise received[0]
    logger.info("rank %d uses the plan rank 0 made", dist.get_rank())
    return Plan(received[0], model, sample)


def _local_target(name: str) -> bool:
    from planner.measure.targets import local_target

    found = local_target()
    return found is not None and found.name == name


def plan(
    model: nn.Module,
    sample: Any,
    budget_gb: float | None = None,
    solver: str = "auto",
    reserved_gb: float = 0.0,
    leaves: tuple[str, ...] = (),
    frontend: str = "auto",
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
    solver_options: dict[str, Any] | None = None,
    target: str | None = None,
    world_size: int = 1,
    optimizer: str | float | None = None,
    measure: str = "auto",
    effort: str = "normal",
    selective: bool = False,
    autocast: torch.dtype | str | None = None,
    param_dtype: torch.dtype | str | None = None,
) -> Plan:
    """Choose which parts of `model` to recompute so one training step fits `budget_gb`.

    The budget is in GiB (2**30 bytes) and bounds the peak of one forward+backward pass per
    rank: parameters, gradients and optimizer state (`optimizer=`: "sgd", "sgd-momentum",
    "adam", "adamw" or bytes per parameter; by default not counted), buffers, inputs,
    activations, and `reserved_gb` that you set aside for anything else. `sample` is a Tensor, a
    tuple of positional arguments or a dict of keyword arguments for `model.forward`: the
    largest batch and length you train on. Model and sample may be on the `meta` device.

    `target` names the GPU the plan is for (`planner.measure.targets()`); without it, the device of
    the model's tensors. Where the target is not this machine's device, times are roofline
    estimates, labelled as such. Without `budget_gb` the target's memory is the budget (else
    80 GiB). `world_size` > 1 plans for FSDP2 over that many ranks (`planner.measure.static`).
    `measure`: "run" measures the whole step at once (exact; needs more memory than the
    step), "no-run" measures sizes on fake tensors and runs one node at a time, "auto" (the
    default) runs the whole step wherever this device has the memory for it (not the budget's
    question: `planner.measure.device.measurable_bytes`). Wherever the plan's own step can run here,
    it is run and the plan solved again if it peaks above the budget (`planner.planning`);
    `p.verified` says whether it ran within the budget. Where a process group is initialised
    (FSDP2, DDP), rank 0 plans and every other rank gets its plan (`Plan` with its record), so
    that all ranks recompute the same submodules. `effort="thorough"` also reads what
    checkpoint calls and runs cost off the model's own training steps (a minute or more on a
    CPU; "normal" reads them on one block). `selective=True` lets a region keep some of its
    nodes' outputs under a selective-checkpoint policy (Megatron-style: keep the matmuls,
    recompute the rest); off by default, as on the benchmark models it bought nothing on a CPU
    (docs/cost-model.md). `autocast=torch.bfloat16` (or float16) plans the step you train under
    `torch.autocast(device, dtype)`, as the Trainer's `bf16=True` does: planning, `replan` and
    `verify` run their steps under it; for a CUDA target on a machine without CUDA, CPU autocast
    casts as CUDA's does (`planner.measure.autocast`). The model is left as it was.
    `param_dtype=torch.bfloat16` plans the step FSDP2 runs under
    `MixedPrecisionPolicy(param_dtype=torch.bfloat16)`: parameters and floating inputs in that
    dtype for forward and backward, shards, gradients and optimizer state in the parameters' own
    (`planner.measure.precision`, `planner.measure.static`); such a plan does not run its own step
    here (one process holds no shards: `p.verified` is False).
    `solver_options` go to the solver (for example `{"time_limit_s": 120}` for "ilp").

    Example:
        >>> from planner import plan
        >>> from planner.examples import gpt
        >>> model, tokens = gpt()
        >>> p = plan(model, tokens, budget_gb=0.2, solver="sqrt")
        >>> m = p.module()  # train m instead of model
    """
    if _other_rank():
        return _plan_of_rank_zero(model, sample)
    try:
        planned = _plan_here(model, sample, budget_gb, solver, reserved_gb, leaves, frontend, repeats, progress,
                             solver_options, target, world_size, optimizer, measure, effort, selective, autocast,
                             param_dtype)
    except Exception as error:
        _share_with_ranks(error)
        raise
    _share_with_ranks(planned.record)
    return planned


def _plan_here(model: nn.Module, sample: Any, budget_gb: float | None, solver: str, reserved_gb: float,
               leaves: tuple[str, ...], frontend: str, repeats: int, progress: Callable[[str], None] | None,
               solver_options: dict[str, Any] | None, target: str | None, world_size: int,
               optimizer: str | float | None, measure: str, effort: str, selective: bool,
               autocast: torch.dtype | str | None, param_dtype: torch.dtype | str | None = None) -> Plan:
    """`plan()` in this process, its arguments as given."""
    gpu = find_target(target) if target is not None else None
    autocast = check_autocast(autocast)
    param_dtype = check_param_dtype(param_dtype)
    world_size = check_world_size(world_size)
    optimizer = check_optimizer(optimizer)
    check_measure(measure)
    check_effort(effort)
    if budget_gb is None:
        budget_bytes = gpu.memory_bytes if gpu else int(DEFAULT_BUDGET_GB * GIB)
    else:
        budget_bytes = int(check_gb("budget_gb", budget_gb) * GIB)
    reserved_bytes = int(check_gb("reserved_gb", reserved_gb, allow_zero=True) * GIB)
    check_trainable(model)
    sample = training_sample(model, sample)
    tensors = sample_tensors(sample)
    if not tensors:
        raise TypeError("the sample holds no tensor: pass the model's input tensors as the sample")
    where = plan_device([*model.parameters(), *model.buffers(), *tensors], gpu)
    say = progress or (lambda message: logger.info(message))
    with step_autocast(where, autocast):
        measured = measure_problem(model, sample, where, reserved_bytes, optimizer, world_size, leaves,
                                   frontend, repeats, measure, say, effort, bool(selective), param_dtype=param_dtype)
        say(f"solving for {len(compute_nodes(measured.traced.gm))} nodes with solver {solver!r}")
        setup = Setup(where, world_size, optimizer, measured.breakdown, measure, autocast, param_dtype)
        return plan_measured(model, sample, measured, setup, budget_bytes, reserved_bytes, solver, solver_options)


def plan_measured(model: nn.Module, sample: Any, measured: MeasuredProblem, setup: Setup, budget_bytes: int,
                  reserved_bytes: int = 0, solver: str = "auto", solver_options: dict[str, Any] | None = None) -> Plan:
    """The plan for a model already measured (`planner.planning.measure_problem`'s answer, for
    what `setup` says) at `budget_bytes`: solved, and checked against its own training step
    wherever that can run here, as `plan()` does after measuring.

    Example:
        >>> measured = measure_problem(model, tokens, where, 0, None, 1, (), "auto", 5, "auto", print)
        >>> p = plan_measured(model, tokens, measured, Setup(where, breakdown=measured.breakdown), 2**30)
    """
    measurements = Measurements(measured.traced, measured.summary, setup, measured.wrapped, measured.seconds)
    return _solved(model, sample, measurements, measured.problem, budget_bytes, reserved_bytes, solver,
                   solver_options or {})


def _plan_of(model: nn.Module, sample: Any, measurements: Measurements, problem: Problem, solution: Solution,
             budget_bytes: int, reserved_bytes: int, method: str, solver_options: dict[str, Any],
             own_step_peak_bytes: int | None = None) -> Plan:
    """The `Plan` of `solution`: its record (each region's checkpoint, what it was planned for)
    with the model, the sample and the measurements it was made from."""
    traced, summary, setup = measurements.traced, measurements.summary, measurements.setup
    fx_nodes = {node.name: node for node in traced.gm.graph.nodes}
    modules = [module_path(fx_nodes[node.name]) for node in problem.nodes]
    specs = region_specs(traced.gm, problem, solution, measurements.wrapped)
    checkpoints = describe_checkpoints(problem, solution.regions, modules, specs, solution.kept)
    planned_for = {
        "device": setup.where.name, "target": setup.where.target.name if setup.where.target else None,
        "world_size": setup.world_size, "optimizer": setup.optimizer, "measurement": summary.measurement,
        "times_estimated": summary.times_estimated, "scratch_measured": summary.scratch_measured,
        "own_step_peak_bytes": own_step_peak_bytes, "autocast": autocast_name(setup.autocast),
        "autocast_emulated": setup.autocast is not None and emulates_cuda(setup.where),
        "param_dtype": autocast_name(setup.param_dtype),
        "seconds": {**measurements.seconds, "solving": solution.solve_seconds},
    }
    record = record_of(model, sample, traced, summary, problem, solution, checkpoints, budget_bytes, reserved_bytes,
                       method, solver_options, planned_for, dict(setup.static_breakdown or {}))
    return Plan(record, model, sample, measurements)


def _solved(model: nn.Module, sample: Any, measurements: Measurements, problem: Problem, budget_bytes: int,
            reserved_bytes: int, method: str, solver_options: dict[str, Any]) -> Plan:
    """The plan `method` solves for; where its own step can run here, checked against that step
    and solved again with what it holds beyond the graph kept free (`planner.planning`).
    Where no plan fits, the smallest budget named is the one a plan's measured step fits in."""
    setup, summary = measurements.setup, measurements.summary

    def keeping_free(extra: int, budget: int = budget_bytes, solve_at: int | None = None) -> Plan:
        kept_free = replace(problem, static_bytes=problem.static_bytes + extra)
        terms = dict(setup.static_breakdown or {})
        if extra:
            terms[BEYOND_PLAN] = terms.get(BEYOND_PLAN, 0) + extra
        # (the report gives the solve's time)
        solution = solve(kept_free, budget if solve_at is None else solve_at, method=method, **solver_options)
        return _plan_of(model, sample, replace(measurements, setup=replace(setup, static_breakdown=terms)), kept_free,
                        solution, budget, reserved_bytes, method, solver_options)

    outside = held_outside_step(setup.static_breakdown or {})  # room in the budget that a bare step leaves unused
    own_step = lambda p: steady_peak(p.module(), sample, setup.where.device, model) + outside  # noqa: E731
    try:
        planned = keeping_free(0)
    except InfeasibleBudget as error:
        at_minimum = keeping_free(0, error.minimum_bytes)
        if not _own_step_runs_here(model, sample, at_minimum, summary, setup):
            raise
        # (what the plan at the minimum holds beyond its prediction raises the minimum by as much)
        excess = own_step(at_minimum) - at_minimum.predicted_peak_bytes
        if excess <= 0:
            raise
        raise InfeasibleBudget(budget_bytes, error.minimum_bytes + excess, error.static_bytes, error.solver,
                               error.proven) from None
    if not _own_step_runs_here(model, sample, planned, summary, setup):
        return planned
    started = time.perf_counter()
    gc.collect()  # (what measuring left in reference cycles goes before the plan's own step runs beside it)
    fitted, measured = fit_to_measured(planned, keeping_free, own_step,
                                       lambda: keeping_free(0, solve_at=minimum_peak_bytes(problem)))
    planned_for = dict(fitted.record.planned_for or {})
    planned_for.update(own_step_peak_bytes=measured,
                       seconds={**planned_for.get("seconds", {}), "its own step": time.perf_counter() - started})
    fitted.record = replace(fitted.record, planned_for=planned_for)
    return fitted


def _own_step_runs_here(model: nn.Module, sample: Any, planned: Plan, summary: GraphProfile, setup: Setup) -> bool:
    """Whether the plan's own training step can run on its device here: planning may run steps
    (not `measure="no-run"`), the plan is for this machine's device, for one rank, the model is
    real, and what the step allocates beyond the tensors already there fits in what measuring
    may use (`planner.measure.device.measurable_bytes`)."""
    where = setup.where
    if setup.measure == "no-run" or not where.local or setup.world_size != 1 or setup.param_dtype is not None:
        return False
    if any(t.device.type == "meta" for t in (*model.parameters(), *sample_tensors(sample))):
        return False
    resident = summary.parameter_bytes + summary.buffer_bytes + summary.input_bytes
    return planned.predicted_peak_bytes - resident <= measurable_bytes(where.device)


__all__ = ["GIB", "Measurements", "Plan", "load_plan", "plan", "plan_measured"]
