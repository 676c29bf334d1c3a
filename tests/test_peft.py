"""A PEFT LoRA model, whose forward passes its keyword arguments on in `**kwargs`, is planned with
the default call below its unplanned peak, fits, trains with the unplanned model's gradients
once the plan is applied, and still saves its adapters."""
import copy
import inspect

import pytest
import torch
from models_hf import llama

from planner import plan
from planner.trace.tracing import bind_arguments

peft = pytest.importorskip("peft")


def test_keyword_arguments_a_forward_passes_on_are_bound_by_their_names():
    def forward(input_ids, labels=None, *args, **kwargs):
        return input_ids

    signature = inspect.signature(forward)
    assert bind_arguments(signature, (1,), {"use_cache": False}) == {"input_ids": 1, "labels": None,
                                                                    "use_cache": False}
    with pytest.raises(TypeError, match=r"forward's \*args receives 1 arguments; pass them by name"):
        bind_arguments(signature, (1, 2, 3), {})


def test_a_lora_model_is_planned_trains_like_the_original_and_saves_its_adapters(tmp_path):
    torch.manual_seed(0)
    base, sample = llama()
    sample = {"input_ids": sample["input_ids"], "labels": sample["labels"]}  # use_cache left to the config
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                                      task_type="CAUSAL_LM"))
    unplanned = plan(model, sample, budget_gb=80, repeats=1)
    static = sum(unplanned.static_breakdown.values())
    budget = static + 0.6 * (unplanned.baseline_peak_bytes - static)
    p = plan(model, sample, budget_gb=budget / 2**30)
    assert p.verified and p.checkpoints
    record = p.verify(steps=2)
    assert record.gradients_match and record.planned_peak_bytes <= budget and abs(record.peak_error) <= 0.01, str(record)
    reference = copy.deepcopy(model)
    p.apply(model)
    model(**sample).loss.backward()
    reference(**sample).loss.backward()
    trained = [(name, parameter.grad) for name, parameter in model.named_parameters() if parameter.requires_grad]
    assert trained and all("lora_" in name for name, _ in trained)
    assert all(torch.equal(grad, reference.get_parameter(name).grad) for name, grad in trained)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").exists()
