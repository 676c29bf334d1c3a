"""`plan()`: trace, measure and solve; and the `Plan` it returns, which applies itself to a model.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn

from planner.apply.checkpoints import apply_plan, sample_shapes, shallow_clone
from planner.core import GraphProfile, ModuleCheckpoint, sample_tensors
from planner.measure.device import check_measure, measurable_bytes, plan_device
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
    Setup,
    check_effort,
    check_gb,
    check_trainable,
    fit_to_measured,
    measure_problem,
)
from planner.plans.matching import check_state, state_shapes
from planner.problem.graph import compute_nodes, kept_indices, module_path
from planner.problem.regions import named_regions, region_specs, submodule_regions
from planner.report.text import PlanFigures, describe_checkpoints, format_report
from planner.trace.tracing import Traced
from solvers import InfeasibleBudget, Problem, Solution, Status, peak_bytes, solve

logger = logging.getLogger(__name__)


GIB = 2**30


DEFAULT_BUDGET_GB = 80.0  # one 80 GB GPU, where no target says otherwise


class Plan(PlanFigures):
    """A checkpointing plan for one model and input shape.

    Example:
        >>> p = plan(model, sample, budget_gb=2.0)
        >>> print(p)
        >>> m = p.module()
    """

    def __init__(self, model: nn.Module, sample: Any, traced: Traced, problem: Problem,
                 summary: GraphProfile, solution: Solution, budget_bytes: int, reserved_bytes: int,
                 requested_solver: str, solver_options: dict[str, Any] | None, setup: Setup,
                 wrapped: dict[range, ModuleCheckpoint]):
        self._model = model
        self.setup = setup
        self._sample = sample
        self.verification: Verification | None = None
        self.requested_solver = requested_solver
        self.solver_options = dict(solver_options or {})
        self._traced = traced
        self._module: nn.Module | None = None
        self.wrapped = wrapped  # the submodule each allowed region checkpoints, by node range
        # the peak of the plan's own training step, where planning ran it on this device
        self.own_step_peak_bytes: int | None = None
        self.problem = problem
        self.profile = summary
        self.budget_bytes = budget_bytes
        self.reserved_bytes = reserved_bytes
        self.solution = solution
        fx_nodes = {node.name: node for node in traced.gm.graph.nodes}
        modules = [module_path(fx_nodes[node.name]) for node in problem.nodes]
        self.checkpoints = describe_checkpoints(problem, solution.regions, modules,
                                                region_specs(traced.gm, problem, solution, wrapped), solution.kept)

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
        if self.verification is not None:
            return self.verification.within_budget
        return self.own_step_peak_bytes is not None and self.own_step_peak_bytes <= self.budget_bytes

    @property
    def baseline_peak_bytes(self) -> int:
        """Simulated peak of one forward+backward without any checkpointing."""
        return peak_bytes(self.problem)

    @property
    def static_breakdown(self) -> dict[str, int]:
        """Static memory per rank, term by term, in bytes (see `planner.measure.static`): parameters,
        gradients, optimizer state, buffers, inputs, FSDP2's unsharded parameters
        and gradients in flight, the reserve. They sum to `problem.static_bytes`."""
        return dict(self.setup.static_breakdown or {})

    @property
    def target(self) -> str | None:
        """The name of the GPU the plan was made for (None: the model's own device)."""
        return self.setup.where.target.name if self.setup.where.target else None

    @property
    def model(self) -> nn.Module:
        """The model this plan was made for (never modified by the planner)."""
        return self._model

    @property
    def sample(self) -> Any:
        """The sample the model was measured on."""
        return self._sample

    @property
    def traced(self) -> Traced:
        """The traced graph, with the per-node measurements in `node.meta["planner.measure.profile"]`."""
        return self._traced

    @property
    def frontend(self) -> str:
        """The tracer that produced the graph: "torch.fx.symbolic_trace" or "torch.export"."""
        return self._traced.frontend

    @property
    def leaves(self) -> tuple[str, ...]:
        """Submodules kept whole because tracing them failed."""
        return self._traced.leaves

    def replan(self, budget_gb: float | None = None, solver: str | None = None,
               reserved_gb: float | None = None, solver_options: dict[str, Any] | None = None) -> "Plan":
        """Solve again for another budget or solver, reusing the measurements. `solver_options`
        go to the solver (see `solvers.solve`); by default the plan's own, unless `solver`
        names another solver.

        Example:
            >>> tighter = p.replan(budget_gb=1.0)
            >>> proven = p.replan(solver="ilp", solver_options={"time_limit_s": 120})
        """
        budget_bytes = int(check_gb("budget_gb", budget_gb) * GIB) if budget_gb is not None else self.budget_bytes
        reserved_bytes = (int(check_gb("reserved_gb", reserved_gb, allow_zero=True) * GIB)
                          if reserved_gb is not None else self.reserved_bytes)
        problem = replace(self.problem, static_bytes=self.problem.static_bytes - self.reserved_bytes + reserved_bytes)
        method = solver or self.requested_solver
        if solver_options is None:
            solver_options = self.solver_options if method == self.requested_solver else {}
        return _solved(self._model, self._sample, self._traced, problem, self.profile, budget_bytes, reserved_bytes,
                       method, solver_options, self.setup.with_reserve(reserved_bytes), self.wrapped)

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
        regions = submodule_regions(self.wrapped, modules)
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
        return Plan(self._model, self._sample, self._traced, self.problem, self.profile, solution,
                    max(self.budget_bytes, peak), self.reserved_bytes, self.requested_solver, self.solver_options,
                    self.setup, self.wrapped)

    def verify(self, sample: Any = None, steps: int = 3) -> Verification:
        """Run real forward+backward steps of the original and the planned module and measure
        both: peaks, step times, whether outputs and gradients match, and the errors of the
        predicted peaks and step overhead (`recompute_ms`), kept and shown in the report. The
        original model is left as it was (gradients, buffers and RNG state are restored).

        Example:
            >>> record = p.verify(steps=3)
            >>> record.within_budget, record.overhead_percent
        """
        if self.setup.where.target is not None and not self.setup.where.local:
            raise ValueError(f"this plan is for {self.setup.where.name}, which is not this machine's device: "
                             "save it and verify it there (load_plan(path).apply(model), then train)")
        if any(t.device.type == "meta" for t in (*self._model.parameters(), *self._model.buffers())):
            raise ValueError("the model is on the meta device and cannot run: save the plan and apply it to "
                             "the real model (load_plan(path).apply(model)), then train")
        self.verification = verify_modules(
            self._model, self.module(), self._sample if sample is None else sample, steps,
            self.predicted_peak_bytes, self.baseline_peak_bytes, self.budget_bytes, self.recompute_ms,
        )
        return self.verification

    @property
    def module_checkpoints(self) -> tuple[ModuleCheckpoint, ...]:
        """The submodules whose forward runs under checkpoint, in order, each with the ATen
        calls it keeps (`ModuleCheckpoint.saved_calls`) for the plan's kept nodes."""
        loose = [c for c in self.checkpoints if c.wrapped is None]
        if loose:  # the solvers choose only allowed regions: this is a bug, not a user error
            raise RuntimeError(f"region {loose[0].nodes[0]}..{loose[0].nodes[-1]} is not a submodule call")
        # (the runs inside one submodule call share one entry)
        return tuple(dict.fromkeys(c.wrapped for c in self.checkpoints if c.wrapped is not None))

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
        if model is not self._model:
            check_state(model, state_shapes(self._model), type(self._model).__name__)
        return apply_plan(model, self.module_checkpoints, sample_shapes(self._model, self._sample),
                          type(self._model).__name__)

    def module(self) -> nn.Module:
        """A planned copy of the model: the same class, parameters and buffers (shared, not
        copied), with the plan applied; the original is left untouched. Built once.

        Example:
            >>> planned = p.module()
            >>> planned.fc.weight is model.fc.weight
            True
        """
        if self._module is None:
            self._module = self.apply(shallow_clone(self._model))
        return self._module

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Write a PNG of the predicted memory over one step, unplanned and planned, with the
        budget and the regions marked (needs matplotlib). See `planner.report.plot`.

        Example:
            >>> p.plot("memory.png")
        """
        from planner.report.plot import plot_plan

        return plot_plan(self, path)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save the plan as JSON; `planner.load_plan(path).apply(model)` re-applies it to a
        freshly built model of the same architecture without measuring again. See `planner.plans.record`.

        Example:
            >>> p.save("plan.json")
        """
        from planner.plans.record import save_plan

        return save_plan(self, path)

    def export(self, path: str | os.PathLike[str]) -> Path:
        """Save the planned copy of the model (`module()`) with `torch.save`; it loads with
        `torch.load(path, weights_only=False)` where `planner` and the model's classes import.

        Example:
            >>> p.export("planned.pt")
        """
        from planner.plans.record import export_module

        return export_module(self, path)

    def __repr__(self) -> str:
        return (f"Plan(solver={self.solver!r}, regions={len(self.checkpoints)}, "
                f"predicted_peak_bytes={self.predicted_peak_bytes}, recompute_ms={self.recompute_ms:.3f})")

    def __str__(self) -> str:
        return format_report(
            model_name=type(self._model).__name__, problem=self.problem, solution=self.solution,
            frontend=self.frontend, leaves=self.leaves, budget_bytes=self.budget_bytes,
            reserved_bytes=self.reserved_bytes, baseline_peak_bytes=self.baseline_peak_bytes,
            timing=self.profile.timing, checkpoints=self.checkpoints, verification=self.verification,
            static_breakdown=self.static_breakdown, device=self.setup.where.name, world_size=self.setup.world_size,
            measurement=self.profile.measurement, times_estimated=self.profile.times_estimated,
            scratch_measured=self.profile.scratch_measured, own_step_peak_bytes=self.own_step_peak_bytes,
        )


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
    `p.verified` says whether it ran within the budget. `effort="thorough"` also reads what
    checkpoint calls and runs cost off the model's own training steps (a minute or more on a
    CPU; "normal" reads them on one block). The model is left as it was. `solver_options` go to
    the solver (for example `{"time_limit_s": 120}` for "ilp").

    Example:
        >>> from planner import plan
        >>> from planner.examples import gpt
        >>> model, tokens = gpt()
        >>> p = plan(model, tokens, budget_gb=0.2, solver="sqrt")
        >>> m = p.module()  # train m instead of model
    """
    gpu = find_target(target) if target is not None else None
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
    tensors = sample_tensors(sample)
    if not tensors:
        raise TypeError("the sample holds no tensor: pass the model's input tensors as the sample")
    where = plan_device([*model.parameters(), *model.buffers(), *tensors], gpu)
    say = progress or (lambda message: logger.info(message))
    measured = measure_problem(model, sample, where, reserved_bytes, optimizer, world_size, leaves,
                               frontend, repeats, measure, say, effort)
    say(f"solving for {len(compute_nodes(measured.traced.gm))} nodes with solver {solver!r}")
    return _solved(model, sample, measured.traced, measured.problem, measured.summary, budget_bytes, reserved_bytes,
                   solver, solver_options or {}, Setup(where, world_size, optimizer, measured.breakdown, measure),
                   measured.wrapped)


def _solved(model: nn.Module, sample: Any, traced: Traced, problem: Problem, summary: GraphProfile,
            budget_bytes: int, reserved_bytes: int, method: str, solver_options: dict[str, Any], setup: Setup,
            wrapped: dict[range, ModuleCheckpoint]) -> Plan:
    """The plan `method` solves for; where its own step can run here, checked against that step
    and solved again with what it holds beyond the graph kept free (`planner.planning`).
    Where no plan fits, the smallest budget named is the one a plan's measured step fits in."""
    def keeping_free(extra: int, budget: int = budget_bytes) -> Plan:
        kept_free = replace(problem, static_bytes=problem.static_bytes + extra)
        terms = dict(setup.static_breakdown or {})
        if extra:
            terms[BEYOND_PLAN] = terms.get(BEYOND_PLAN, 0) + extra
        solution = solve(kept_free, budget, method=method, **solver_options)  # (the report gives its time)
        return Plan(model, sample, traced, kept_free, summary, solution, budget, reserved_bytes, method,
                    solver_options, replace(setup, static_breakdown=terms), wrapped)

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
    fitted, measured = fit_to_measured(planned, keeping_free, own_step)
    fitted.own_step_peak_bytes = measured
    return fitted


def _own_step_runs_here(model: nn.Module, sample: Any, planned: Plan, summary: GraphProfile, setup: Setup) -> bool:
    """Whether the plan's own training step can run on its device here: planning may run steps
    (not `measure="no-run"`), the plan is for this machine's device, for one rank, the model is
    real, and what the step allocates beyond the tensors already there fits in what measuring
    may use (`planner.measure.device.measurable_bytes`)."""
    where = setup.where
    if setup.measure == "no-run" or not where.local or setup.world_size != 1:
        return False
    if any(t.device.type == "meta" for t in (*model.parameters(), *sample_tensors(sample))):
        return False
    resident = summary.parameter_bytes + summary.buffer_bytes + summary.input_bytes
    return planned.predicted_peak_bytes - resident <= measurable_bytes(where.device)
