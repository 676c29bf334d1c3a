"""The step fit keeps a figure where its rounds cannot tell the step's reading from the price."""
from __future__ import annotations

import logging
from dataclasses import replace
from math import comb

import pytest
import torch
from conftest import small_gpt

from planner import plan
from planner.measure.clock import (
    paired_difference,
    paired_differences,
    paired_interval,
    reading_or_price,
    timed_rounds,
)
from solvers import Problem

pytestmark = pytest.mark.full_timing_rounds  # (the block's fake rounds are as many as a planning's)


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


def test_paired_rounds_read_each_call_against_the_baseline_runs_around_it_under_a_drifting_clock(monkeypatch):
    # A machine whose every call takes 1 ms longer than the one before: "plan" costs 5 ms more
    # than "base", "other" 2 ms more. Timed in rounds base, other, plan, with base once more at
    # the end, each reads exactly its own cost; paired in the round only, the drift adds to it.
    import planner.measure.clock as clock

    clock_ms = iter(range(1000))
    cost = {"base": 10.0, "other": 12.0, "plan": 15.0}
    monkeypatch.setattr(clock, "elapsed_ms", lambda device, call, ahead_ms=0.0: call() + next(clock_ms))
    calls = {name: (lambda ms=ms: ms) for name, ms in cost.items()}
    times = timed_rounds(torch.device("cpu"), calls, 7, closing="base")
    assert [len(times[name]) for name in cost] == [8, 7, 7]
    assert paired_differences(times, "plan", "base") == [5.0] * 7
    assert paired_difference(times, "other", "base") == 2.0
    assert paired_interval(times, "plan", "base") == (5.0, 5.0)
    unclosed = timed_rounds(torch.device("cpu"), calls, 7)
    assert paired_differences(unclosed, "plan", "base") == [7.0] * 7  # (two calls of drift)
    assert paired_difference(times, "base", "plan") == -7.0  # (plan ran first: paired in the round)


def test_a_reading_replaces_its_price_only_where_its_interval_at_the_readings_level_is_clear_of_it():
    # Eight of nine rounds read +30 to +37 ms, one -5 ms, against a price of 0: a 95% interval
    # (2nd to 8th smallest) is clear of the price, the readings' (all nine) holds it. A planning
    # tests about ten readings: at 95% each, one in three plannings may replace a price on noise.
    from planner.measure.clock import READING_LEVEL

    times = {"unplanned": [1000.0] * 9, "plan": [1000.0 + d for d in (-5, 30, 31, 32, 33, 34, 35, 36, 37)]}
    assert paired_interval(times, "plan", "unplanned") == (30.0, 36.0)
    interval = paired_interval(times, "plan", "unplanned", READING_LEVEL)
    assert interval == (-5.0, 37.0)
    assert reading_or_price(paired_difference(times, "plan", "unplanned"), interval, 0.0, "runs") == 0.0
    clear = {"unplanned": [1000.0] * 9, "plan": [1000.0 + d for d in (29, 30, 31, 32, 33, 34, 35, 36, 37)]}
    assert reading_or_price(33.0, paired_interval(clear, "plan", "unplanned", READING_LEVEL), 0.0, "runs") == 33.0
    assert paired_interval({"unplanned": [1.0] * 8, "plan": [2.0] * 8}, "plan", "unplanned", READING_LEVEL) is None


def test_a_reading_inside_its_interval_of_the_price_keeps_the_price():
    assert reading_or_price(12.0, (-30.0, 51.0), 20.0, "runs") == 20.0
    assert reading_or_price(31.0, (28.0, 35.0), 20.0, "runs") == 31.0
    assert reading_or_price(31.0, None, 20.0, "runs") == 31.0  # (too few rounds for an interval)


def test_each_reading_is_logged_with_its_interval_price_and_outcome(caplog):
    from planner.measure.clock import READING_STOOD, READING_TAKEN, READING_TAKEN_ALONE

    with caplog.at_level(logging.INFO, logger="planner.measure.clock"):
        reading_or_price(12.0, (-30.0, 51.0), 20.0, "24 runs")
        reading_or_price(31.0, (28.0, 35.0), 20.0, "6 blocks")
        reading_or_price(31.0, None, 20.0, "6 calls")
    records = [record for record in caplog.records if record.name == "planner.measure.clock"]
    assert [record.msg for record in records] == [READING_STOOD, READING_TAKEN, READING_TAKEN_ALONE]
    assert records[0].args == ("24 runs", 12.0, -30.0, 51.0, 20.0)
    assert records[1].args == ("6 blocks", 31.0, 28.0, 35.0, 20.0)
    assert records[2].args == ("6 calls", 31.0, 20.0)
    assert "the reading replaces it" in records[1].getMessage()


def _fake_rounds(differences: list[float]):
    def timed_rounds(device, calls, rounds, closing=None):
        assert rounds == len(differences)
        return {name: [1000.0 + (0.0 if name == "unplanned" else d) for d in differences] for name in calls}
    return timed_rounds


@pytest.fixture(scope="module")
def planned_gpt():
    model, tokens = small_gpt()
    return model, tokens, plan(model, tokens, budget_gb=80, repeats=1, selective=True)


def test_figures_stand_where_the_steps_rounds_cannot_tell_them_from_their_price(monkeypatch, planned_gpt):
    # A machine so busy that each configuration's step, less the unplanned one, spreads over
    # +-1 s: every set's price lies inside its reading's interval, so every figure stays what
    # it was (before, each came out at its floor: the median difference, 0, priced nothing).
    # Rounds that agree (each +1 s, exactly) are read as measured.
    from planner.core import training_loss
    from planner.costs import step as step_costs
    from planner.costs import step as step_regions
    from planner.problem.graph import run_checkpoints, saved_calls

    model, tokens, p = planned_gpt
    problem = replace(p.problem, region_overhead_ms=0.3, saved_tensor_ms=0.05, run_region_ms=0.2,
                      recorded_call_ms=0.01, keep_region_ms=0.4)
    wrapped = p.wrapped
    assert step_regions.small_calls(problem, wrapped) and step_regions.lone_short_runs(problem, wrapped)
    assert step_regions.long_runs(problem, wrapped) and step_regions.keeping_calls(problem, wrapped)

    monkeypatch.setattr(step_costs, "within_step_block_ms", lambda *args: None)  # (across steps only here)

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

    # One round in nine below every price: the other eight, at +1 s, are clear of it at 95% (the
    # 2nd to 8th smallest), not at the readings' level (all nine), so the prices stand.
    one_round_under = residuals([-5.0] + [1000.0] * 8)
    assert one_round_under.per_call_ms == pytest.approx(0.0, abs=1e-9)
    assert one_round_under.saved_tensor_ms == pytest.approx(0.05)
    assert (one_round_under.per_run_ms, one_round_under.recorded_call_ms) == pytest.approx((0.2, 0.01))
    assert one_round_under.per_keep_ms == pytest.approx(0.0, abs=1e-9)

    agreed = residuals([1000.0] * 9)
    assert agreed.per_call_ms > 1.0  # (8 calls at +1 s: about 125 ms each)
    assert (agreed.per_run_ms, agreed.recorded_call_ms) != pytest.approx((0.2, 0.01))
    assert abs(agreed.per_keep_ms) > 1.0


def test_a_blocks_checkpoint_cost_inside_its_noise_leaves_the_tiny_modules_figure(monkeypatch, planned_gpt):
    # The block's checkpoint measured 20 ms beyond its forward. Where its rounds' interval holds
    # what the tiny modules' figures price it at (0.3 ms a call, 10 us a saved tensor), their
    # per-tensor figure stands; where the interval is clear of it, the block's is read.
    from planner.costs import block as block_costs
    from planner.problem.graph import saved_calls

    model, tokens, p = planned_gpt
    problem = replace(p.problem, region_overhead_ms=0.3, saved_tensor_ms=0.01, run_region_ms=0.0)  # (not as measured)

    def saved_tensor_ms(interval: tuple[float, float]) -> float:
        cost = block_costs.SelectiveCost(0.01, 0.0, 0.0, 0.0, 20.0, {"checkpoint_ms": interval})
        monkeypatch.setattr(block_costs, "selective_costs_in_model", lambda *args, **kwargs: cost)
        return block_costs.selective_overhead_for_plan(
            model, problem, p.wrapped, torch.device("cpu"), True, lambda: model(tokens),
            lambda region, kept: saved_calls(p.traced.gm, region, kept)).saved_tensor_ms

    assert saved_tensor_ms((-5.0, 40.0)) == pytest.approx(0.01)
    assert saved_tensor_ms((15.0, 25.0)) > 0.01


def test_a_block_whose_forward_dwarfs_what_the_prices_add_is_not_timed(monkeypatch, planned_gpt):
    # A block whose node times are a thousand times the tiny GPT's (GPT-2 124M at 4 x 1024 tokens:
    # a round of its steps takes about 40 s) stakes far under a percent of its forward on the
    # tiny modules' prices: its rounds could not tell a reading from them, so they are not run.
    from planner.costs import block as block_costs
    from planner.costs.overhead import selective_overhead_ms
    from planner.problem.graph import saved_calls

    model, tokens, p = planned_gpt
    timed: list[str] = []
    cost = block_costs.SelectiveCost(1.0, 0.0, 1.0, 1.0, None)
    monkeypatch.setattr(block_costs, "selective_costs_in_model", lambda *args, **kwargs: timed.append("block") or cost)

    def costs(problem: Problem) -> block_costs.MeasuredCosts:
        timed.clear()
        return block_costs.selective_overhead_for_plan(
            model, problem, p.wrapped, torch.device("cpu"), True, lambda: model(tokens),
            lambda region, kept: saved_calls(p.traced.gm, region, kept))

    tiny_call = selective_overhead_ms(torch.device("cpu"))[1]
    assert costs(p.problem).keep_call_ms == 1.0 and timed == ["block"]
    slow = replace(p.problem, nodes=tuple(replace(node, compute_ms=1000 * node.compute_ms) for node in p.problem.nodes))
    read = costs(slow)
    assert timed == []
    assert (read.keep_call_ms, read.run_call_ms, read.recorded_call_ms) == pytest.approx((tiny_call,) * 3)
    assert read.saved_tensor_ms == slow.saved_tensor_ms


def test_a_blocks_policy_and_recording_figures_inside_their_noise_leave_their_prices(
        monkeypatch, planned_gpt):
    # The block's rounds, each configuration spread over +-1 s: every figure read off them
    # (per ATen call under a policy, per kept node, per call counted and per call recorded)
    # is the tiny modules' price (per kept node: nothing). Before, each was max(0, the noise).
    # The rounds go on while the policy's cost per call is undecided, up to MAX_BLOCK_ROUNDS.
    # Rounds that agree are read as measured, after the first FINE_ROUNDS.
    from planner.costs import block as block_costs
    from planner.costs.overhead import selective_overhead_ms
    from planner.measure import clock
    from planner.problem.graph import saved_calls

    model, tokens, p = planned_gpt
    assert any(node.keepable for node in p.problem.nodes)
    # each configuration's step (ms), and its noise where noisy: every paired difference the
    # figures are read off spreads symmetrically over about +-1 s
    base = {"unchecked": 1000.0, "plain": 1030.0, "selective": 1090.0, "keeping": 1190.0, "bare": 20.0,
            "counted": 60.0, "policy forwards": 60.0, "counted step": 1000.0, "recorded step": 1160.0}
    spread = [-1000.0, 1000.0, -900.0, 900.0, -800.0, 800.0, -700.0, 0.0, 700.0, -800.0, 800.0, -900.0, 900.0,
              -1000.0, 1000.0]  # (as many as the block's rounds at a time; each time again, as noisy)
    everywhere = {"plain": spread, "unchecked": spread[::-1], "keeping": spread, "bare": spread,
                  "counted step": spread}

    timed: list[int] = []

    def costs(noise: dict[str, list[float]]) -> block_costs.MeasuredCosts:
        timed.clear()

        def timed_rounds(device, calls, rounds, kernels_only=False):
            assert set(calls) <= set(base) and rounds == len(spread), set(calls) - set(base)
            timed.append(rounds)
            return {name: [base[name] + noise.get(name, [0.0] * rounds)[i] for i in range(rounds)] for name in calls}
        monkeypatch.setattr(clock, "timed_rounds", timed_rounds)
        return block_costs.selective_overhead_for_plan(
            model, p.problem, p.wrapped, torch.device("cpu"), True, lambda: model(tokens),
            lambda region, kept: saved_calls(p.traced.gm, region, kept))

    tiny_call = selective_overhead_ms(torch.device("cpu"))[1]
    noisy = costs(everywhere)
    assert sum(timed) == block_costs.MAX_BLOCK_ROUNDS > len(spread)
    assert noisy.keep_call_ms == pytest.approx(tiny_call)
    assert noisy.kept_node_ms == 0.0
    assert noisy.run_call_ms == pytest.approx(tiny_call) and noisy.recorded_call_ms == pytest.approx(tiny_call)
    assert noisy.saved_tensor_ms == pytest.approx(p.problem.saved_tensor_ms)
    agreed = costs({})
    assert timed == [len(spread)]
    assert agreed.keep_call_ms != pytest.approx(tiny_call) and agreed.kept_node_ms > 1.0
    assert agreed.run_call_ms != pytest.approx(tiny_call) and agreed.recorded_call_ms != pytest.approx(tiny_call)
    assert agreed.saved_tensor_ms > p.problem.saved_tensor_ms
    # The policy's rounds agree, counting's and recording's do not: those two are priced at the
    # policy's cost per call in the block (a dispatch mode's work per call, as theirs), not at
    # the tiny modules'.
    runs_noisy = costs({"counted": spread, "counted step": spread})
    assert runs_noisy.keep_call_ms == pytest.approx(agreed.keep_call_ms) != pytest.approx(tiny_call)
    assert runs_noisy.run_call_ms == pytest.approx(agreed.keep_call_ms) != pytest.approx(agreed.run_call_ms)
    assert runs_noisy.recorded_call_ms == pytest.approx(agreed.keep_call_ms) != pytest.approx(agreed.recorded_call_ms)


def test_sandwiched_rounds_difference_each_call_from_its_two_neighbouring_baseline_runs():
    # A clock whose speed jumps between calls: each call's difference is against the baseline
    # runs just before and after it, so a jump two calls away does not reach it.
    from planner.measure.clock import sandwiched_rounds

    log: list[str] = []
    baseline: list[float] = []  # (the baseline's times, as it returned them)
    speed = iter([1.0] * 3 + [1.0, 1.0, 1.0, 1.5, 1.5] + [2.0] * 5)  # (warm-up, round 0, round 1)

    def call(name: str, ms: float):
        def run() -> float:
            log.append(name)
            took = ms * next(speed)
            if name == "b" and len(log) > 3:  # (after the warm-up)
                baseline.append(took)
            return took
        return run

    differences = sandwiched_rounds({"b": call("b", 10.0), "x": call("x", 13.0), "y": call("y", 11.0)}, "b",
                                    2, after_round=lambda index: log.append(f"round {index}"))
    assert log == ["b", "x", "y", "b", "x", "b", "y", "b", "round 0", "b", "y", "b", "x", "b", "round 1"]
    assert baseline == [10.0, 10.0, 15.0, 20.0, 20.0, 20.0]
    assert differences == {"x": [3.0, 6.0], "y": [1.5 * 11.0 - 12.5, 2.0]}
