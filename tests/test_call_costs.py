"""What a checkpoint call costs on the model's own smallest repeated submodule, alone and in the
model's forward (`planner.call_costs`): read beyond the recomputation the problem prices, and
never below the figure held so far."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from planner import call_costs, plan
from planner.memory import preserved_state
from planner.step_regions import small_calls


class Wavy(nn.Module):
    """A repeated submodule whose recomputation is one large matmul: much work, few saved tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(512, 512) / 23)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x @ self.weight)


class Waves(nn.Module):
    """Matmuls (no submodules) between calls of `Wavy`: its calls are the one repeated class."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(512, 512) / 23) for _ in range(4))
        self.waves = nn.ModuleList(Wavy() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for weight, wave in zip(self.weights, self.waves):
            x = wave(x @ weight)
        return x


def test_a_small_calls_cost_is_read_beyond_its_recomputation_and_not_below_the_figure(monkeypatch):
    # Each call recomputes a large matmul: a reading that did not take the problem's recomputation off
    # would put about that on each checkpoint call.
    monkeypatch.setattr(call_costs, "CALL_ROUNDS", 6)  # (no interval at 6: the reading is taken)
    torch.manual_seed(0)
    model, x = Waves(), torch.randn(1024, 512)
    p = plan(model, x, budget_gb=80, repeats=1)
    calls = small_calls(p.problem, p.wrapped)
    assert [p.wrapped[region].module for region in calls] == [f"waves.{i}" for i in range(4)]
    recompute_ms = p.problem.region_recompute_ms(calls[0])
    # (a figure low enough to read over, high enough that the calls' recomputation is read at all)
    low = replace(p.problem, region_overhead_ms=recompute_ms / 8, saved_tensor_ms=0.0, run_region_ms=0.0)
    with preserved_state(model, [torch.device("cpu")]):
        per_call = call_costs.small_call_cost(model, low, p.wrapped, torch.device("cpu"), lambda m: m(x))
    assert recompute_ms / 8 <= per_call < recompute_ms
    priced = replace(p.problem, region_overhead_ms=recompute_ms)  # a figure above anything read
    with preserved_state(model, [torch.device("cpu")]):
        assert call_costs.small_call_cost(model, priced, p.wrapped, torch.device("cpu"), lambda m: m(x)) == recompute_ms


def test_a_model_without_repeated_submodules_keeps_the_figure():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    p = plan(model, torch.randn(4, 8), budget_gb=80, repeats=1)
    problem = replace(p.problem, region_overhead_ms=0.123)
    assert not small_calls(problem, p.wrapped)
    assert call_costs.small_call_cost(model, problem, p.wrapped, torch.device("cpu"), lambda m: m(torch.randn(4, 8))) \
        == pytest.approx(0.123)


def test_calls_that_cannot_be_read_leave_the_figure_with_a_warning(monkeypatch, caplog):
    torch.manual_seed(0)
    model, x = Waves(), torch.randn(64, 512)
    p = plan(model, x, budget_gb=80, repeats=1)

    def not_called(*args):
        raise RuntimeError("'waves.0' was not called by the model's forward")

    monkeypatch.setattr(call_costs, "captured_call", not_called)
    problem = replace(p.problem, region_overhead_ms=0.25)
    with caplog.at_level("WARNING", logger="planner.call_costs"):
        assert call_costs.small_call_cost(model, problem, p.wrapped, torch.device("cpu"), lambda m: m(x)) == 0.25
    assert "could not be read on waves.0" in caplog.text


def test_calls_that_recompute_far_more_than_a_call_costs_are_not_read(monkeypatch, caplog):
    torch.manual_seed(0)
    model, x = Waves(), torch.randn(64, 512)
    p = plan(model, x, budget_gb=80, repeats=1)
    problem = replace(p.problem, region_overhead_ms=p.problem.region_recompute_ms(small_calls(p.problem, p.wrapped)[0])
                      / (2 * call_costs.RECOMPUTE_LIMIT), run_region_ms=0.0)
    monkeypatch.setattr(call_costs, "timed_rounds", None)  # (timing anything would fail)
    with caplog.at_level("INFO", logger="planner.call_costs"):
        assert call_costs.small_call_cost(model, problem, p.wrapped, torch.device("cpu"), lambda m: m(x)) \
            == problem.region_overhead_ms
    assert "not read on waves.0" in caplog.text
