import copy
from typing import Callable

import pytest
import torch
from torch import nn

from planner.examples import TinyGPT, cnn, mlp


def small_gpt() -> tuple[nn.Module, torch.Tensor]:
    """The built-in transformer (8 blocks, dropout, layer norm) at a test-sized input."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, width=32, heads=4, blocks=8, context=32, dropout=0.1)
    return model, torch.randint(0, 128, (4, 32))


def small_mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return mlp(width=64, depth=12, batch=256)


def small_cnn() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return cnn(batch=8, size=16)


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "mlp": small_mlp,
    "cnn": small_cnn,
    "gpt": small_gpt,
}


def train_step(module: nn.Module, sample: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward+backward with a fixed RNG seed; returns the output and parameter gradients."""
    for parameter in module.parameters():
        parameter.grad = None
    torch.manual_seed(seed)
    output = module(sample)
    output.float().pow(2).mean().backward()
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters()}
    for parameter in module.parameters():
        parameter.grad = None
    return output.detach(), grads


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.fixture(params=sorted(MODELS))
def example(request: pytest.FixtureRequest) -> tuple[str, nn.Module, torch.Tensor]:
    model, sample = MODELS[request.param]()
    return request.param, model, sample


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
