"""Measure peak memory of a piece of work: one interface, a CPU and a CUDA implementation.

On CUDA the caching allocator's own statistics are exact. On CPU there are none: `PeakMemory`
replays the allocator events `torch.profiler` records (`planner.allocations`), kernel scratch
included, and `LiveBytesTracker`, a `TorchDispatchMode`, follows every storage an op creates
until it is freed, which is what attributing memory to graph nodes needs.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from planner.allocations import ProfiledPeakMemory


class LiveBytesTracker(TorchDispatchMode):
    """Bytes of storages created by ops while the mode is active and not yet freed.

    Storages that existed before (parameters, inputs) are not counted.

    Example:
        >>> with LiveBytesTracker() as tracker:
        ...     y = torch.randn(256, 256) @ torch.randn(256, 256)
        >>> tracker.peak_bytes >= 3 * 256 * 256 * 4
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, weakref.ref] = {}

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        inputs = {
            id(value.untyped_storage())
            for value in tree_flatten((args, kwargs))[0]
            if isinstance(value, torch.Tensor)
        }
        for value in tree_flatten(result)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value.untyped_storage(), inputs)
        return result

    def _track(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        # A storage the op read is not a new allocation (views, in-place and out= results).
        key = id(storage)
        if key in inputs or (key in self._refs and self._refs[key]() is storage):
            return
        nbytes = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._free(key, nbytes))
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.live_bytes -= nbytes


class PeakMemory:
    """Peak bytes allocated during a `with` block, on the CPU or on a CUDA device.

    `peak_bytes` counts what was allocated inside the block at its highest point, kernel
    scratch included; what was allocated before the block is not counted.

    Example:
        >>> with PeakMemory(torch.device("cpu")) as memory:
        ...     loss = model(x).sum(); loss.backward()
        >>> memory.peak_bytes
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes = 0
        self._allocator: ProfiledPeakMemory | None = None
        self._baseline = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._allocator = ProfiledPeakMemory(self.device)
            self._allocator.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._baseline
        else:
            assert self._allocator is not None
            self._allocator.__exit__(*exc)
            self.peak_bytes = self._allocator.peak_bytes


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind the tensors in a (nested) structure.

    Example:
        >>> x = torch.zeros(10)
        >>> storage_bytes([x, x[2:]])
        40
    """
    seen: dict[int, int] = {}
    for value in tree_flatten(tensors)[0]:
        if isinstance(value, torch.Tensor) and value.layout == torch.strided:
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(nbytes for ptr, nbytes in seen.items() if ptr != 0)


@contextmanager
def preserved_state(model: torch.nn.Module, devices: list[torch.device]) -> Iterator[None]:
    """Run work on `model` and leave it, and the global RNG, as they were: buffers (BatchNorm
    statistics) are restored, gradients are put back, the training flag is kept.

    Example:
        >>> with preserved_state(model, [torch.device("cpu")]):
        ...     model(x).sum().backward()
    """
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    grads = {id(p): p.grad for p in model.parameters()}
    training = {module: module.training for module in model.modules()}
    cuda_devices = [d for d in devices if d.type == "cuda"]
    try:
        with torch.random.fork_rng(devices=cuda_devices):
            yield
    finally:
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])
        for parameter in model.parameters():
            parameter.grad = grads.get(id(parameter))
        for module, flag in training.items():
            module.training = flag
