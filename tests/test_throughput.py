"""Throughput mode (`planner.plan_throughput`): the batch size and the plan chosen together by
samples per second within the budget; a batch no plan fits is reported, never chosen."""
import copy

import pytest
import torch

from planner import plan_throughput
from planner.api import GIB
from planner.examples import TinyGPT
from planner.measure.steps import steady_peak
from planner.throughput.search import StepTimes, fit_line


def _gpt():
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, width=32, heads=4, blocks=4, context=64, dropout=0.0).train()
    return model, lambda batch: torch.randint(0, 128, (batch, 64), generator=torch.Generator().manual_seed(batch))


@pytest.fixture(scope="module")
def chosen():
    model, sample_for = _gpt()
    budget = 0.6 * steady_peak(model, sample_for(8), torch.device("cpu"))
    return model, sample_for, budget, plan_throughput(model, sample_for, budget / GIB, [2, 4, 8, 64],
                                                      optimizer="adamw")


def test_a_batch_no_plan_fits_is_reported_and_not_chosen(chosen):
    model, _, budget, tp = chosen
    rows = {row.batch: row for row in tp.table}
    assert rows[64].peak_bytes is None and "smallest budget a plan fits" in rows[64].why
    assert tp.batch_size != 64 and rows[tp.batch_size].peak_bytes <= budget
    assert tp.plan.predicted_peak_bytes <= budget and tp.plan.verified  # its own step ran within the budget
    assert rows[tp.batch_size].measured_samples_per_s is not None  # the chosen batch was timed
    assert "cannot fit" in str(tp) and "<- chosen" in str(tp)


def test_the_chosen_plan_applies_and_trains_like_the_original(chosen):
    model, sample_for, _, tp = chosen
    sample = sample_for(tp.batch_size)
    planned = tp.apply(copy.deepcopy(model))
    for module in (model, planned):
        module.zero_grad(set_to_none=True)
        module(sample).float().pow(2).mean().backward()
    for (name, a), b in zip(model.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_sample_for_that_does_not_scale_the_batch_is_refused():
    model, _ = _gpt()
    with pytest.raises(ValueError, match="first dimension must be the batch"):
        plan_throughput(model, lambda batch: torch.zeros(4, 64, dtype=torch.long), 1.0, [2, 4])


def test_a_global_batch_keeps_the_samples_per_step_through_accumulation(chosen):
    model, sample_for, budget, _ = chosen
    tp = plan_throughput(model, sample_for, budget / GIB, [2, 3, 4], global_batch=8, optimizer="adamw")
    rows = {row.batch: row for row in tp.table}
    assert "does not divide the global batch" in rows[3].why
    assert rows[2].accumulation == 4 and rows[4].accumulation == 2
    assert tp.batch_size in (2, 4)


def test_step_time_is_fitted_as_a_line_in_the_batch():
    assert fit_line([(2, 10.0), (4, 18.0)]) == (2.0, 4.0)
    intercept, slope = fit_line([(1, 5.0), (2, 7.0), (4, 11.0)])
    assert intercept == pytest.approx(3.0) and slope == pytest.approx(2.0)
    assert fit_line([(4, 8.0)]) == (0.0, 2.0)


def test_step_time_is_as_measured_where_timed_and_on_lines_between_and_beyond():
    # Timed steps that are not one line: 10 ms at batch 2, 30 at 4, 40 at 8; fitted slope 4.
    times = StepTimes(intercept_ms=5.0, per_sample_ms=4.0, optimizer_ms=0.0,
                      measured=((2, 10.0), (4, 30.0), (8, 40.0)))
    assert [times.step_ms(b) for b in (2, 4, 8)] == [10.0, 30.0, 40.0]
    assert times.step_ms(3) == pytest.approx(20.0) and times.step_ms(6) == pytest.approx(35.0)
    assert times.step_ms(16) == pytest.approx(40.0 + 4.0 * 8) and times.step_ms(1) == pytest.approx(6.0)


def test_where_no_candidate_fits_the_refusal_names_the_smallest_batch_s_minimum():
    from planner import InfeasibleBudget, plan

    model, sample_for = _gpt()
    with pytest.raises(InfeasibleBudget) as refused:
        plan_throughput(model, sample_for, 1e-4, [2, 4], optimizer="adamw")
    with pytest.raises(InfeasibleBudget) as alone:
        plan(model, sample_for(2), budget_gb=1e-4, optimizer="adamw", measure="no-run")
    # (sizes on fake tensors at batch 2, as plan_throughput sizes every batch but its reference)
    assert refused.value.minimum_bytes == pytest.approx(alone.value.minimum_bytes, rel=0.01)
