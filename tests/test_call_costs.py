"""What a checkpoint call costs on the model's own smallest repeated submodule, alone and in the
model's forward (`planner.costs.calls`): read beyond the recomputation the problem prices, and
never below the figure held so far."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from planner import plan
from planner.costs import calls as call_costs
from planner.costs.step import small_calls
from planner.measure import clock
from planner.measure.memory import preserved_state


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
    # Each round's steps run for real once; their times are set, so that the reading's arithmetic
    # is checked exactly (timings on a shared CPU are not): alone, the calls cost their
    # recomputation and 0.5 ms each more checkpointed; in the model's forward 0.7 ms each more,
    # and their forwards alone 0.2 ms each more. A call beyond its recomputation: 0.5 + 0.7 - 0.2.
    torch.manual_seed(0)
    model, x = Waves(), torch.randn(256, 512)
    p = plan(model, x, budget_gb=80, repeats=1)
    calls = small_calls(p.problem, p.wrapped)
    assert [p.wrapped[region].module for region in calls] == [f"waves.{i}" for i in range(4)]
    recompute_ms = sum(map(p.problem.region_recompute_ms, calls))
    ran: list[str] = []

    def set_rounds(device, steps, rounds, kernels_only=False, closing=None):
        for name, run in steps.items():
            run()
            ran.append(name)
        more = {"alone checkpointed": recompute_ms + 4 * 0.5, "model checkpointed": 4 * 0.7,
                "forwards checkpointed": 4 * 0.2}
        return {name: [100.0 + more.get(name, 0.0)] * rounds for name in steps}

    monkeypatch.setattr(clock, "timed_rounds", set_rounds)
    monkeypatch.setattr(call_costs, "RECOMPUTE_LIMIT", float("inf"))  # (read however slow this CPU's matmuls)
    saved = sum(p.problem.nodes[i].saved_tensors for i in calls[0])
    low = replace(p.problem, region_overhead_ms=0.1, saved_tensor_ms=0.01, run_region_ms=0.0)
    with preserved_state(model, [torch.device("cpu")]):
        per_call = call_costs.small_call_cost(model, low, p.wrapped, torch.device("cpu"), lambda m: m(x))
    assert per_call == pytest.approx(1.0 - 0.01 * saved)
    assert set(ran) == {"model", "model checkpointed", "alone", "alone checkpointed", "forwards",
                        "forwards checkpointed"}
    high = replace(low, region_overhead_ms=1.5)  # never below the figure so far
    with preserved_state(model, [torch.device("cpu")]):
        assert call_costs.small_call_cost(model, high, p.wrapped, torch.device("cpu"), lambda m: m(x)) == 1.5


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
    monkeypatch.setattr(call_costs, "RECOMPUTE_LIMIT", float("inf"))  # (read however slow this CPU's matmuls)
    problem = replace(p.problem, region_overhead_ms=0.25)
    with caplog.at_level("WARNING", logger="planner.costs.calls"):
        assert call_costs.small_call_cost(model, problem, p.wrapped, torch.device("cpu"), lambda m: m(x)) == 0.25
    assert "could not be read on waves.0" in caplog.text


def test_calls_that_recompute_far_more_than_a_call_costs_are_not_read(monkeypatch, caplog):
    torch.manual_seed(0)
    model, x = Waves(), torch.randn(64, 512)
    p = plan(model, x, budget_gb=80, repeats=1)
    # (under the least of the calls' recomputations: their median, which the limit is held to,
    # is over it whatever the suite's load does to their node times)
    least_ms = min(map(p.problem.region_recompute_ms, small_calls(p.problem, p.wrapped)))
    problem = replace(p.problem, region_overhead_ms=least_ms / (2 * call_costs.RECOMPUTE_LIMIT), run_region_ms=0.0)
    monkeypatch.setattr(clock, "timed_rounds", None)  # (timing anything would fail)
    with caplog.at_level("INFO", logger="planner.costs.calls"):
        assert call_costs.small_call_cost(model, problem, p.wrapped, torch.device("cpu"), lambda m: m(x)) \
            == problem.region_overhead_ms
    assert "not read on waves.0" in caplog.text


@pytest.mark.parametrize("seconds_per_round, batches", [(35 / 40, 1), (20 / 40, 3)])
def test_an_undecided_read_adds_rounds_only_while_they_end_within_its_time(monkeypatch, seconds_per_round, batches):
    # The rounds read the price, give or take 1 ms a call: the read stays undecided. The clock
    # moves as the rounds run. 40 rounds in 35 s: 20 more would end at 52.5 s, past MAX_READ_S
    # (45): none are run. 40 in 20 s: 20 more end at 30 s, 20 more at 40 s, then MAX_CALL_ROUNDS.
    torch.manual_seed(0)
    model, x = Waves(), torch.randn(64, 512)
    p = plan(model, x, budget_gb=80, repeats=1)
    calls = small_calls(p.problem, p.wrapped)
    problem = replace(p.problem, region_overhead_ms=0.1, saved_tensor_ms=0.0, run_region_ms=0.0)
    recompute_ms = sum(map(problem.region_recompute_ms, calls))
    seconds = [0.0]
    batches_run: list[int] = []

    def set_rounds(device, steps, rounds, kernels_only=False, closing=None):
        seconds[0] += rounds * seconds_per_round
        batches_run.append(rounds)
        times = {name: [100.0] * rounds for name in steps}
        times["alone checkpointed"] = [100.0 + recompute_ms + len(calls) * (0.1 + (-1) ** i) for i in range(rounds)]
        return times

    monkeypatch.setattr(clock, "timed_rounds", set_rounds)
    monkeypatch.setattr(clock, "_now", lambda: seconds[0])
    for name, value in (("CALL_ROUNDS", 40), ("MAX_CALL_ROUNDS", 80), ("MAX_READ_S", 45.0)):  # (conftest sets fewer)
        monkeypatch.setattr(call_costs, name, value)
    monkeypatch.setattr(call_costs, "RECOMPUTE_LIMIT", float("inf"))
    with preserved_state(model, [torch.device("cpu")]):
        assert call_costs.small_call_cost(model, problem, p.wrapped, torch.device("cpu"), lambda m: m(x)) \
            == pytest.approx(0.1)
    assert len(batches_run) == batches
    assert seconds[0] <= call_costs.MAX_READ_S
    assert sum(batches_run) <= call_costs.MAX_CALL_ROUNDS
