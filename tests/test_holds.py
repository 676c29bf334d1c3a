"""planner.measure.holds: what the model's own forward keeps alive that the traced graph does not show."""
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
    """Keeps `first` in a list until it returns; passes `first` to a call that ignores it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = [self.a(x)]
        second = torch.relu(kept[0])
        third = self.b(second)
        return self.inner(third, kept[0]) * 2


def test_a_local_kept_until_return_and_an_unread_argument_are_found():
    model, x = Holding(), torch.randn(4, 8)
    gm = torch.fx.symbolic_trace(model)  # Inner is traced through: its call starts at inner_fc
    lifetimes = eager_holds(gm, [x], lambda: model(x))
    # The graph frees each output after its last reader; the list and the locals keep them
    # until forward returns, during its last call (mul).
    assert lifetimes.holds == {"a": "mul", "relu": "mul", "b": "mul"}
    # Each call's tensors (read or not) by the call's first node; the sample is no node's.
    assert lifetimes.arguments == {"b": {"relu"}, "inner_fc": {"a", "b"}}


def test_different_calls_report_nothing():
    model, x = Holding(), torch.randn(4, 8)
    gm = torch.fx.symbolic_trace(model)
    lifetimes = eager_holds(gm, [x], lambda: model(x) + 1)  # one more ATen call than the graph
    assert lifetimes.holds == {} and lifetimes.arguments == {}
