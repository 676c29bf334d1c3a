"""Plans applied inside the model's own forward: other shapes, the round trip through
`remove_plan`, Hugging Face conveniences (`save_pretrained`, `generate`), autocast, frozen bases
with adapters, torch.compile, and the in-place hazards that broke a replacement graph."""
import copy
import warnings

import pytest
import torch
from conftest import small_gpt, train_step
from models_hf import bert, gpt2, llama
from torch import nn

import planner
from planner import load_plan, plan, remove_plan
from planner.api import GIB
from planner.apply.checkpoints import CheckpointedForward
from planner.core import training_loss
from solvers import minimum_peak_bytes

pytestmark = pytest.mark.slow

HF_MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert}


def _grads(module: nn.Module, sample: dict, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    for parameter in module.parameters():
        parameter.grad = None
    torch.manual_seed(seed)
    loss = training_loss(module(**sample))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same(expected: tuple, got: tuple, what: str) -> None:
    torch.testing.assert_close(got[0], expected[0], msg=f"{what}: loss")
    assert got[1].keys() == expected[1].keys(), what
    for key in expected[1]:
        torch.testing.assert_close(got[1][key], expected[1][key], msg=f"{what}: {key}")


def _tight(p):
    """The plan again at 60% of the activations above static memory: several regions."""
    static = p.problem.static_bytes
    return p.replan(budget_gb=(static + 0.6 * (p.baseline_peak_bytes - static)) / GIB)


def _wrapped(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module.__dict__.get("forward"), CheckpointedForward)]


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_hugging_face_model_trains_at_other_shapes(name):
    torch.manual_seed(0)
    model, sample = HF_MODELS[name]()  # batch 2 x 32 tokens
    reference = copy.deepcopy(model)
    p = _tight(plan(model, sample, budget_gb=80, repeats=1))
    assert p.checkpoints
    assert p.apply(model) is model and type(model) is type(reference)
    # each planned module wrapped once (two runs recomputed alone inside one call share its wrapper)
    assert sorted(_wrapped(model)) == sorted({c.wrapped.module for c in p.checkpoints})
    ids = sample["input_ids"]
    for shape_name, tokens in (("batch 1", ids[:1]), ("half length", ids[:, :16].contiguous()), ("planned", ids)):
        smaller = {**sample, "input_ids": tokens, "labels": tokens}
        _assert_same(_grads(reference, smaller), _grads(model, smaller), f"{name}, {shape_name}")
    larger = {**sample, "input_ids": ids.repeat(2, 1), "labels": ids.repeat(2, 1)}
    with pytest.warns(UserWarning, match=r"larger than the planned \(2, 32\)"):
        _assert_same(_grads(reference, larger), _grads(model, larger), f"{name}, larger batch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shape warning comes once
        _grads(model, larger)


def test_apply_and_remove_round_trip_restores_forward_and_state_dict():
    model, tokens = small_gpt()
    before = {name: module.__dict__.get("forward") for name, module in model.named_modules()}
    state = model.state_dict()
    p = _tight(plan(model, tokens, budget_gb=80, repeats=1))
    assert not _wrapped(model), "planning must not change the model"
    p.apply(model)
    assert _wrapped(model) and list(model.state_dict()) == list(state)
    assert all(model.state_dict()[key] is not None for key in state)
    assert remove_plan(model) is model
    assert {name: module.__dict__.get("forward") for name, module in model.named_modules()} == before
    assert "_checkpoint_plan" not in model.__dict__ and not model._forward_pre_hooks
    for key, tensor in model.state_dict().items():
        assert tensor.data_ptr() == state[key].data_ptr()
    with pytest.raises(ValueError, match="no checkpoint plan is applied"):
        remove_plan(model)


def test_module_is_a_planned_copy_and_the_original_stays_untouched():
    model, tokens = small_gpt()
    reference = copy.deepcopy(model)
    p = _tight(plan(model, tokens, budget_gb=80, repeats=1))
    planned = p.module()
    assert type(planned) is type(model) and planned is not model
    assert planned.blocks[0].attention.qkv.weight is model.blocks[0].attention.qkv.weight
    assert _wrapped(planned) and not _wrapped(model)
    expected = train_step(reference, tokens)
    got = train_step(planned, tokens)
    torch.testing.assert_close(got[0], expected[0])
    for key in expected[1]:
        torch.testing.assert_close(got[1][key], expected[1][key])


def test_saved_plan_applies_in_place_to_a_fresh_model_and_refuses_another(tmp_path):
    model, tokens = small_gpt()
    p = _tight(plan(model, tokens, budget_gb=80, repeats=1))
    saved = load_plan(p.save(tmp_path / "plan.json"))
    fresh, _ = small_gpt()
    assert saved.apply(fresh) is fresh
    assert sorted(_wrapped(fresh)) == sorted({c.wrapped.module for c in p.checkpoints})
    expected = train_step(model, tokens)
    got = train_step(fresh, tokens)
    for key in expected[1]:
        torch.testing.assert_close(got[1][key], expected[1][key])
    other = planner.examples.TinyGPT(vocab=128, width=32, heads=4, blocks=2, context=32, dropout=0.1)
    with pytest.raises(ValueError, match="does not match the plan"):
        saved.apply(other)
    assert not _wrapped(other)


def test_applied_hugging_face_model_saves_and_generates(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, sample = gpt2()
    p = _tight(plan(model, sample, budget_gb=80, repeats=1))
    p.apply(model)
    assert isinstance(model, transformers.GPT2LMHeadModel) and model.config.n_layer == 2
    model.save_pretrained(tmp_path / "saved")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    for key, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], tensor)
    model.eval()
    prompt = sample["input_ids"][:1, :4]
    generated = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    remove_plan(model)
    assert torch.equal(generated, model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0))


def test_relu_on_an_earlier_consumed_tensor_trains_like_the_original():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 64))

        def forward(self, old):
            # cat and a product with a constant read `old` without saving it: the unplanned
            # step trains although `old` is written in place afterwards
            return self.mlp(torch.cat([old, old * 2.0], dim=-1))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(4))

        def forward(self, x):
            h = x
            for block in self.blocks:
                old = h
                h = block(old)
                h = h + torch.relu_(old)  # old fed a cat and a mul before: mutated after use
            return h

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(32, 64)
    reference = copy.deepcopy(model)
    p = plan(model, x.clone(), budget_gb=80, repeats=1)
    p = p.replan(budget_gb=(minimum_peak_bytes(p.problem) + p.baseline_peak_bytes) / 2 / GIB)
    # Recomputing a block would start from the mutated `old`: only mlps (or parts) may run
    # under checkpoint, or runs in the model's own forward that start after the in-place ReLU
    # (at its add).
    assert p.checkpoints and all(".mlp" in c.wrapped.module or c.nodes[0].startswith("add")
                                 for c in p.checkpoints)
    p.apply(model)
    expected = train_step(reference, x.clone())
    got = train_step(model, x.clone())
    for key in expected[1]:
        torch.testing.assert_close(got[1][key], expected[1][key], msg=key)


def test_autocast_and_frozen_base_with_adapters():
    class Adapted(nn.Module):
        def __init__(self, base: nn.Linear):
            super().__init__()
            self.base = base
            self.down = nn.Linear(base.in_features, 4, bias=False)
            self.up = nn.Linear(4, base.out_features, bias=False)

        def forward(self, x):
            return self.base(x) + self.up(self.down(x))

    model, tokens = small_gpt()
    for block in model.blocks:
        block.attention.qkv = Adapted(block.attention.qkv)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".down." in name or ".up." in name)
    reference = copy.deepcopy(model)
    p = _tight(plan(model, tokens, budget_gb=80, repeats=1))
    p.apply(model)
    for module in (reference, model):
        for parameter in module.parameters():
            parameter.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(3)
        expected = reference(tokens).float().pow(2).mean()
        torch.manual_seed(3)
        got = model(tokens).float().pow(2).mean()
    expected.backward()
    got.backward()
    torch.testing.assert_close(got, expected)
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, msg=name)
