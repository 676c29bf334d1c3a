"""End to end: plan() on small models, the rewritten module's behaviour and the report."""
import pytest
import torch
from conftest import small_gpt, snapshot, train_step

from planner import Plan, plan
from planner.api import GIB
from solvers import peak_bytes


def unplanned(model, sample) -> Plan:
    return plan(model, sample, budget_gb=80.0, solver="sqrt", repeats=1)


def tight(p: Plan, fraction: float = 0.75) -> Plan:
    return p.replan(budget_gb=fraction * p.baseline_peak_bytes / GIB)


def test_planned_module_matches_original(example):
    name, model, sample = example
    p = tight(unplanned(model, sample))
    assert p.checkpoints, f"{name}: a budget under the unplanned peak must checkpoint something"
    expected_output, expected_grads = train_step(model, sample)
    output, grads = train_step(p.module(), sample)
    torch.testing.assert_close(output, expected_output)
    assert grads.keys() == expected_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], expected_grads[key], msg=f"{name}: gradient of {key}")


def test_state_dict_keys_and_tensors_are_the_originals(example):
    _, model, sample = example
    m = tight(unplanned(model, sample)).module()
    assert list(m.state_dict().keys()) == list(model.state_dict().keys())
    for key, tensor in m.state_dict().items():
        assert tensor.data_ptr() == model.state_dict()[key].data_ptr(), key
    assert {id(p) for p in m.parameters()} == {id(p) for p in model.parameters()}


def test_planning_leaves_the_model_unchanged(example):
    _, model, sample = example
    before = snapshot(model)
    flags = [module.training for module in model.modules()]
    rng = torch.get_rng_state()
    p = tight(unplanned(model, sample))
    p.module()
    after = snapshot(model)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), f"planning changed {key}"
    assert [module.training for module in model.modules()] == flags
    assert all(parameter.grad is None for parameter in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_budget_above_unplanned_peak_gives_no_region(example):
    _, model, sample = example
    p = unplanned(model, sample)
    again = p.replan(budget_gb=1.01 * p.baseline_peak_bytes / GIB)
    assert again.checkpoints == ()
    assert again.predicted_peak_bytes == again.baseline_peak_bytes
    assert again.recompute_ms == 0


def test_smaller_budget_gives_smaller_predicted_peak(example):
    name, model, sample = example
    p = unplanned(model, sample)
    planned = tight(p)
    assert planned.predicted_peak_bytes < p.baseline_peak_bytes
    assert planned.predicted_peak_bytes <= planned.budget_bytes
    assert planned.recompute_ms > 0


def test_regions_cover_what_the_report_says(example):
    _, model, sample = example
    p = tight(unplanned(model, sample))
    names = [node.name for node in p.problem.nodes]
    for checkpoint, region in zip(p.checkpoints, p.solution.regions, strict=True):
        assert checkpoint.nodes == tuple(names[i] for i in region)
        assert checkpoint.recompute_ms == pytest.approx(
            p.problem.region_recompute_ms(region) + p.problem.checkpoint_ms(region))
        assert checkpoint.freed_bytes > 0
    assert p.recompute_ms == pytest.approx(sum(c.recompute_ms for c in p.checkpoints))
    assert p.predicted_peak_bytes == peak_bytes(p.problem, p.solution.regions)
    # each region is one submodule call: its nodes are that submodule's, and it runs under checkpoint
    planned = p.module()
    for checkpoint in p.checkpoints:
        path = checkpoint.wrapped.module
        assert all(m == path or m.startswith(path + ".") for m in checkpoint.node_modules), (path, checkpoint.modules)
        assert "forward" in planned.get_submodule(path).__dict__
    report = str(p)
    for index, checkpoint in enumerate(p.checkpoints):
        assert f" {checkpoint.wrapped.module} " in report and checkpoint.wrapped.module_class in report


def test_batchnorm_statistics_match_after_one_step():
    from conftest import small_cnn

    model, sample = small_cnn()
    reference, _ = small_cnn()
    p = tight(unplanned(model, sample), 0.8)
    assert p.checkpoints
    train_step(reference, sample)
    train_step(p.module(), sample)
    for (key, expected), (_, got) in zip(reference.state_dict().items(), model.state_dict().items()):
        torch.testing.assert_close(got, expected, msg=key)


def test_sample_forms_tensor_tuple_and_dict():
    from conftest import small_mlp

    model, x = small_mlp()
    for sample in (x, (x,), {"input": x}):
        p = plan(model, sample, budget_gb=80.0, solver="sqrt", repeats=1)
        assert len(p.problem) > 0


def test_eval_mode_and_no_grad_run_the_original_forward():
    from conftest import small_gpt

    model, tokens = small_gpt()
    m = tight(unplanned(model, tokens)).module()
    m.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(tokens), model(tokens))
    assert not any(module.training for module in m.modules())
    assert all(module.training is False for module in model.modules())
    m.train()
    assert not model.training, "training the planned module must not flip the original's flag"


def test_plan_str_is_a_readable_report():
    from conftest import small_gpt

    model, tokens = small_gpt()
    p = tight(unplanned(model, tokens))
    text = str(p)
    assert "TinyGPT" in text and "predicted" in text and "its own step      ran on cpu" in text
    assert "regions" in text and "recompute" in text and "blocks.0" in text
    assert "solver" not in text and "sqrt" in p.report(verbose=True)  # the cost model's internals: on request


def test_solver_options_reach_the_solver_and_stay_with_the_plan():
    model, tokens = small_gpt()
    p = plan(model, tokens, budget_gb=80, repeats=1, solver="ilp", solver_options={"time_limit_s": 5})
    assert p.solver_options == {"time_limit_s": 5}
    tight = p.replan(budget_gb=0.6 * p.baseline_peak_bytes / GIB)
    assert tight.solver_options == {"time_limit_s": 5} and tight.checkpoints
    assert p.replan(solver="dp").solver_options == {}  # another solver: not its options
    with pytest.raises(TypeError, match="unknown options"):
        p.replan(solver_options={"no_such_option": 1})


def test_report_module_column_names_the_first_and_last_node_modules():
    # A region that starts and ends in one module but passes through its children is that module.
    from planner.problem.regions import Checkpoint

    def span(modules):
        return Checkpoint((), 0.0, 0, node_modules=modules).name

    assert span(("blocks.0.attention", "blocks.0.attention.qkv", "blocks.0.attention")) == "blocks.0.attention"
    assert span(("blocks.0.norm1", "blocks.0.attention.qkv", "blocks.0.attention")) == (
        "blocks.0.norm1 .. blocks.0.attention"
    )
    assert span(("", "head")) == "(model) .. head"
    assert span(()) == ""
