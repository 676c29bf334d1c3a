"""The plan as a plain record: what `Plan.save` writes and `load_plan` reads, what the report and
the plot show, and all that applying a plan needs (`PlanRecord`). A live plan (`planner.api.Plan`)
holds one, with the model and the measurements that replanning needs; a loaded plan holds only it.

A record holds what is needed to check a plan against a model later and to apply it without
measuring again: the compute graph (node names, ops and targets), the per-node costs the solver
saw and the profiler's records, the regions (the submodule each checkpoints, and its nodes), the
solver, budget, reserve and predicted peaks, what it was planned for and how it was measured
(whether its own step ran), the shapes of the model's state dict, and the structure of the
sample (which forward arguments were tensors, with shapes and dtypes; which were fixed, with
their values).

Example:
    >>> p = plan(model, sample, budget_gb=4)
    >>> p.save("plan.json")
    >>> saved = load_plan("plan.json")
    >>> print(saved)                       # the report, without re-profiling
    >>> model = saved.apply(build_model()) # same architecture, fresh weights: no measuring
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.fx as fx
from torch import nn

from planner.apply.checkpoints import apply_plan
from planner.core import GraphProfile, ModuleCheckpoint
from planner.measure.profile import META_KEY
from planner.measure.steps import Verification
from planner.plans.document import (
    cost_record,
    graph_nodes,
    json_text,
    problem_from_record,
    problem_record,
    profile_delta,
    profile_full,
    region_record,
    regions_from_records,
    sample_structure,
    verification_from_record,
    whole_modules,
)
from planner.plans.matching import (
    FX_FRONTEND,
    check_state,
    sample_like,
    state_shapes,
    trace_matching,
)
from planner.problem.regions import Checkpoint, describe_checkpoints
from planner.trace.structure import compute_nodes
from planner.trace.tracing import Traced
from solvers import Problem, Solution, Status, peak_bytes

FORMAT = "ckpt-planner plan"
VERSION = 3
# Version 1 lacks what the plan was for (target, FSDP, optimizer); versions 1 and 2 name regions
# as node ranges of a replacement graph, which no longer applies: their reports still print.
READABLE_VERSIONS = (1, 2, 3)


@dataclass(frozen=True)
class PlanRecord:
    """A plan as plain data: its problem and solution, what it was for, the region checkpoints
    it applies, and what checking a model against it needs.

    Fields: `model_class` (module and qualified name), `frontend` (the tracer), `problem`,
    `solution`, `requested_solver`, `budget_bytes`, `reserved_bytes`, `baseline_peak_bytes`
    (simulated, no plan), `timing` (how node times were read), `leaves` (submodules kept whole
    after tracing failed), `graph` (compute nodes: name, op, target, module), `profiles` (the
    profiler's record of each compute node), `trace_leaves`, `sample` and `state` (the sample's
    structure and the state dict's shapes), `verification`, `source` (the file it was read from),
    `planned_for` (device, target, world size, optimizer, how it was measured, the peak of its own
    step where planning ran it), `static_breakdown` (static memory per rank, by term), `wrapped`
    (per region, the checkpoint that applies it), `solver_options`, `version` (of its file).

    Example:
        >>> record = load_plan("plan.json").record
        >>> record.predicted_peak_bytes <= record.budget_bytes
        True
    """

    model_class: str
    frontend: str
    problem: Problem
    solution: Solution
    requested_solver: str
    budget_bytes: int
    reserved_bytes: int
    baseline_peak_bytes: int
    timing: str
    leaves: tuple[str, ...]
    graph: tuple[dict[str, str], ...]  # compute nodes: name, op, target
    profiles: tuple[dict[str, Any], ...]  # the profiler's record of each compute node
    trace_leaves: tuple[str, ...]
    sample: dict[str, Any]
    state: dict[str, dict[str, Any]]
    verification: Verification | None = None
    source: str | None = None  # the file it was read from
    planned_for: dict[str, Any] | None = None  # device, target, world size, optimizer, how measured
    static_breakdown: dict[str, int] | None = None  # static memory per rank, by term
    wrapped: tuple[ModuleCheckpoint | None, ...] = ()  # per region: the submodule it checkpoints
    solver_options: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION  # of the file it was read from

    # -- figures ---------------------------------------------------------------------------

    @property
    def predicted_peak_bytes(self) -> int:
        """Simulated peak of one forward+backward with the plan (static memory included)."""
        return self.solution.peak_bytes

    @property
    def recompute_ms(self) -> float:
        """What the plan adds to every training step: recomputation and checkpoint's own work."""
        return self.solution.recompute_ms

    @property
    def forward_ms(self) -> float:
        """Forward time of the whole graph (its nodes' times)."""
        return sum(node.compute_ms for node in self.problem.nodes)

    @property
    def solver(self) -> str:
        """The solver that produced the plan."""
        return self.solution.solver

    @property
    def model_name(self) -> str:
        return self.model_class.rsplit(".", 1)[-1]

    @property
    def own_step_peak_bytes(self) -> int | None:
        """The measured peak of the plan's own training step, where planning ran it (None: not run)."""
        return (self.planned_for or {}).get("own_step_peak_bytes")

    @property
    def verified(self) -> bool:
        """Whether the plan's own training step ran on its device and peaked within its budget:
        in planning, or in `verify()`."""
        if self.verification is not None:
            return self.verification.within_budget
        peak = self.own_step_peak_bytes
        return peak is not None and peak <= self.budget_bytes

    @property
    def module_checkpoints(self) -> tuple[ModuleCheckpoint, ...]:
        """The submodules whose forward runs under checkpoint, in order, each with the ATen calls
        it keeps (`ModuleCheckpoint.saved_calls`); the runs inside one submodule call share one."""
        if any(spec is None for spec in self.wrapped):
            raise ValueError(
                f"this plan{' in ' + self.source if self.source else ''} has regions that are not submodule calls "
                f"(format version {self.version}; before version 3 regions were node ranges of a replacement "
                "graph), which no longer apply: make a new plan with planner.plan(model, sample, ...)"
            )
        return tuple(dict.fromkeys(spec for spec in self.wrapped if spec is not None))

    @property
    def regions(self) -> list[list[str]]:
        """The recomputed regions as lists of compute node names."""
        names = [node.name for node in self.problem.nodes]
        return [[names[i] for i in region] for region in self.solution.regions]

    @property
    def checkpoints(self) -> tuple[Checkpoint, ...]:
        modules = [node.get("module", "") for node in self.graph]
        wrapped = {region: spec for region, spec in zip(self.solution.regions, self.wrapped) if spec is not None}
        return describe_checkpoints(self.problem, self.solution.regions, modules, wrapped, self.solution.kept)

    # -- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (see the module docstring and `load_plan`).

        Example:
            >>> load_plan("plan.json").to_dict()["regions"][0][:2]
            ['getattr_1', 'getitem']
        """
        names = [node.name for node in self.problem.nodes]
        s = self.solution
        kept = {names[i] for i in s.kept}
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model_class,
            "frontend": self.frontend,
            "solver": s.solver,
            "requested_solver": self.requested_solver,
            "status": s.status.value,
            "solve_seconds": s.solve_seconds,
            "budget_bytes": self.budget_bytes,
            "reserved_bytes": self.reserved_bytes,
            **problem_record(self.problem, names),
            "predicted_peak_bytes": s.peak_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "recompute_ms": s.recompute_ms,
            "times_estimated": bool((self.planned_for or {}).get("times_estimated", False)),
            "timing": self.timing,
            "planned_for": self.planned_for,
            "static_breakdown": self.static_breakdown,
            "leaves": list(self.leaves),
            "trace_leaves": list(self.trace_leaves),
            "solver_options": self.solver_options,
            "regions": [region_record(region, spec, kept) for region, spec in zip(self.regions, self.wrapped)],
            "sample": self.sample,
            "nodes": [
                {**node, "cost": record, "profile": profile_delta(profile, record)}
                for node, record, profile in zip(
                    self.graph, (cost_record(cost, names) for cost in self.problem.nodes), self.profiles
                )
            ],
            "state_dict": self.state,
            "verification": None if self.verification is None else dataclasses.asdict(self.verification),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> "PlanRecord":
        """Read a document written by `to_dict`; ValueError names what is missing or wrong.

        Example:
            >>> PlanRecord.from_dict(json.loads(text))
        """
        where = f" in {source}" if source else ""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a saved checkpoint plan{where}: no \"format\": {FORMAT!r} field")
        if data.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"saved plan{where} has version {data.get('version')!r}; this planner reads "
                             f"{', '.join(map(str, READABLE_VERSIONS))}")
        try:
            nodes = data["nodes"]
            index = {node["name"]: i for i, node in enumerate(nodes)}
            problem = problem_from_record(data, index)
            regions, wrapped, kept = regions_from_records(data["regions"], index)
            solution = Solution(
                regions=tuple(regions),
                peak_bytes=data["predicted_peak_bytes"],
                recompute_ms=problem.recompute_ms(tuple(regions), kept),
                status=Status(data["status"]),
                solver=data["solver"],
                solve_seconds=data["solve_seconds"],
                kept=kept,
            )
            verification = verification_from_record(data.get("verification"))
            return cls(
                model_class=data["model"],
                frontend=data["frontend"],
                problem=problem,
                solution=solution,
                requested_solver=data["requested_solver"],
                budget_bytes=data["budget_bytes"],
                reserved_bytes=data["reserved_bytes"],
                baseline_peak_bytes=data["baseline_peak_bytes"],
                timing=data["timing"],
                leaves=tuple(data["leaves"]),
                graph=tuple({key: n.get(key, "") for key in ("name", "op", "target", "module")} for n in nodes),
                profiles=tuple(profile_full(n["profile"], n["cost"]) for n in nodes),
                trace_leaves=tuple(data["trace_leaves"]),
                sample=data["sample"],
                state=data["state_dict"],
                verification=verification,
                source=source,
                planned_for=data.get("planned_for"),
                static_breakdown=data.get("static_breakdown"),
                wrapped=tuple(wrapped),
                solver_options=dict(data.get("solver_options") or {}),
                version=data["version"],
            )
        except KeyError as error:
            raise ValueError(f"saved plan{where} lacks {error.args[0]!r}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as JSON (indented, so that it diffs well).

        Example:
            >>> load_plan("plan.json").save("copy.json")
        """
        target = Path(path)
        target.write_text(json_text(self.to_dict()))
        return target

    # -- applying -----------------------------------------------------------------------------

    def sample_for(self, model: nn.Module) -> Any:
        """A sample shaped like the one the plan was made with: zeros of the saved shapes and
        dtypes on `model`'s device, and the saved values of the fixed arguments. Enough to
        trace with; not meant for measuring.

        Example:
            >>> saved.sample_for(model)
            {'tokens': tensor([[0, 0, ...]])}
        """
        return sample_like(self.sample, model)

    def check(self, model: nn.Module, sample: Any = None) -> fx.GraphModule:
        """Trace `model` and raise ValueError unless it matches the saved plan: same state-dict
        shapes and the same compute nodes (names, ops and targets, in order). Returns the traced
        graph module. A different dtype only warns: the plan still applies, its figures do not.

        Example:
            >>> saved.check(fresh_model)
        """
        return trace_matching(self, model, self.sample_for(model) if sample is None else sample).gm

    def apply(self, model: nn.Module) -> nn.Module:
        """Apply the plan in place to `model` (the planned model or a freshly built one of the
        same architecture) without measuring again: check its state-dict shapes and planned
        submodules, then run each planned submodule under checkpoint. Returns `model`;
        `planner.remove_plan(model)` undoes it.

        Example:
            >>> model = build_model()
            >>> model.load_state_dict(torch.load("weights.pt"))
            >>> load_plan("plan.json").apply(model)
        """
        specs = self.module_checkpoints
        check_state(model, self.state, self.model_class)
        planned_shapes = {a["name"]: tuple(a["tensor"]["shape"]) for a in self.sample["arguments"] if "tensor" in a}
        return apply_plan(model, specs, planned_shapes, self.model_name)


def record_of(model: nn.Module, sample: Any, traced: Traced, summary: GraphProfile, problem: Problem,
              solution: Solution, checkpoints: tuple[Checkpoint, ...], budget_bytes: int, reserved_bytes: int,
              requested_solver: str, solver_options: dict[str, Any], planned_for: dict[str, Any],
              static_breakdown: dict[str, int] | None, verification: Verification | None = None) -> PlanRecord:
    """The record of a plan made here: `model` and `sample` as measured, `traced` and its nodes'
    profiles (`summary` for the graph), and what planning chose (`checkpoints`: the report's
    view of each region).

    Example:
        >>> record_of(model, sample, traced, summary, problem, solution, checkpoints, ...).predicted_peak_bytes
    """
    gm = traced.gm
    graph = tuple(graph_nodes(gm))
    if [node.name for node in problem.nodes] != [node["name"] for node in graph]:
        raise ValueError("the plan's problem does not follow its traced graph")
    profiles = tuple(dataclasses.asdict(node.meta[META_KEY]) for node in compute_nodes(gm))
    whole = tuple(whole_modules(gm)) if traced.frontend == FX_FRONTEND else tuple(traced.leaves)
    return PlanRecord(
        model_class=f"{type(model).__module__}.{type(model).__qualname__}", frontend=traced.frontend,
        problem=problem, solution=solution, requested_solver=requested_solver, budget_bytes=budget_bytes,
        reserved_bytes=reserved_bytes, baseline_peak_bytes=peak_bytes(problem), timing=summary.timing,
        leaves=tuple(traced.leaves), graph=graph, profiles=profiles, trace_leaves=whole,
        sample=sample_structure(model, sample, traced.tensor_names, traced.fixed_args), state=state_shapes(model),
        verification=verification, planned_for=planned_for, static_breakdown=static_breakdown,
        wrapped=tuple(checkpoint.wrapped for checkpoint in checkpoints), solver_options=dict(solver_options),
    )


def load_record(path: str | os.PathLike[str]) -> PlanRecord:
    """Read a plan record saved with `Plan.save` (`planner.load_plan` wraps it in a `Plan`).

    Example:
        >>> load_record("plan.json").budget_bytes
    """
    source = Path(path)
    try:
        data = json.loads(source.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{source} is not JSON: {error}") from None
    return PlanRecord.from_dict(data, source=str(source))


__all__ = ["FORMAT", "PlanRecord", "READABLE_VERSIONS", "VERSION", "load_record", "record_of"]
