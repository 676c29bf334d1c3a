"""Parameters FSDP2 frees between forward and backward, gathered back for a run's replay.

`fully_shard` frees a unit's gathered parameters after its forward and gathers them again just
before its backward. A run recorded across units (in the model's own forward, from one sharded
stage's last BatchNorm into the next stage's convolution) replays in the later unit's backward,
while the earlier unit's parameters are freed: the replay gathers them itself and frees them
after, as FSDP2's pre-forward hook does for a checkpointed module's recomputation.

Example:
    >>> owners = UnitParameters(sharded_units(model))
    >>> with gathered([owners.owner(weight)]):
    ...     replay()
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn


def sharded_units(module: nn.Module) -> tuple[nn.Module, ...]:
    """The FSDP2 units (modules `fully_shard` was applied to) in `module`'s tree, parents first."""
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FSDPModule

    return tuple(m for m in module.modules() if isinstance(m, FSDPModule))


class UnitParameters:
    """Which unit gathered a parameter (the gathered tensor a forward's calls receive)."""

    def __init__(self, units: tuple[nn.Module, ...]):
        self.units = units
        self._owners: dict[int, nn.Module | None] = {}

    def owner(self, tensor: torch.Tensor) -> nn.Module | None:
        """The innermost unit whose parameters include `tensor` now, or None."""
        if not self.units or not isinstance(tensor, nn.Parameter):
            return None
        if id(tensor) not in self._owners:  # (a unit gathered since the last look)
            for unit in self.units:  # parents first: a nested unit's own parameters are its
                self._owners.update(dict.fromkeys(map(id, unit.parameters()), unit))
            self._owners.setdefault(id(tensor), None)
        return self._owners[id(tensor)]


def freed(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s memory was released (FSDP2 resizes a freed parameter's storage to 0)."""
    return tensor.numel() > 0 and tensor.untyped_storage().size() == 0


@contextlib.contextmanager
def gathered(units: Iterable[nn.Module]) -> Iterator[None]:
    """Gather the units' parameters (`FSDPModule.unshard`) for the block, free them after."""
    units = list(units)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


__all__ = ["UnitParameters", "freed", "gathered", "sharded_units"]
