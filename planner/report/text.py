"""The plan report: what a user decides with, by default (the regions, what each recomputes,
frees and costs; the predicted peak against the budget, with the static breakdown; whether the
plan's own step ran; the step overhead; what was measured and what estimated), and the cost
model's internals on request (`verbose`).

Example:
    >>> print(format_report(p.record))
    >>> print(format_report(p.record, verbose=True))
"""
from __future__ import annotations

from planner.plans.record import PlanRecord
from solvers.solution import format_bytes


def own_step(record: PlanRecord) -> str:
    """Whether the plan's own training step ran in planning, and what it peaked at."""
    peak = record.own_step_peak_bytes
    if peak is None:
        return ("not run: the peak is predicted only; apply the plan where it is for and call verify(), "
                "or plan there")
    device = (record.planned_for or {}).get("device", "")
    within = "within the budget" if peak <= record.budget_bytes else "ABOVE the budget"
    return f"ran{' on ' + device if device else ''} in planning and peaked at {format_bytes(peak)}, {within}"


def measured(record: PlanRecord) -> str:
    """What was measured and what estimated."""
    planned_for = record.planned_for or {}
    device = planned_for.get("device", "")
    how = planned_for.get("measurement", "whole step")
    if planned_for.get("times_estimated"):
        text = f"sizes on fake tensors; node times are estimates for {device} (roofline), not measured"
    elif how == "whole step":
        text = f"the whole step on {device}: sizes, saved tensors and node times"
    else:
        text = f"sizes on fake tensors, each distinct node alone on {device} for its time"
    if not planned_for.get("scratch_measured", True):
        text += "; kernel scratch not measured"
    if planned_for.get("autocast"):
        text += f"; the step under autocast to {planned_for['autocast']}"
        if planned_for.get("autocast_emulated"):
            text += " (CUDA autocast's casts, applied on this machine's CPU: an estimate)"
    if planned_for.get("param_dtype"):
        text += f"; parameters and inputs in {planned_for['param_dtype']}, as FSDP2's MixedPrecisionPolicy runs them"
    return text


def planning_time(record: PlanRecord) -> str:
    """How long planning took, in all and part by part."""
    seconds = (record.planned_for or {}).get("seconds") or {}
    parts = ", ".join(f"{name} {value:.1f} s" for name, value in seconds.items() if value >= 0.05)
    return f"{sum(seconds.values()):.1f} s: {parts}"


def _static(record: PlanRecord) -> str:
    terms = record.static_breakdown or {}
    shown = ", ".join(f"{term} {format_bytes(size)}" for term, size in terms.items() if size)
    text = format_bytes(record.problem.static_bytes) + (f": {shown}" if shown else "")
    if terms and "optimizer state" not in terms:
        text += "; optimizer state not counted (pass optimizer=)"
    world_size = (record.planned_for or {}).get("world_size", 1)
    fsdp = world_size > 1 or (record.planned_for or {}).get("param_dtype")
    return text + (f" (per rank, FSDP2 over {world_size} rank{'s' * (world_size > 1)})" if fsdp else "")


def _regions(record: PlanRecord) -> list[str]:
    checkpoints = record.checkpoints
    if not checkpoints:
        return []
    names = [c.name for c in checkpoints]
    kinds = [c.wrapped.module_class if c.wrapped else "(nodes)" for c in checkpoints]
    width = max(len("checkpointed submodule"), *map(len, names))
    kind_width = max(len("class"), *map(len, kinds))
    lines = [f"    {'#':>3}  {'checkpointed submodule':<{width}} {'class':<{kind_width}} {'recomputes':>10} "
             f"{'frees':>11} {'costs':>11}"]
    for index, (c, name, kind) in enumerate(zip(checkpoints, names, kinds)):
        note = f"  keeps {', '.join(c.kept)}" if c.kept else ""
        if c.wrapped is not None and c.wrapped.runs:  # a run inside the call, not the whole call
            note = f"  only {c.nodes[0]}..{c.nodes[-1]}" if len(c.nodes) > 1 else f"  only {c.nodes[0]}"
        elif c.wrapped is not None and c.wrapped.segments:
            note = "  a slice of its children"
        lines.append(f"    {index:>3}  {name:<{width}} {kind:<{kind_width}} {len(c.nodes) - len(c.kept):>4} nodes "
                     f"{format_bytes(c.freed_bytes):>11} {c.recompute_ms:>8.2f} ms{note}")
    return lines


def _cost_model(record: PlanRecord) -> list[str]:
    problem, estimate = record.problem, " (estimate)" if (record.planned_for or {}).get("times_estimated") else ""
    lines = [f"  cost model        {problem.region_overhead_ms:.3f} ms per checkpoint call + "
             f"{1000 * problem.saved_tensor_ms:.1f} us per tensor saved in it{estimate}"]
    if problem.keep_region_ms or problem.keep_call_ms:
        lines.append(f"                    a region keeping nodes: {problem.keep_region_ms:.3f} ms + "
                     f"{1000 * problem.keep_call_ms:.1f} us per ATen call its policy sees + "
                     f"{1000 * problem.kept_node_ms:.1f} us per kept node{estimate}")
    if problem.run_spans:
        lines.append(f"                    a run recomputed alone: {problem.region_overhead_ms + problem.run_region_ms:.3f}"
                     f" ms + {1000 * problem.run_call_ms:.1f} us per ATen call its recording sees + "
                     f"{1000 * problem.recorded_call_ms:.1f} us per call recorded{estimate}")
    method, _, spread = record.timing.partition("; ")
    lines.append(f"  node times        {method}" + (f"; {spread} (the clock's noise in these figures)" if spread else ""))
    return lines


def format_report(record: PlanRecord, verbose: bool = False) -> str:
    """A plan as text: the regions and the figures a user decides with; with `verbose`, also the
    solver, the graph, and the cost model's figures. Whatever was estimated says so, and so does
    a plan whose own training step has not run. A verification, where there is one, follows.

    Example:
        >>> print(format_report(load_plan("plan.json").record))
    """
    solution, budget = record.solution, record.budget_bytes
    forward_ms = record.forward_ms
    share = f", +{100 * solution.recompute_ms / forward_ms:.0f}% of the {forward_ms:.2f} ms forward" if forward_ms else ""
    estimate = " (estimate)" if (record.planned_for or {}).get("times_estimated") else ""
    origin = f" (loaded from {record.source})" if record.source else ""
    reserved = f" (of which reserved {format_bytes(record.reserved_bytes)})" if record.reserved_bytes else ""
    lines = [
        f"Checkpoint plan for {record.model_name}{origin}: {len(solution.regions)} regions, predicted peak "
        f"{format_bytes(solution.peak_bytes)} for a budget of {format_bytes(budget)}{reserved}",
        f"  its own step      {own_step(record)}",
        f"  without a plan    {format_bytes(record.baseline_peak_bytes)} (predicted)",
        f"  static memory     {_static(record)}",
        f"  step overhead     {solution.recompute_ms:.2f} ms{estimate or ' (predicted)'}{share}: recomputation and "
        "checkpoint's own work",
        f"  measured          {measured(record)}",
        *([f"  planning took     {planning_time(record)}"] if (record.planned_for or {}).get("seconds") else []),
    ]
    if verbose:
        lines += [
            f"  solver            {solution.solver}, {solution.status.value}, solved in {solution.solve_seconds:.2f} s",
            f"  graph             {len(record.problem)} nodes via {record.frontend}; kept whole after tracing "
            f"failed: {', '.join(record.leaves) or 'none'}",
            *_cost_model(record),
        ]
    lines += [f"  regions           {len(solution.regions)}" + ("" if solution.regions else " (nothing to recompute)"),
              *_regions(record)]
    if record.verification is not None:
        lines += ["", str(record.verification)]
    return "\n".join(lines)


__all__ = ["format_report", "measured", "own_step", "planning_time"]
