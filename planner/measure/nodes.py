"""Times and kernel scratch node by node (the no-run path's second half).

After `planner.measure.sizes` has written every node's sizes, each node that launches work is
run alone on real tensors made for it on the plan's device: its inputs materialised (random
floats, zero integers: any valid index), run forward with autograd as training would, then
backward from a gradient of ones, and freed before the next node. That gives what sizes on
fake tensors cannot: the node's forward time (median of `repeats` runs after a warm-up), the
scratch its kernels allocate for themselves in forward, what it saves for backward where real
kernels save more than fake ones (mkldnn's LSTM layer: a workspace), and its backward's
temporaries as the allocator sees them. Nodes that do the same thing (same op or module class,
same argument shapes, dtypes and constants: the layers of a transformer) are measured once.
Parameters are the model's own tensors where the model is real and on the device, else made
for the node.

Where the target is not this machine's device, nothing runs: each node's time is the roofline
estimate of its ATen calls on the target (`planner.measure.targets`), and scratch is not measured.

Example:
    >>> fake = profile_sizes(gm, inputs, torch.device("cpu"))
    >>> measure_nodes(gm, fake, torch.device("cpu"), repeats=3)
"""
from __future__ import annotations

import contextlib
import copy
import gc
import logging
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map_only

from planner.core import after_autocast
from planner.measure.allocations import (
    backward_operator_scratch,
    forward_scratch,
    memory_profile,
)
from planner.measure.clock import ahead_for, elapsed_ms, launch_ms
from planner.measure.memory import storage_key
from planner.measure.profile import (
    LOSS_LABEL,
    META_KEY,
    SIGNATURE_KEY,
    NODE_LABEL,
    claim_autograd_nodes,
    tensors_in,
)
from planner.measure.sizes import (
    GRADIENT_STRIDES_KEY,
    FakeProfile,
    kernels_of,
)
from planner.measure.targets import Target
from planner.trace.structure import COMPUTE_OPS

logger = logging.getLogger(__name__)


def _materialise(fake: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor shaped and strided like `fake` (expanded dimensions too): normal floats,
    zero integers (valid indices)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(fake.shape, fake.stride()) if size > 0)
    storage = torch.empty(span if fake.numel() else 0, dtype=fake.dtype, device=device)
    _fill(storage, 1.0)
    real = storage.as_strided(fake.shape, fake.stride()).detach()
    return real.requires_grad_(fake.requires_grad)


@dataclass(frozen=True)
class _NodeReading:
    """What one node run alone on real tensors showed beyond the fake pass: its forward time;
    the scratch its kernels allocate beyond the tensors (forward; backward per operator, in the
    order they ran); how much more its real outputs' storages hold than the fake ones (a CPU
    `mse_loss` returns its scalar in the storage of the elementwise losses); and the bytes of
    the new storages it saves for backward besides its outputs (mkldnn's LSTM layer saves a
    workspace that its fake kernel makes empty)."""

    forward_ms: float
    scratch: int
    backward_scratch: list[tuple[str, int]]
    grown: int
    saved_bytes: int


class _NodeRunner:
    """Runs single nodes of `gm` on real tensors made from the fake profile's values."""

    def __init__(self, gm: fx.GraphModule, fake: FakeProfile, device: torch.device, repeats: int, warmup: int):
        self.gm = gm
        self.fake = fake
        self.device = device
        self.repeats = repeats
        self.warmup = warmup

    def _real(self, fake_tensor: torch.Tensor) -> torch.Tensor:
        source = self.fake.sources.get(id(fake_tensor))
        if source is not None and source.device == self.device:
            return source  # the model's own parameter or buffer: no copy
        return _materialise(fake_tensor, self.device)

    def _callable(self, node: fx.Node) -> tuple[Callable[..., Any], list[torch.Tensor]]:
        """What runs the node, and the parameters its backward produces gradients for."""
        if node.op == "call_module":
            module = self.gm.get_submodule(str(node.target))
            if any(t.device != self.device for t in (*module.parameters(), *module.buffers())):
                module = copy.deepcopy(module).to_empty(device=self.device)  # made for this node
                with torch.no_grad():
                    for tensor in (*module.parameters(), *module.buffers()):
                        _fill(tensor)
            return module, [p for p in module.parameters() if p.requires_grad]
        if node.op == "call_method":
            return lambda this, *args, **kwargs: getattr(this, str(node.target))(*args, **kwargs), []
        return node.target, []  # type: ignore[return-value]

    def measure(self, node: fx.Node, writes_inputs: bool) -> "_NodeReading":
        """One node run alone on real tensors (`_NodeReading`). A node that writes its inputs in
        place gets copies of them (autograd refuses in-place writes to leaves), made before
        measuring starts."""
        leaves: list[torch.Tensor] = []

        def real(fake_tensor: torch.Tensor) -> torch.Tensor:
            tensor = self._real(fake_tensor)
            if tensor.requires_grad and tensor.is_leaf:
                leaves.append(tensor)
                if writes_inputs and not isinstance(fake_tensor, nn.Parameter):
                    return tensor.clone()
            return tensor

        fake_arguments = _fetch(self.fake, node)
        args, kwargs = tree_map_only(FakeTensor, real, fake_arguments)
        function, parameters = self._callable(node)
        wrt = [*leaves, *parameters]
        strides = node.meta.get(GRADIENT_STRIDES_KEY, {})
        owners: dict[Any, str] = {}
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.layout == torch.strided:
                saved[storage_key(tensor)] = tensor.untyped_storage().nbytes()
            return tensor

        # (garbage collection off: a collection in the profile would free the last node's tensors,
        # in reference cycles, and the profiler prints a warning of memory it never saw allocated)
        with torch.enable_grad(), _collection_off():
            with memory_profile() as allocations:
                # The label first (see ProfileInterpreter.run_node): else its scratch is lost.
                with (torch.profiler.record_function(NODE_LABEL + node.name),
                      torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)):
                    result = function(*args, **kwargs)
                grown = max(0, _new_storage_bytes(result, (args, kwargs))
                            - _new_storage_bytes(self.fake.values[node], fake_arguments))
                kept = {storage_key(t) for t in tensors_in((result, args, kwargs, parameters))}
                if isinstance(function, nn.Module):
                    kept |= {storage_key(t) for t in function.buffers()}
                saved_bytes = sum(nbytes for key, nbytes in saved.items() if key not in kept)
                outputs = [(position, t) for position, t in enumerate(tensors_in(result))
                           if t.requires_grad and t.grad_fn is not None]
                claim_autograd_nodes([t for _, t in outputs], node.name, owners)
                if outputs and wrt:
                    with after_autocast():
                        torch.autograd.grad([t for _, t in outputs], wrt,
                                            [_gradient(t, strides.get(position)) for position, t in outputs],
                                            allow_unused=True)
            del result, outputs
            scratch = forward_scratch(allocations, self.device.type, NODE_LABEL).get(node.name, 0)
            numbers = {grad_fn._sequence_nr(): name for grad_fn, name in owners.items()}
            backward_scratch = backward_operator_scratch(allocations, self.device.type, numbers).get(node.name, [])
            del allocations
            # on CUDA its launch time sets how far ahead to queue (planner.measure.clock)
            ahead = ahead_for(launch_ms(lambda: function(*args, **kwargs))) if self.device.type == "cuda" else 0.0
            times = [elapsed_ms(self.device, lambda: function(*args, **kwargs), ahead)
                     for _ in range(self.warmup + self.repeats)]
        return _NodeReading(statistics.median(times[self.warmup:]), scratch, backward_scratch, grown, saved_bytes)

    def loss_scratch(self, loss: Callable[[Any], torch.Tensor]) -> int:
        """The kernel scratch of `loss` computed on real outputs shaped like the graph's."""
        output = next(node for node in self.gm.graph.nodes if node.op == "output")
        real = tree_map_only(FakeTensor, self._real, fx.node.map_arg(output.args[0], lambda a: self.fake.values[a]))
        with torch.enable_grad(), _collection_off(), memory_profile() as allocations:
            with torch.profiler.record_function(LOSS_LABEL):
                loss(real)
        return forward_scratch(allocations, self.device.type, LOSS_LABEL).get("", 0)


@contextlib.contextmanager
def _collection_off() -> Iterator[None]:
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _new_storage_bytes(value: Any, arguments: Any) -> int:
    """Bytes of the storages of `value`'s tensors that none of `arguments`' tensors uses."""
    read = {id(t.untyped_storage()) for t in tensors_in(arguments)}
    made = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors_in(value)}
    return sum(size for key, size in made.items() if key not in read)


def _gradient(output: torch.Tensor, stride: tuple[int, ...] | None) -> torch.Tensor:
    """Ones shaped like `output`, laid out as the step's backward hands it its gradient (`stride`,
    from the fake pass), else contiguous."""
    if stride is None or len(stride) != output.dim():
        return torch.ones_like(output, memory_format=torch.contiguous_format)
    span = 1 + sum((size - 1) * step for size, step in zip(output.shape, stride) if size > 0)
    storage = torch.ones(span if output.numel() else 0, dtype=output.dtype, device=output.device)
    return storage.as_strided(output.shape, stride)


def _fill(tensor: torch.Tensor, std: float = 0.02) -> None:
    if (tensor.is_floating_point() or tensor.is_complex()) and tensor.element_size() > 1:
        tensor.normal_(0.0, std)
    else:
        tensor.zero_()  # integers (valid indices), booleans, 8-bit floats


def _fetch(fake: FakeProfile, node: fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The node's arguments as the fake pass saw them."""
    lookup = lambda argument: fake.values[argument]  # noqa: E731
    args = fx.node.map_arg(node.args, lookup)
    kwargs = fx.node.map_arg(node.kwargs, lookup)
    return args, kwargs  # type: ignore[return-value]


def measure_nodes(
    gm: fx.GraphModule,
    fake: FakeProfile,
    device: torch.device,
    repeats: int = 5,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
) -> int:
    """Run every distinct compute node of `gm` alone on `device`; set its forward time and add
    its kernels' scratch (what the allocator sees beyond the tensors, forward and backward) and
    what its real outputs hold beyond the fake ones to its `NodeProfile`; with `loss`, the
    loss's scratch on real outputs too (`FakeProfile.loss_scratch_bytes`). Returns how many distinct nodes
    ran. The caller restores
    state that the runs change (BatchNorm statistics of a real model, RNG): see
    `planner.measure.memory.preserved_state`.

    Example:
        >>> measure_nodes(gm, profile_sizes(gm, inputs, device), device)
        41
    """
    runner = _NodeRunner(gm, fake, device, repeats, warmup)
    measured: dict[tuple[Any, ...], _NodeReading] = {}
    backward_scratch: dict[str, list[tuple[str, int]]] = {}
    nodes = [node for node in gm.graph.nodes if node.op in COMPUTE_OPS]
    for index, node in enumerate(nodes):
        args, kwargs = _fetch(fake, node)
        key = (node.meta[SIGNATURE_KEY], tuple(sorted(node.meta.get(GRADIENT_STRIDES_KEY, {}).items())))
        if key not in measured:
            if progress and len(measured) % 25 == 0:
                progress(f"running node {index + 1}/{len(nodes)} alone ({len(measured)} distinct so far)")
            try:
                measured[key] = runner.measure(node, bool(node.meta[META_KEY].mutates))
            except Exception as error:
                raise RuntimeError(f"running node {node.name!r} ({node.format_node()}) alone failed: "
                                   f"{type(error).__name__}: {error}") from error
        reading = measured[key]
        backward_scratch[node.name] = reading.backward_scratch
        record = node.meta[META_KEY]
        record.forward_ms = reading.forward_ms
        record.output_bytes += reading.grown
        if node.name == fake.loss_output:  # the caller holds this output, the loss, through backward
            fake.loss_bytes += reading.grown
        record.saved_bytes = max(record.saved_bytes, reading.saved_bytes)
        record.transient_bytes += reading.scratch
        if record.stop_transient_bytes is not None:  # (all of it: not cut off at the last pack here)
            record.stop_transient_bytes += reading.scratch
    temporaries = fake.backward.temporaries(backward_scratch)  # each operator's scratch where its fake one returned
    for node in nodes:
        record = node.meta[META_KEY]
        # at least the fake pass's figure floored at 0 (see profile_sizes), so no lower floor applies
        record.backward_transient_bytes = max(record.backward_transient_bytes, temporaries.get(node.name, 0))
    if loss is not None:
        fake.loss_scratch_bytes = runner.loss_scratch(loss)
    return len(measured)


def estimate_nodes(gm: fx.GraphModule, target: Target) -> None:
    """Set every compute node's forward time to the roofline estimate of its ATen calls on
    `target` (kernel scratch stays unmeasured).

    Example:
        >>> estimate_nodes(gm, target("h100"))
    """
    for node in gm.graph.nodes:
        if node.op in COMPUTE_OPS:
            node.meta[META_KEY].forward_ms = target.estimate_ms(kernels_of(node))
