"""The plot of `benchmarks/compare.py`: per model, each configuration's measured peak against
its median step time, with the Pareto front and the planner's budgets.

Example:
    >>> plot(result, Path("benchmarks/results/compare_gpt.png"))
"""
from __future__ import annotations

from pathlib import Path

from benchmarks.compare_results import ModelResult


def _place_labels(figure, axes, labels) -> None:
    """Annotate each point, trying offsets until the label overlaps no marker and no label
    placed before."""
    from matplotlib.transforms import Bbox

    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    placed = []
    for x, y, _, _ in labels:
        px, py = axes.transData.transform((x, y))
        placed.append(Bbox.from_extents(px - 4, py - 4, px + 4, py + 4))
    offsets = [(4, 3), (4, -9), (4, 10), (-4, 3), (-4, -9), (4, -16), (4, 17), (-4, 10), (-4, -16), (4, 24)]
    for x, y, text, color in labels:
        for dx, dy in offsets:
            annotation = axes.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=6.5,
                                       color=color, ha="left" if dx > 0 else "right")
            box = annotation.get_window_extent(renderer).expanded(1.02, 1.1)
            if not any(box.overlaps(other) for other in placed) or (dx, dy) == offsets[-1]:
                placed.append(box)
                break
            annotation.remove()


def plot(result: ModelResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(c.step_ms, c.peak / 2**20, c) for c in result.configs if c.module is not None]
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=90)
    colors = {"baseline": "#444444", "compile": "#1f77b4"}
    solver_colors = ["#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    solvers = sorted({c.solver for _, _, c in points if c.kind == "planner"})
    markers = {"baseline": "s", "compile": "^", "planner": "o"}
    labels = []
    for x, y, c in points:
        color = colors.get(c.kind) or solver_colors[solvers.index(c.solver) % len(solver_colors)]
        axes.scatter(x, y, color=color, marker=markers[c.kind], s=28, zorder=3)
        labels.append((x, y, c.name.replace("planner ", "").replace("sqrt(N) segments", "sqrt(N) seg"), color))
    front = []
    for x, y, c in sorted(points, key=lambda point: (point[0], point[1])):
        if not front or y < front[-1][1]:
            front.append((x, y, c))
    if front:
        xs = [x for x, _, _ in front]
        ys = [y for _, y, _ in front]
        axes.step(xs + [max(x for x, _, _ in points)], ys + [ys[-1]], where="post", color="#999999",
                  linewidth=1, linestyle="--", zorder=1, label="Pareto front")
    budgets = sorted({c.budget_bytes for c in result.configs if c.budget_bytes is not None})
    for budget in budgets:
        axes.axhline(budget / 2**20, color="#dddddd", linewidth=0.8, zorder=0)
    handles = [plt.Line2D([], [], color="#444444", marker="s", linestyle="", label="baselines")]
    if any(c.kind == "compile" for _, _, c in points):
        handles.append(plt.Line2D([], [], color="#1f77b4", marker="^", linestyle="", label="torch.compile,\nbudget b"))
    handles += [plt.Line2D([], [], color=solver_colors[i % len(solver_colors)], marker="o", linestyle="",
                           label=f"planner {name},\n% of unplanned peak") for i, name in enumerate(solvers)]
    handles.append(plt.Line2D([], [], color="#999999", linestyle="--", label="Pareto front"))
    handles.append(plt.Line2D([], [], color="#dddddd", label="planner budgets"))
    axes.margins(x=0.12, y=0.08)
    axes.set_xlabel("median step time, forward+backward (ms)", fontsize=9)
    axes.set_ylabel("measured peak (MiB)", fontsize=9)
    axes.set_title(f"{result.spec.title}: peak vs step time", fontsize=9)
    axes.tick_params(labelsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout(rect=(0, 0, 0.77, 1))
    _place_labels(figure, axes, labels)  # after the layout: placement works in display coordinates
    figure.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(0.77, 0.95), frameon=False)
    figure.savefig(path, dpi=90)
    plt.close(figure)
