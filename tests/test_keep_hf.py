"""Keeping outputs inside Hugging Face blocks (selective checkpointing). torch.export traces
them, and its graph's ATen calls differ from the model's own forward (metadata asserts, dropped
no-op slices, ...): each block's matrix products and attention calls still match, so its nodes
are keepable, and the policy finds every planned call in the real forward."""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from keep_models import CallCounter
from models_hf import bert, gpt2, llama
from torch import nn

from planner import Plan, plan
from planner.api import GIB
from planner.core import training_loss
from planner.measure.holds import KEEPABLE_OPS
from planner.trace.structure import compute_nodes, module_calls, module_path

transformers = pytest.importorskip("transformers")


# The blocks' path prefix and the keepable nodes of each block: GPT-2's four Conv1D (addmm; its
# attention draws dropout, so it is not keepable), Llama's seven linears (mm: no bias) and its
# fused attention, BERT's six linears (its attention draws dropout too), and their norms,
# activations (GPT-2's written-out GELU: eight nodes), residual adds, Llama's rotary embedding.
CASES = {"gpt2": (gpt2, "transformer.h.", 17), "llama": (llama, "model.layers.", 34),
         "bert": (bert, "bert.encoder.layer.", 12)}


@pytest.fixture(scope="module", params=sorted(CASES))
def measured(request: pytest.FixtureRequest) -> tuple[nn.Module, dict[str, Any], Plan, list[str], int]:
    build, prefix, per_block = CASES[request.param]
    torch.manual_seed(0)
    model, sample = build()
    model.train()
    p = plan(model, sample, budget_gb=80, repeats=1, selective=True)
    blocks = [call.path for call in module_calls(p.traced.gm)
              if call.path.startswith(prefix) and call.path[len(prefix):].isdigit()]
    assert p.frontend == "torch.export" and len(blocks) == 2
    return model, sample, p, blocks, per_block


def step(module: nn.Module, sample: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    for parameter in module.parameters():
        parameter.grad = None
    torch.manual_seed(1)
    loss = training_loss(module(**sample))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    for parameter in module.parameters():
        parameter.grad = None
    return loss.detach(), grads


def backward_calls(module: nn.Module, sample: dict[str, Any]) -> Counter[str]:
    torch.manual_seed(1)
    loss = training_loss(module(**sample))
    with CallCounter() as counter:
        loss.backward()
    for parameter in module.parameters():
        parameter.grad = None
    return counter.calls


def test_each_block_has_keepable_nodes(measured):
    _, _, p, blocks, per_block = measured
    keepable = {node.name for node in p.problem.nodes if node.keepable}
    found: Counter[str] = Counter()
    for node in compute_nodes(p.traced.gm):
        path = module_path(node)
        for block in blocks:
            if node.name in keepable and (path == block or path.startswith(block + ".")):
                found[block] += 1
    assert dict(found) == {block: per_block for block in blocks}


def test_a_selective_plan_trains_like_the_model_and_skips_the_kept_calls(measured):
    model, sample, p, blocks, per_block = measured
    plain = p.with_submodules(blocks)
    every = [p.problem.nodes[i].name for region in plain.solution.regions for i in p.problem.keepable_in(region)]
    keeping = p.with_submodules(blocks, kept=every)
    # every keepable node of a block that recomputation reaches (not its last linear, whose
    # recomputation stops before its matmul, nor the residual add after it)
    assert len(keeping.solution.kept) == len(every) >= (per_block - 2) * len(blocks)
    # (matrix products and attention: other funcs are also made by recomputed nodes, dropout's mul)
    kept_funcs = {name for spec in keeping.module_checkpoints for name, _ in spec.saved_calls
                  if name in KEEPABLE_OPS}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expected_loss, expected = step(model, sample)
        loss, grads = step(keeping.module(), sample)
        unplanned, recomputing, selective = (backward_calls(module, sample)
                                             for module in (model, plain.module(), keeping.module()))
    assert not [str(w.message) for w in caught if "keep" in str(w.message)]
    torch.testing.assert_close(loss, expected_loss)
    assert grads.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(grads[key], expected[key], msg=key)
    # Plain checkpoint runs the kept funcs again in backward; keeping them, no more than no plan.
    for func in kept_funcs:
        assert recomputing[func] > unplanned[func] == selective[func], func


def test_a_selective_plan_peaks_as_predicted_within_its_budget(measured):
    _, _, p, blocks, _ = measured
    # the matrix products and attention (keepable in any region: no keep span); keeping every
    # keepable node would cache outputs nothing saves, more than the unplanned step holds
    every = [p.problem.nodes[i].name for region in p.with_submodules(blocks).solution.regions
             for i in p.problem.keepable_in(region) if p.problem.nodes[i].keep_span is None]
    predicted = p.with_submodules(blocks, kept=every).predicted_peak_bytes
    assert predicted < p.baseline_peak_bytes
    # A budget between the plan's peak and the unplanned step's.
    tight = p.replan(budget_gb=(predicted + p.baseline_peak_bytes) / 2 / GIB)
    keeping = tight.with_submodules(blocks, kept=every)
    assert keeping.solution.kept and keeping.budget_bytes < p.baseline_peak_bytes
    check = keeping.verify(steps=1)
    assert check.outputs_match and check.gradients_match
    assert abs(check.peak_error) <= 0.03, check
    assert check.within_budget, check


def test_runs_inside_each_block_train_like_the_model(measured):
    # A run in the second half of each block (from about its second norm to its last node but
    # one), recomputed alone: the block's calls in the model's forward match the graph's.
    model, sample, p, blocks, _ = measured
    spans = [call.nodes for call in module_calls(p.traced.gm) if call.path in blocks]
    assert set(spans) <= set(p.problem.run_spans)
    names = [node.name for node in p.problem.nodes]
    regions = []
    for span in spans:
        start = next(s for s in range(span.start + len(span) // 2, span.stop - 1)
                     if p.problem.allows_region(s, span.stop - 1))
        regions.append((names[start], names[span.stop - 2]))
    runs = p.with_regions(regions)
    assert len(runs.module_checkpoints) == len(blocks) and all(spec.runs for spec in runs.module_checkpoints)
    expected_loss, expected = step(model, sample)
    planned = runs.module()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "other ATen calls than planned"
        loss, grads = step(planned, sample)
    assert all(planned.get_submodule(spec.module).__dict__["forward"].recording.dropped > 0 for spec in runs.module_checkpoints)
    torch.testing.assert_close(loss, expected_loss)
    for key, value in expected.items():
        torch.testing.assert_close(grads[key], value, msg=key)


def test_a_run_across_two_blocks_trains_like_the_model(measured):
    # From the first block's last node (its residual add) into the second block, up to the first
    # node whose recomputation frees something: a run in the stack's forward (GPT-2's and
    # Llama's make other calls than the graph before their first block, for the attention mask:
    # the stack's calls match from there on).
    model, sample, p, blocks, _ = measured
    calls = {call.path: call.nodes for call in module_calls(p.traced.gm)}
    first, second = calls[blocks[0]], calls[blocks[1]]
    names = [node.name for node in p.problem.nodes]
    stop = next(stop for stop in range(second.start + 1, second.stop)
                if p.problem.region_recompute_ms(range(first.stop - 1, stop)) > 0)
    assert p.problem.allows_region(first.stop - 1, stop)
    runs = p.with_regions([(names[first.stop - 1], names[stop - 1])])
    [spec] = runs.module_checkpoints
    assert len(spec.runs) == 1 and blocks[0].startswith(spec.module + "." if spec.module else "")
    expected_loss, expected = step(model, sample)
    planned = runs.module()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "other ATen calls than planned"
        loss, grads = step(planned, sample)
    assert planned.get_submodule(spec.module).__dict__["forward"].recording.dropped > 0
    torch.testing.assert_close(loss, expected_loss)
    for key, value in expected.items():
        torch.testing.assert_close(grads[key], value, msg=key)


def test_a_run_across_blocks_may_start_while_a_run_of_the_block_records():
    # GPT-2's first block recomputes its norm through attention (a run recorded until its
    # attention call ends), and a run of the stack starts at that call's output projection and
    # ends in the next block: the two recordings overlap without nesting. Each records its own
    # calls (one dispatch mode serves both): the peak is the predicted one, gradients are equal.
    torch.manual_seed(0)
    model, sample = gpt2()
    model.train()
    p = plan(model, sample, budget_gb=80, repeats=1, selective=True)
    calls = {call.path: call.nodes for call in module_calls(p.traced.gm)}
    names = [node.name for node in p.problem.nodes]
    block, attention = calls["transformer.h.0"], calls["transformer.h.0.attn"]
    sdpa = next(i for i in attention if names[i].startswith("scaled_dot_product_attention"))
    projection, norm = calls["transformer.h.0.attn.c_proj"], calls["transformer.h.1.ln_1"]
    runs = p.with_regions([(names[block.start], names[sdpa]), (names[projection.start], names[norm.stop - 1])])
    assert sorted(spec.module for spec in runs.module_checkpoints) == ["transformer", "transformer.h.0"]
    record = runs.verify(steps=2)
    assert record.gradients_match and abs(record.peak_error) <= 0.002, str(record)
