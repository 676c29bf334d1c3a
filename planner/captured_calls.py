"""One submodule call taken out of the model to be timed alone: its arguments captured from a
forward, fresh copies of them for each timed call, and a backward through what it returned
(`planner.block_costs`, `planner.call_costs`).

Example:
    >>> args, kwargs = captured_call(model, "blocks.0", lambda: model(x))
    >>> block = model.get_submodule("blocks.0")
    >>> backward_from(block, block(*fresh_inputs(args), **kwargs))
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from planner.profile import tensors_in


def captured_call(model: nn.Module, path: str, run_model: Callable[[], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of the first call of `model`'s submodule `path` in one forward
    (`run_model()`, under no_grad), each floating-point tensor made a leaf that needs grad,
    like an intermediate activation. Raises RuntimeError where the forward does not call it.

    Example:
        >>> args, kwargs = captured_call(model, "blocks.0", lambda: model(x))
    """
    module = model.get_submodule(path)
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def capture(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not captured:
            captured.append((args, dict(kwargs)))

    handle = module.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            run_model()
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{path!r} was not called by the model's forward")
    args, kwargs = captured[0]
    return tuple(a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args), kwargs


def fresh_inputs(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """New non-leaf copies of the captured arguments that need grad, for one call: its forward
    may write them in place.

    Example:
        >>> block(*fresh_inputs(args), **kwargs)
    """
    return tuple(a.clone() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)


def backward_from(module: nn.Module, output: Any) -> None:
    """Backward from `output` (a sum of its tensors that need grad); `module`'s gradients reset.

    Example:
        >>> backward_from(block, block(*fresh_inputs(args), **kwargs))
    """
    loss = sum(t.float().sum() for t in tensors_in(output) if t.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    clear_grads(module)


def clear_grads(module: nn.Module) -> None:
    """`module`'s parameters without gradients, as a training loop's `set_to_none` leaves them."""
    for parameter in module.parameters():
        parameter.grad = None


__all__ = ["backward_from", "captured_call", "clear_grads", "fresh_inputs"]
