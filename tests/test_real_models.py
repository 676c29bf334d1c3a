"""Hugging Face models (random weights from small configs), nn.TransformerEncoder stacks and a
U-Net-shaped model: planned modules train exactly like the originals."""
import pytest
import torch
from models_hf import MODELS, _ids, gpt2

from planner import load_plan, plan
from planner.api import GIB
from planner.core import training_loss
from solvers import minimum_peak_bytes

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def _call(module, sample):
    return module(**sample) if isinstance(sample, dict) else module(sample)


def _step(module, sample, seed=0):
    for parameter in module.parameters():
        parameter.grad = None
    torch.manual_seed(seed)
    output = _call(module, sample)
    training_loss(output).backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    return output, grads


@pytest.mark.parametrize("name", sorted(MODELS))
def test_planned_real_model_trains_like_the_original(name):
    torch.manual_seed(0)
    model, sample = MODELS[name]()
    model.train()
    p = plan(model, sample, budget_gb=80, solver="sqrt", repeats=1)
    static = p.problem.static_bytes
    p = p.replan(budget_gb=(static + 0.9 * (p.baseline_peak_bytes - static)) / GIB)
    assert p.checkpoints, f"{name}: a budget under the unplanned peak must checkpoint something"
    m = p.module()
    expected_output, expected = _step(model, sample)
    output, grads = _step(m, sample)
    assert type(output) is type(expected_output)
    torch.testing.assert_close(training_loss(output), training_loss(expected_output))
    assert grads.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(grads[key], expected[key], msg=f"{name}: {key}")
    assert list(m.state_dict()) == list(model.state_dict())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_decoder_layers_are_split_into_many_recomputable_nodes(name):
    torch.manual_seed(0)
    model, sample = MODELS[name]()
    p = plan(model, sample, budget_gb=80, solver="sqrt", repeats=1)
    assert p.frontend == "torch.export"
    per_layer = {}
    for node in p.traced.gm.graph.nodes:
        stack = node.meta.get("nn_module_stack", {})
        layers = [path for path, _ in stack.values() if path.rsplit(".", 1)[-1].isdigit()]
        if node.op == "call_function" and layers:
            per_layer[layers[0]] = per_layer.get(layers[0], 0) + 1
    assert len(per_layer) == 2 and all(count >= 10 for count in per_layer.values()), per_layer


def test_tied_weights_gradient_is_held_through_backward():
    # GPT-2 ties its output layer to the token embedding: autograd keeps the output layer's
    # weight gradient from the first backward node to the embedding's, the whole of backward.
    # Measured node by node ("no-run"), the gradients come from the graph, not from a step (a
    # step's measured gradients would hold the buffer anyway). Near the smallest budget the
    # peak is inside backward: without that buffer the smallest peak would be 6% lower, and
    # the plan made for it would peak over its budget.
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=2048, n_positions=256,
                                     bos_token_id=0, eos_token_id=0)
    ids = _ids(batch=1, length=256, vocab=2048)
    model = transformers.GPT2LMHeadModel(config)
    p = plan(model, {"input_ids": ids, "labels": ids, "use_cache": False}, budget_gb=80, repeats=1, measure="no-run")
    assert p.problem.measured_gradients is None
    shared = [(p.problem.nodes[user].name, size) for node in p.problem.nodes for user, size in node.shared_grads]
    assert shared == [("embedding", 2048 * 256 * 4)]  # wte's gradient, held until wte's backward
    p = p.replan(budget_gb=1.01 * minimum_peak_bytes(p.problem) / GIB)
    record = p.verify(steps=1)
    assert record.within_budget, str(record)
    assert abs(record.peak_error) <= 0.01, str(record)


def test_saved_plan_reapplies_to_a_fresh_hugging_face_model(tmp_path):
    torch.manual_seed(0)
    model, sample = gpt2()
    p = plan(model, sample, budget_gb=80, repeats=1)
    p = p.replan(budget_gb=0.7 * p.baseline_peak_bytes / GIB)
    assert p.frontend == "torch.export" and p.checkpoints
    saved = load_plan(p.save(tmp_path / "plan.json"))
    torch.manual_seed(0)
    fresh, _ = gpt2()  # same weights, new objects
    module = saved.apply(fresh)
    expected_output, expected = _step(model, sample)
    output, grads = _step(module, sample)
    torch.testing.assert_close(output.loss, expected_output.loss)
    for key in expected:
        torch.testing.assert_close(grads[key], expected[key], msg=key)


def test_a_transformer_encoder_in_a_sequential_is_planned_layer_by_layer():
    # fx keeps torch.nn modules whole; nn.TransformerEncoder and its layers have children, so
    # they are followed (fx cannot: its fast-path checks branch on tensors; torch.export can),
    # and the plan checkpoints layers, reaching below what checkpointing every layer holds.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)).train()
    x = torch.randn(4, 32, 64)
    unplanned = plan(model, x, budget_gb=80, repeats=1)
    assert unplanned.frontend == "torch.export" and len(unplanned.problem) > 40
    every_layer = unplanned.with_submodules([f"0.layers.{i}" for i in range(4)])
    assert minimum_peak_bytes(unplanned.problem) < every_layer.predicted_peak_bytes
    p = plan(model, x, budget_gb=every_layer.predicted_peak_bytes / GIB)
    assert p.verified and p.checkpoints
    expected_output, expected = _step(model, x)
    output, grads = _step(p.module(), x)
    torch.testing.assert_close(output, expected_output)
    for key in expected:
        torch.testing.assert_close(grads[key], expected[key], msg=key)


def test_a_sample_with_an_attention_mask_is_planned_for_padded_batches():
    # Hugging Face skips an all-ones mask on real tensors but builds it for a padded batch; the
    # traced graph cannot read the mask, so the plan counts the padded batch's step, which then
    # peaks at the prediction, under the budget.
    from models_hf import llama

    torch.manual_seed(0)
    model, sample = llama()
    ids = torch.randint(0, 100, (2, 256))
    ones = {**sample, "input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    padded = {**ones, "attention_mask": ones["attention_mask"].clone()}
    padded["attention_mask"][0, -40:] = 0
    unplanned = plan(model.train(), ones, budget_gb=80)
    p = plan(model, ones, budget_gb=0.7 * unplanned.baseline_peak_bytes / GIB)
    assert p.checkpoints
    record = p.verify(padded, steps=1)
    assert record.within_budget and record.gradients_match, str(record)
    assert abs(record.peak_error) <= 0.01, str(record)
    assert p.verify(ones, steps=1).planned_peak_bytes < record.planned_peak_bytes
