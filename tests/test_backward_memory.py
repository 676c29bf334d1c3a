"""Backward's memory as measured: gradients in flight between nodes, branches whose backward
never runs, and where recomputation that stops at a node leaves its output unmade."""
import pytest
import torch
from torch import nn

from planner import plan
from planner.measure.allocations import LOSS_BACKWARD, AllocationEvent, window_memory


def test_window_memory_finds_gradients_in_flight_and_temporaries():
    events = [
        AllocationEvent(0, 100, 1, None),  # forward: not a gradient
        AllocationEvent(2, 8, 2, None),  # made after backward began, before the first window: the loss's
        AllocationEvent(4, 16, 3, None),  # made by "add", freed by "relu": in flight
        AllocationEvent(5, 32, 4, None),  # a temporary of "add"
        AllocationEvent(6, -32, 4, None),
        AllocationEvent(9, 64, 5, None),  # never freed (a parameter's .grad)
        AllocationEvent(10, -8, 2, None),
        AllocationEvent(11, -16, 3, None),
        AllocationEvent(12, -100, 1, None),
    ]
    memory = window_memory(events, [(3, "add"), (8, "relu")], backward_start=1)
    assert sorted(memory.gradients) == [(LOSS_BACKWARD, "relu", 8), ("add", "relu", 16)]
    assert memory.temporaries == {"add": 32, "relu": 0}
    assert window_memory(events, [(3, "add"), (8, "relu")]).gradients == [("add", "relu", 16)]


def test_a_shared_parameters_gradient_made_early_is_in_flight_until_its_first_reader():
    # A tied weight read by "embed" and "head": head's backward makes the buffer that embed's
    # gradient is summed into in place, which becomes `.grad` (never freed).
    events = [AllocationEvent(4, 64, 7, None), AllocationEvent(9, 64, 8, None), AllocationEvent(10, -64, 8, None)]
    starts = [(3, "head"), (8, "embed")]
    assert window_memory(events, starts, settled={7: "embed"}).gradients == [("head", "embed", 64)]
    assert window_memory(events, starts, settled={7: "head"}).gradients == []
    assert window_memory(events, starts).gradients == []


class DeadBranch(nn.Module):
    """`gelu(h)`, then `relu_` on it, which nothing returned depends on: autograd never runs
    their backward, so what they saved is freed with the result when `forward` returns."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        unused = torch.relu_(self.act(h))
        out = self.fc2(h) * 2
        del unused
        return out


def test_a_branch_whose_backward_never_runs_saves_nothing_for_backward():
    torch.manual_seed(0)
    p = plan(DeadBranch(), torch.randn(512, 64), budget_gb=80, repeats=1)
    names = [node.name for node in p.problem.nodes]
    for name in ("act", "relu_"):
        node = p.problem.nodes[names.index(name)]
        assert not node.saves and not node.saved_bytes, name
    assert p.problem.measured_gradients is not None
    check = p.verify(steps=1)
    assert abs(check.original_peak_error) <= 0.01, check


def test_recomputation_stops_before_the_output_of_a_node_that_saves_only_its_inputs():
    # Linear, GELU and dropout's product save inputs (or a mask) before their last kernel runs;
    # ReLU saves its result and LayerNorm its statistics, both made by the kernel.
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.ReLU(), nn.Dropout(0.1), nn.LayerNorm(8), nn.Linear(8, 8))
    p = plan(model, torch.randn(4, 8), budget_gb=80, repeats=1)
    stops = {node.name: node.stops_before_output for node in p.problem.nodes}
    assert stops == {"_0": True, "_1": True, "_2": False, "_3": True, "_4": False, "_5": True}


class ReturnsAnIntermediate(nn.Module):
    """A block with dropout that returns an early result next to its last: recomputing it
    forks the RNG state, and the early result stays referenced until recomputation stops."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        early = self.fc1(x)
        hidden = nn.functional.dropout(torch.tanh(self.fc2(early)), 0.2, self.training)
        return torch.tanh(self.fc3(hidden)), early


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block1, self.block2 = ReturnsAnIntermediate(), ReturnsAnIntermediate()
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last, early = self.block1(x)
        last, early = self.block2(last * early)
        return self.head(last * early)


def test_recomputation_holds_what_the_region_returns_and_a_forked_rng_state():
    torch.manual_seed(0)
    base = plan(TwoOutputs(), torch.randn(256, 64), budget_gb=80, repeats=1)
    # Checkpoint both blocks whatever the solver would choose: their recomputation is the peak.
    p = base.with_submodules(["block1", "block2"])
    assert [c.wrapped.module for c in p.checkpoints] == ["block1", "block2"]
    check = p.verify(steps=1)
    assert check.gradients_match
    assert abs(check.peak_error) <= 0.001, check


def test_a_plan_of_given_submodules_names_what_it_cannot_checkpoint():
    base = plan(TwoOutputs(), torch.randn(8, 64), budget_gb=80, repeats=1)
    with pytest.raises(ValueError, match="'block3' is not a submodule call"):
        base.with_submodules(["block1", "block3"])


@pytest.mark.parametrize("build", ["small_gpt", "vit"])
def test_planning_a_model_that_has_gradients_measures_a_fresh_step(build):
    # Mid-training, `.grad` holds the last step's gradients; autograd then adds each new one
    # into it, leaving temporaries that a training loop zeroing with set_to_none never has.
    import conftest
    import models_hf

    from planner.core import split_sample, training_loss

    model, sample = getattr(conftest, build)() if build == "small_gpt" else models_hf.vit()
    fresh = plan(model, sample, budget_gb=80, repeats=1)
    args, kwargs = split_sample(sample)
    training_loss(model(*args, **kwargs)).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    again = plan(model, sample, budget_gb=80, repeats=1)
    assert again.problem.measured_gradients == fresh.problem.measured_gradients
    assert again.baseline_peak_bytes == fresh.baseline_peak_bytes
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), f"{name}: planning changed its gradient"


class _ReadsAWeightDetached(nn.Module):
    """Reads its second layer's weight detached (a scale; as a metadata check reads one): a
    reader with no backward, which makes that weight no shared one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 1024)
        self.b = nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.b.weight.detach().abs().mean()
        return self.b(torch.relu(self.a(x))) * scale


def test_a_reader_without_backward_does_not_make_a_parameters_gradient_one_in_flight():
    from planner.api import GIB
    from planner.measure.steps import steady_peak

    torch.manual_seed(0)
    model, x = _ReadsAWeightDetached(), torch.randn(512, 256)
    unplanned = steady_peak(model, x, torch.device("cpu"))
    p = plan(model, x, budget_gb=unplanned / GIB)
    assert p.baseline_peak_bytes == unplanned  # (+1 MiB, the weight's gradient, were the detach a reader)
