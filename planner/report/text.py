"""The plan report: each recomputed region as the report shows it (`Checkpoint`), and one
formatter for live plans (`Plan`) and loaded ones (`SavedPlan`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Sequence

from solvers import Problem, Solution, format_bytes, held_after_forward

if TYPE_CHECKING:
    from planner.core import ModuleCheckpoint


@dataclass(frozen=True)
class Checkpoint:
    """One recomputed region: one submodule call, run under checkpoint (its fx nodes listed)."""

    nodes: tuple[str, ...]
    recompute_ms: float
    freed_bytes: int  # activation bytes no longer held at the end of forward
    node_modules: tuple[str, ...] = ()  # the model's submodule of each node ("" for the model)
    wrapped: ModuleCheckpoint | None = None  # the submodule whose forward runs under checkpoint
    kept: tuple[str, ...] = ()  # the nodes whose outputs it keeps (a selective-checkpoint policy)

    @property
    def modules(self) -> tuple[str, ...]:
        """The submodules the nodes belong to, each once, in order of first appearance."""
        return tuple(dict.fromkeys(self.node_modules))


def describe_checkpoints(problem: Problem, regions: tuple[range, ...], modules: Sequence[str],
                         wrapped: dict[range, ModuleCheckpoint] | None = None,
                         kept: Collection[int] = ()) -> tuple[Checkpoint, ...]:
    """The report's view of each region: its nodes, the submodules they belong to (`modules`
    holds one path per node), the nodes it keeps (of `kept`), its recompute time, what it frees
    at the end of forward, and the submodule whose forward it checkpoints (`wrapped`, by range).

    Example:
        >>> describe_checkpoints(p.problem, p.solution.regions, [""] * len(p.problem))[0].nodes
    """
    unplanned = held_after_forward(problem)
    checkpoints = []
    for region in regions:
        keeps = tuple(i for i in sorted(kept) if i in region)
        checkpoints.append(Checkpoint(
            nodes=tuple(problem.nodes[i].name for i in region),
            node_modules=tuple(modules[i] for i in region),
            recompute_ms=problem.recompute_ms((region,), keeps),
            freed_bytes=unplanned - held_after_forward(problem, (region,), keeps),
            wrapped=(wrapped or {}).get(region),
            kept=tuple(problem.nodes[i].name for i in keeps),
        ))
    return tuple(checkpoints)


class PlanFigures:
    """The figures every plan derives from its problem and solution (`Plan`, `SavedPlan`)."""

    problem: Problem
    solution: Solution

    @property
    def predicted_peak_bytes(self) -> int:
        """Simulated peak of one forward+backward with the plan (static memory included)."""
        return self.solution.peak_bytes

    @property
    def recompute_ms(self) -> float:
        """Forward time added to every training step by recomputation."""
        return self.solution.recompute_ms

    @property
    def forward_ms(self) -> float:
        """Measured forward time of the whole graph."""
        return sum(node.compute_ms for node in self.problem.nodes)

    @property
    def solver(self) -> str:
        """The solver that produced the plan."""
        return self.solution.solver


def span(node_modules: Sequence[str]) -> str:
    """The submodules of a region's first and last node, for one report column.

    Example:
        >>> span(("transformer.h.0.attn", "transformer.h.0.attn.c_attn", "transformer.h.0.mlp"))
        'transformer.h.0.attn .. transformer.h.0.mlp'
    """
    if not node_modules:
        return ""
    first, last = (module or "(model)" for module in (node_modules[0], node_modules[-1]))
    return first if first == last else f"{first} .. {last}"


def _own_step(peak_bytes: int | None, budget_bytes: int, device: str) -> str:
    if peak_bytes is None:
        return ("not run: the peak is predicted only; apply the plan where it is for and call verify(), "
                "or train a step and compare")
    where = f" on {device}" if device else ""
    within = "within the budget" if peak_bytes <= budget_bytes else "ABOVE the budget"
    return f"ran{where} in planning and peaked at {format_bytes(peak_bytes)}, {within}"


def format_report(
    *,
    model_name: str,
    problem: Problem,
    solution: Solution,
    frontend: str,
    leaves: Sequence[str],
    budget_bytes: int,
    reserved_bytes: int,
    baseline_peak_bytes: int,
    timing: str,
    checkpoints: Sequence[Any],
    verification: Any = None,
    origin: str = "",
    static_breakdown: dict[str, int] | None = None,
    device: str = "",
    world_size: int = 1,
    measurement: str = "whole step",
    times_estimated: bool = False,
    scratch_measured: bool = True,
    own_step_peak_bytes: int | None = None,
) -> str:
    """A readable table of a plan's figures, regions, and measured figures once verified.
    Whatever was estimated rather than measured says so, and so does a plan whose own training
    step has not run (`own_step_peak_bytes`: its measured peak, where planning ran it).

    Example:
        >>> print(format_report(model_name="TinyGPT", problem=p.problem, solution=p.solution, ...))
    """
    forward_ms = sum(node.compute_ms for node in problem.nodes)
    method, _, spread = timing.partition("; ")  # (how the times were read; how far their passes spread)
    overhead = 100 * solution.recompute_ms / forward_ms if forward_ms else 0.0
    estimate = " (estimate)" if times_estimated else ""
    per_rank = f" per rank, FSDP2 over {world_size} ranks" if world_size > 1 else ""
    lines = [
        f"Checkpoint plan for {model_name} (solver {solution.solver}, {solution.status.value}, "
        f"solved in {solution.solve_seconds:.2f} s{origin})",
        f"  graph             {len(problem)} nodes via {frontend}; "
        f"kept whole after tracing failed: {', '.join(leaves) or 'none'}",
    ]
    if device:
        scratch = "" if scratch_measured else "; kernel scratch not measured"
        lines.append(f"  planned for       {device}; measured: {measurement}{scratch}")
    lines += [
        f"  budget            {format_bytes(budget_bytes)}{per_rank}"
        + (f" (of which reserved {format_bytes(reserved_bytes)})" if reserved_bytes else ""),
        f"  static memory     {format_bytes(problem.static_bytes)}{per_rank}"
        + ("" if static_breakdown else " (parameters, gradients, buffers, inputs, reserve)")
        + (" (optimizer state not counted: pass optimizer=)"
           if static_breakdown and "optimizer state" not in static_breakdown else ""),
    ]
    if static_breakdown:
        width = max(len(term) for term in static_breakdown)
        lines += [f"      {term:<{width}}  {format_bytes(size):>11}" for term, size in static_breakdown.items()
                  if size or term in ("parameters", "gradients", "optimizer state")]
    lines += [
        f"  peak, no plan     {format_bytes(baseline_peak_bytes)}",
        f"  peak, this plan   {format_bytes(solution.peak_bytes)} (predicted)",
        f"  its own step      {_own_step(own_step_peak_bytes, budget_bytes, device)}",
        f"  recompute         {solution.recompute_ms:.2f} ms per step{estimate} "
        f"(+{overhead:.0f}% of the {forward_ms:.2f} ms forward, {method})",
        *([f"                    including {problem.region_overhead_ms:.3f} ms per checkpoint call "
           + (f"+ {1000 * problem.saved_tensor_ms:.1f} us per tensor saved in it " if problem.saved_tensor_ms else "")
           + f"(checkpoint's own work, and what a region costs in the step beyond it){estimate}"] if problem.region_overhead_ms and checkpoints else []),
        *([f"                    and {problem.keep_region_ms:.3f} ms + {1000 * problem.keep_call_ms:.1f} us per ATen "
           f"call + {1000 * problem.kept_node_ms:.1f} us per kept node for each region that keeps nodes "
           f"(its selective policy){estimate}"]
          if solution.kept and (problem.keep_region_ms or problem.keep_call_ms) else []),
        *([f"                    and, for each run recomputed inside a submodule, "
           f"{problem.region_overhead_ms + problem.run_region_ms:.3f} ms (for the call's) + "
           f"{1000 * problem.run_call_ms:.1f} us per ATen call its recording sees + "
           f"{1000 * problem.recorded_call_ms:.1f} us per call recorded{estimate}"]
          if any(c.wrapped and c.wrapped.runs for c in checkpoints) else []),
        *([f"                    node times: {spread} (the clock's noise in these figures)"] if spread else []),
        f"  regions           {len(checkpoints)}",
    ]
    if checkpoints:
        # (a slice of a Sequential's children: its first and last child)
        names = [c.wrapped.module if c.wrapped and not c.wrapped.segments else span(c.node_modules)
                 for c in checkpoints]
        kinds = [c.wrapped.module_class if c.wrapped else "(nodes)" for c in checkpoints]
        width = max(len("checkpointed submodule"), *map(len, names))
        kind_width = max(len("class"), *map(len, kinds))
        lines.append(f"    {'#':>3}  {'checkpointed submodule':<{width}} {'class':<{kind_width}} {'nodes':>5} "
                     f"{'recompute':>12} {'freed':>11}")
        for index, (c, name, kind) in enumerate(zip(checkpoints, names, kinds)):
            keeps = f"  keeps {', '.join(c.kept)}" if c.kept else ""
            if c.wrapped is not None and c.wrapped.runs:  # not the whole call: a run inside it
                keeps = f"  only {c.nodes[0]}..{c.nodes[-1]}" if len(c.nodes) > 1 else f"  only {c.nodes[0]}"
            lines.append(f"    {index:>3}  {name:<{width}} {kind:<{kind_width}} {len(c.nodes):>5} "
                         f"{c.recompute_ms:>9.2f} ms {format_bytes(c.freed_bytes):>11}{keeps}")
    if verification is not None:
        lines += ["", str(verification)]
    return "\n".join(lines)
