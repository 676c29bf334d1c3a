"""Keeping outputs inside a region (selective activation checkpointing), end to end: which
nodes a region may keep, the policy that keeps them in the model's own forward, what it saves
in memory and time, and its survival through torch.compile, other shapes and save/load.
(FSDP2 with a keep plan: tests/test_distributed.py; Hugging Face models: tests/test_keep_hf.py; the
model and helpers: tests/keep_models.py.)"""
from __future__ import annotations

import copy
import json
import logging
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import train_step
from keep_models import (
    BLOCK_NAMES,
    BLOCKS,
    KEPT_LINEARS,
    LINEARS,
    assert_same_step,
    backward_calls,
    build,
    recomputed_ms,
    selective,
)
from torch import nn

from planner import Plan, load_plan, plan
from planner.apply.policy import KeepPolicy
from planner.measure.holds import KEEPABLE_OPS, eager_holds


@pytest.fixture(scope="module")
def measured() -> tuple[nn.Module, torch.Tensor, Plan]:
    model, tokens = build()
    return model, tokens, plan(model, tokens, budget_gb=80, repeats=1, selective=True)

# -- which nodes are keepable --------------------------------------------------------------------

def test_what_is_keepable_and_where(measured):
    _, _, p = measured
    nodes = {node.name: node for node in p.problem.nodes}
    keepable = {name for name, node in nodes.items() if node.keepable}
    # matrix products and attention, in any region (their calls match in every submodule call)
    heavy = {f"blocks_{i}_{name}" for i in range(BLOCKS) for name in LINEARS}
    # the written-out attention's two matmuls (blocks 0, 2) and the fused kernel (blocks 1, 3)
    heavy |= {"matmul", "matmul_1", "matmul_2", "matmul_3", "scaled_dot_product_attention",
              "scaled_dot_product_attention_1"}
    assert heavy <= keepable and all(nodes[name].keep_span is None for name in heavy)
    # other deterministic storage-making nodes, within the submodule calls whose calls match
    from planner.trace.structure import compute_nodes, module_calls

    calls = {(call.nodes.start, call.nodes.stop) for call in module_calls(p.traced.gm)}
    index = {name: i for i, name in enumerate(nodes)}
    for name in ("blocks_0_norm1", "blocks_0_act", "softmax", "add", "truediv"):
        assert name in keepable and nodes[name].keep_span in calls, name
        start, stop = nodes[name].keep_span
        assert start <= index[name] < stop
    # random (dropout) and storage-less (reshape) nodes never
    for name in ("blocks_0_attention_dropout", "blocks_1_dropout", "reshape"):
        assert name not in keepable, name
    # each keepable node's cached calls are the ones that make its storages
    from planner.measure.profile import META_KEY

    for node in compute_nodes(p.traced.gm):
        record = node.meta[META_KEY]
        assert bool(record.keep_calls) == (node.name in keepable), node.name
        if node.name in heavy:
            assert all(record.aten_calls[i] in KEEPABLE_OPS for i in record.keep_calls)


def test_an_output_written_in_place_later_is_not_keepable():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 16))
    p = plan(model, torch.randn(8, 16), budget_gb=80, repeats=1, selective=True)
    keepable = {node.name: node.keepable for node in p.problem.nodes}
    assert keepable == {"_0": False, "_1": False, "_2": True}


def test_without_running_the_calls_are_recorded_on_fake_tensors_as_on_real_ones():
    model, tokens = build()
    ran = plan(model, tokens, budget_gb=80, repeats=1, selective=True)
    predicted = plan(model, tokens, budget_gb=80, repeats=1, selective=True, measure="no-run")
    assert [node.keepable for node in predicted.problem.nodes] == [node.keepable for node in ran.problem.nodes]
    assert any(node.keepable for node in predicted.problem.nodes)
    assert predicted.problem.run_spans == ran.problem.run_spans
    assert [node.holds for node in predicted.problem.nodes] == [node.holds for node in ran.problem.nodes]


def test_nothing_is_keepable_where_the_calls_are_not_recorded(caplog, monkeypatch):
    import planner.measure.paths

    def fails(*args, **kwargs):
        raise RuntimeError("data-dependent control flow")

    monkeypatch.setattr(planner.measure.paths, "fake_eager_holds", fails)
    model, tokens = build()
    with caplog.at_level(logging.INFO, logger="planner"):
        p = plan(model, tokens, budget_gb=80, repeats=1, selective=True, measure="no-run")
    assert not any(node.keepable for node in p.problem.nodes)
    assert "no region may keep a node's output" in caplog.text
    assert "data-dependent control flow" in caplog.text
    with pytest.raises(ValueError, match="cannot keep 'blocks_0_fc1'.*may keep none"):
        p.with_submodules(["blocks.0"], kept=["blocks_0_fc1"])


def test_calls_are_found_per_region_where_the_whole_runs_differ(caplog):
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    gm = torch.fx.symbolic_trace(model)
    same = eager_holds(gm, [x], lambda: model(x))
    assert same.calls["_0"].keepable and same.calls["_2"].keepable
    # A call of the model's own outside every region (a loss, a check on values): the other
    # calls are matched around it, lifetimes as without it, and each region still makes the
    # graph's matrix products, at the same occurrences.
    extra = eager_holds(gm, [x], lambda: model(x) + 1)
    assert same.arguments and (extra.holds, extra.arguments) == (same.holds, same.arguments)
    assert extra.calls == same.calls
    # Work the graph does that the model's forward does not: no lifetimes.
    fewer = eager_holds(gm, [x], lambda: model[2](model[1](x)))
    assert fewer.holds == {} and fewer.arguments == {}
    # A region that makes other matrix products, or that the model calls twice, keeps nothing.
    changed = copy.deepcopy(model)  # the graph runs the traced model's modules
    changed[2].forward = lambda h: F.linear(F.linear(h, model[2].weight), model[2].weight, model[2].bias)
    with caplog.at_level(logging.INFO, logger="planner.measure.holds"):
        other = eager_holds(gm, [x], lambda: changed(x))
    assert other.calls["_0"].keepable and not other.calls["_2"].keepable
    assert other.calls["_2"].names == same.calls["_2"].names  # the graph run's, for counting occurrences
    assert "2 (keepable call 0 is aten.mm.default in the model, aten.addmm.default in the graph)" in caplog.text
    with caplog.at_level(logging.INFO, logger="planner.measure.holds"):
        twice = eager_holds(gm, [x], lambda: (model[0](x), model(x)))
    assert not twice.calls["_0"].keepable and twice.calls["_2"].keepable
    assert "0 (called 2 times in the model's forward, once in the graph)" in caplog.text


def test_with_submodules_names_what_it_cannot_keep(measured):
    _, _, p = measured
    with pytest.raises(ValueError, match="cannot keep 'blocks_0_dropout': it is not a node its region may keep"):
        p.with_submodules(["blocks.0"], kept=["blocks_0_dropout"])
    with pytest.raises(ValueError, match="cannot keep 'blocks_1_fc1': it lies in none of the checkpointed"):
        p.with_submodules(["blocks.0"], kept=["blocks_1_fc1"])
    with pytest.raises(ValueError, match="cannot keep 'nothing': it is not a node of the graph"):
        p.with_submodules(["blocks.0"], kept=["nothing"])
    with pytest.raises(TypeError, match="list of node names"):
        p.with_submodules(["blocks.0"], kept="blocks_0_fc1")


# -- the plan in the model's own forward --------------------------------------------------------

def test_saved_calls_name_each_kept_call_by_occurrence(measured):
    _, _, p = measured
    q = selective(p, ["blocks_0_attention_proj", "matmul_1", "blocks_1_fc1", "scaled_dot_product_attention"])
    specs = {spec.module: spec.saved_calls for spec in q.module_checkpoints}
    # block 0: qkv, proj, fc1, fc2 are its addmm calls 0..3; its matmuls its bmm calls 0 and 1
    assert specs["blocks.0"] == (("aten.bmm.default", 1), ("aten.addmm.default", 1))
    assert specs["blocks.1"] == (("aten._scaled_dot_product_flash_attention_for_cpu.default", 0),
                                 ("aten.addmm.default", 2))
    assert specs["blocks.2"] == specs["blocks.3"] == ()
    assert all(spec.saved_calls == () for spec in p.with_submodules(BLOCK_NAMES).module_checkpoints)
    report = str(q)
    assert "keeps matmul_1, blocks_0_attention_proj" in report
    assert "keeps scaled_dot_product_attention, blocks_1_fc1" in report


def test_a_selective_plan_matches_the_model_and_its_predicted_peak(measured):
    model, tokens, p = measured
    plain, keeping = p.with_submodules(BLOCK_NAMES), selective(p)
    # Recomputation skips the kept nodes (the policy's own cost may outweigh that on tiny models).
    assert keeping.solution.kept and recomputed_ms(keeping) < recomputed_ms(plain)
    assert keeping.predicted_peak_bytes > plain.predicted_peak_bytes  # keeping costs memory
    assert_same_step(model, keeping.module(), tokens)
    check = keeping.verify(steps=1)
    assert check.outputs_match and check.gradients_match
    assert abs(check.peak_error) <= 0.03, check
    assert check.within_budget, check


def test_a_plan_keeping_every_candidate_matches_too(measured):
    model, tokens, p = measured
    every = [p.problem.nodes[i].name for region in p.with_submodules(BLOCK_NAMES).solution.regions
             for i in p.problem.keepable_in(region)]
    assert "scaled_dot_product_attention" in every and "matmul" in every
    keeping = selective(p, every)
    assert recomputed_ms(keeping) < recomputed_ms(selective(p))
    check = keeping.verify(steps=1)
    assert check.outputs_match and check.gradients_match
    assert abs(check.peak_error) <= 0.03, check


def test_convolutions_kept_beside_batchnorm_statistics():
    # The region writes BatchNorm statistics (put back after recomputation) and keeps convolutions.
    from conftest import small_cnn

    model, images = small_cnn()
    reference, _ = small_cnn()
    p = plan(model, images, budget_gb=80, repeats=1, selective=True)
    stages = [f"stages.{i}" for i in range(len(model.stages))]
    convolutions = [node.name for node in p.problem.nodes if node.keepable and node.name.startswith("stages_")]
    assert len(convolutions) == 2 * len(stages)
    keeping = p.with_submodules(stages, kept=convolutions)
    assert all(spec.written_buffers and spec.saved_calls for spec in keeping.module_checkpoints)
    planned = keeping.module()
    assert_same_step(reference, planned, images)
    for (key, expected), got in zip(reference.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(got, expected, msg=key)
    assert backward_calls(planned, images)["aten.convolution.default"] == 0


def test_kept_calls_are_not_run_again_in_backward(measured):
    model, tokens, p = measured
    plain = backward_calls(p.with_submodules(BLOCK_NAMES).module(), tokens)
    keeping = backward_calls(selective(p).module(), tokens)
    # Linear's backward uses mm, never addmm: every addmm in backward is a recomputed linear.
    assert plain["aten.addmm.default"] == len(KEPT_LINEARS)
    assert keeping["aten.addmm.default"] == 0
    # what is not kept is still recomputed
    assert keeping["aten.native_layer_norm.default"] == plain["aten.native_layer_norm.default"] > 0
    assert keeping["aten._scaled_dot_product_flash_attention_for_cpu.default"] == 2


def test_the_policy_counts_each_func_in_forward_and_recomputation_apart():
    class Context:
        def __init__(self, is_recompute: bool):
            self.is_recompute = is_recompute

    addmm, mm = torch.ops.aten.addmm.default, torch.ops.aten.mm.default
    policy = KeepPolicy((("aten.addmm.default", 1),))
    forward = [policy(Context(False), func).name for func in (addmm, mm, addmm, addmm)]
    assert forward == ["PREFER_RECOMPUTE", "PREFER_RECOMPUTE", "MUST_SAVE", "PREFER_RECOMPUTE"]
    assert [policy(Context(True), func).name for func in (addmm, addmm)] == ["PREFER_RECOMPUTE", "MUST_SAVE"]
    assert policy.missed() == [] and KeepPolicy((("aten.mm.default", 1),)).missed() == [("aten.mm.default", 1)]


def test_other_batch_sizes_and_lengths_keep_too(measured):
    model, _, p = measured
    planned = selective(p).module()
    for shape in ((3, 40), (1, 64), (8, 16)):
        tokens = torch.randint(0, 128, shape)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no missed keep, no larger-than-planned input
            assert_same_step(model, planned, tokens)
        assert backward_calls(planned, tokens)["aten.addmm.default"] == 0


def test_calls_that_differ_at_apply_time_warn_once_and_still_train(measured):
    _, tokens, p = measured
    planned = selective(p).module()
    # A forward that skips the MLP makes two addmm calls fewer than the plan keeps.
    for block in planned.blocks:
        block.__dict__["forward"].previous = lambda x, block=block: x + block.attention(block.norm1(x))
    with pytest.warns(UserWarning, match="made no call aten.addmm.default number 3 to keep") as caught:
        for _ in range(2):
            planned(tokens).sum().backward()
    assert sum("keeps less than planned" in str(w.message) for w in caught) == BLOCKS  # once per block


@pytest.mark.slow
def test_torch_compile_of_a_selective_plan_trains_like_eager():
    model, tokens = build(dropout=0.0)
    tokens = tokens[:4, :32]
    # Without dropout each block's recomputation stops before fc2 makes its output: not kept.
    p = selective(plan(model, tokens, budget_gb=80, repeats=1, selective=True), [n for n in KEPT_LINEARS if not n.endswith("fc2")])
    expected_output, expected = train_step(model, tokens)
    compiled = torch.compile(p.module())  # (inductor, the default: the other tests' COMPILE_BACKEND stops short of it)
    output, grads = train_step(compiled, tokens)
    torch.testing.assert_close(output, expected_output, rtol=1e-4, atol=1e-5)
    for key, value in expected.items():
        torch.testing.assert_close(grads[f"_orig_mod.{key}"], value, rtol=1e-4, atol=1e-5, msg=key)


def test_the_memory_plot_draws_the_kept_nodes(measured, tmp_path, monkeypatch):
    import planner.report.plot
    from planner.report.plot import timelines

    _, _, p = measured
    keeping = selective(p)
    regions, kept = keeping.solution.regions, keeping.solution.kept
    _, planned = timelines(p.problem, regions, kept)
    assert planned.peak_bytes == keeping.predicted_peak_bytes > timelines(p.problem, regions)[1].peak_bytes
    pytest.importorskip("matplotlib")
    assert keeping.plot(tmp_path / "drawn.png").read_bytes().startswith(b"\x89PNG")
    drawn: list[Any] = []
    monkeypatch.setattr(planner.report.plot, "plot_memory", lambda *args, **kwargs: drawn.append(kwargs["kept"]))
    keeping.plot(tmp_path / "plan.png")
    load_plan(keeping.save(tmp_path / "plan.json")).plot(tmp_path / "saved.png")
    assert drawn == [kept, kept]


# -- save and load -------------------------------------------------------------------------------

def test_save_and_load_keep_the_kept_nodes_and_their_calls(measured, tmp_path):
    model, tokens, p = measured
    keeping = selective(p, KEPT_LINEARS + ["scaled_dot_product_attention"])
    path = keeping.save(tmp_path / "plan.json")
    saved = load_plan(path)
    assert saved.solution.kept == keeping.solution.kept
    assert saved.module_checkpoints == keeping.module_checkpoints
    assert saved.recompute_ms == pytest.approx(keeping.recompute_ms)
    assert [c.kept for c in saved.checkpoints] == [c.kept for c in keeping.checkpoints]
    assert "keeps blocks_0_attention_qkv" in str(saved)
    fresh, _ = build()
    saved.apply(fresh)
    assert backward_calls(fresh, tokens)["aten.addmm.default"] == 0
    assert_same_step(model, fresh, tokens)

    # a plan saved before keeps existed loads as keeping nothing
    document = json.loads(path.read_text())
    for region in document["regions"]:
        region.pop("kept", None)
        region.pop("saved_calls", None)
    for node in document["nodes"]:
        node["cost"].pop("keepable", None)
        for key in ("aten_calls", "keep_calls"):
            node["profile"].pop(key, None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(document))
    loaded = load_plan(old)
    assert loaded.solution.kept == () and all(spec.saved_calls == () for spec in loaded.module_checkpoints)
    assert loaded.recompute_ms == pytest.approx(p.with_submodules(BLOCK_NAMES).recompute_ms)

