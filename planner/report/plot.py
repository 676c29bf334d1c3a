"""Plot the predicted memory of one training step, without a plan and with one.

Both curves come from the one simulator (`solvers.simulate`): live activation bytes after each
step plus the static memory, the plan's with the nodes its regions keep (selective
checkpointing), as its predicted peak has them. Forward walks the nodes in order, backward in
reverse; a plan's recomputation steps run just before the backward of each region's last saving
node. To line the two curves up, the x axis is the phase of the step: forward of node i at x = i,
backward of node i at x = 2n - 1 - i, and the recomputation steps of a region spread evenly over
the interval just before the backward step they precede.

matplotlib is imported only when a plot is drawn, and only its Agg backend is used (no window,
no change to pyplot's global backend).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Collection

from planner.plans.record import PlanRecord
from solvers import Problem, simulate
from solvers.simulate import Timeline
from solvers.solution import format_bytes

FIGURE_SIZE_INCHES = (8.0, 4.0)
DPI = 100
MAX_NUMBERED_REGIONS = 12  # more region numbers than this would overlap


def figure_classes() -> tuple[Any, Any]:
    """The Figure class and the Agg canvas, or an ImportError that says what to install."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "plotting needs matplotlib, which is not installed: pip install matplotlib "
            "(or install this project with its dev extra: pip install -e '.[dev]')"
        ) from error
    return Figure, FigureCanvasAgg


def step_positions(timeline: Timeline, node_count: int) -> list[float]:
    """The x position of every step of `timeline` on the shared forward/backward axis.

    Forward of node i sits at i and backward of node i at 2n - 1 - i, so timelines with and
    without recomputation line up; the loss's step and recomputation steps share the unit just
    before the backward step that follows them.

    Example:
        >>> t = simulate(problem, (range(1, 3),))  # 4 nodes, one region of 2
        >>> step_positions(t, 4)
        [0, 1, 2, 3, 3.5, 4, 4.333, 4.667, 5, 6, 7]  # (rounded)
    """
    positions: list[float] = []
    pending: list[int] = []  # indices of loss and recomputation steps waiting for their backward step
    backward_done = 0
    for label in timeline.labels:
        kind = label.split(" ", 1)[0]
        if kind == "forward":
            positions.append(float(len(positions)))
        elif kind in ("recompute", "loss"):
            pending.append(len(positions))
            positions.append(0.0)  # placed once the next backward step is known
        else:
            x = float(node_count + backward_done)
            for rank, index in enumerate(pending, start=1):
                positions[index] = x - 1 + rank / (len(pending) + 1)
            pending.clear()
            positions.append(x)
            backward_done += 1
    return positions


def _unit(size: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return unit, float(scale)
    return "B", 1.0


def timelines(problem: Problem, regions: tuple[range, ...], kept: Collection[int] = ()) -> tuple[Timeline, Timeline]:
    """The two curves of the plot: one step without a plan, and with `regions` recomputed,
    keeping the nodes `kept` (node indices; `Solution.kept`).

    Example:
        >>> baseline, planned = timelines(p.problem, p.solution.regions, p.solution.kept)
        >>> planned.peak_bytes == p.predicted_peak_bytes
        True
    """
    return simulate(problem, ()), simulate(problem, regions, kept)


def plot_memory(
    problem: Problem,
    regions: tuple[range, ...],
    budget_bytes: int,
    path: str | os.PathLike[str],
    title: str | None = None,
    kept: Collection[int] = (),
) -> Path:
    """Draw the predicted memory of one forward+backward without a plan and with `regions`
    recomputed, keeping `kept` (node indices, the plan's `Solution.kept`), the budget as a
    horizontal line, and each region shaded over its forward span and over its recomputation +
    backward span. Writes a PNG (8x4 inches, 100 dpi).

    Example:
        >>> plot_memory(p.problem, p.solution.regions, p.budget_bytes, "memory.png", kept=p.solution.kept)
        PosixPath('memory.png')
    """
    Figure, FigureCanvasAgg = figure_classes()
    n = len(problem)
    static = problem.static_bytes
    baseline, planned = timelines(problem, regions, kept)
    keeps = f", keeping {len(kept)} node{'' if len(kept) == 1 else 's'}" if kept else ""
    top = max(baseline.peak_bytes, planned.peak_bytes, budget_bytes)
    unit, scale = _unit(top)

    figure = Figure(figsize=FIGURE_SIZE_INCHES, dpi=DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.axhspan(0, static / scale, color="0.85", label=f"static ({format_bytes(static)})")
    for timeline, name, style in (
        (baseline, "no plan", {"color": "0.35", "linewidth": 1.0}),
        (planned, f"plan, {len(regions)} region{'' if len(regions) == 1 else 's'}{keeps}",
         {"color": "C0", "linewidth": 1.5}),
    ):
        x = step_positions(timeline, n)
        y = [(static + live) / scale for live in timeline.live_bytes]
        axes.plot(x, y, drawstyle="steps-post", label=f"{name} (peak {format_bytes(timeline.peak_bytes)})",
                  **style)
        axes.plot([x[timeline.peak_step]], [timeline.peak_bytes / scale], marker="v",
                  color=style["color"], linestyle="none")
    axes.axhline(budget_bytes / scale, color="C3", linestyle="--", linewidth=1.0,
                 label=f"budget ({format_bytes(budget_bytes)})")

    positions = step_positions(planned, n)
    recompute_x = {
        label.split(" ", 1)[1]: x for label, x in zip(planned.labels, positions) if label.startswith("recompute ")
    }
    numbered = len(regions) <= MAX_NUMBERED_REGIONS
    for index, region in enumerate(regions):
        alpha = 0.15 if index % 2 == 0 else 0.28  # neighbouring regions stay distinguishable
        first = recompute_x.get(problem.nodes[region.start].name, 2 * n - region.stop - 1.0)
        spans = (
            (region.start - 0.5, region.stop - 0.5, "C1", "region: forward"),
            (first - 0.5 / (len(region) + 1), 2 * n - region.start - 0.5, "C2", "region: recompute + backward"),
        )
        for left, right, color, label in spans:
            axes.axvspan(left, right, color=color, alpha=alpha, linewidth=0, label=label if index == 0 else None)
            if numbered:
                axes.text((left + right) / 2, 1.02 * top / scale, f"#{index}", ha="center", va="bottom", fontsize=7)

    axes.axvline(n - 0.5, color="0.5", linewidth=0.8)
    axes.text(0.25, 1.01, "forward", transform=axes.transAxes, ha="center", va="bottom", fontsize=9)
    axes.text(0.75, 1.01, "backward", transform=axes.transAxes, ha="center", va="bottom", fontsize=9)
    axes.set_xlim(-0.5, 2 * n - 0.5)
    axes.set_ylim(0, 1.08 * top / scale)
    axes.set_xticks([])
    axes.set_xlabel(f"step: forward over {n} nodes, then backward in reverse")
    axes.set_ylabel(f"memory ({unit})")
    if title:
        figure.suptitle(title, fontsize=11)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)  # never over the curves
    figure.tight_layout()
    target = Path(path)
    figure.savefig(target, format="png")
    return target


def plot_plan(record: PlanRecord, path: str | os.PathLike[str]) -> Path:
    """`plot_memory` for a plan's record (what `Plan.plot(path)` calls).

    Example:
        >>> plot_plan(p.record, "memory.png")
    """
    title = f"Predicted memory of one training step: {record.model_name}"
    return plot_memory(record.problem, record.solution.regions, record.budget_bytes, path, title,
                       kept=record.solution.kept)


__all__ = ["DPI", "FIGURE_SIZE_INCHES", "MAX_NUMBERED_REGIONS", "figure_classes", "plot_memory", "plot_plan", "step_positions",
           "timelines"]
