"""The step fit keeps a figure where its rounds cannot tell the step's reading from the price."""
from __future__ import annotations

from dataclasses import replace
from math import comb

import pytest
import torch

from conftest import small_gpt
from planner import plan
from planner.clock import paired_interval, reading_or_price


@pytest.mark.parametrize("n", range(1, 40))
def test_the_paired_interval_is_the_distribution_free_95_percent_interval_of_a_median(n):
    # k-th smallest and largest difference, k the largest with P(Binomial(n, 1/2) < k) <= 2.5%,
    # found here by brute force over every k.
    differences = [float(3 * i % n) for i in range(n)]  # a shuffle of 0..n-1 where 3 and n are coprime
    times = {"a": [d + 100.0 for d in differences], "b": [100.0] * n}
    tail = [sum(comb(n, i) for i in range(k)) / 2 ** n for k in range(n + 1)]  # P(Binomial < k)
    k = max(k for k in range(n + 1) if tail[k] <= 0.025)
    found = paired_interval(times, "a", "b")
    ordered = sorted(a - b for a, b in zip(times["a"], times["b"]))
    assert found == (None if k == 0 else (ordered[k - 1], ordered[n - k]))
    assert (found is None) == (n < 6)


def test_a_reading_inside_its_interval_of_the_price_keeps_the_price():
    assert reading_or_price(12.0, (-30.0, 51.0), 20.0, "runs") == 20.0
    assert reading_or_price(31.0, (28.0, 35.0), 20.0, "runs") == 31.0
    assert reading_or_price(31.0, None, 20.0, "runs") == 31.0  # (too few rounds for an interval)


def _fake_rounds(differences: list[float]):
    def timed_rounds(device, calls, rounds):
        assert rounds == len(differences)
        return {name: [1000.0 + (0.0 if name == "unplanned" else d) for d in differences] for name in calls}
    return timed_rounds


@pytest.fixture(scope="module")
def planned_gpt():
    model, tokens = small_gpt()
    return model, tokens, plan(model, tokens, budget_gb=80, repeats=1)


def test_figures_stand_where_the_steps_rounds_cannot_tell_them_from_their_price(monkeypatch, planned_gpt):
    # A machine so busy that each configuration's step, less the unplanned one, spreads over
    # +-1 s: every set's price lies inside its reading's interval, so every figure stays what
    # it was (before, each came out at its floor: the median difference, 0, priced nothing).
    # Rounds that agree (each +1 s, exactly) are read as measured.
    from planner import step_costs, step_regions
    from planner.graph import run_checkpoints, saved_calls
    from planner.verify import training_loss

    model, tokens, p = planned_gpt
    problem = replace(p.problem, region_overhead_ms=0.3, saved_tensor_ms=0.05, run_region_ms=0.2,
                      recorded_call_ms=0.01, keep_region_ms=0.4)
    wrapped = p.wrapped
    assert step_regions.small_calls(problem, wrapped) and step_regions.lone_short_runs(problem, wrapped)
    assert step_regions.long_runs(problem, wrapped) and step_regions.keeping_calls(problem, wrapped)

    def residuals(differences: list[float]):
        monkeypatch.setattr(step_costs, "timed_rounds", _fake_rounds(differences))
        return step_costs.step_residuals(
            model, problem, wrapped, lambda runs: run_checkpoints(p.traced.gm, problem, runs, wrapped).values(),
            lambda pairs: [replace(wrapped[region], saved_calls=saved_calls(p.traced.gm, region, kept))
                           for region, kept in pairs],
            lambda module: training_loss(module(tokens)).backward(), torch.device("cpu"), rounds=len(differences))

    noisy = residuals([-1000.0, -400.0, -200.0, -50.0, 0.0, 50.0, 200.0, 400.0, 1000.0])
    assert noisy.per_call_ms == pytest.approx(0.0, abs=1e-9)
    assert noisy.saved_tensor_ms == pytest.approx(0.05)
    assert noisy.per_run_ms == pytest.approx(0.2) and noisy.recorded_call_ms == pytest.approx(0.01)
    assert noisy.per_keep_ms == pytest.approx(0.0, abs=1e-9)
    assert noisy.priced(problem).recompute_ms(tuple(step_regions.lone_short_runs(problem, wrapped))) == \
        pytest.approx(problem.recompute_ms(tuple(step_regions.lone_short_runs(problem, wrapped))))

    agreed = residuals([1000.0] * 9)
    assert agreed.per_call_ms > 1.0  # (8 calls at +1 s: about 125 ms each)
    assert (agreed.per_run_ms, agreed.recorded_call_ms) != pytest.approx((0.2, 0.01))
    assert abs(agreed.per_keep_ms) > 1.0


def test_a_blocks_checkpoint_cost_inside_its_noise_leaves_the_tiny_modules_figure(monkeypatch, planned_gpt):
    # The block's checkpoint measured 20 ms beyond its forward. Where its rounds' interval holds
    # what the tiny modules' figures price it at (0.3 ms a call, 10 us a saved tensor), their
    # per-tensor figure stands; where the interval is clear of it, the block's is read.
    from planner import block_costs
    from planner.graph import saved_calls

    model, tokens, p = planned_gpt
    problem = replace(p.problem, region_overhead_ms=0.3, saved_tensor_ms=0.01)

    def saved_tensor_ms(interval: tuple[float, float]) -> float:
        cost = block_costs.SelectiveCost(0.01, 0.0, 0.0, 0.0, 20.0, interval)
        monkeypatch.setattr(block_costs, "selective_costs_in_model", lambda *args, **kwargs: cost)
        return block_costs.selective_overhead_for_plan(
            model, problem, p.wrapped, torch.device("cpu"), True, lambda: model(tokens),
            lambda region, kept: saved_calls(p.traced.gm, region, kept)).saved_tensor_ms

    assert saved_tensor_ms((-5.0, 40.0)) == pytest.approx(0.01)
    assert saved_tensor_ms((15.0, 25.0)) > 0.01
