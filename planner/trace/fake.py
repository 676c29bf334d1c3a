"""Fake copies of tensors and of a model's state: shapes, strides and dtypes, no memory.

Used to trace a model built on the `meta` device as it would trace on the plan's device (so
its graph is the real model's, device constants included) and to profile sizes without
running anything (`planner.measure.sizes`).

Example:
    >>> mode = FakeTensorMode()
    >>> with fake_model_state(model, mode, torch.device("cpu")):
    ...     model(fake_like(x, mode, torch.device("cpu")))  # on fake tensors
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module


def fake_like(tensor: torch.Tensor, mode: FakeTensorMode, device: torch.device) -> torch.Tensor:
    """A fake tensor with `tensor`'s shape, strides, dtype and requires_grad on `device`.

    Example:
        >>> fake_like(torch.empty(2, 3, device="meta"), FakeTensorMode(), torch.device("cpu")).device
        device(type='cpu')
    """
    with mode:
        fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    return fake.requires_grad_(tensor.requires_grad) if fake.is_floating_point() else fake


def fake_state(module: nn.Module, mode: FakeTensorMode, device: torch.device) -> dict[str, torch.Tensor]:
    """Fake copies of `module`'s parameters (as Parameters) and buffers, by qualified name
    (a tied parameter once, under its first name).

    Example:
        >>> fake_state(nn.Linear(2, 2), FakeTensorMode(), torch.device("cpu"))["weight"].shape
        torch.Size([2, 2])
    """
    state: dict[str, torch.Tensor] = {}
    for name, parameter in module.named_parameters():
        state[name] = nn.Parameter(fake_like(parameter, mode, device), requires_grad=parameter.requires_grad)
    for name, buffer in module.named_buffers():
        state[name] = fake_like(buffer, mode, device)
    return state


@contextmanager
def fake_model_state(module: nn.Module, mode: FakeTensorMode, device: torch.device,
                     state: dict[str, torch.Tensor] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Run `module` on fake copies of its state (`state`, else new ones) for the duration of
    the block; it is left as it was afterwards.

    Example:
        >>> with fake_model_state(model, mode, torch.device("cpu")) as state:
        ...     ...
    """
    state = fake_state(module, mode, device) if state is None else state
    with _reparametrize_module(module, state, tie_weights=True):
        yield state
