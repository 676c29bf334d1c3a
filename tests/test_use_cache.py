"""A Hugging Face model whose config leaves its key-value cache on (`use_cache=True`, the
default of causal language models) is planned and trained with the cache off, as Hugging Face's
own gradient checkpointing does in training (`planner.core.cache_off`): a checkpointed layer's
recomputation would append its keys and values to the cache a second time."""
import copy
import inspect
import warnings

import pytest
import torch
from models_hf import gpt2

from planner import plan
from planner.core import cache_off, cache_signature, training_sample

transformers = pytest.importorskip("transformers")


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [parameter.grad for parameter in model.parameters()]


def test_a_model_with_its_cache_on_is_planned_and_trains_with_it_off_as_planned():
    torch.manual_seed(0)
    model, sample = gpt2()
    sample = {"input_ids": sample["input_ids"], "labels": sample["labels"]}  # as a user passes it
    assert model.config.use_cache
    static = sum(plan(model, sample, budget_gb=80, repeats=1).static_breakdown.values())
    unplanned = plan(model, sample, budget_gb=80, repeats=1).baseline_peak_bytes
    p = plan(model, sample, budget_gb=(static + 0.6 * (unplanned - static)) / 2**30)
    assert p.verified and p.sample["use_cache"] is False and "use_cache" not in sample
    every_layer = p.with_submodules([f"transformer.h.{i}" for i in range(2)])  # attention recomputed
    planned, reference = every_layer.apply(copy.deepcopy(model)), copy.deepcopy(model)
    appended = []
    update = transformers.cache_utils.DynamicLayer.update

    def counted(layer, *args, **kwargs):
        appended.append(layer)
        return update(layer, *args, **kwargs)

    transformers.cache_utils.DynamicLayer.update = counted
    try:
        torch.manual_seed(1)  # (dropout: the same draws in both models)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            output = planned(**sample)
        assert output.past_key_values is None and not appended
        output.loss.backward()
        assert not appended  # (recomputation appended to the cache before)
        torch.manual_seed(1)
        reference(**sample, use_cache=False).loss.backward()
        assert all(torch.equal(a, b) for a, b in zip(_grads(planned), _grads(reference)))
        with pytest.warns(UserWarning, match="use_cache=True turned off"):
            planned(**sample, use_cache=True).loss.backward()
        with torch.no_grad():  # generate(): the cache stays
            assert planned(input_ids=sample["input_ids"]).past_key_values is not None
    finally:
        transformers.cache_utils.DynamicLayer.update = update


def test_cache_off_sets_use_cache_by_name_or_by_position():
    def forward(input_ids, labels=None, use_cache=None, **kwargs):
        return input_ids

    signature = inspect.signature(forward)
    assert cache_off(signature, (1,), {"labels": 2}) == ((1,), {"labels": 2, "use_cache": False}, False)
    assert cache_off(signature, (1, 2, True), {}) == ((1, 2, False), {}, True)
    assert cache_off(None, (1,), {}) == ((1,), {}, False)
    model, sample = gpt2()
    assert cache_signature(model) is not None and cache_signature(torch.nn.Linear(2, 2)) is None

    class Wrapper(torch.nn.Module):  # as a PEFT model: use_cache in **kwargs, a config that has it
        def __init__(self):
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, input_ids, **kwargs):
            return self.inner(input_ids, **kwargs)

    assert cache_off(cache_signature(Wrapper()), (1,), {}) == ((1,), {"use_cache": False}, False)
    ids = sample["input_ids"]
    assert training_sample(model, ids) == {"input_ids": ids, "use_cache": False}
    assert training_sample(torch.nn.Linear(2, 2), ids) is ids
    with pytest.warns(UserWarning, match="sample asks for use_cache=True"):
        assert training_sample(model, {"input_ids": ids, "use_cache": True})["use_cache"] is False
