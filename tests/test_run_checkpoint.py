"""Regions that are runs of nodes inside a submodule call, recomputed alone
(`planner.apply.runs`): gradients equal to the unplanned model's, saved tensors freed as
predicted, the planner choosing them, and their survival through save/load, other shapes and
torch.compile. (FSDP2: tests/test_distributed.py; what they cost in the step:
tests/test_run_step_costs.py.)"""
from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import replace

import pytest
import torch
from conftest import (
    COMPILE_BACKEND,
    assert_trains_like,
    cnn_step,
    small_cnn_plan,
    small_gpt,
    train_step,
)
from torch.utils._python_dispatch import TorchDispatchMode

from planner import load_plan, plan
from planner.apply.runs import RunRecorder
from planner.core import counted_call
from planner.costs.overhead import forward_calls
from planner.examples import Block, TinyGPT
from solvers import NodeCost, Problem, solve


def _block_step(block: Block, x: torch.Tensor, mask: torch.Tensor, recorder: RunRecorder | None
                ) -> list[torch.Tensor]:
    for parameter in block.parameters():
        parameter.grad = None
    x = x.clone().requires_grad_()
    torch.manual_seed(3)
    if recorder is None:
        out = block(x, mask)
    else:
        with recorder:
            out = block(x, mask)
    out.pow(2).sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())]


def test_recorded_runs_give_the_unplanned_gradients_bit_for_bit():
    torch.manual_seed(0)
    block = Block(32, 4, dropout=0.1).train()
    mask = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
    x = torch.randn(2, 16, 32)
    names = [name for name in forward_calls(block, x.clone().requires_grad_(), mask) if counted_call(name)]
    dropouts = [i for i, name in enumerate(names) if name == "aten.empty_like.default"]  # CPU dropout's mask
    expected = _block_step(block, x, mask, None)
    # The whole forward; attention's dropout to the MLP's input; two runs, each from a dropout.
    for runs in [((0, len(names)),), ((dropouts[0], names.index("aten.native_layer_norm.default", 1) + 1),),
                 ((dropouts[0], dropouts[1]), (dropouts[2], len(names)))]:
        recorder = RunRecorder(names, runs)
        grads = _block_step(block, x, mask, recorder)
        assert recorder.mismatch is None and recorder.dropped > 0
        assert all(torch.equal(a, b) for a, b in zip(grads, expected)), runs


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_entered_inside_a_recording_and_left_after_it_is_warned_about():
    # (modes leave by popping the top of one stack: the recording's exit pops the other mode)
    linear, x = torch.nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
    names = [name for name in forward_calls(linear, x) if counted_call(name)]
    recorder, other = RunRecorder(names, ((0, len(names)),)), _PassThrough()
    with pytest.warns(UserWarning, match="crossed the scope of another dispatch mode"):
        recorder.__enter__()
        other.__enter__()
        linear(x)
        recorder.__exit__(None, None, None)
    other.__exit__(None, None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with recorder, _PassThrough():  # nested: no warning
            linear(x)


def test_a_forward_with_other_calls_stops_recording_and_warns():
    model, tokens = small_gpt()
    p = plan(model, tokens, budget_gb=80, repeats=1, measure="run")
    runs = p.with_regions([("blocks_0_norm2", "blocks_0_mlp_1")])
    planned = runs.module()
    recording = planned.blocks[0].__dict__["forward"].recording
    assert recording.windows == [("norm2", recording.windows[0][1], "mlp.1", recording.windows[0][3])]
    recording.calls = ("aten.mul.Tensor",) * 99  # as if the forward made other calls than planned
    with pytest.warns(UserWarning, match="makes other ATen calls than planned"):
        train_step(planned, tokens)
    assert planned.blocks[0].__dict__["forward"].recording.dropped == 0


@pytest.fixture(scope="module")
def measured():
    model, tokens = small_gpt()
    return model, tokens, plan(model, tokens, budget_gb=80, repeats=1, measure="run")


def test_runs_inside_blocks_train_like_the_model_and_free_what_was_predicted(measured):
    model, tokens, p = measured
    assert p.problem.run_spans, "the blocks' calls match the graph's: runs inside them are regions"
    # norm2 and the MLP's first linear and GELU, in each block: not a submodule call
    regions = [(f"blocks_{i}_norm2", f"blocks_{i}_mlp_1") for i in range(8)]
    runs = p.with_regions(regions)
    specs = runs.module_checkpoints
    assert [spec.module for spec in specs] == [f"blocks.{i}" for i in range(8)] and all(len(s.runs) == 1 for s in specs)
    record = runs.verify(steps=2)
    assert record.outputs_match and record.gradients_match, str(record)
    assert abs(record.peak_error) <= 0.01, str(record)
    assert runs.predicted_peak_bytes < p.baseline_peak_bytes


def test_a_run_across_two_blocks_is_recorded_in_the_models_own_forward(measured):
    # The first block's last node (its residual add) to the second block's first (its norm):
    # a run in TinyGPT's own forward, whatever its length, since runs hold at most 32 nodes.
    model, tokens, p = measured
    assert len(p.problem.nodes) > 200 and p.problem.max_run_nodes == 32
    calls = {spec.module: region for region, spec in p.wrapped.items()}
    first, second, nodes = calls["blocks.0"], calls["blocks.1"], p.problem.nodes
    runs = p.with_regions([(nodes[first.stop - 1].name, nodes[second.start].name)])
    assert [(spec.module, len(spec.runs)) for spec in runs.module_checkpoints] == [("", 1)]
    planned = runs.module()
    train_step(planned, tokens)
    assert planned.__dict__["forward"].recording.dropped > 0
    record = runs.verify(steps=2)
    assert record.outputs_match and record.gradients_match and abs(record.peak_error) <= 0.01, str(record)


def test_runs_hold_at_most_max_run_nodes() -> None:
    nodes = tuple(NodeCost(f"n{i}", compute_ms=1.0, output_bytes=8, uses=(i - 1,) if i else (), saves=(i,))
                  for i in range(6))
    problem = Problem(nodes, allowed_regions=(range(0, 6),), run_spans=(range(0, 6),), max_run_nodes=2)
    assert problem.allows_region(1, 3) and not problem.allows_region(1, 4)
    assert problem.allows_region(0, 6)  # the call itself
    with pytest.raises(ValueError, match="max_run_nodes"):
        replace(problem, max_run_nodes=0)


def test_the_planner_recomputes_runs_where_they_are_cheaper(measured):
    model, tokens, p = measured
    tight = p.replan(budget_gb=0.8 * p.baseline_peak_bytes / 2**30)
    without = solve(replace(tight.problem, run_spans=()), tight.budget_bytes, method="dp")
    assert tight.recompute_ms <= without.recompute_ms + 1e-9
    record = tight.verify(steps=2)
    assert record.within_budget and record.gradients_match and abs(record.peak_error) <= 0.01, str(record)


def test_a_saved_plan_with_runs_applies_to_a_fresh_model_and_other_lengths(measured, tmp_path):
    model, tokens, p = measured
    runs = p.with_regions([("blocks_2_norm2", "blocks_2_mlp_1"), ("blocks_2_mlp_2", "blocks_2_mlp_2")])
    loaded = load_plan(runs.save(tmp_path / "plan.json"))
    fresh, _ = small_gpt()
    loaded.apply(fresh)
    assert fresh.blocks[2].__dict__["forward"].spec == runs.module_checkpoints[0]
    for sample in (tokens, tokens[:2, :20]):
        expected_output, expected = train_step(model, sample)
        output, grads = train_step(fresh, sample)
        torch.testing.assert_close(output, expected_output)
        for key, value in expected.items():
            torch.testing.assert_close(grads[key], value, msg=key)


@pytest.mark.slow
def test_torch_compile_of_a_plan_with_runs_trains_like_eager():
    # (no dropout: compiled and eager code draw different random numbers)
    torch.manual_seed(0)
    model, tokens = TinyGPT(vocab=128, width=32, heads=4, blocks=4, context=32, dropout=0.0), torch.randint(0, 128, (4, 32))
    p = plan(model, tokens, budget_gb=80, repeats=1, measure="run")
    planned = p.with_regions([(f"blocks_{i}_norm2", f"blocks_{i}_mlp_1") for i in range(4)]).module()
    expected_output, expected = train_step(model, tokens)
    output, grads = train_step(torch.compile(planned, backend=COMPILE_BACKEND), tokens)
    torch.testing.assert_close(output, expected_output, rtol=1e-4, atol=1e-5)
    for key, value in expected.items():
        torch.testing.assert_close(grads[f"_orig_mod.{key}"], value, rtol=1e-4, atol=1e-5, msg=key)


def test_runs_in_the_models_own_forward_cross_its_stages_and_update_batchnorm_once():
    # SmallCNN's loop adds each stage's output to its input and applies ReLU in the model's own
    # forward: a run from one stage's last BatchNorm to the next stage's first convolution lies
    # in that forward, not in a submodule call. Its replay writes BatchNorm's statistics on
    # copies, so a step updates them once, as the unplanned step does.
    model, images, p = small_cnn_plan()
    assert range(0, len(p.problem.nodes)) in p.problem.run_spans
    runs = p.with_regions([("stages_0_4", "stages_1_0"), ("stages_1_4", "stages_2_0")])
    assert [(spec.module, len(spec.runs)) for spec in runs.module_checkpoints] == [("", 2)]
    planned = runs.module()
    # inspect (the Hugging Face Trainer picks dataset columns by it) sees the model's own forward
    assert inspect.signature(planned.forward) == inspect.signature(model.forward)
    assert_trains_like(planned, model, images)
    assert planned.__dict__["forward"].recording.dropped > 0
    record = runs.verify(steps=2)
    assert record.gradients_match and abs(record.peak_error) <= 0.01, str(record)


@pytest.mark.slow
def test_torch_compile_of_runs_in_the_models_own_forward_trains_like_eager():
    # Under torch.compile the runs across stages are a selective policy over the model's own
    # forward: its gradients and BatchNorm statistics are the unplanned eager step's, up to the
    # rounding that compiled kernels change (an update applied twice would be far off).
    model, images, p = small_cnn_plan()
    planned = p.with_regions([("stages_0_4", "stages_1_0"), ("stages_1_4", "stages_2_0")]).module()
    grads, buffers = cnn_step(copy.deepcopy(model), images)
    compiled_grads, compiled_buffers = cnn_step(torch.compile(planned, backend=COMPILE_BACKEND), images)
    for got, want in zip(compiled_grads + compiled_buffers, grads + buffers):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

def test_a_run_does_not_make_again_what_a_node_freed_in_forward_saved():
    # Fuzz seed 478: in a run in the model's own forward, an in-place ReLU writes `add`, which
    # nothing reads afterwards; autograd saves the result for a node freed in forward with it.
    # The run's replay made every dropped tensor, that one too, and held it until the run's
    # tape was freed after backward: 5.0% above the predicted peak.
    from benchmarks.fuzz_models import random_model

    model, sample = random_model(478)
    p = plan(model, sample, budget_gb=80, repeats=1)
    runs = p.with_regions([("stem_2", "relu__1")])
    assert [len(spec.runs) for spec in runs.module_checkpoints] == [1]
    assert_trains_like(runs.module(), model, sample)
    record = runs.verify(steps=2)
    assert record.gradients_match and abs(record.peak_error) <= 0.005, str(record)


class _Pair(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, width)
        self.fc2 = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _PairThenGlue(torch.nn.Module):
    """A block, then glue in the model's own forward: a run there starts recording at the
    pre-hook of the block's last linear, the innermost submodule call before it."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.block = _Pair(width)
        self.head = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        h = torch.tanh(h) * torch.sigmoid(h)
        return self.head(h * h)


def test_a_run_whose_recording_would_start_inside_a_keeping_region_frees_what_was_predicted():
    # Fuzz seed 401: the block keeps its first linear under a selective policy, whose dispatch
    # mode is on over its forward; the recording's mode, entered at fc2's pre-hook inside it,
    # was popped when the policy's exited, and the run freed nothing (the run's freed bytes above
    # the predicted peak).
    torch.manual_seed(0)
    model, x = _PairThenGlue(), torch.randn(256, 64)
    p = plan(model, x, budget_gb=80, repeats=1, selective=True)
    keeping = p.with_regions([("block_fc1", "block_fc2"), ("tanh", "mul_1")], kept=["block_fc1"])
    assert keeping.solution.kept and [len(spec.runs) for spec in keeping.module_checkpoints] == [0, 1]
    window = keeping.module_checkpoints[1].run_windows[0]
    assert window[0] == "block"  # not "block.fc2"
    planned = keeping.module()
    assert_trains_like(planned, model, x)
    assert planned.__dict__["forward"].recording.dropped > 0
    record = keeping.verify(steps=2)
    assert record.gradients_match and abs(record.peak_error) <= 0.005, str(record)
