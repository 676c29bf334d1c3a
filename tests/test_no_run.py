"""Planning without running the unplanned step: sizes on fake tensors, nodes run one at a time,
models on the meta device, target GPUs, and static memory as FSDP2 and the optimizer hold it."""
import json
import math

import pytest
import torch
from conftest import MODELS, small_gpt
from test_hazards import _assert_unchanged, _fingerprint
from torch import nn
from torch._subclasses import FakeTensorMode

from planner import InfeasibleBudget, load_plan, plan
from planner.api import GIB
from planner.core import split_sample, training_loss
from planner.examples import TinyGPT
from planner.measure.device import _malloc_trim, release_freed_host_memory
from planner.measure.memory import LiveBytesTracker, preserved_state
from planner.measure.profile import META_KEY, claim_autograd_nodes, profile
from planner.measure.sizes import BackwardWindows, profile_sizes
from planner.measure.static import static_breakdown
from planner.measure.targets import KernelCounter, target, targets
from planner.trace.structure import compute_nodes
from planner.trace.tracing import trace

SIZE_FIELDS = ("output_bytes", "grad_bytes", "saved_bytes", "uses", "saves", "mutates", "param_grad_bytes",
               "late_grad_bytes", "unhooked_saved_bytes", "random", "mutated_buffers", "parameters")


def _records(gm):
    return {node.name: node.meta[META_KEY] for node in compute_nodes(gm)}


def _sizes_both_ways(model, sample):
    traced = trace(model, sample)
    inputs = traced.graph_inputs(*split_sample(sample))
    loss = lambda result: training_loss(traced.model_output(result))  # noqa: E731
    with preserved_state(model, [torch.device("cpu")]):
        profile(traced.gm, inputs, repeats=1, loss=loss)
    real = {name: {f: getattr(r, f) for f in SIZE_FIELDS} for name, r in _records(traced.gm).items()}
    profile_sizes(traced.gm, inputs, torch.device("cpu"), loss=loss)
    fake = {name: {f: getattr(r, f) for f in SIZE_FIELDS} for name, r in _records(traced.gm).items()}
    return real, fake


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fake_sizes_equal_real_sizes_node_by_node(name):
    model, sample = MODELS[name]()
    real, fake = _sizes_both_ways(model, sample)
    assert real == fake
    assert any(r["saved_bytes"] or r["saves"] for r in real.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_fake_sizes_equal_real_sizes_on_hugging_face_models(name):
    import test_real_models

    torch.manual_seed(0)
    model, sample = test_real_models.MODELS[name]()
    real, fake = _sizes_both_ways(model.train(), sample)
    assert real == fake


class Residual(nn.Module):
    """A tensor read by two consumers: autograd sums their gradients in one buffer."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        h = x * 2
        return self.fc(self.norm(h)) + h


def _tensor_temporaries(model, x):
    owners = {}
    tracker = LiveBytesTracker(log=[])
    with tracker:
        h = x * 2
        claim_autograd_nodes([h], "h", owners)
        y = model.fc(model.norm(h))
        claim_autograd_nodes([y], "fc", owners)
        out = y + h
        claim_autograd_nodes([out], "add", owners)
    with BackwardWindows(tracker, owners) as windows:
        out.sum().backward()
    return windows.temporaries()


def test_fake_backward_sums_gradients_in_place_as_real_tensors_do():
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    model = Residual()
    real = _tensor_temporaries(model, torch.randn(32, 64, requires_grad=True))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_model = Residual()
        x = torch.empty(32, 64, requires_grad=True)
        fake = _tensor_temporaries(fake_model, x)
    assert mode is not None
    assert real == fake  # without replaying the sums in place, "fc" reads 16 640 on fake tensors


def _temporaries_beside_a_sum(fc: nn.Linear, x: torch.Tensor) -> dict[str, int]:
    owners = {}
    tracker = LiveBytesTracker(log=[])
    with tracker:
        h = x * 2
        claim_autograd_nodes([h], "h", owners)
        y = fc(h)
        claim_autograd_nodes([y], "fc", owners)
        total = h.sum()
        claim_autograd_nodes([total], "sum", owners)
        out = y.sum() + total
    with BackwardWindows(tracker, owners) as windows:
        out.backward()
    return windows.temporaries()


def test_a_gradient_summed_after_a_broadcast_one_is_a_new_tensor_on_fake_tensors_too():
    # The sum's backward hands `h` an expanded gradient first; autograd sums in place only into
    # the gradient that came first, where it is dense, so the linear's sum is a new tensor.
    torch.manual_seed(0)
    real = _temporaries_beside_a_sum(nn.Linear(64, 64), torch.randn(32, 64, requires_grad=True))
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = _temporaries_beside_a_sum(nn.Linear(64, 64), torch.empty(32, 64, requires_grad=True))
    assert real == fake and real["fc"] == 32 * 64 * 4  # summed into the linear's gradient, "fc" read 0


def test_a_forced_no_run_plan_verifies_under_budget_and_leaves_the_model_unchanged():
    model, tokens = small_gpt()
    before = _fingerprint(model)
    unplanned = plan(model, tokens, budget_gb=80, measure="no-run", repeats=1)
    assert unplanned.profile.measurement == "node by node"
    p = unplanned.replan(budget_gb=0.6 * unplanned.baseline_peak_bytes / GIB)
    assert p.checkpoints
    record = p.verify(steps=1)
    assert record.within_budget and record.gradients_match, str(record)
    assert abs(record.peak_error) <= 0.05, str(record)
    _assert_unchanged(model, before)


def test_auto_measures_the_whole_step_wherever_the_device_holds_it_whatever_the_budget():
    model, tokens = small_gpt()
    first = plan(model, tokens, budget_gb=80, repeats=1)
    assert first.profile.measurement == "whole step" and first.verified
    tight = plan(model, tokens, budget_gb=0.5 * first.baseline_peak_bytes / GIB, repeats=1)
    assert tight.profile.measurement == "whole step"  # the budget is the run's, not measuring's
    assert tight.checkpoints and tight.verified and tight.own_step_peak_bytes <= tight.budget_bytes


def test_where_the_device_cannot_hold_the_unplanned_step_the_plans_own_step_runs(monkeypatch):
    import planner.api
    import planner.measure.paths

    model, tokens = small_gpt()
    first = plan(model, tokens, budget_gb=80, repeats=1)
    budget = int(0.5 * first.baseline_peak_bytes)
    # a device with room for the planned step, not for measuring the unplanned one whole
    resident = first.profile.parameter_bytes + first.profile.buffer_bytes + first.profile.input_bytes
    room = budget - resident
    monkeypatch.setattr(planner.measure.paths, "measurable_bytes", lambda device: room)
    monkeypatch.setattr(planner.api, "measurable_bytes", lambda device: room)
    p = plan(model, tokens, budget_gb=budget / GIB, repeats=1)
    assert p.profile.measurement == "node by node" and p.checkpoints
    assert p.verified and p.own_step_peak_bytes <= p.budget_bytes
    assert "ran on cpu in planning" in str(p)
    record = p.verify(steps=1)
    assert record.within_budget and record.gradients_match, str(record)


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


@pytest.mark.skipif(_malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_measuring_hands_the_heaps_freed_memory_back_before_a_step():
    # 64 KiB tensors are heap allocations; the last one kept pins the heap's top, so freeing the
    # others leaves their 256 MiB resident until it is handed back
    tensors = [torch.ones(16 * 1024) for _ in range(4096)]
    kept = tensors[-1]
    del tensors
    held = _resident_bytes()
    release_freed_host_memory()
    assert held - _resident_bytes() > 200 * 2**20
    assert kept.sum() == 16 * 1024


def test_a_no_run_plan_does_not_run_its_own_step_and_says_so():
    model, tokens = small_gpt()
    p = plan(model, tokens, budget_gb=0.01, measure="no-run", repeats=1)
    assert p.own_step_peak_bytes is None and not p.verified
    assert "its own step      not run" in str(p)


def _meta_gpt():
    with torch.device("meta"):
        model = TinyGPT(vocab=128, width=32, heads=4, blocks=8, context=32, dropout=0.1)
    return model.train(), torch.zeros(4, 32, dtype=torch.long, device="meta")


def test_a_broadcast_parameters_gradient_is_late_and_a_recomputed_linear_has_freed_its_input_by_then():
    # Each linear's bias reaches addmm broadcast; autograd sums its gradient after addmm's
    # backward returns. This flat model's plan at its smallest budget recomputes a run of nodes
    # through two linears, whose unpacks free the recomputed inputs before their bias sums.
    import copy

    from benchmarks.fuzz_models import random_model
    from planner.measure.steps import steady_peak

    model, sample = random_model(1, "flat")
    traced = trace(model, sample)
    profile_sizes(traced.gm, traced.graph_inputs(*split_sample(sample)), torch.device("cpu"))
    late = {name: record.late_grad_bytes for name, record in _records(traced.gm).items() if record.late_grad_bytes}
    assert late == {name: 48 * 4 for name in ("stem", "fc1", "proj2")} | {"head": 10 * 4}
    on_meta = copy.deepcopy(model).to("meta")
    with pytest.raises(InfeasibleBudget) as refused:
        plan(on_meta, sample.to("meta"), budget_gb=0.4 * steady_peak(model, sample, torch.device("cpu")) / GIB)
    p = plan(on_meta, sample.to("meta"), budget_gb=refused.value.minimum_bytes / GIB)
    assert p.checkpoints
    measured = steady_peak(p.apply(copy.deepcopy(model)), sample, torch.device("cpu"))
    # Exact where the step peaks in backward (192 bytes high when the bias sum was counted beside
    # the recomputed input); a plan that node times make peak at the end of forward is 8 bytes
    # high: the loss, counted as static, is not made yet.
    assert 0 <= p.predicted_peak_bytes - measured <= 8


def test_python_numbers_autograd_saves_past_the_hooks_are_counted_on_their_device():
    # `h * 1.0` saves its 1.0 as an 8-byte CPU tensor, which autograd hands to no saved-tensor
    # hook (so no region drops it); `h * h` saves tensors the hooks see.
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return (h * 1.0 + h * h) / 3

    model, sample = Scaled(), torch.randn(4, 8)
    real, fake = _sizes_both_ways(model, sample)
    assert real == fake
    unhooked = {name: record["unhooked_saved_bytes"] for name, record in real.items()}
    assert unhooked == {"fc": 0, "mul": 8, "mul_1": 0, "add": 0, "truediv": 8}
    traced = trace(model.to("meta"), sample.to("meta"))  # planned for a GPU, the numbers stay on the host
    profile_sizes(traced.gm, traced.graph_inputs(*split_sample(sample.to("meta"))), torch.device("meta"))
    assert not any(record.unhooked_saved_bytes for record in _records(traced.gm).values())


def test_a_plan_made_on_meta_applies_to_the_real_model(tmp_path):
    real, tokens = small_gpt()
    reference = plan(real, tokens, budget_gb=80, solver="sqrt", repeats=1)
    budget_gb = 0.6 * reference.baseline_peak_bytes / GIB
    meta_model, meta_tokens = _meta_gpt()
    p = plan(meta_model, meta_tokens, budget_gb=budget_gb, repeats=1)
    assert p.checkpoints and p.profile.measurement == "node by node"
    assert p.problem.static_bytes == reference.problem.static_bytes  # sizes of nothing no more
    assert p.baseline_peak_bytes == pytest.approx(reference.baseline_peak_bytes, rel=0.02)
    with pytest.raises(ValueError, match="meta device"):
        p.verify()
    saved = load_plan(p.save(tmp_path / "plan.json"))
    module = saved.apply(real)
    from planner.measure.steps import verify_modules

    record = verify_modules(real, module, tokens, 1, p.predicted_peak_bytes, p.baseline_peak_bytes, p.budget_bytes)
    assert record.gradients_match and record.within_budget, str(record)
    assert abs(record.peak_error) <= 0.05, str(record)


def test_a_plan_for_a_target_gpu_is_labelled_an_estimate(tmp_path):
    meta_model, meta_tokens = _meta_gpt()
    p = plan(meta_model, meta_tokens, target="h100")
    assert p.budget_bytes == target("h100").memory_bytes == 80 * 10**9
    assert p.profile.times_estimated and not p.profile.scratch_measured
    assert "(estimate)" in str(p) and "roofline" in str(p)
    document = json.loads(p.save(tmp_path / "plan.json").read_text())
    assert document["times_estimated"] is True and document["planned_for"]["target"] == "h100-sxm"
    assert "(estimate)" in str(load_plan(tmp_path / "plan.json"))
    assert p.forward_ms > 0


def test_the_roofline_is_flops_over_throughput_or_bytes_over_bandwidth():
    gpu = target("a100-80gb")
    with KernelCounter() as counter:
        torch.randn(1024, 1024, dtype=torch.bfloat16) @ torch.randn(1024, 1024, dtype=torch.bfloat16)
    matmul = counter.kernels[-1]
    assert matmul.flops == 2 * 1024**3 and matmul.matrix
    assert gpu.kernel_ms(matmul) == pytest.approx(1000 * max(2 * 1024**3 / 312e12, 3 * 2 * 1024**2 / 2039e9))
    with KernelCounter() as counter:
        torch.randn(1 << 20).relu()
    relu = counter.kernels[-1]
    assert relu.flops == 0 and gpu.kernel_ms(relu) == pytest.approx(1000 * 8 * 2**20 / 2039e9)
    assert {t.name for t in targets()} >= {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "l4",
                                            "rtx-4090"}


def test_static_breakdown_follows_the_arithmetic():
    model = nn.ModuleDict({"embed": nn.Embedding(1000, 64),
                           "blocks": nn.ModuleList(nn.Linear(64, 64) for _ in range(4))})
    one = static_breakdown(model, 0, 0, torch.device("cuda"), "adamw", 1)
    params = (1000 * 64 + 4 * (64 * 64 + 64)) * 4
    assert one["parameters"] == one["gradients"] == params and one["optimizer state"] == 2 * params
    sharded = static_breakdown(model, 0, 0, torch.device("cuda"), "sgd-momentum", 8)
    assert sharded["parameters"] == params // 8 and sharded["optimizer state"] == params // 8
    assert sharded["root parameters, unsharded (FSDP)"] == 1000 * 64 * 4
    assert sharded["block parameters in flight (FSDP, 2 blocks)"] == 2 * (64 * 64 + 64) * 4
    odd = static_breakdown(nn.Linear(10, 3), 0, 0, torch.device("cuda"), 6.0, 4)  # 10 rows over 4 ranks
    assert odd["parameters"] == math.ceil(3 / 4) * 10 * 4 + 4 and odd["optimizer state"] == 6 * (10 + 1)
    p = plan(*small_gpt(), budget_gb=80, optimizer="adam", repeats=1)
    assert sum(p.static_breakdown.values()) == p.problem.static_bytes
    assert "optimizer state" in str(p)


@pytest.mark.parametrize("argument, value, message", [
    ("target", "h1000", "target must be one of a100-40gb"),
    ("world_size", 0, "world_size must be a whole number"),
    ("world_size", 2.5, "world_size must be a whole number"),
    ("optimizer", "lion", "optimizer must be one of 'sgd', 'sgd-momentum', 'adam', 'adamw'"),
    ("optimizer", -1, "optimizer must be one of"),
    ("measure", "sometimes", "measure must be one of 'auto', 'run', 'no-run'"),
    ("effort", "max", "effort must be one of 'normal', 'thorough'"),
])
def test_bad_arguments_name_the_argument_and_the_accepted_values(argument, value, message):
    model, tokens = small_gpt()
    with pytest.raises(ValueError, match=message):
        plan(model, tokens, **{argument: value})


def test_measuring_the_whole_step_of_a_meta_model_is_refused():
    meta_model, meta_tokens = _meta_gpt()
    with pytest.raises(ValueError, match="measure='no-run'"):
        plan(meta_model, meta_tokens, budget_gb=1, measure="run")


@pytest.mark.slow
def test_cli_plans_a_hugging_face_architecture_on_meta(capsys, tmp_path):
    pytest.importorskip("transformers")
    from planner.cli.main import main

    code = main(["plan", "hf:llama", "--config", "hidden_size=64,intermediate_size=128,num_hidden_layers=2,"
                 "num_attention_heads=4,num_key_value_heads=2,vocab_size=100", "--seq", "64", "--batch", "2",
                 "--target", "h100", "--world-size", "4", "--optimizer", "adamw", "--budget-gb", "0.01",
                 "--json", str(tmp_path / "plan.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "FSDP2 over 4 ranks" in out and "(estimate)" in out and "optimizer state" in out
    assert "times are estimates" in err
    assert json.loads((tmp_path / "plan.json").read_text())["planned_for"]["world_size"] == 4


@pytest.mark.slow
def test_cli_verifies_a_hugging_face_architecture_built_on_the_cpu(capsys):
    # --verify runs steps: the architecture is built with random weights on the CPU, not on meta
    # (where verify refused it), and its plan's own step ran in planning.
    pytest.importorskip("transformers")
    from planner.cli.main import main

    code = main(["plan", "hf:gpt2", "--config", "n_layer=2,n_embd=64,n_head=4,vocab_size=100,n_positions=64",
                 "--seq", "64", "--batch", "2", "--budget-gb", "0.004", "--verify", "--verify-steps", "1", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "its own step      ran on cpu in planning" in out and "Verification over 1 measured steps" in out
    assert [line.split() for line in out.splitlines() if "gradients match" in line] == [["gradients", "match", "yes"]]


def _saved_shapes(attention, query, key, value, **options) -> list[tuple[int, ...]]:
    saved: list[tuple[int, ...]] = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    mode = FakeTensorMode()
    q, k, v = (mode.from_tensor(t).requires_grad_() for t in (query, key, value))
    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(q, k, v, **options)
    return saved


def test_a_cuda_target_runs_grouped_query_attention_on_the_math_path():
    from planner.measure.targets import target_attention

    batch, heads, length, width = 2, 4, 32, 16
    query = torch.randn(batch, heads, length, width)
    fewer = torch.randn(batch, 2, length, width)
    matrix = (batch, heads, length, length)
    assert matrix in _saved_shapes(target_attention, query, fewer, fewer, is_causal=True, enable_gqa=True)
    assert matrix not in _saved_shapes(target_attention, query, query, query, is_causal=True)  # memory-efficient
    half = query.to(torch.bfloat16), fewer.to(torch.bfloat16), fewer.to(torch.bfloat16)
    assert matrix not in _saved_shapes(target_attention, *half, is_causal=True, enable_gqa=True)  # flash


class _Attention(nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_the_models_own_attention_is_counted_where_it_saves_more_than_the_graphs():
    # A grouped-query call (2 key/value heads for 4) as a CUDA GPU runs it in training: the math
    # path, which saves the attention matrix. Where the traced graph's attention node saves less
    # (another call: repeated heads and a mask, the efficient kernel), the plan counts the model's.
    import warnings

    from planner.measure.holds import AttentionSaves
    from planner.measure.paths import keep_attention_saves
    from planner.measure.targets import target_attention

    q = torch.randn(2, 4, 64, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 64, 16, requires_grad=True) for _ in range(2))
    with FakeTensorMode(allow_non_fake_inputs=True):
        with AttentionSaves(target_attention) as saves:
            _Attention()(q, k, v)
    assert saves.saved and saves.saved[0] >= 2 * 4 * 64 * 64 * 4  # the attention matrix, at least
    traced = trace(_Attention(), (q, k, v))
    profile_sizes(traced.gm, [q, k, v], torch.device("cpu"))
    node = next(n for n in traced.gm.graph.nodes if n.op == "call_function")
    before = node.meta[META_KEY].saved_bytes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keep_attention_saves(traced.gm, [before + 4096])
    assert node.meta[META_KEY].saved_bytes == before + 4096
    assert any(node.name in str(w.message) for w in caught)
    keep_attention_saves(traced.gm, [0])  # saving less than the graph lowers nothing
    assert node.meta[META_KEY].saved_bytes == before + 4096


def test_a_decoders_own_attention_on_fake_tensors_saves_what_it_saves_on_real_ones():
    # Without position ids or a mask, a real Hugging Face call never packs sequences and passes
    # no mask (SDPA's causal kernel); on fake tensors its code cannot read the position ids
    # and, left alone, builds a causal mask: each attention call then saves 2 MiB more here.
    pytest.importorskip("transformers")
    from models_hf import llama

    from planner.measure.holds import AttentionSaves, fake_eager_holds

    torch.manual_seed(0)
    model, sample = llama()
    sample = {**sample, "input_ids": torch.randint(0, 100, (2, 512)), "labels": None}
    traced = trace(model.train(), sample)
    inputs = traced.graph_inputs(*split_sample(sample))
    with AttentionSaves() as real:
        model(**sample)
    fake = fake_eager_holds(traced.gm, inputs, model, (), sample, torch.device("cpu"))
    assert len(real.saved) == 2 and fake.attention_saved == real.saved


class ViewedReads(nn.Module):
    """Gradients for views: a convolution reads a transposed linear output that an add reads
    too (its gradient for the view is a storage of its own until the transpose's backward),
    and a GELU reads a slice of the padded convolution's output (the slice's backward copies
    the GELU's gradient into a new one of the convolution's size), as wav2vec2's positional
    convolution does; then halves of a slice are negated and concatenated, as rotary
    embeddings do."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.conv = nn.Conv1d(width, width, 4, padding=2, groups=4)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        c = self.conv(h.transpose(1, 2))[:, :, :-1]
        h = h + nn.functional.gelu(c).transpose(1, 2)
        half = h.shape[-1] // 2
        rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
        return x + self.out(h * 2 + rotated)


def test_gradients_for_views_are_derived_as_the_whole_step_measures_them():
    import dataclasses

    from solvers.simulate import gradient_spans

    torch.manual_seed(0)
    model, x = nn.Sequential(*(ViewedReads() for _ in range(4))), torch.randn(8, 32, 64)
    measured = plan(model, x, budget_gb=80, repeats=1)
    problem = measured.problem
    derived = gradient_spans(dataclasses.replace(problem, measured_gradients=None))
    assert sorted(s for s in derived if s[2]) == sorted(s for s in problem.measured_gradients if s[2])
    # without the views' own storages, two of them are missing
    unviewed = dataclasses.replace(problem, measured_gradients=None,
                                   nodes=tuple(dataclasses.replace(n, view_grads=()) for n in problem.nodes))
    assert sorted(s for s in gradient_spans(unviewed) if s[2]) != sorted(s for s in derived if s[2])
    try:
        no_run = plan(model, x, budget_gb=0.75 * measured.baseline_peak_bytes / GIB, measure="no-run", repeats=1)
    except InfeasibleBudget as error:
        no_run = plan(model, x, budget_gb=error.minimum_bytes / GIB, measure="no-run", repeats=1)
    assert no_run.checkpoints
    record = no_run.verify(steps=1)
    assert record.within_budget and record.gradients_match, str(record)
    assert abs(record.peak_error) <= 0.001, str(record)


def test_planning_node_by_node_prints_no_profiler_warning():
    # A garbage collection inside a node's profile freed tensors made before it (the last node's,
    # in reference cycles), and the profiler printed "Memory block of unknown size was allocated
    # before the profiling started" to the user's terminal. (In a fresh process: it prints once.)
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import torch\n"
        "from torch import nn\n"
        "from planner import plan\n"
        "torch.manual_seed(0)\n"
        "embed = nn.Embedding(512, 128)\n"
        "blocks = [nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)) for _ in range(4)]\n"
        "model = nn.Sequential(embed, *blocks, nn.Linear(128, 512))\n"
        "plan(model, torch.randint(0, 512, (4, 256)), budget_gb=1, measure='no-run')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    assert "unknown size" not in done.stderr, done.stderr


class _ScaledByCast(nn.Module):
    """A weight read through a cast to its own dtype: export checks its metadata (a node that
    reads the weight and whose backward never runs) and aliases it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.scale = nn.Parameter(torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.linear(x) * self.scale.to(torch.float32)).relu().sum(-1)


def test_a_metadata_check_reading_a_weight_makes_no_gradient():
    torch.manual_seed(0)
    model, x = _ScaledByCast(), torch.randn(512, 64)
    p = plan(model, x, budget_gb=80, measure="no-run", frontend="export")
    grads = {node.name: node.param_grad_bytes for node in p.problem.nodes}
    assert grads["_assert_tensor_metadata_default"] == 0 and grads["mul"] == 64 * 4  # (made once, by the product)
    assert not any(node.shared_grads for node in p.problem.nodes)  # (the weight is not tied to anything)
    measured = plan(model, x, budget_gb=80, frontend="export")
    assert p.baseline_peak_bytes == measured.baseline_peak_bytes == measured.verify(steps=1).planned_peak_bytes


class _RelativeEmbeddings(nn.Module):
    """DeBERTa's relative embeddings: one weight passed through dropout at p=0 (which hands on
    the weight itself) and viewed by every layer, whose key and query projections both read the
    view. Each layer's gradient for the view is a storage of its own until the view's backward;
    the first layer's to get there is held until the last's has (the first layer's backward)."""

    def __init__(self, width: int = 64, span: int = 128, layers: int = 3) -> None:
        super().__init__()
        self.rel = nn.Parameter(torch.randn(span, width) * 0.02)
        self.layers = nn.ModuleList(nn.ModuleDict({"key": nn.Linear(width, width), "query": nn.Linear(width, width),
                                                   "mix": nn.Linear(width, width)}) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            rel = nn.functional.dropout(self.rel, 0.0, self.training)[: self.rel.shape[0]].unsqueeze(0)
            key, query = layer["key"](rel), layer["query"](rel)
            x = x + layer["mix"](torch.softmax(x @ key.transpose(-1, -2), -1) @ query)
        return x


def test_a_weight_viewed_by_every_layer_holds_its_gradients_as_autograd_does():
    torch.manual_seed(0)
    model, x = _RelativeEmbeddings(), torch.randn(4, 64, 64)
    unplanned = plan(model, x, budget_gb=80, repeats=1).baseline_peak_bytes
    for share in (0.7, 0.8, 0.9):  # (at 0.8 the plan read 2.6% low, over its budget, before)
        p = plan(model, x, budget_gb=share * unplanned / GIB, measure="no-run", repeats=1)
        record = p.verify(steps=1)
        assert record.within_budget and abs(record.peak_error) <= 0.001, f"{share}: {record}"
    from planner.problem.graph import parameter_gradient_paths

    nodes = compute_nodes(p._measurements.traced.gm)
    paths = parameter_gradient_paths(nodes, {node.name: i for i, node in enumerate(nodes)})["rel"]
    # one path a layer, from its view to the later of its two projections
    assert len(paths) == 3 and all(entry < maker for entry, maker in paths.items())
    assert all(nodes[maker].meta[META_KEY].parameters[0].endswith("query.weight") for maker in paths.values())


class _IgnoredOutput(nn.Module):
    """Returns its loss and a hidden state, transposed, that the loss does not read (as Swin
    returns its reshaped hidden states): no gradient ever reaches that output, nor through it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        wide = self.body[1](self.body[0](x))
        loss = nn.functional.cross_entropy(self.head(self.body[2](wide)), labels)
        return {"loss": loss, "wide": wide.transpose(0, 1).contiguous()}


def test_an_output_the_loss_does_not_read_gets_no_gradient():
    torch.manual_seed(0)
    model, sample = _IgnoredOutput(), {"x": torch.randn(512, 64), "labels": torch.randint(0, 8, (512,))}
    no_run = plan(model, sample, budget_gb=80, measure="no-run", repeats=1)
    record = no_run.verify(steps=1)
    assert abs(record.original_peak_error) <= 0.001, str(record)  # (its gradient was counted before)
    assert no_run.baseline_peak_bytes == plan(model, sample, budget_gb=80, repeats=1).baseline_peak_bytes


class _DepthwiseBlock(nn.Module):
    """ConvNeXt's block: a depthwise convolution, channels last for a norm and two linears,
    back, and added to the block's input (whose gradient arrives first, from the add)."""

    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.up, self.down = nn.Linear(channels, 4 * channels), nn.Linear(4 * channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.depthwise(x).permute(0, 2, 3, 1))
        return x + self.down(nn.functional.gelu(self.up(h))).permute(0, 3, 1, 2)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_a_depthwise_convolutions_backward_is_measured_node_by_node_as_in_the_whole_step(autocast):
    # The convolution's backward fills a workspace before it returns; under autocast the cast
    # weight's float32 gradient is made after it, when the incoming gradient is gone. Each
    # operator's scratch is counted where that operator returns in the fake pass's backward:
    # taken as the window's allocator peak less its tensor peak, this read 3 200 B low here
    # (2 048 B on ConvNeXt).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 1), _DepthwiseBlock(), _DepthwiseBlock())
    x = torch.randn(2, 3, 8, 8)
    plans = {measure: plan(model, x, budget_gb=80, measure=measure, repeats=1, autocast=autocast)
             for measure in ("run", "no-run")}
    run, no_run = ({n.name: n.backward_transient_bytes for n in plans[m].problem.nodes} for m in ("run", "no-run"))
    assert run == no_run


class _Recurrent(nn.Module):
    """Residual recurrent layers (LSTM or GRU) over embeddings, with a loss."""

    def __init__(self, kind: type[nn.Module] = nn.LSTM, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(500, width)
        self.lstms = nn.ModuleList(kind(width, width, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(width, 500)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embedding(ids)
        for lstm in self.lstms:
            h = h + lstm(h)[0]
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("measure", ["auto", "no-run"])
def test_an_lstm_plans_within_its_budget_on_both_paths(measure):
    # On the CPU an LSTM runs mkldnn's layer kernel, which saves a workspace for its backward
    # that its fake kernel makes empty (node by node the unplanned peak read 48% low here) and
    # that it makes only while gradients are on (a run's replay, under no_grad, handed backward
    # None and planning stopped).
    torch.manual_seed(0)
    ids = torch.randint(0, 500, (16, 64))
    model, sample = _Recurrent(), {"ids": ids, "labels": ids}
    unplanned = plan(model, sample, budget_gb=80, repeats=1, measure=measure)
    assert abs(unplanned.verify(steps=1).original_peak_error) <= 0.005
    p = plan(model, sample, budget_gb=0.6 * unplanned.baseline_peak_bytes / GIB, measure=measure)
    record = p.verify(steps=1)
    high = 0.005 if measure == "auto" else 0.05  # (node by node it errs high: +3.3% here)
    assert p.checkpoints and record.within_budget and -0.001 <= record.peak_error <= high, str(record)
    assert record.gradients_match and record.outputs_match


@pytest.mark.parametrize("measure", ["auto", "no-run"])
def test_a_grus_unplanned_peak_is_predicted_on_both_paths(measure):
    # Inside a GRU, `aten::linear` (composite, though its `out` overload has a kernel of its own)
    # makes and frees the input projection of every time step: the whole-step path counted it as
    # a temporary and again as the operator's scratch, and read the unplanned peak 12.7% high.
    torch.manual_seed(0)
    grus = nn.ModuleList(nn.GRU(64, 64, batch_first=True) for _ in range(2))
    model = nn.Sequential(_Residual(grus[0]), _Residual(grus[1]), nn.Linear(64, 1))
    unplanned = plan(model, torch.randn(16, 64, 64), budget_gb=80, repeats=1, measure=measure)
    assert abs(unplanned.verify(steps=1).original_peak_error) <= 0.001


class _Residual(nn.Module):
    """x + the recurrent layer's output sequence."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layer(x)[0]
