"""Memory truth: the CPU tracker, verify(), budgets and their errors."""
import copy
import dataclasses
import math

import pytest
import torch
from conftest import MODELS, small_gpt
from torch import nn

from planner import InfeasibleBudget, plan
from planner.api import GIB
from planner.core import training_loss
from planner.measure import steps as verify
from planner.measure.allocations import ProfiledPeakMemory
from planner.measure.memory import LiveBytesTracker, PeakMemory
from planner.plans.document import verification_from_record


def test_tracker_counts_new_storages_once_and_frees_them():
    weight = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(64, 256)
    with LiveBytesTracker() as tracker:
        y = (x @ weight).relu()  # the matmul result is freed by relu's out-of-place result
        assert tracker.live_bytes == 64 * 256 * 4
        view = y.t()  # a view allocates nothing
        assert tracker.live_bytes == 64 * 256 * 4
        y.sum().backward()
        del y, view
    # Only weight.grad is left of what was allocated inside.
    assert tracker.live_bytes == 256 * 256 * 4
    # Backward peak: y + its gradient + weight.grad (+ 8 bytes of scalars).
    assert tracker.peak_bytes == 64 * 256 * 4 * 2 + 256 * 256 * 4 + 8


def test_the_trackers_log_names_each_storage_once_though_python_reuses_ids():
    # A freed storage's id goes to a later one; logged by id, the fake pass's backward windows
    # paired a gradient sum with the wrong storage now and then (fuzz seed 6: a convolution's
    # backward read a gradient low, and its no-run plan measured 1.5% over its budget).
    log: list[tuple[int, int, int]] = []
    with LiveBytesTracker(log=log):
        for _ in range(100):
            scratch = torch.ones(64) * 2  # (the storages' ids are reused, the more so the longer)
            del scratch
    made = [key for _, size, key in log if size > 0]
    freed = [key for _, size, key in log if size < 0]
    assert made == list(range(1, 201)) and freed == made  # each named by its place in allocation order


def test_tracker_agrees_with_torch_mem_tracker():
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    x = torch.randn(64, 128)
    model(x).sum().backward()  # gradients allocated before measuring
    reference = mem_tracker.MemTracker()
    reference.track_external(model)
    with reference:
        model(x).sum().backward()
    with LiveBytesTracker() as ours:
        model(x).sum().backward()
    reference_peak = reference.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    static = sum(p.numel() * 4 * 2 for p in model.parameters()) + x.numel() * 4
    assert ours.peak_bytes + static == pytest.approx(reference_peak, rel=0.02)


def test_allocator_peak_is_the_tracker_peak_plus_kernel_scratch():
    # oneDNN convolutions allocate scratch that no tensor holds: PeakMemory (the allocator's
    # events) counts it, the tensor tracker cannot; without it the two agree exactly.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1))
    x = torch.randn(4, 8, 32, 32)
    model(x).sum().backward()
    with LiveBytesTracker() as tensors:
        model(x).sum().backward()
    with ProfiledPeakMemory() as allocator:
        model(x).sum().backward()
    with PeakMemory(torch.device("cpu")) as memory:
        model(x).sum().backward()
    assert allocator.peak_bytes_without_scratch == tensors.peak_bytes
    assert memory.peak_bytes == allocator.peak_bytes > tensors.peak_bytes


@pytest.mark.parametrize("name", sorted(MODELS))
def test_measured_peak_is_within_ten_percent_of_prediction(name):
    model, sample = MODELS[name]()
    p = plan(model, sample, budget_gb=80, solver="sqrt", repeats=1)
    p = p.replan(budget_gb=0.8 * p.baseline_peak_bytes / GIB)
    record = p.verify(steps=1)
    assert record.outputs_match and record.gradients_match
    assert abs(record.original_peak_error) <= 0.10, str(record)
    assert abs(record.peak_error) <= 0.10, str(record)
    assert record.within_budget, str(record)
    assert record.predicted_overhead_ms == p.recompute_ms and record.overhead_ms is not None
    assert "Verification" in str(p), "the report shows measured figures once verified"


def test_convolution_scratch_is_predicted():
    # The measured peak is the allocator's, convolution scratch included; the profiler adds
    # that scratch to each node's temporaries, so the prediction stays within 1%.
    model, sample = MODELS["cnn"]()
    p = plan(model, sample, budget_gb=80, repeats=1)
    p = p.replan(budget_gb=0.7 * p.baseline_peak_bytes / GIB)
    record = p.verify(steps=1)
    assert abs(record.original_peak_error) <= 0.01 and abs(record.peak_error) <= 0.01, str(record)
    assert record.within_budget, str(record)


def test_each_node_carries_its_own_kernel_scratch():
    # A 1x1 convolution on CPU copies its input into oneDNN's layout (scratch no tensor holds):
    # the profiled node's forward temporaries must include it, as a lone call measures it.
    import torch.fx

    from planner.measure.profile import META_KEY, profile

    class Concat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Conv2d(32, 16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(torch.cat([x, x], dim=1))

    x = torch.randn(8, 16, 12, 12, requires_grad=True)
    gm = torch.fx.symbolic_trace(Concat())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (with one thread, as under pytest-xdist, oneDNN copies nothing)
    try:
        profile(gm, [x], repeats=1)
        joined = torch.cat([x, x], dim=1)
        with ProfiledPeakMemory() as alone:
            gm.proj(joined)
    finally:
        torch.set_num_threads(threads)
    scratch = alone.peak_bytes - alone.peak_bytes_without_scratch
    node = next(n for n in gm.graph.nodes if n.target == "proj")
    assert scratch > 0
    assert node.meta[META_KEY].transient_bytes == scratch
    # It saves its input before its kernel runs: recomputation stopped there holds none of it.
    assert node.meta[META_KEY].stops_before_output
    assert node.meta[META_KEY].stop_transient_bytes == 0


def test_verify_leaves_the_model_as_it_was():
    model, tokens = small_gpt()
    p = plan(model, tokens, budget_gb=80, solver="sqrt", repeats=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    p.verify(steps=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(parameter.grad is None for parameter in model.parameters())


def test_verify_reads_the_step_overhead_from_paired_steps_beside_the_prediction(monkeypatch):
    torch.manual_seed(0)
    model, x = nn.Linear(8, 8), torch.randn(4, 8)
    clock = iter([10.0, 13.0, 20.0, 21.0, 10.0, 19.0])  # (original, planned) in each of 3 steps
    monkeypatch.setattr(verify, "step_ms", lambda module, sample, device: next(clock))
    record = verify.verify_modules(model, copy.deepcopy(model), x, 3, 1, 1, 1 << 20, predicted_overhead_ms=2.5)
    # the median of each step's difference (3, 1, 9), not the difference of the medians (19 - 10)
    assert record.overhead_ms == 3.0 and record.planned_step_ms - record.original_step_ms == 9.0
    assert "step overhead" in str(record) and "+3.0 ms      2.5 ms  -0.5 ms" in str(record)
    saved = {key: value for key, value in dataclasses.asdict(record).items()
             if key not in ("overhead_ms", "predicted_overhead_ms")}  # a record saved before they were
    old = verification_from_record(saved)
    assert old.overhead_ms is None and "step overhead" not in str(old)


def test_infeasible_budget_names_the_minimum_and_what_dominates():
    model, tokens = small_gpt()
    p = plan(model, tokens, budget_gb=80, solver="sqrt", repeats=1)
    with pytest.raises(InfeasibleBudget) as caught:
        p.replan(budget_gb=p.problem.static_bytes / GIB)
    error = caught.value
    assert error.minimum_bytes > error.budget_bytes
    assert error.static_bytes == p.problem.static_bytes
    # The minimum really fits: planning at it succeeds.
    fitted = p.replan(budget_gb=error.minimum_bytes / GIB + 1e-9)
    assert fitted.predicted_peak_bytes <= error.minimum_bytes
    assert "below the minimum" in str(error) and "dominate" in str(error)


def test_static_memory_alone_over_budget_says_so():
    model, tokens = small_gpt()
    with pytest.raises(InfeasibleBudget, match="static memory dominates"):
        plan(model, tokens, budget_gb=80, reserved_gb=79.9999, solver="sqrt", repeats=1)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "4", True])
def test_bad_budget_values_are_rejected(bad):
    model, tokens = small_gpt()
    with pytest.raises(ValueError, match="budget_gb"):
        plan(model, tokens, budget_gb=bad)


@pytest.mark.parametrize("bad", [-1.0, math.nan, "1"])
def test_bad_reserve_values_are_rejected(bad):
    model, tokens = small_gpt()
    with pytest.raises(ValueError, match="reserved_gb"):
        plan(model, tokens, budget_gb=1.0, reserved_gb=bad)


def test_training_loss_prefers_the_models_own_loss():
    loss = torch.tensor(2.0, requires_grad=True)
    assert training_loss({"loss": loss, "logits": torch.ones(3, requires_grad=True)}) is loss
    assert training_loss((torch.ones(2, requires_grad=True), 3)).item() == 2.0
    with pytest.raises(ValueError, match="requires grad"):
        training_loss(torch.ones(2))


class _NormBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.fc(x)))


def test_a_region_holding_batchnorm_is_predicted_with_the_statistics_it_copies_to_recompute():
    # Recomputation copies the running statistics it writes (to put them back after), 2056 B per
    # norm here, while the last block recomputes, at the peak: on the CPU, predicted to the byte
    # (without the copies, 8 B under the measured peak).
    torch.manual_seed(0)
    model = nn.Sequential(*(_NormBlock(256) for _ in range(3)), nn.Linear(256, 8)).train()
    sample = torch.randn(512, 256)
    p = plan(model, sample, budget_gb=80, repeats=1)
    assert [node.buffer_bytes for node in p.problem.nodes if node.buffer_bytes] == [2 * 256 * 4 + 8] * 3
    for blocks in (["2"], ["1", "2"], ["0", "1", "2"]):
        record = p.with_submodules(blocks).verify(steps=1)
        assert record.planned_peak_bytes == record.predicted_peak_bytes, (blocks, str(record))
