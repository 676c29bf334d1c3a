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
  blocks' unsharded parameters are in flight at a time (the block computing, or the output of
  its all-gather, which FSDP2 holds in forward until the next one's, and the next block's);
* on CPU ranks gloo's collectives copy their buffers, and a collective's work holds its
  buffers until it is cleaned up, beyond FSDP2's release (`collective_copies`): a third block
  in flight, a fourth in a block's backward (`planner.problem.fsdp`), and the reduce-scatter
  buffers twice;
* the root's own parameters (embeddings, the output layer, final norms) are all-gathered once
  and kept unsharded for the whole step (FSDP2 does not reshard the root after forward);
* with FSDP2's mixed precision (`param_dtype`, `MixedPrecisionPolicy(param_dtype=...)`: these
  terms appear for one rank too), the unsharded parameters are in `param_dtype`; the shards,
  their gradients and the optimizer's state stay in the parameters' own dtype.

The unsharded gradients and the reduce-scatter buffers are not static: backward makes and
frees them, and the problem places them there (`reduce_scatter_bytes` gives the buffers' sizes;
`planner.problem.fsdp`).

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
from typing import Any, Sequence

import torch
from torch import nn

OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
SCALAR_STEP_BYTES = 4  # Adam's per-parameter `step`: a float32 scalar, on the CPU unless fused
IN_FLIGHT_BLOCKS = 2  # FSDP2: the block computing (or its all-gather's output) and the next one's


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


def fsdp_unit_of(name: str, blocks: Sequence[str]) -> str:
    """The FSDP2 unit a module path or a parameter's name lies in: one of `blocks`, else the
    root, "".

    Example:
        >>> fsdp_unit_of("transformer.h.0.attn.c_attn.weight", ["transformer.h.0"]), fsdp_unit_of("lm_head", [])
        ('transformer.h.0', '')
    """
    return next((block for block in blocks if name == block or name.startswith(block + ".")), "")


def fsdp_units(model: nn.Module) -> dict[str, list[_Parameter]]:
    """The parameters each FSDP2 unit shards, by unit: the blocks (`fsdp_blocks`) and the root,
    "", which shards the rest. A tied parameter is counted once, where `named_parameters` names it.

    Example:
        >>> list(fsdp_units(gpt2))[:2]  # (GPT-2's blocks are its `_no_split_modules`)
        ['', 'transformer.h.0']
    """
    units: dict[str, list[_Parameter]] = {"": []}
    blocks = fsdp_blocks(model)
    for parameter in _parameters(model):
        units.setdefault(fsdp_unit_of(parameter.name, blocks), []).append(parameter)
    return units


def collective_copies(device: torch.device, world_size: int) -> int:
    """How many copies of a collective's buffer a rank may hold beside FSDP2's own: one on CPU
    ranks, where gloo's all-gather and reduce-scatter copy their buffers and the work keeps them
    (and FSDP2's, past FSDP2's release) until it is cleaned up; none on CUDA (NCCL).

    Example:
        >>> collective_copies(torch.device("cuda"), 8), collective_copies(torch.device("cpu"), 2)
        (0, 1)
    """
    return 1 if device.type == "cpu" and world_size > 1 else 0


def reduce_scatter_bytes(model: nn.Module, world_size: int, device: torch.device) -> dict[str, int]:
    """Per FSDP2 unit ("" the root), the bytes of the buffer its gradients are reduce-scattered
    from: every trainable floating parameter's gradient, dim 0 padded to a multiple of
    `world_size`, in the parameters' own dtype (what a float32 `reduce_dtype` reduces; a
    bfloat16 one would need half); with gloo's copy on CPU ranks (`collective_copies`).

    Example:
        >>> reduce_scatter_bytes(nn.Sequential(nn.Linear(3, 4)), 8, torch.device("cuda"))  # 4 rows padded to 8
        {'': 128}
    """
    copies = 1 + collective_copies(device, world_size)
    return {path: copies * sum(p.bytes_per_rank(world_size) * world_size for p in parameters
                               if p.trainable and p.floating)
            for path, parameters in fsdp_units(model).items()}


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

        units = fsdp_units(model)
        largest_block = max((sum(unsharded(p) for p in units[path]) for path in units if path), default=0)
        breakdown["root parameters, unsharded (FSDP)"] = sum(unsharded(p) for p in units[""])
        blocks = IN_FLIGHT_BLOCKS + collective_copies(device, world_size)
        breakdown[f"block parameters in flight (FSDP, {blocks} blocks)"] = blocks * largest_block
    breakdown["reserved"] = reserved_bytes
    return breakdown


__all__ = ["IN_FLIGHT_BLOCKS", "OPTIMIZER_STATES", "SCALAR_STEP_BYTES", "check_optimizer", "check_world_size",
           "collective_copies", "fsdp_blocks", "fsdp_unit_of", "fsdp_units", "reduce_scatter_bytes", "static_breakdown"]
