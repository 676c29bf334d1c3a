"""The model's own step against the traced graph (`planner.measure.steps`)."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from conftest import small_gpt
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from planner import InfeasibleBudget, plan
from planner.api import GIB
from planner.measure.steps import BEYOND_GRAPH, held_outside_step
from planner.planning import BEYOND_PLAN

EAGER_CHECK_WARNING = "the model's own training step peaked"  # (planner.measure.steps's warning)

EXTRA_BYTES = 4 << 20


def _tracing() -> bool:
    return torch.fx._symbolic_trace.is_fx_symbolic_tracing() or torch.compiler.is_compiling()


class EagerOnlySave(nn.Module):
    """Holds 4 MiB more for backward in its own code than under tracing, as a kernel the
    graph does not see would (a workspace, another attention kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(6)])
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers(x)
        if not _tracing():
            hidden = torch.ones(EXTRA_BYTES // 4, device=x.device)
            y = y + (hidden * self.scale).sum() * 0  # `hidden` saved for the gradient of `scale`
        return y


def test_memory_the_graph_does_not_show_is_measured_kept_free_and_named():
    torch.manual_seed(0)
    model, x = EagerOnlySave().train(), torch.randn(8192, 128)
    with pytest.warns(UserWarning, match="above the traced graph"):
        unplanned = plan(model, x, budget_gb=80, repeats=1)
    gap = unplanned.static_breakdown[BEYOND_GRAPH]
    assert EXTRA_BYTES <= gap <= 2 * EXTRA_BYTES
    measured = unplanned.verify(steps=1).original_peak_bytes
    assert unplanned.baseline_peak_bytes >= measured  # the prediction now covers the model's own step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned = unplanned.replan(budget_gb=0.8 * measured / GIB)
    record = planned.verify(steps=1)
    assert planned.checkpoints and record.gradients_match
    assert record.planned_peak_bytes <= planned.budget_bytes
    assert BEYOND_GRAPH in str(planned)


def test_a_model_whose_code_matches_its_graph_gets_no_such_term():
    model, tokens = small_gpt()
    with warnings.catch_warnings():
        # (only the eager check's warning: the step readings may warn of node times on a busy machine)
        warnings.filterwarnings("error", message=EAGER_CHECK_WARNING, category=UserWarning)
        p = plan(model, tokens, budget_gb=80, repeats=1)
    assert BEYOND_GRAPH not in p.static_breakdown


class RecomputeWorkspace(nn.Module):
    """Blocks whose own code takes a 24 MiB workspace for a moment when it runs inside backward
    (a recomputation), which the graph does not show, as a kernel that picks another algorithm
    there would: the unplanned step never does, a planned step does in each recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(128, 256), nn.Linear(256, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() != -1:  # inside backward
            with _disable_current_modes():  # inside the kernel, as it were: no dispatch mode sees it
                workspace = torch.ones(WORKSPACE_BYTES // 4, device=x.device)
            del workspace
        return x + self.down(torch.tanh(self.up(x)))


WORKSPACE_BYTES = 24 << 20


@pytest.mark.parametrize("optimizer", [None, "adam"])
def test_a_plan_whose_own_step_peaks_above_its_budget_is_solved_again_with_the_excess_kept_free(optimizer):
    torch.manual_seed(0)
    model, x = RecomputeWorkspace().train(), torch.randn(4096, 128)
    with warnings.catch_warnings():
        # the unplanned step peaks where the graph says
        warnings.filterwarnings("error", message=EAGER_CHECK_WARNING, category=UserWarning)
        # each block one node: every region is a block whose own forward runs again (a run inside
        # it would replay recorded calls and skip its code)
        base = plan(model, x, budget_gb=80, repeats=1, optimizer=optimizer, leaves=tuple(f"blocks.{i}" for i in range(6)))
    assert BEYOND_GRAPH not in base.static_breakdown and BEYOND_PLAN not in base.static_breakdown
    # Node times set, not measured, so that the solver's choice does not hang on the clock: the
    # later a block, the cheaper, so plans checkpoint the last blocks, recomputed where the step
    # peaks (plans of the first blocks recompute them when little is left, and fit as they are).
    base.problem = dataclasses.replace(base.problem, nodes=tuple(
        dataclasses.replace(node, compute_ms=1.0 + 0.1 * (5 - i), stop_ms=None)
        for i, node in enumerate(base.problem.nodes)))
    every = base.with_submodules([f"blocks.{i}" for i in range(6)])
    # the budget holds the optimizer state, which a bare step does not
    outside = held_outside_step(base.static_breakdown)
    assert (optimizer is None) == (outside == 0)
    # unfitted (a given plan), it goes over its predicted peak
    over = every.verify(steps=1).planned_peak_bytes + outside - every.predicted_peak_bytes
    assert over > 1 << 20
    fitted, loose = [], []
    for extra_mib in range(8, 26, 4):  # too tight to fit with the excess kept free, fitted, and loose
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                planned = base.replan(budget_gb=(every.predicted_peak_bytes + (extra_mib << 20)) / GIB)
        except InfeasibleBudget as infeasible:  # kept free, no plan fits: the error names the minimum
            assert infeasible.minimum_bytes > infeasible.budget_bytes
            continue
        record = planned.verify(steps=1)
        assert record.gradients_match and record.planned_peak_bytes + outside <= planned.budget_bytes
        assert planned.predicted_peak_bytes <= planned.budget_bytes
        if any("above its budget" in str(warning.message) for warning in caught):
            assert 0 < planned.static_breakdown[BEYOND_PLAN] <= WORKSPACE_BYTES
            assert BEYOND_PLAN in str(planned)
            fitted.append(planned)
        else:
            assert BEYOND_PLAN not in planned.static_breakdown
            loose.append(planned)
    assert fitted and loose, "every budget gave the same outcome"
