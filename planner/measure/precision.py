"""FSDP2's mixed precision, as planning measures it.

Under `fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))` each
sharded module all-gathers its parameters in `param_dtype` and computes with them, and the
root casts the floating inputs to it (`cast_forward_inputs`): activations, what backward saves
and the gradients it passes on are in `param_dtype`, while each rank's shards of the parameters,
their gradients and the optimizer's state stay in the parameters' own dtype
(`planner.measure.static` counts those, and the unsharded copies in flight). Planning runs the
model with its floating parameters swapped for `param_dtype` copies (`parameters_in`) on
floating inputs cast the same way (`inputs_in`); the model gets its own tensors back after.

Example:
    >>> with parameters_in(model, torch.bfloat16):
    ...     model(inputs_in(x, torch.bfloat16)).dtype
    torch.bfloat16
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map_only

from planner.measure.autocast import low_precision_dtype
from planner.measure.static import fsdp_unit_of
from planner.trace.structure import compute_nodes, module_path


def check_param_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`plan(param_dtype=...)`: None, torch.bfloat16 or torch.float16 (or their names).

    Example:
        >>> check_param_dtype("bfloat16")
        torch.bfloat16
    """
    return low_precision_dtype(dtype, "param_dtype", "the param_dtype of FSDP2's MixedPrecisionPolicy",
                               "parameters computing in their own dtype")


@contextlib.contextmanager
def parameters_in(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """The model's floating parameters computing in `dtype`, as FSDP2's unsharded parameters do:
    each parameter's data (and gradient, set aside) swapped for a `dtype` copy, its own restored
    on exit. A no-op for None.

    Example:
        >>> with parameters_in(model, torch.bfloat16):
        ...     next(model.parameters()).dtype
        torch.bfloat16
    """
    swapped: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor | None]] = []
    if dtype is not None:
        for parameter in model.parameters():
            if parameter.is_floating_point() and parameter.dtype != dtype:
                swapped.append((parameter, parameter.data, parameter.grad))
                parameter.grad = None
                parameter.data = parameter.data.to(dtype)
    try:
        yield
    finally:
        for parameter, data, grad in swapped:
            parameter.grad = None
            parameter.data = data
            parameter.grad = grad


def block_input_casts(gm: fx.GraphModule, blocks: Sequence[str], dtype: torch.dtype) -> int:
    """Bytes of the copies FSDP2's `cast_forward_inputs` makes where a block is passed a
    floating buffer of the model's in another dtype (a mask kept in float32): one per block,
    each counted for the whole step (an estimate: a block that does not save it frees it after
    its forward). Planning runs the blocks on the buffer itself, so it sees none of them.

    Example:
        >>> block_input_casts(gm, ["blocks.0", "blocks.1"], torch.bfloat16)  # a 32 x 32 float32 mask
        4096
    """
    copies: dict[tuple[str, str], int] = {}
    for node in compute_nodes(gm):
        block = fsdp_unit_of(module_path(node), blocks)
        for read in node.all_input_nodes if block else ():
            if read.op != "get_attr" or str(read.target).startswith(block + "."):
                continue
            try:
                buffer = gm.get_buffer(str(read.target))
            except AttributeError:  # (a parameter: in param_dtype already)
                continue
            if buffer.is_floating_point() and buffer.dtype != dtype:
                copies[block, str(read.target)] = buffer.numel() * dtype.itemsize
    return sum(copies.values())


def inputs_in(sample: Any, dtype: torch.dtype | None) -> Any:
    """The sample with its floating tensors cast to `dtype` (FSDP2's `cast_forward_inputs`);
    token ids and masks of other dtypes as they are. None leaves it as it is.

    Example:
        >>> inputs_in({"pixel_values": images, "labels": labels}, torch.bfloat16)["pixel_values"].dtype
        torch.bfloat16
    """
    if dtype is None:
        return sample
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, sample)


__all__ = ["block_input_casts", "check_param_dtype", "inputs_in", "parameters_in"]
