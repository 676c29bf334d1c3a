"""Regions of consecutive children of an `nn.Sequential` (`planner.problem.segments`): one checkpoint
call around them in the Sequential's own loop, trained like the model (gradients, BatchNorm
statistics), saved and applied again, and under torch.compile."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
from conftest import COMPILE_BACKEND, assert_trains_like, cnn_step, small_cnn_plan
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner import load_plan, plan, remove_plan
from planner.apply.checkpoints import CheckpointedForward
from planner.apply.sequential import run_segments
from planner.problem.segments import plain_sequential


def test_run_segments_is_the_sequentials_forward():
    torch.manual_seed(0)
    stack = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    seen = []

    def checkpointed(run, segment, value):
        seen.append(segment[:2])
        return checkpoint(run, value, use_reentrant=False)

    assert torch.equal(run_segments(stack, x, ((0, 2, False), (3, 5, False)), checkpointed), stack(x))
    assert seen == [(0, 2), (3, 5)]


def test_only_nn_sequentials_own_forward_is_cut_in_slices():
    class Residual(nn.Sequential):
        def forward(self, x):
            return x + super().forward(x)

    patched = nn.Sequential(nn.ReLU(), nn.ReLU(), nn.ReLU())
    patched.forward = lambda x: x
    assert plain_sequential(nn.Sequential(nn.ReLU()))
    assert not plain_sequential(Residual(nn.ReLU())) and not plain_sequential(patched)


def test_slices_of_a_stages_children_train_like_the_model_and_free_what_was_predicted():
    # A CNN stage is an nn.Sequential of conv, BatchNorm, ReLU, conv, BatchNorm: its children
    # from the first BatchNorm through the second conv are one region, a checkpoint call in the
    # stage's loop that keeps nothing; a step updates BatchNorm's statistics once.
    model, images, p = small_cnn_plan()
    problem = p.problem
    stages = [region for region, spec in p.wrapped.items() if spec.module.startswith("stages.") and
              spec.module.count(".") == 1 and not spec.segments]
    assert len(stages) == 3
    assert problem.segment_regions and not set(stages) & set(problem.run_spans)
    assert all(problem.keepable_in(region) == [] for region in problem.segment_regions)
    sliced = p.with_regions([(f"stages_{i}_1", f"stages_{i}_3") for i in range(3)])
    assert [(spec.module, spec.segments, spec.runs) for spec in sliced.module_checkpoints] == [
        (f"stages.{i}", ((1, 4, False),), ()) for i in range(3)]
    assert sliced.recompute_ms == pytest.approx(sum(problem.region_cost_ms(r) for r in sliced.solution.regions))
    assert all(problem.run_ms(r) == 0 for r in sliced.solution.regions)
    planned = sliced.module()
    assert inspect.signature(planned.stages[0].forward) == inspect.signature(model.stages[0].forward)
    assert_trains_like(planned, model, images)
    record = sliced.verify(steps=2)
    assert record.gradients_match and abs(record.peak_error) <= 0.01, str(record)


def test_two_slices_of_one_sequential_share_its_forward_and_survive_save_and_load(tmp_path):
    model, images, p = small_cnn_plan()
    sliced = p.with_regions([("stages_0_0", "stages_0_1"), ("stages_0_3", "stages_0_4")])
    assert [(spec.module, spec.segments) for spec in sliced.module_checkpoints] == [("stages.0", ((0, 2, False), (3, 5, False)))]
    assert sliced.module_checkpoints[0].written_buffers == tuple(sorted(
        f"{child}.{name}" for child in (1, 4) for name in ("num_batches_tracked", "running_mean", "running_var")))
    assert "stages.0.0 .. stages.0.1" in str(sliced)
    sliced.save(tmp_path / "plan.json")
    fresh = copy.deepcopy(model)
    load_plan(tmp_path / "plan.json").apply(fresh)
    assert_trains_like(fresh, model, images)
    # a stage whose forward something else replaced is refused before anything changes
    patched = copy.deepcopy(model)
    patched.stages[0].forward = lambda x: x
    with pytest.raises(ValueError, match="cannot be checkpointed in slices"):
        load_plan(tmp_path / "plan.json").apply(patched)
    assert not any("_checkpoint_plan" in module.__dict__ for module in patched.modules())


@pytest.mark.slow
def test_torch_compile_of_a_plan_with_slices_trains_like_eager():
    # Under torch.compile BatchNorm's buffer writes apply once: gradients and statistics are the
    # eager unplanned step's, up to the rounding compiled kernels change.
    model, images, p = small_cnn_plan()
    planned = p.with_regions([(f"stages_{i}_1", f"stages_{i}_3") for i in range(3)]).module()
    grads, buffers = cnn_step(copy.deepcopy(model), images)
    compiled_grads, compiled_buffers = cnn_step(torch.compile(planned, backend=COMPILE_BACKEND), images)
    for got, want in zip(compiled_grads + compiled_buffers, grads + buffers):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _stack(dropout: float) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(32, 256), nn.BatchNorm1d(256), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.GELU(), nn.Dropout(dropout)] if dropout else [nn.Linear(256, 256), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(256, 4)).train()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_model_that_is_itself_a_sequential_is_planned_in_slices_of_its_children(dropout, tmp_path):
    # Its forward is nn.Sequential's loop, with no nodes of its own: the default call below its
    # unplanned peak checkpoints slices of its children there (it used to find no region at all).
    torch.manual_seed(0)
    model = _stack(dropout)
    x = torch.randn(64, 32)
    unplanned = plan(model, x, budget_gb=80, repeats=1)
    static = sum(unplanned.static_breakdown.values())
    budget = static + 0.7 * (unplanned.baseline_peak_bytes - static)
    p = plan(model, x, budget_gb=budget / 2**30)
    assert p.checkpoints and all(spec.module == "" and spec.segments for spec in p.module_checkpoints)
    assert p.verified and p.predicted_peak_bytes <= budget
    record = p.verify(steps=2)
    assert record.gradients_match and record.planned_peak_bytes <= budget, str(record)
    if not dropout:  # (bit for bit, BatchNorm's statistics too: dropout draws differ between the two models)
        assert_trains_like(p.module(), model, x)
    p.save(tmp_path / "plan.json")
    fresh = copy.deepcopy(model)
    load_plan(tmp_path / "plan.json").apply(fresh)
    assert isinstance(fresh.__dict__["forward"], CheckpointedForward)
    remove_plan(fresh)
    assert "forward" not in fresh.__dict__ and plain_sequential(fresh)
