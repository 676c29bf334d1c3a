"""A saved plan applied before FSDP2 (`fully_shard` per block, then the root) or DDP trains
exactly like the unplanned model: 2 CPU ranks over gloo, each on its own half of the batch,
dropout on (the same seed before each forward in both runs), two steps with an SGD step between.

The parent plans once (measured, small models) and saves the plan; each rank builds two models
from the same seed, applies the saved plan to one (`load_plan(path).apply(model)`), wraps both
the same way and trains them side by side. The ranks send back losses, full gradients and which
submodules ran in backward (recomputation); the parent compares planned against unplanned.
The harness is tests/distributed_ranks.py; plans of runs and slices: test_distributed_runs.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed_ranks import WORLD, build, check, plan_on_one_thread, spawn, warned

import planner
from planner.api import GIB
from solvers import InfeasibleBudget

pytestmark = pytest.mark.slow

MODELS = ("gpt", "gpt2")


@pytest.fixture(scope="module", params=MODELS)
def saved_plan(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Plan the model once under a tight budget (measured here) and save the plan."""
    name = request.param
    model, sample = build(name)
    p = plan_on_one_thread(model, sample)  # (as each rank runs)
    static = p.problem.static_bytes
    p = p.replan(budget_gb=(static + 0.6 * (p.baseline_peak_bytes - static)) / GIB)
    assert p.checkpoints
    assert p.module_checkpoints  # raises RuntimeError where a region is not a submodule call
    path = p.save(tmp_path_factory.mktemp(f"plan_{name}") / "plan.json")
    return name, Path(path)


def test_fsdp2_planned_matches_unplanned(saved_plan, tmp_path):
    name, path = saved_plan
    results = spawn("fsdp2", name, path, tmp_path / "ranks")
    check(results)
    assert any(cls.startswith("FSDP") for cls in results[0]["planned_class"])  # fully_shard swapped the class


def test_ddp_planned_matches_unplanned(saved_plan, tmp_path):
    name, path = saved_plan
    check(spawn("ddp", name, path, tmp_path / "ranks"))


@pytest.fixture(scope="module")
def saved_keep_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every block of the small GPT checkpointed, keeping every node its recomputation reaches
    but the block's layer norms and activation (a selective policy: its linears, attention,
    residual adds), as a hand-written plan; saved, so each rank applies the saved calls to keep."""
    model, sample = build("gpt")
    p = plan_on_one_thread(model, sample, selective=True)  # (as each rank runs)
    blocks = [f"blocks.{i}" for i in range(len(model.blocks))]
    plain = p.with_submodules(blocks)
    recomputed = ("norm", "act", "gelu")
    kept = [p.problem.nodes[i].name for region in plain.solution.regions for i in p.problem.keepable_in(region)
            if not any(part in p.problem.nodes[i].name for part in recomputed)]
    keeping = p.with_submodules(blocks, kept=kept)
    per_block = len(kept) // len(blocks)
    assert len(keeping.solution.kept) == len(kept) == per_block * len(blocks) and per_block > 4
    # (one call per kept node or more: attention's written-out softmax makes several)
    assert all(len(spec.saved_calls) >= per_block for spec in keeping.module_checkpoints), [
        (len(spec.saved_calls), per_block) for spec in keeping.module_checkpoints]
    return Path(keeping.save(tmp_path_factory.mktemp("keep_plan") / "plan.json"))


def test_fsdp2_keep_plan_matches_unplanned(saved_keep_plan, tmp_path):
    assert all(len(spec.saved_calls) > 4 for spec in planner.load_plan(saved_keep_plan).module_checkpoints)
    results = spawn("fsdp2_warned", "gpt", saved_keep_plan, tmp_path / "ranks")
    check(results)
    assert warned(results, "keeps less than planned") == [[]] * WORLD


def test_every_rank_calling_plan_gets_rank_zeros_plan_and_trains_like_unplanned(tmp_path):
    # The user's call on every rank of an FSDP2 job, at 60% of the model's unplanned peak: rank 0
    # measures and plans, rank 1 receives the same plan (timings differ between processes; ranks
    # that recompute different submodules could issue their collectives in different orders).
    model, sample = build("gpt")
    p = plan_on_one_thread(model, sample)
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"budget_gb": 0.6 * p.baseline_peak_bytes / GIB}))
    results = spawn("fsdp2_planning", "gpt", budget, tmp_path / "ranks")
    assert results[0]["plan"] and results[0]["plan"] == results[1]["plan"]
    assert results[0]["measured_here"] and not results[1]["measured_here"]  # rank 1 measured nothing
    check(results)


def test_fsdp2_mixed_precision_plan_matches_unplanned(tmp_path):
    # Planned for FSDP2's MixedPrecisionPolicy(param_dtype=torch.bfloat16) (activations in
    # bfloat16: half the float32 plan's), applied, and trained under that policy beside the
    # unplanned model under it: the same losses and gradients on every rank.
    model, sample = build("gpt")
    p = plan_on_one_thread(model, sample, param_dtype=torch.bfloat16, world_size=WORLD)
    static = p.problem.static_bytes
    p = p.replan(budget_gb=(static + 0.6 * (p.baseline_peak_bytes - static)) / GIB)
    assert p.checkpoints and p.record.planned_for["param_dtype"] == "bfloat16"
    results = spawn("fsdp2_mixed", "gpt", Path(p.save(tmp_path / "plan.json")), tmp_path / "ranks")
    check(results)


@pytest.mark.parametrize("name, param_dtype", [("gpt2", None), ("gpt2", torch.bfloat16), ("gpt", torch.bfloat16)],
                         ids=["gpt2-float32", "gpt2-mixed", "gpt-mixed"])
def test_fsdp2_ranks_peak_under_the_plans_prediction(name, param_dtype, tmp_path):
    # The user's call for FSDP2 over 2 ranks halfway from the smallest budget that fits to the
    # unplanned peak; the plan applied, the model sharded, and each rank's peak measured (its
    # shards and sample, and the step's allocations: unsharded parameters and gradients,
    # reduce-scatter buffers, activations) is at most the prediction; the largest within 20% of it
    # (gloo's work may or may not still hold a block's all-gather output: a tenth of this peak).
    # The built-in GPT passes its float32 mask to every block, which FSDP2 casts for each.
    model, sample = build(name)
    p = plan_on_one_thread(model, sample, world_size=WORLD, param_dtype=param_dtype)
    with pytest.raises(InfeasibleBudget) as smallest:
        p.replan(budget_gb=1e-6)
    p = plan_on_one_thread(model, sample, world_size=WORLD, param_dtype=param_dtype,
                           budget_gb=(smallest.value.minimum_bytes + p.baseline_peak_bytes) / 2 / GIB)
    assert p.checkpoints
    results = spawn("fsdp2_memory", name, Path(p.save(tmp_path / "plan.json")), tmp_path / "ranks")
    peaks = [result["peak"] for result in results]
    assert max(peaks) <= p.predicted_peak_bytes, (peaks, p.predicted_peak_bytes)
    assert max(peaks) >= 0.8 * p.predicted_peak_bytes, (peaks, p.predicted_peak_bytes)
