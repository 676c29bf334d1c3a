"""The model's own step against the traced graph (`planner.eager_check`)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from planner import plan
from planner.api import GIB
from planner.eager_check import BEYOND_GRAPH
from planner.examples import gpt

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
        unplanned = plan(model, x, budget_gb=80)
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
    model, tokens = gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        p = plan(model, tokens, budget_gb=80)
    assert BEYOND_GRAPH not in p.static_breakdown
