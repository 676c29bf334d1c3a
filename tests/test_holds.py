"""planner.measure.holds: what the model's own forward keeps alive that the traced graph does not show."""
import pytest
import torch
import torch.fx
from torch import nn

from planner.measure.holds import eager_holds


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Holding(nn.Module):
    """Keeps `first` in a list until it returns; passes `first` to a call that ignores it (by
    keyword with `by_keyword`, as Hugging Face models pass a layer its position ids)."""

    def __init__(self, by_keyword: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.inner = Inner()
        self.by_keyword = by_keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = [self.a(x)]
        second = torch.relu(kept[0])
        third = self.b(second)
        if self.by_keyword:
            return self.inner(third, unused=kept[0]) * 2
        return self.inner(third, kept[0]) * 2


@pytest.mark.parametrize("by_keyword", [False, True])
def test_a_local_kept_until_return_and_an_unread_argument_are_found(by_keyword):
    model, x = Holding(by_keyword), torch.randn(4, 8)
    gm = torch.fx.symbolic_trace(model)  # Inner is traced through: its call starts at inner_fc
    lifetimes = eager_holds(gm, [x], lambda: model(x))
    # No global module hook, nor a flag of one, is left to slow (and warn) the user's own calls.
    hooks = torch.nn.modules.module
    assert not (hooks._global_forward_pre_hooks or hooks._global_forward_hooks
                or hooks._global_forward_hooks_with_kwargs or hooks._global_forward_hooks_always_called)
    # The graph frees each output after its last reader; the list and the locals keep them
    # until forward returns, during its last call (mul).
    assert lifetimes.holds == {"a": "mul", "relu": "mul", "b": "mul"}
    # Each call's tensors (read or not) by the call's first node; the sample is no node's.
    assert lifetimes.arguments == {"b": {"relu"}, "inner_fc": {"a", "b"}}


class _ParallelBranches(nn.Module):
    """Phi's layer: attention and MLP read one norm; a dropout of p=0 (a module call that makes
    no ATen call) is applied to the attention's output just before the MLP's call."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.0)
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended = self.drop(self.attn(x))
        return attended + self.drop(self.mlp(x)) + x


def test_a_call_that_makes_no_aten_call_passes_nothing_to_the_next_call():
    # The dropout's call makes no ATen call; counted from the next one, its argument would be
    # taken for the MLP's, held to the MLP's backward where a plan checkpoints it (Phi, 2.5% high).
    model, x = _ParallelBranches().train(), torch.randn(4, 8)
    gm = torch.fx.symbolic_trace(model)
    lifetimes = eager_holds(gm, [x], lambda: model(x))
    assert lifetimes.arguments == {"mlp_1": {"mlp_0"}, "mlp_2": {"mlp_1"}}  # (the sample is no node's)


def test_calls_of_the_models_own_are_matched_around_and_work_it_does_not_do_reports_nothing():
    model, x = Holding(), torch.randn(4, 8)
    gm = torch.fx.symbolic_trace(model)
    alone = eager_holds(gm, [x], lambda: model(x))
    extra = eager_holds(gm, [x], lambda: model(x) + 1)  # one more ATen call than the graph
    assert (extra.holds, extra.arguments) == (alone.holds, alone.arguments)
    fewer = eager_holds(gm, [x], lambda: model.inner(model.b(torch.relu(model.a(x))), x))  # no mul
    assert fewer.holds == {} and fewer.arguments == {}


class _ConstantScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))  # held by this local to the end of forward
        out = self.fc2(h * torch.tensor(2.0).to(h.dtype))
        return self.fc3(out)


def test_holds_are_measured_where_an_exported_graph_makes_its_calls_a_little_differently():
    # torch.export makes the constant `lift_fresh_copy` (the model: `lift_fresh`) and adds an
    # `_assert_tensor_metadata` call; the two runs are matched around those.
    from planner.trace.tracing import trace

    model, x = _ConstantScaled(), torch.randn(4, 8, requires_grad=True)
    traced = trace(model, (x,), frontend="export")
    targets = [str(node.target) for node in traced.gm.graph.nodes]
    assert "aten.lift_fresh_copy.default" in targets and "aten._assert_tensor_metadata.default" in targets
    lifetimes = eager_holds(traced.gm, traced.graph_inputs((x,), {}), lambda: model(x))
    assert lifetimes.holds == {"tanh": "linear_2"}


def test_calls_are_matched_around_the_models_own_checks_and_the_traces_metadata_checks():
    from planner.measure.holds import _matched_calls

    layer = ["aten.view.default", "aten.mm.default", "aten.add.Tensor", "aten.view.default"]
    graph = layer + ["aten._assert_tensor_metadata.default"] + layer * 3
    check = ["aten.select.int", "aten.eq.Scalar", "aten.all.default", "aten._local_scalar_dense.default"]
    model = layer + check + layer * 3  # a check of the model's own where the graph checks metadata
    matched = _matched_calls(model, graph)
    assert matched is not None
    assert [matched[i] for i in range(4)] == [0, 1, 2, 3]
    assert all(matched[i] is None for i in range(4, 8))  # the check
    assert [matched[i] for i in range(8, 20)] == list(range(5, 17))
    assert _matched_calls(layer * 4, layer * 4) == list(range(16))
    assert _matched_calls(layer, layer + ["aten.mul.Tensor"]) is None  # work the model does not do


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return h + self.fc2(torch.relu(self.fc1(h)))  # `positions` unread, as an HF decoder layer's


class _PositionsAndOwnLoss(nn.Module):
    """Passes each layer position ids by keyword, which it does not read, and returns its own
    loss (as a Hugging Face model given labels)."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        positions = torch.arange(x.shape[0] * 4, device=x.device) + 1  # 16 KiB at 512 rows
        h = x
        for layer in self.layers:
            h = layer(h, positions=positions)
        return {"loss": nn.functional.mse_loss(self.head(h), target)}


@pytest.mark.parametrize("measure", ["auto", "no-run"])
def test_a_checkpointed_call_holds_its_keyword_arguments_and_the_caller_its_loss(measure):
    # A checkpoint holds every argument of the call it wraps until that call's backward, keyword
    # ones included; the caller holds the loss the model returns through backward: on a CPU an
    # mse_loss's scalar keeps the storage of its 64 KiB of elementwise losses, which fake tensors
    # do not show and running the node alone does. Planned below the unplanned peak, on either
    # path the prediction is the measured peak to the byte (without these, 16 or 64 KiB low).
    from planner import plan
    from planner.api import GIB
    from planner.measure.steps import steady_peak

    torch.manual_seed(0)
    model, sample = _PositionsAndOwnLoss(), (torch.randn(512, 32), torch.randn(512, 32))
    unplanned = steady_peak(model, sample, torch.device("cpu"))
    p = plan(model, sample, budget_gb=0.8 * unplanned / GIB, measure=measure)
    assert p.checkpoints
    record = p.verify(steps=1)
    assert record.within_budget and record.gradients_match
    assert record.predicted_peak_bytes == record.planned_peak_bytes
    assert p.baseline_peak_bytes == unplanned


class _HandCheckpointed(nn.Module):
    """Checkpoints its first layer by hand, as users did before a planner."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(32) for _ in range(3))
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.layers[0], x, use_reentrant=self.use_reentrant)
        return self.layers[2](self.layers[1](h))


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("measure", ["auto", "no-run"])
def test_a_model_that_checkpoints_its_own_calls_is_refused(use_reentrant, measure):
    from torch.utils import checkpoint as module

    from planner import plan
    from planner.measure.holds import OwnCheckpoints

    originals = (module.checkpoint, module.CheckpointFunction, module._checkpoint_without_reentrant_generator)
    x = torch.randn(64, 32, requires_grad=True)
    with pytest.raises(OwnCheckpoints, match=r"calls torch.utils.checkpoint itself \(1 call\)"):
        plan(_HandCheckpointed(use_reentrant), x, budget_gb=80, measure=measure)
    assert (module.checkpoint, module.CheckpointFunction, module._checkpoint_without_reentrant_generator) == originals
