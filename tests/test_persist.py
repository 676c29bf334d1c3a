"""Saving plans as JSON, loading them, re-applying them to fresh models, and exporting modules."""
import json
import math

import pytest
import torch
from conftest import MODELS, small_cnn, small_gpt, small_mlp, train_step
from torch import nn

from planner import Plan, load_plan, plan
from planner.api import GIB
from planner.apply.checkpoints import CheckpointedForward
from planner.examples import TinyGPT
from planner.plans.document import decode_value, encode_value
from planner.plans.matching import FX_FRONTEND
from planner.plans.record import PlanRecord
from planner.trace.tracing import trace


def tight(model, sample, fraction: float = 0.75, **options) -> Plan:
    p = plan(model, sample, budget_gb=80.0, solver="sqrt", repeats=1, **options)
    return p.replan(budget_gb=fraction * p.baseline_peak_bytes / GIB)


class PlansByModel(dict):
    """name -> (a tight plan of that test model, its sample), planned on first use."""

    def __missing__(self, name: str) -> tuple[Plan, object]:
        model, sample = MODELS[name]()
        self[name] = (tight(model, sample), sample)
        return self[name]


@pytest.fixture(scope="module")
def planned() -> PlansByModel:
    """One plan per test model, made once for this module's tests."""
    return PlansByModel()


@pytest.fixture(scope="module")
def gpt_plan_file(planned, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plans") / "gpt.json"
    planned["gpt"][0].save(path)
    return str(path)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_round_trip_reapplies_to_a_fresh_model_with_the_same_gradients(name, planned, tmp_path):
    p, sample = planned[name]
    model = p._model
    assert p.checkpoints
    path = p.save(tmp_path / "plan.json")

    saved = load_plan(path)
    assert saved.record.regions == [list(c.nodes) for c in p.checkpoints]
    assert saved.checkpoints == p.checkpoints  # nodes, modules, recompute and freed bytes
    assert saved.predicted_peak_bytes == p.predicted_peak_bytes
    assert saved.baseline_peak_bytes == p.baseline_peak_bytes
    assert saved.budget_bytes == p.budget_bytes and saved.solver == p.solver
    assert saved.problem == p.problem  # the costs the solver saw, exactly

    fresh, _ = MODELS[name]()  # same seed: same weights, new objects
    keys = list(fresh.state_dict())
    module = saved.apply(fresh)
    assert module is fresh and list(module.state_dict()) == keys
    assert saved.record.wrapped == tuple(c.wrapped for c in p.checkpoints)
    wrapped = [n for n, m in fresh.named_modules() if isinstance(m.__dict__.get("forward"), CheckpointedForward)]
    assert sorted(wrapped) == sorted({c.wrapped.module for c in p.checkpoints})

    expected_output, expected_grads = train_step(model, sample)
    output, grads = train_step(module, sample)
    torch.testing.assert_close(output, expected_output)
    assert grads.keys() == expected_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], expected_grads[key], msg=f"{name}: gradient of {key}")


def test_tied_weights_survive_the_round_trip(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, width=32, heads=4, blocks=2, context=32)
    model.head.weight = model.token_embedding.weight
    p = tight(model, torch.randint(0, 256, (2, 32)))
    assert [node.shared_grads for node in p.problem.nodes if node.shared_grads] == [((4, 256 * 32 * 4),)]
    assert load_plan(p.save(tmp_path / "plan.json")).problem == p.problem


def test_loaded_plan_prints_the_same_report_without_the_model(tmp_path):
    model, x = small_cnn()
    p = tight(model, x)
    saved = load_plan(p.save(tmp_path / "plan.json"))
    original, loaded = str(p).splitlines(), str(saved).splitlines()
    assert loaded[0].startswith("Checkpoint plan for SmallCNN") and str(tmp_path / "plan.json") in loaded[0]
    assert loaded[1:] == original[1:]  # figures, region table: identical


def test_reapplied_plan_keeps_batchnorm_statistics_right(tmp_path):
    # The rewrite restores buffers a region writes, from the profile records: they must be saved.
    model, x = small_cnn()
    saved = load_plan(tight(model, x, 0.8).save(tmp_path / "plan.json"))
    fresh, _ = small_cnn()
    reference, _ = small_cnn()
    train_step(reference, x)
    train_step(saved.apply(fresh), x)
    for (key, expected), (_, got) in zip(reference.state_dict().items(), fresh.state_dict().items()):
        torch.testing.assert_close(got, expected, msg=key)


def test_saved_json_describes_graph_sample_and_regions(gpt_plan_file):
    data = json.loads(open(gpt_plan_file).read())
    assert data["format"] == "ckpt-planner plan" and data["version"] == 3
    assert data["planned_for"]["device"] == "cpu" and data["times_estimated"] is False
    assert sum(data["static_breakdown"].values()) == data["static_bytes"]
    assert data["frontend"] == FX_FRONTEND
    assert data["model"] == "planner.examples.TinyGPT"
    assert data["sample"]["arguments"] == [
        {"name": "tokens", "tensor": {"shape": [4, 32], "dtype": "int64", "requires_grad": False}}
    ]
    names = [node["name"] for node in data["nodes"]]
    for region in data["regions"]:
        nodes = region["nodes"]
        assert nodes == names[names.index(nodes[0]):names.index(nodes[0]) + len(nodes)]
        assert all(by_module == region["module"] or by_module.startswith(region["module"] + ".")
                   for by_module in (node["module"] for node in data["nodes"] if node["name"] in nodes))
    by_name = {node["name"]: node for node in data["nodes"]}
    assert by_name["softmax"]["op"] == "call_function"
    assert by_name["softmax"]["target"] == "torch.nn.functional.softmax"
    assert by_name["blocks_0_attention_qkv"]["target"] == "blocks.0.attention.qkv"
    assert by_name["blocks_0_attention_qkv"]["cost"]["output_bytes"] == 4 * 32 * 96 * 4
    assert data["state_dict"]["token_embedding.weight"] == {"shape": [128, 32], "dtype": "float32"}
    assert data["predicted_peak_bytes"] <= data["budget_bytes"] < data["baseline_peak_bytes"]


def test_frontend_field_matches_the_fx_frontend():
    model, x = small_mlp()
    assert trace(model, x, frontend="fx").frontend == FX_FRONTEND


def test_another_architecture_is_refused_naming_the_first_difference(gpt_plan_file):
    saved = load_plan(gpt_plan_file)
    deeper = TinyGPT(vocab=128, width=32, heads=4, blocks=7, context=32)
    with pytest.raises(ValueError, match=r"TinyGPT does not match the plan .*no 'blocks.7.norm1.weight'"):
        saved.apply(deeper)
    with pytest.raises(ValueError, match=r"compute node \d+ is 'norm' .* but 'blocks_7_norm1' "):
        saved.record.check(deeper)  # the full check traces the model and compares the graphs
    wider = TinyGPT(vocab=128, width=64, heads=4, blocks=8, context=32)
    with pytest.raises(ValueError, match=r"'token_embedding.weight' has shape \(128, 64\) here and \(128, 32\)"):
        saved.apply(wider)
    cnn, _ = small_cnn()
    with pytest.raises(ValueError, match="SmallCNN does not match the plan"):
        saved.apply(cnn)
    assert not [m for m in cnn.modules() if "forward" in m.__dict__]


def test_another_dtype_warns_and_still_applies(gpt_plan_file):
    fresh, tokens = small_gpt()
    with pytest.warns(UserWarning, match="float64 here and was float32"):
        module = load_plan(gpt_plan_file).apply(fresh.double())
    assert module(tokens).dtype == torch.float64


def test_a_plan_from_the_export_frontend_reapplies_with_the_same_gradients(tmp_path):
    model, x = small_mlp()
    p = tight(model, x, frontend="export")
    assert p.checkpoints
    saved = load_plan(p.save(tmp_path / "plan.json"))
    assert saved.frontend == "torch.export" and "via torch.export" in saved.report(verbose=True)
    fresh, _ = small_mlp()
    module = saved.apply(fresh)
    _, expected = train_step(model, x)
    _, got = train_step(module, x)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], msg=key)
    with pytest.raises(ValueError, match="does not match the plan"):
        saved.apply(nn.Sequential(nn.Linear(64, 64)))


class Scaled(nn.Module):
    """Fixed (non-tensor) forward arguments of several kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 64)
        self.middle = nn.Sequential(*(nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh())
                                      for _ in range(3)))
        self.last = nn.Linear(64, 64)

    def forward(self, x, scale: float = 2.0, dims=(1,), flag=None):
        y = self.middle(torch.tanh(self.first(x)) * scale)
        y = torch.tanh(self.last(y)) * (1.0 if flag is None else flag.factor)
        return y.sum(dim=dims)


class Flag:
    factor = 3.0


def assert_same_values(got, expected) -> None:
    assert type(got) is type(expected)  # the model's own output structure, not a flat list
    torch.testing.assert_close(got, expected)


def test_fixed_arguments_are_saved_and_used_again(tmp_path):
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(256, 64)
    sample = {"x": x, "scale": 0.5, "dims": (0, 1)}
    saved = load_plan(tight(model, sample, 0.9).save(tmp_path / "plan.json"))
    fixed = {a["name"]: a["value"] for a in saved.record.sample["arguments"] if "value" in a}
    assert fixed == {"scale": 0.5, "dims": {"tuple": [0, 1]}, "flag": None}
    expected = {scale: model(x, scale=scale, dims=(0, 1)) for scale in (0.5, 1.0)}
    module = saved.apply(model)
    # The model's own forward runs: the planned values and others give the unplanned results.
    for scale, value in expected.items():
        assert_same_values(module(x, scale=scale, dims=(0, 1)), value)


@pytest.mark.filterwarnings("ignore:Was not able to add assertion")  # fx, about the object argument
def test_a_fixed_argument_json_cannot_hold_needs_a_sample_only_to_check(tmp_path):
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(256, 64)
    flag = Flag()
    saved = load_plan(tight(model, {"x": x, "flag": flag}, 0.9).save(tmp_path / "plan.json"))
    with pytest.raises(ValueError, match=r"'flag' was fixed to .*Flag.*apply\(model, sample=\.\.\.\)"):
        saved.record.check(model)
    saved.record.check(model, sample={"x": x, "flag": flag})
    expected = model(x, flag=flag)
    module = saved.apply(model)  # applying needs no sample: the model's own forward runs
    assert_same_values(module(x, flag=flag), expected)


@pytest.mark.parametrize("value", [
    None, True, 3, 0.25, "mean", [1, 2], (1, (2, 3)), {"a": (1,)}, torch.float16, torch.device("cpu"),
    float("inf"),
])
def test_fixed_values_survive_json(value):
    assert decode_value(json.loads(json.dumps(encode_value(value)))) == value


def test_nan_survives_json():
    assert math.isnan(decode_value(json.loads(json.dumps(encode_value(float("nan"))))))


def test_files_that_are_not_plans_give_clear_errors(tmp_path, gpt_plan_file):
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a saved checkpoint plan"):
        load_plan(other)
    other.write_text("not json")
    with pytest.raises(ValueError, match="is not JSON"):
        load_plan(other)
    data = json.loads(open(gpt_plan_file).read())
    data["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        PlanRecord.from_dict(data)
    del data["regions"]
    data["version"] = 1
    with pytest.raises(ValueError, match="lacks 'regions'"):
        PlanRecord.from_dict(data)


def test_a_loaded_plan_saves_the_same_document(tmp_path, gpt_plan_file):
    again = load_plan(gpt_plan_file).save(tmp_path / "again.json")
    assert json.loads(again.read_text()) == json.loads(open(gpt_plan_file).read())




@pytest.mark.parametrize("name", sorted(MODELS))
def test_exported_module_loads_with_torch_load_and_trains_the_same(name, planned, tmp_path):
    p, sample = planned[name]
    model = p._model
    path = p.export(tmp_path / "planned.pt")
    loaded = torch.load(path, weights_only=False)
    assert type(loaded) is type(model)
    assert sorted(n for n, m in loaded.named_modules() if "forward" in m.__dict__) == sorted(
        {c.wrapped.module for c in p.checkpoints})
    assert list(loaded.state_dict()) == list(model.state_dict())
    expected_output, expected_grads = train_step(model, sample)
    output, grads = train_step(loaded, sample)
    torch.testing.assert_close(output, expected_output)
    for key in expected_grads:
        torch.testing.assert_close(grads[key], expected_grads[key], msg=key)


def test_exported_module_follows_to_after_loading(planned, tmp_path):
    loaded = torch.load(planned["gpt"][0].export(tmp_path / "planned.pt"), weights_only=False)
    loaded.double()  # the planned forwards follow the module (its mask buffer included)
    output, _ = train_step(loaded, small_gpt()[1])
    assert output.dtype == torch.float64


def test_exported_module_from_the_export_frontend(tmp_path):
    model, tokens = small_gpt()
    p = tight(model, tokens, 0.8, frontend="export")
    loaded = torch.load(p.export(tmp_path / "planned.pt"), weights_only=False)
    expected_output, expected_grads = train_step(model, tokens)
    output, grads = train_step(loaded, tokens)
    torch.testing.assert_close(output, expected_output)
    for key in expected_grads:
        torch.testing.assert_close(grads[key], expected_grads[key], msg=key)


def test_exported_module_with_fixed_arguments_keeps_the_output_structure(tmp_path):
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(256, 64)
    p = tight(model, {"x": x, "scale": 0.5, "dims": (0, 1)}, 0.9)
    expected = model(x, scale=0.5, dims=(0, 1))
    torch.testing.assert_close(p.module()(x, scale=0.5, dims=(0, 1)), expected)  # a Tensor, not [Tensor]
    loaded = torch.load(p.export(tmp_path / "planned.pt"), weights_only=False)
    torch.testing.assert_close(loaded(x, scale=0.5, dims=(0, 1)), expected)
