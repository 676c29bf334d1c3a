"""Saved plans whose regions are not whole submodule calls, applied before FSDP2 on 2 CPU
ranks (the harness: tests/distributed_ranks.py), train exactly like the unplanned model: runs
recomputed alone inside the small GPT's blocks, runs in the CNN's own forward across the stages
FSDP2 shards, and slices of those stages' children."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed_ranks import STEPS, WORLD, build, plan_on_one_thread, spawn, warned

import planner

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved_run_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """In every block of the small GPT, the second norm and the MLP's first linear and
    activation recomputed alone (runs inside the block, `planner.apply.runs`); saved."""
    model, sample = build("gpt")
    p = plan_on_one_thread(model, sample, measure="run")  # (as each rank runs)
    runs = p.with_regions([(f"blocks_{i}_norm2", f"blocks_{i}_mlp_1") for i in range(len(model.blocks))])
    assert all(len(spec.runs) == 1 for spec in runs.module_checkpoints)
    return Path(runs.save(tmp_path_factory.mktemp("run_plan") / "plan.json"))


def test_fsdp2_plan_with_runs_inside_blocks_matches_unplanned(saved_run_plan, tmp_path):
    results = spawn("fsdp2_warned", "gpt", saved_run_plan, tmp_path / "ranks")
    assert warned(results, "other ATen calls") == [[]] * WORLD
    for rank, result in enumerate(results):
        assert result["planned_checkpointed"] == result["planned_modules"]
        planned, reference = result["planned"], result["reference"]
        for step in range(STEPS):
            # (the runs replay ATen calls, not submodules: nothing runs again in backward)
            assert planned["backward_calls"][step] == reference["backward_calls"][step] == {}
            torch.testing.assert_close(planned["loss"][step], reference["loss"][step])
            for key, grad in reference["grads"][step].items():
                torch.testing.assert_close(planned["grads"][step][key], grad, msg=f"rank {rank} step {step} {key}")
        assert all(count > 0 for count in result["dropped"].values()), result["dropped"]


@pytest.fixture(scope="module")
def saved_cross_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """In the CNN, runs from each stage's last BatchNorm through the model's residual add and
    ReLU to the next stage's first convolution: runs in the model's own forward, across the
    stages that FSDP2 shards (its all-gather and reshard hooks run inside the recording)."""
    model, sample = build("cnn")
    p = planner.plan(model, sample, budget_gb=80, repeats=1)
    runs = p.with_regions([("stages_0_4", "stages_1_0"), ("stages_1_4", "stages_2_0")])
    assert [(spec.module, len(spec.runs)) for spec in runs.module_checkpoints] == [("", 2)]
    return Path(runs.save(tmp_path_factory.mktemp("cross_plan") / "plan.json"))


def test_fsdp2_plan_with_runs_across_sharded_stages_matches_unplanned(saved_cross_plan, tmp_path):
    results = spawn("fsdp2_warned", "cnn", saved_cross_plan, tmp_path / "ranks")
    assert warned(results, "other ATen calls") == [[]] * WORLD
    for rank, result in enumerate(results):
        assert result["planned_checkpointed"] == list(dict.fromkeys(result["planned_modules"])) == [""]
        planned, reference = result["planned"], result["reference"]
        for step in range(STEPS):
            torch.testing.assert_close(planned["loss"][step], reference["loss"][step])
            for key, grad in reference["grads"][step].items():
                torch.testing.assert_close(planned["grads"][step][key], grad, msg=f"rank {rank} step {step} {key}")
        assert result["dropped"][""] > 0, result["dropped"]


@pytest.fixture(scope="module")
def saved_slice_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """In the CNN, each stage's children from its first BatchNorm through its second
    convolution under one checkpoint call in the stage's loop (`planner.problem.segments`), in the
    stages that FSDP2 shards."""
    model, sample = build("cnn")
    p = planner.plan(model, sample, budget_gb=80, repeats=1)
    sliced = p.with_regions([(f"stages_{i}_1", f"stages_{i}_3") for i in range(len(model.stages))])
    assert all(spec.segments == ((1, 4, False),) for spec in sliced.module_checkpoints)
    return Path(sliced.save(tmp_path_factory.mktemp("slice_plan") / "plan.json"))


def test_fsdp2_plan_with_slices_of_sharded_stages_matches_unplanned(saved_slice_plan, tmp_path):
    results = spawn("fsdp2_warned", "cnn", saved_slice_plan, tmp_path / "ranks")
    stages = [f"stages.{i}" for i in range(3)]  # (build's CNN)
    for rank, result in enumerate(results):
        assert result["planned_checkpointed"] == stages
        planned, reference = result["planned"], result["reference"]
        for step in range(STEPS):
            # the slices' children run again in backward up to the last that saves (the ReLU: the
            # convolution after it saves its input, made by the ReLU), nothing else does
            assert planned["backward_calls"][step] == {f"{stage}.{child}": 1 for stage in stages for child in (1, 2)}
            assert reference["backward_calls"][step] == {}
            torch.testing.assert_close(planned["loss"][step], reference["loss"][step])
            for key, grad in reference["grads"][step].items():
                torch.testing.assert_close(planned["grads"][step][key], grad, msg=f"rank {rank} step {step} {key}")
