"""The memory plot: a small PNG from the simulator's timelines, with aligned phases."""
import struct
import sys

import pytest
from conftest import small_cnn

from planner import load_plan, plan
from planner.api import GIB
from planner.report.plot import plot_memory, step_positions
from solvers import NodeCost, Problem, simulate

pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(PNG_SIGNATURE)
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def chain(n: int) -> Problem:
    """n nodes in a line, each reading and saving its predecessor's output."""
    return Problem(
        nodes=tuple(
            NodeCost(f"n{i}", 1.0, output_bytes=1000, grad_bytes=1000, uses=(i - 1,) if i else (),
                     saves=(i - 1,) if i else (), is_output=i == n - 1)
            for i in range(n)
        ),
        static_bytes=5000,
    )


def test_plan_plot_writes_a_small_png(tmp_path):
    model, x = small_cnn()
    p = plan(model, x, budget_gb=80.0, solver="sqrt", repeats=1)
    p = p.replan(budget_gb=0.75 * p.baseline_peak_bytes / GIB)
    assert p.checkpoints
    path = p.plot(tmp_path / "memory.png")
    data = path.read_bytes()
    assert png_size(data) == (800, 400)  # 8x4 inches at 100 dpi
    assert 10_000 < len(data) < 300_000

    # A saved plan draws the same figure without the model.
    saved = load_plan(p.save(tmp_path / "plan.json"))
    again = saved.plot(tmp_path / "again.png").read_bytes()
    assert png_size(again) == (800, 400)


def test_plot_memory_needs_only_the_problem(tmp_path):
    problem = chain(6)
    path = plot_memory(problem, (range(1, 4),), budget_bytes=12_000, path=tmp_path / "m.png", title="chain")
    assert png_size(path.read_bytes()) == (800, 400)


def test_step_positions_line_up_forward_and_backward():
    problem = chain(4)
    baseline = simulate(problem, ())
    assert step_positions(baseline, 4) == [0, 1, 2, 3, 3.5, 4, 5, 6, 7]  # (the loss at 3.5)
    planned = simulate(problem, (range(1, 3),))
    positions = step_positions(planned, 4)
    assert len(positions) == len(planned.labels) == 11
    assert positions == sorted(positions), "steps stay in order"
    by_label = dict(zip(planned.labels, positions))
    # forward and backward steps sit where they sit without a plan
    for label, x in zip(baseline.labels, step_positions(baseline, 4)):
        assert by_label[label] == x
    # recomputation of nodes 1 and 2 happens between backward of node 3 (x=4) and of node 2 (x=5)
    assert 4 < by_label["recompute n1"] < by_label["recompute n2"] < 5


def test_missing_matplotlib_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"plotting needs matplotlib.*pip install matplotlib"):
        plot_memory(chain(3), (), budget_bytes=10_000, path=tmp_path / "m.png")
    assert not (tmp_path / "m.png").exists()
