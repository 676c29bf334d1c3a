"""Samples per second against batch size, for no checkpointing, every block and the planner,
with the memory wall marked: the largest candidate batch any plan fits (`plot_throughput`).
matplotlib is imported only when a plot is drawn, and only its Agg backend is used.

Example:
    >>> plot_throughput(tp, "throughput.png")
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from planner.report.plot import figure_classes

if TYPE_CHECKING:
    from planner.throughput.search import ThroughputPlan


def plot_throughput(tp: ThroughputPlan, path: str | os.PathLike[str]) -> Path:
    """Write a PNG of `tp`'s predicted samples per second against batch size (measured ones
    marked), one line per configuration, and a vertical line at the memory wall.

    Example:
        >>> plot_throughput(tp, "throughput.png")
    """
    figure_class, canvas_class = figure_classes()
    figure = figure_class(figsize=(7.0, 4.0), dpi=100)
    canvas_class(figure)
    axes = figure.add_subplot(1, 1, 1)
    # Drawn planner first and no checkpointing last, hollow: where no checkpointing fits, the
    # planner's plan there is the same step, and its point would hide the baseline's.
    series = {
        "planner": ([(row.batch, row.samples_per_s) for row in tp.table if row.samples_per_s], "o", "tab:green"),
        "every block": ([(row.batch, row.every_block_samples_per_s) for row in tp.table
                         if row.every_block_samples_per_s], "s", "tab:orange"),
        "no checkpointing": ([(row.batch, row.none_samples_per_s) for row in tp.table if row.none_samples_per_s],
                             "D", "tab:blue"),
    }
    for order, (label, (points, marker, color)) in enumerate(series.items()):
        if points:
            axes.plot([b for b, _ in points], [rate for _, rate in points], marker=marker, color=color, label=label,
                      markersize=6 + 3 * order, markerfacecolor="none" if order else color, zorder=2 + order)
    measured = [(row.batch, row.measured_samples_per_s) for row in tp.table if row.measured_samples_per_s]
    if measured:
        axes.scatter([b for b, _ in measured], [rate for _, rate in measured], marker="x", s=80, color="black",
                     label="planner, measured", zorder=5)
    fitting = [row.batch for row in tp.table if row.peak_bytes is not None]
    if fitting:
        axes.axvline(max(fitting), color="grey", linestyle="--", label="memory wall (largest batch a plan fits)")
    axes.set_xscale("log", base=2)
    axes.set_xticks([row.batch for row in tp.table], [str(row.batch) for row in tp.table])
    axes.minorticks_off()
    axes.set_xlabel("batch size")
    axes.set_ylabel("samples / s")
    axes.set_title(f"Throughput within {tp.budget_bytes / 2**30:.2f} GiB: chosen batch {tp.batch_size}")
    axes.legend(fontsize=8)
    figure.tight_layout()
    target = Path(path)
    figure.savefig(target, format="png")
    return target


__all__ = ["plot_throughput"]
