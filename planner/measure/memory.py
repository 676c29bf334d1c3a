"""Measure peak memory of a piece of work: one interface, a CPU and a CUDA implementation.

On CUDA the caching allocator's own statistics are exact. On CPU there are none: `PeakMemory`
replays the allocator events `torch.profiler` records (`planner.measure.allocations`), kernel scratch
included, and `LiveBytesTracker`, a `TorchDispatchMode`, follows every storage an op creates
until it is freed, which is what attributing memory to graph nodes needs.
"""
from __future__ import annotations

import itertools
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from planner.measure.allocations import ProfiledPeakMemory


def storage_key(tensor: torch.Tensor) -> int:
    """An identity for the storage behind `tensor`, the same for all its views, unique among
    live storages: the address of its StorageImpl. Unlike `data_ptr()` it also tells apart
    storages of meta and fake tensors, which have no data (their `data_ptr()` is 0).

    Example:
        >>> x = torch.zeros(4)
        >>> storage_key(x) == storage_key(x[1:])
        True
    """
    return tensor.untyped_storage()._cdata


def draws_random_numbers(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an ATen call draws from the random generator: an op tagged
    `nondeterministic_seeded` (dropout, bernoulli, rand*, attention with dropout), unless its
    dropout probability is 0 or its `train` flag is off, which draw nothing. An argument the
    call leaves out takes its schema default: attention called without `dropout_p` (as
    `F.scaled_dot_product_attention` calls it at 0) draws nothing. Decided from the call alone,
    so it works on fake tensors too, where the generator is never touched.

    Example:
        >>> draws_random_numbers(torch.ops.aten.native_dropout.default, (x, 0.0, True), {})
        False
        >>> draws_random_numbers(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v), {})
        False
    """
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    try:
        schema_arguments = func._schema.arguments
    except AttributeError:
        return True
    bound = {a.name: a.default_value for a in schema_arguments if a.has_default_value()}
    bound |= dict(zip((a.name for a in schema_arguments), args)) | dict(kwargs)
    probability = bound.get("dropout_p", bound.get("p"))
    if isinstance(probability, (int, float)) and probability == 0:
        return False
    return bound.get("train", True) is not False


# Batch norm kernels whose schema does not declare that they update the running statistics
# (arguments 3 and 4) when `training` (argument 5) is set; nor do they bump their versions.
_UNDECLARED_WRITES = ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")


def written_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an ATen call writes in place: its schema's `Tensor(a!)` arguments, and the
    running statistics of the batch-norm kernels that write them undeclared.

    Those kernels do not bump the statistics' version counters either, so `_version` cannot
    say what a call wrote; this works on fake tensors too, where values cannot be compared.

    Example:
        >>> written_arguments(torch.ops.aten.add_.Tensor, (x, y), {})[0] is x
        True
    """
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    written = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written += [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]
    if schema.name.removeprefix("aten::") in _UNDECLARED_WRITES and len(args) > 5 and args[5]:
        written += [v for v in args[3:5] if isinstance(v, torch.Tensor)]
    return written


# Calls that broadcast `self` into their output and whose backward hands it the output's gradient
# as it is (a linear's bias in `addmm`).
_BROADCAST_SELF = ("addmm", "addbmm", "baddbmm", "addmv", "addr")


def broadcast_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> list[torch.Tensor]:
    """The tensors an ATen call broadcasts to its output's shape and whose gradient its backward
    returns at that shape, for autograd to sum to their own after the backward returns: every
    smaller operand of a pointwise call (`add`, `mul`, `where`), and `self` of `addmm` and its kin.

    Example:
        >>> broadcast_arguments(torch.ops.aten.addmm.default, (bias, x, weight_t), {}, out)[0] is bias
        True
    """
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    if schema.name.removeprefix("aten::") in _BROADCAST_SELF:
        candidates = list(args[:1])
    elif torch.Tag.pointwise in getattr(func, "tags", ()):
        candidates = tree_flatten((args, kwargs))[0]
    else:
        return []
    outputs = [value for value in tree_flatten(result)[0] if isinstance(value, torch.Tensor)]
    if not outputs:
        return []
    shape = outputs[0].shape
    return [value for value in candidates if isinstance(value, torch.Tensor) and value.shape != shape]


class LiveBytesTracker(TorchDispatchMode):
    """Bytes of storages created by ops while the mode is active and not yet freed.

    Storages that existed before (parameters, inputs) are not counted. It also notes, for the
    ops it sees, which storages they write in place (`written`, storage keys) and whether any
    drew random numbers (`random`); the caller resets both. With `log` set, every allocation
    and free is appended to it as `(tick, signed bytes, serial)`, ticks from `clock`; a storage's
    serial is its place in the order of allocations (`ordinal` while it lives): unique, where
    Python hands a freed storage's `id` to a later one.
    `broadcast` holds (storage key, shape, bytes) of the tensors the ops broadcast
    (`broadcast_arguments`), `casts` the storages of parameters' copies cast to another dtype
    (autocast's, which its cache holds), `cast_reads` the storages of parameters whose copies
    the ops made or read (from autocast's cache too); the caller resets all three. It works on
    real, meta and fake tensors alike.

    Example:
        >>> with LiveBytesTracker() as tracker:
        ...     y = torch.randn(256, 256) @ torch.randn(256, 256)
        >>> tracker.peak_bytes >= 3 * 256 * 256 * 4
        True
    """

    def __init__(self, log: list[tuple[int, int, int]] | None = None,
                 clock: Callable[[], int] | None = None) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.written: set[int] = set()
        self.broadcast: set[tuple[int, tuple[int, ...], int]] = set()
        self.casts: dict[int, int] = {}  # storage key -> bytes, of copies of parameters cast to another dtype
        self.cast_reads: set[int] = set()  # storage keys of parameters whose casts ops made or read
        self._cast_sources: dict[int, int] = {}  # id of a live cast's storage -> its parameter's storage key
        self.random = False
        self.log = log
        self.clock = clock or itertools.count().__next__
        self.allocations = 0  # storages tracked so far
        self.ordinal: dict[int, int] = {}  # id of a live storage -> its place in that count (1, 2, ...)
        self._refs: dict[int, weakref.ref] = {}

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.random = self.random or draws_random_numbers(func, args, kwargs)
        self.written.update(storage_key(t) for t in written_arguments(func, args, kwargs))
        result = func(*args, **kwargs)
        self.broadcast.update((storage_key(t), tuple(t.shape), t.numel() * t.element_size())
                              for t in broadcast_arguments(func, args, kwargs, result))
        inputs = {
            id(value.untyped_storage())
            for value in tree_flatten((args, kwargs))[0]
            if isinstance(value, torch.Tensor)
        }
        if self._cast_sources:  # (none outside autocast: no work on every op of a float32 step)
            self.cast_reads.update(self._cast_sources[key] for key in inputs if key in self._cast_sources)
        if func is torch.ops.aten._to_copy.default and args[0].is_leaf and args[0].requires_grad:
            self.casts[storage_key(result)] = result.untyped_storage().nbytes()
            self.cast_reads.add(storage_key(args[0]))
            self._cast_sources[id(result.untyped_storage())] = storage_key(args[0])
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
        self.allocations += 1
        serial = self.allocations
        self._refs[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._free(key, nbytes, serial))
        self.ordinal[key] = serial
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.log is not None:
            self.log.append((self.clock(), nbytes, serial))

    def _free(self, key: int, nbytes: int, serial: int) -> None:
        self._refs.pop(key, None)
        self._cast_sources.pop(key, None)
        self.ordinal.pop(key, None)
        self.live_bytes -= nbytes
        if self.log is not None:
            self.log.append((self.clock(), -nbytes, serial))


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
            seen[storage_key(value)] = value.untyped_storage().nbytes()
    return sum(seen.values())


@contextmanager
def preserved_state(model: torch.nn.Module, devices: list[torch.device]) -> Iterator[None]:
    """Run work on `model` and leave it, and the global RNG, as they were: buffers (BatchNorm
    statistics) are restored, gradients are put back, the training flag is kept. Inside, the
    parameters have no gradients, as at each step of a training loop that zeroes them with
    `set_to_none` (the default): autograd then hands each new gradient over instead of adding
    it into `.grad` (which leaves a temporary behind, and measured backward windows depend on it).

    Example:
        >>> with preserved_state(model, [torch.device("cpu")]):
        ...     model(x).sum().backward()
    """
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    grads = {id(p): p.grad for p in model.parameters()}
    training = {module: module.training for module in model.modules()}
    cuda_devices = [d for d in devices if d.type == "cuda"]
    try:
        for parameter in model.parameters():
            parameter.grad = None
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


__all__ = ["LiveBytesTracker", "PeakMemory", "draws_random_numbers", "preserved_state", "storage_bytes", "storage_key",
           "written_arguments"]
