"""Save a plan as JSON, load it back, and re-apply it to a freshly built model.

A saved plan holds what is needed to check it against a model later and to apply it without
measuring again: the compute graph (node names, ops and targets), the per-node costs the solver
saw and the profiler's records, the regions (the submodule each checkpoints, and its nodes), the solver,
budget, reserve and predicted peaks, the shapes of the model's state dict, and the structure of
the sample (which forward arguments were tensors, with shapes and dtypes; which were fixed, with
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn

from planner.apply.checkpoints import apply_plan
from planner.core import ModuleCheckpoint
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
    report_setup,
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
from planner.problem.graph import compute_nodes
from planner.report.text import (
    Checkpoint,
    PlanFigures,
    describe_checkpoints,
    format_report,
)
from solvers import Problem, Solution, Status

if TYPE_CHECKING:
    from planner.api import Plan


FORMAT = "ckpt-planner plan"


VERSION = 3


# Version 1 lacks what the plan was for (target, FSDP, optimizer); versions 1 and 2 name regions
# as node ranges of a replacement graph, which no longer applies: their reports still print.
READABLE_VERSIONS = (1, 2, 3)


@dataclass(frozen=True)
class SavedPlan(PlanFigures):
    """A plan read from JSON: its report, its figures, and `apply(model)`.

    Example:
        >>> saved = load_plan("plan.json")
        >>> saved.predicted_peak_bytes <= saved.budget_bytes
        True
        >>> m = saved.apply(fresh_model)
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
    version: int = VERSION  # of the file it was read from

    # -- figures, as on Plan ------------------------------------------------------------------

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

    @classmethod
    def from_plan(cls, plan: "Plan") -> "SavedPlan":
        """Collect what a saved plan holds from a `Plan` (what `Plan.save` writes).

        Example:
            >>> SavedPlan.from_plan(p).to_dict()["regions"]
        """
        traced = plan.traced
        gm = traced.gm
        graph = tuple(graph_nodes(gm))
        names = [node.name for node in plan.problem.nodes]
        if names != [node["name"] for node in graph]:
            raise ValueError("the plan's problem does not follow its traced graph; cannot save it")
        profiles = tuple(dataclasses.asdict(node.meta[META_KEY]) for node in compute_nodes(gm))
        whole = tuple(whole_modules(gm)) if traced.frontend == FX_FRONTEND else tuple(traced.leaves)
        return cls(
            model_class=f"{type(plan.model).__module__}.{type(plan.model).__qualname__}",
            frontend=traced.frontend,
            problem=plan.problem,
            solution=plan.solution,
            requested_solver=plan.requested_solver,
            budget_bytes=plan.budget_bytes,
            reserved_bytes=plan.reserved_bytes,
            baseline_peak_bytes=plan.baseline_peak_bytes,
            timing=plan.profile.timing,
            leaves=tuple(traced.leaves),
            graph=graph,
            profiles=profiles,
            trace_leaves=whole,
            sample=sample_structure(plan.model, plan.sample, traced.tensor_names, traced.fixed_args),
            state=state_shapes(plan.model),
            verification=plan.verification,
            wrapped=tuple(checkpoint.wrapped for checkpoint in plan.checkpoints),
            planned_for={
                "device": plan.setup.where.name,
                "target": plan.target,
                "world_size": plan.setup.world_size,
                "optimizer": plan.setup.optimizer,
                "measurement": plan.profile.measurement,
                "times_estimated": plan.profile.times_estimated,
                "scratch_measured": plan.profile.scratch_measured,
                "own_step_peak_bytes": plan.own_step_peak_bytes,
            },
            static_breakdown=plan.static_breakdown,
        )

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
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> "SavedPlan":
        """Read a document written by `to_dict`; ValueError names what is missing or wrong.

        Example:
            >>> SavedPlan.from_dict(json.loads(text))
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
        same architecture) without measuring again, as `Plan.apply` does: check its state-dict
        shapes and planned submodules, then run each planned submodule under checkpoint.
        Returns `model`; `planner.remove_plan(model)` undoes it.

        Example:
            >>> model = build_model()
            >>> model.load_state_dict(torch.load("weights.pt"))
            >>> load_plan("plan.json").apply(model)
        """
        if any(spec is None for spec in self.wrapped):
            raise ValueError(
                f"this plan{' in ' + self.source if self.source else ''} has regions that are not submodule calls "
                f"(format version {self.version}; before version 3 regions were node ranges of a replacement "
                "graph), which no longer apply: make a new plan with planner.plan(model, sample, ...)"
            )
        check_state(model, self.state, self.model_class)
        planned_shapes = {a["name"]: tuple(a["tensor"]["shape"]) for a in self.sample["arguments"] if "tensor" in a}
        # (the runs inside one submodule call share one entry)
        specs = list(dict.fromkeys(spec for spec in self.wrapped if spec is not None))
        return apply_plan(model, specs, planned_shapes,
                          self.model_class.rsplit(".", 1)[-1])

    # -- report ------------------------------------------------------------------------------

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Write the memory plot of the saved plan (see `planner.report.plot.plot_memory`).

        Example:
            >>> load_plan("plan.json").plot("memory.png")
        """
        from planner.report.plot import plot_memory

        title = f"Predicted memory of one training step: {self.model_class.rsplit('.', 1)[-1]}"
        return plot_memory(self.problem, self.solution.regions, self.budget_bytes, path, title,
                           kept=self.solution.kept)

    def __str__(self) -> str:
        return format_report(
            model_name=self.model_class.rsplit(".", 1)[-1], problem=self.problem, solution=self.solution,
            frontend=self.frontend, leaves=self.leaves, budget_bytes=self.budget_bytes,
            reserved_bytes=self.reserved_bytes, baseline_peak_bytes=self.baseline_peak_bytes,
            timing=self.timing, checkpoints=self.checkpoints, verification=self.verification,
            origin=f", loaded from {self.source}" if self.source else "", static_breakdown=self.static_breakdown,
            **report_setup(self.planned_for),
        )

    def __repr__(self) -> str:
        return (f"SavedPlan(model={self.model_class!r}, solver={self.solver!r}, regions={len(self.solution.regions)}, "
                f"predicted_peak_bytes={self.predicted_peak_bytes})")


def save_plan(plan: "Plan", path: str | os.PathLike[str]) -> Path:
    """Save `plan` as JSON at `path` (what `Plan.save` calls).

    Example:
        >>> save_plan(p, "plan.json")
        PosixPath('plan.json')
    """
    return SavedPlan.from_plan(plan).save(path)


def load_plan(path: str | os.PathLike[str]) -> SavedPlan:
    """Read a plan saved with `Plan.save`. Its report prints without the model; `.apply(model)`
    rebuilds the planned module for a fresh model of the same architecture.

    Example:
        >>> from planner import load_plan
        >>> saved = load_plan("plan.json")
        >>> print(saved)
        >>> m = saved.apply(model)
    """
    source = Path(path)
    try:
        data = json.loads(source.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{source} is not JSON: {error}") from None
    return SavedPlan.from_dict(data, source=str(source))


def export_module(plan: "Plan", path: str | os.PathLike[str]) -> Path:
    """Save the planned copy of the model (`Plan.module()`) with `torch.save` (what
    `Plan.export` calls).

    The file loads with `torch.load(path, weights_only=False)` wherever `planner` and the
    model's own classes can be imported; it is the model's class, with the plan applied
    (`planner.remove_plan` undoes it), and its `state_dict()` keys are the model's.

    Example:
        >>> export_module(p, "planned.pt")
        >>> m = torch.load("planned.pt", weights_only=False)
    """
    target = Path(path)
    torch.save(plan.module(), target)
    return target


__all__ = ['SavedPlan', 'export_module', 'load_plan', 'save_plan']
