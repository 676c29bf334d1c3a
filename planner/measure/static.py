"""Static memory as the user's run will hold it: the part of the peak no plan changes.

Per rank: parameters, their gradients and the optimizer's state (`optimizer=`: "sgd" keeps
none, "sgd-momentum" one buffer per parameter, "adam" and "adamw" two; or a number of bytes
per parameter element), buffers, the sample's inputs and a reserve. (The RNG states
checkpoint keeps depend on the plan: the simulator counts one per random region.) With FSDP2
(`world_size=N` > 1, `fully_shard` on each block and then on the root, as PyTorch's FSDP2 and
Hugging Face's FSDP integration do):

* parameters, gradients and optimizer state are sharded on dim 0: each rank holds
  ceil(dim0 / N) rows of every parameter (FSDP2 pads the last shard);
* the blocks' parameters are all-gathered for forward, again for recompute and backward: two
  blocks' unsharded parameters are in flight at a time (the one computing and the one being
  prefetched), and one block's unsharded gradients before they are reduce-scattered;
* the root's own parameters (embeddings, the output layer, final norms) are all-gathered once
  and kept unsharded for the whole step (FSDP2 does not reshard the root after forward), and
  their gradients are unsharded until the end of backward;
* with FSDP2's mixed precision (`param_dtype`, `MixedPrecisionPolicy(param_dtype=...)`: these
  terms appear for one rank too), the unsharded parameters and gradients are in `param_dtype`,
  and a block's gradients in flight are counted again in the parameters' own dtype, the copy a
  float32 `reduce_dtype` (torchtitan's, accelerate's) reduce-scatters; the shards, their
  gradients and the optimizer's state stay in the parameters' own dtype.

Blocks are the model's `_no_split_modules` classes (Hugging Face models name their layers so),
else the children of its largest `nn.ModuleList`.

Example:
    >>> static_breakdown(model, buffer_bytes=0, input_bytes=32768,
    ...                  device=torch.device("cuda"), optimizer="adamw", world_size=8)
    {'parameters': ..., 'gradients': ..., 'optimizer state': ..., ...}
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
SCALAR_STEP_BYTES = 4  # Adam's per-parameter `step`: a float32 scalar, on the CPU unless fused
IN_FLIGHT_BLOCKS = 2  # FSDP2: the block computing and the next one being all-gathered


def check_optimizer(optimizer: Any) -> str | float | None:
    """Validate `optimizer=`: None, a known name, or bytes of state per parameter element.

    Example:
        >>> check_optimizer("AdamW")
        'adamw'
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, str):
        name = optimizer.lower().replace("_", "-")
        if name in OPTIMIZER_STATES:
            return name
    elif isinstance(optimizer, numbers.Real) and not isinstance(optimizer, bool):
        if math.isfinite(optimizer) and optimizer >= 0:
            return float(optimizer)
    raise ValueError(f"optimizer must be one of {', '.join(repr(n) for n in OPTIMIZER_STATES)}, a number of "
                     f"bytes per parameter (zero or more), or None; not {optimizer!r}")


def check_world_size(world_size: Any) -> int:
    """Validate `world_size=`: a whole number of ranks, at least 1.

    Example:
        >>> check_world_size(8)
        8
    """
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be a whole number of ranks, 1 or more (FSDP2 shards across "
                         f"more than 1); not {world_size!r}")
    return int(world_size)


@dataclass(frozen=True)
class _Parameter:
    name: str
    shape: tuple[int, ...]
    element_bytes: int
    trainable: bool
    floating: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def bytes_per_rank(self, world_size: int) -> int:
        """What one rank holds: all of it, or FSDP2's padded dim-0 shard."""
        if world_size == 1:
            return self.numel * self.element_bytes
        rows = self.shape[0] if self.shape else 1
        return math.ceil(rows / world_size) * (self.numel // max(rows, 1)) * self.element_bytes


def fsdp_blocks(model: nn.Module) -> list[str]:
    """The submodules FSDP2 would shard one by one: instances of the model's
    `_no_split_modules` classes (outermost only), else the children of its largest ModuleList.

    Example:
        >>> fsdp_blocks(gpt2)[:2]
        ['transformer.h.0', 'transformer.h.1']
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks: list[str] = []
    if names:
        for path, module in model.named_modules():
            if type(module).__name__ in names and not any(path.startswith(b + ".") for b in blocks):
                blocks.append(path)
    if not blocks:
        lists = [(sum(p.numel() for p in m.parameters()), path, m) for path, m in model.named_modules()
                 if isinstance(m, nn.ModuleList) and len(m) > 0]
        if lists:
            _, path, largest = max(lists, key=lambda item: item[0])
            blocks = [f"{path}.{name}" if path else name for name, _ in largest.named_children()]
    return blocks


def _parameters(module: nn.Module, prefix: str = "") -> list[_Parameter]:
    return [_Parameter(prefix + name, tuple(p.shape), p.element_size(), p.requires_grad, p.is_floating_point())
            for name, p in module.named_parameters()]


def static_breakdown(
    model: nn.Module,
    buffer_bytes: int,
    input_bytes: int,
    device: torch.device,
    optimizer: str | float | None = None,
    world_size: int = 1,
    reserved_bytes: int = 0,
    loss_bytes: int = 0,
    param_dtype: torch.dtype | None = None,
) -> dict[str, int]:
    """Static memory per rank, term by term, in bytes (see the module docstring); the plan's
    static memory is their sum. FSDP2 terms appear for `world_size` > 1, or with `param_dtype`.

    Example:
        >>> breakdown = static_breakdown(model, 0, 4096, torch.device("cuda"), "adamw", 8)
        >>> breakdown["optimizer state"] == 2 * breakdown["parameters"]
        True
    """
    parameters = _parameters(model)  # named_parameters counts a tied parameter once
    trainable = [p for p in parameters if p.trainable]
    sharded = sum(p.bytes_per_rank(world_size) for p in parameters)
    gradients = sum(p.bytes_per_rank(world_size) for p in trainable)
    if isinstance(optimizer, str):
        state = OPTIMIZER_STATES[optimizer] * gradients
        if optimizer in ("adam", "adamw") and device.type == "cpu":
            state += SCALAR_STEP_BYTES * len(trainable)
    elif isinstance(optimizer, float):
        state = math.ceil(optimizer * sum(p.bytes_per_rank(world_size) // p.element_bytes for p in trainable))
    else:
        state = 0
    breakdown = {"parameters": sharded, "gradients": gradients}
    if optimizer is not None:  # not counted unless named
        breakdown["optimizer state"] = state
    breakdown.update({"buffers": buffer_bytes, "inputs": input_bytes})
    if loss_bytes:  # the loss computed outside the model and backward's seed gradient
        breakdown["loss"] = loss_bytes
    if world_size > 1 or param_dtype is not None:
        def unsharded(p: _Parameter) -> int:  # (FSDP2's all-gathered copy, in param_dtype where given)
            return p.numel * (param_dtype.itemsize if param_dtype is not None and p.floating else p.element_bytes)

        def reduced(p: _Parameter) -> int:  # (and where cast, the copy reduce-scattered in its own dtype)
            return unsharded(p) + (p.numel * p.element_bytes if param_dtype is not None and p.floating else 0)

        blocks = fsdp_blocks(model)
        in_blocks = {f"{path}.{p.name}" for path in blocks for p in _parameters(model.get_submodule(path))}
        block_sizes = [(sum(unsharded(p) for p in _parameters(model.get_submodule(path))),
                        sum(reduced(p) for p in _parameters(model.get_submodule(path)) if p.trainable))
                       for path in blocks]
        largest_parameters, largest_gradients = max(block_sizes, default=(0, 0))
        root = [p for p in parameters if p.name not in in_blocks]
        breakdown["root parameters, unsharded (FSDP)"] = sum(unsharded(p) for p in root)
        breakdown["root gradients, unsharded (FSDP)"] = sum(unsharded(p) for p in root if p.trainable)
        breakdown[f"block parameters in flight (FSDP, {IN_FLIGHT_BLOCKS} blocks)"] = IN_FLIGHT_BLOCKS * largest_parameters
        breakdown["block gradients in flight (FSDP, 1 block)"] = largest_gradients
    breakdown["reserved"] = reserved_bytes
    return breakdown


__all__ = ["IN_FLIGHT_BLOCKS", "OPTIMIZER_STATES", "SCALAR_STEP_BYTES", "check_optimizer", "check_world_size",
           "fsdp_blocks", "static_breakdown"]
