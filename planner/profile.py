"""Measure every compute node of a traced graph: time, output bytes, saved-for-backward bytes.

`ProfileInterpreter` runs the graph node by node with autograd on, as training would, and
writes one `NodeProfile` per node into `node.meta["planner.profile"]`. Saved tensors are seen
through `torch.autograd.graph.saved_tensors_hooks` and deduplicated by storage; every storage
is attributed to the node that created it, so views and in-place results point to their owner.
Memory that kernels allocate and free for themselves (scratch) is invisible to tensors; the
profiler's allocator events add it to each node's forward and backward temporaries.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from planner.allocations import backward_temporaries, forward_scratch, memory_profile
from planner.memory import LiveBytesTracker, storage_bytes
from planner.verify import training_loss

logger = logging.getLogger(__name__)

META_KEY = "planner.profile"
NODE_LABEL = "planner.node:"  # record_function label of each node's forward, for the profiler
COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclass
class NodeProfile:
    """What one fx node costs. Node references are fx node names of the owning nodes."""

    forward_ms: float = 0.0
    output_bytes: int = 0
    grad_bytes: int = 0
    saved_bytes: int = 0
    transient_bytes: int = 0
    param_grad_bytes: int = 0
    parameters: tuple[str, ...] = ()  # trainable parameters it reads (first qualified name of each)
    uses: tuple[str, ...] = ()
    saves: tuple[str, ...] = ()
    mutates: tuple[str, ...] = ()
    mutated_buffers: tuple[str, ...] = ()  # qualified names of buffers written (BatchNorm statistics)
    backward_transient_bytes: int = 0  # temporaries of this node's backward (freed when it ends)
    random: bool = True  # draws random numbers (dropout): a region holding it must replay the RNG


@dataclass(frozen=True)
class GraphProfile:
    """Whole-graph figures next to the per-node records in `node.meta`."""

    parameter_bytes: int
    gradient_bytes: int
    buffer_bytes: int
    input_bytes: int
    device: torch.device
    timing: str  # how forward times were measured
    # Checkpoint keeps a copy of the RNG state for each region that draws random numbers, from
    # its forward to its backward: at most one per random node, counted as if always held.
    rng_state_bytes: int = 0

    @property
    def static_bytes(self) -> int:
        return (self.parameter_bytes + self.gradient_bytes + self.buffer_bytes + self.input_bytes
                + self.rng_state_bytes)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor) and v.layout == torch.strided]


def _rng_states() -> list[torch.Tensor]:
    """The CPU generator's state and, once CUDA is in use, every device's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return [torch.get_rng_state(), *cuda]


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class ProfileInterpreter(fx.Interpreter):
    """One pass that records sizes, saved tensors and aliasing for every compute node.

    Example:
        >>> ProfileInterpreter(gm).run(*inputs)
        >>> gm.graph.nodes[1].meta["planner.profile"].saved_bytes
    """

    def __init__(self, gm: fx.GraphModule, static_keys: set[int]):
        # Keep every value alive so storage addresses stay unique for the whole pass.
        super().__init__(gm, garbage_collect_values=False)
        self.static_keys = static_keys
        self.owner: dict[int, str] = {}  # storage address -> name of the node that created it
        self.tracker = LiveBytesTracker()
        self.buffer_names = {id(buffer): name for name, buffer in gm.named_buffers()}
        self.parameter_names = {id(p): name for name, p in gm.named_parameters()}  # tied: one name
        self.grad_fn_owner: dict[Any, str] = {}  # autograd node -> fx node that created it

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in COMPUTE_OPS:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        inputs = _tensors((args, kwargs))
        versions = [t._version for t in inputs]
        buffers = self._buffers_read(n, inputs)
        buffers_before = {name: (buffer._version, buffer.clone()) for name, buffer in buffers.items()}
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.layout == torch.strided:
                saved[_key(tensor)] = tensor.untyped_storage().nbytes()
            return tensor

        rng_before = _rng_states()
        self.tracker.reset_peak()
        live_before = self.tracker.live_bytes
        try:
            with (self.tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
                  torch.profiler.record_function(NODE_LABEL + n.name)):
                result = getattr(self, n.op)(n.target, args, kwargs)
        except Exception as error:
            raise RuntimeError(f"profiling node {n.name!r} ({n.format_node()}) failed: {error}") from error
        live_after = self.tracker.live_bytes

        record = NodeProfile(random=any(not torch.equal(a, b) for a, b in zip(rng_before, _rng_states())))
        for tensor in _tensors(result):
            key = _key(tensor)
            if key not in self.owner and key not in self.static_keys and key != 0:
                self.owner[key] = n.name
                record.output_bytes += tensor.untyped_storage().nbytes()
                if tensor.requires_grad and tensor.is_floating_point():
                    record.grad_bytes += tensor.numel() * tensor.element_size()
        record.uses = self._owners(_key(t) for t in inputs)
        record.mutates = self._owners(
            _key(t) for t, version in zip(inputs, versions) if t._version != version
        )
        record.mutated_buffers = tuple(sorted(
            name for name, buffer in buffers.items()
            if buffer._version != buffers_before[name][0] or not torch.equal(buffer, buffers_before[name][1])
        ))
        record.saves = self._owners(saved)
        record.saved_bytes = sum(
            nbytes for key, nbytes in saved.items() if key not in self.owner and key not in self.static_keys
        )
        record.transient_bytes = max(0, self.tracker.peak_bytes - live_after)
        parameters = self._parameters_read(n)
        record.parameters = tuple(self.parameter_names[id(p)] for p in parameters)
        record.param_grad_bytes = sum(p.numel() * p.element_size() for p in parameters)
        logger.debug("profiled %s: %s (live %+d bytes)", n.name, record, live_after - live_before)
        n.meta[META_KEY] = record
        self._claim_grad_fns(_tensors(result), n.name)
        return result

    def _claim_grad_fns(self, outputs: list[torch.Tensor], name: str) -> None:
        """Attribute to node `name` the autograd nodes its forward created (all those reachable
        from its outputs that no earlier node created)."""
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            grad_fn = stack.pop()
            if grad_fn is None or grad_fn in self.grad_fn_owner or not hasattr(grad_fn, "next_functions"):
                continue
            if type(grad_fn).__name__ == "AccumulateGrad":  # a parameter's, not a node's
                continue
            self.grad_fn_owner[grad_fn] = name
            stack.extend(next_fn for next_fn, _ in grad_fn.next_functions)

    def _buffers_read(self, n: fx.Node, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Buffers a node can write: those passed to it and those of the module it calls."""
        found = {self.buffer_names[id(t)]: t for t in inputs if id(t) in self.buffer_names}
        if n.op == "call_module":
            for name, buffer in self.module.get_submodule(n.target).named_buffers():
                found[f"{n.target}.{name}"] = buffer
        return found

    def _owners(self, keys: Any) -> tuple[str, ...]:
        return tuple(sorted({self.owner[key] for key in keys if key in self.owner}))

    def _parameters_read(self, n: fx.Node) -> list[torch.nn.Parameter]:
        """Trainable parameters whose gradients the node's backward produces, each once."""
        parameters: dict[int, torch.nn.Parameter] = {}
        if n.op == "call_module":
            parameters.update((id(p), p) for p in self.module.get_submodule(n.target).parameters())
        for argument in n.all_input_nodes:
            if argument.op == "get_attr":
                value = self.fetch_attr(argument.target)
                if isinstance(value, torch.nn.Parameter):
                    parameters[id(value)] = value
        return [p for p in parameters.values() if p.requires_grad]


class TimingInterpreter(fx.Interpreter):
    """Runs the graph and adds each compute node's forward time (ms) to `times[node.name]`.

    On CUDA, CUDA events bracket each node and are read after one synchronisation.
    """

    def __init__(self, gm: fx.GraphModule, times: dict[str, list[float]], device: torch.device):
        super().__init__(gm)
        self.times = times
        self.device = device
        self.events: list[tuple[str, Any, Any]] = []

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in COMPUTE_OPS:
            return super().run_node(n)
        if self.device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            result = super().run_node(n)
            end.record()
            self.events.append((n.name, start, end))
            return result
        started = time.perf_counter()
        result = super().run_node(n)
        self.times.setdefault(n.name, []).append((time.perf_counter() - started) * 1000)
        return result

    def collect(self) -> None:
        if self.events:
            torch.cuda.synchronize(self.device)
            for name, start, end in self.events:
                self.times.setdefault(name, []).append(start.elapsed_time(end))
            self.events.clear()


def profile(
    gm: fx.GraphModule,
    inputs: list[torch.Tensor],
    repeats: int = 5,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
) -> GraphProfile:
    """Profile `gm` on `inputs` (a forward with autograd on) and annotate its nodes.

    Times are the median of `repeats` runs after `warmup` runs. One backward pass, from
    `loss(graph output)` (default: `planner.verify.training_loss`), measures each node's backward
    temporaries; it leaves parameter gradients behind. The caller is responsible for
    restoring state that forward changes (BatchNorm statistics, RNG): see
    `planner.memory.preserved_state`.

    Example:
        >>> summary = profile(gm, [torch.randn(8, 16)])
        >>> summary.static_bytes
    """
    parameters = list(gm.parameters())
    buffers = list(gm.buffers())
    device = inputs[0].device
    static = _tensors((parameters, buffers, inputs))
    static_keys = {_key(t) for t in static}

    with torch.enable_grad():
        if progress:
            progress("measuring sizes and saved tensors")
        # The profiler sees what kernels and autograd allocate for themselves, which the
        # tensor tracker cannot: scratch, and backward's temporaries.
        with memory_profile() as allocations:
            interpreter = ProfileInterpreter(gm, static_keys)
            output = interpreter.run(*inputs)
            if progress:
                progress("measuring backward temporaries")
            (loss or training_loss)(output).backward()
        records = {node.name: node.meta[META_KEY] for node in gm.graph.nodes if META_KEY in node.meta}
        for name, extra in forward_scratch(allocations, device.type, NODE_LABEL).items():
            records[name].transient_bytes += extra
        owners = {grad_fn._sequence_nr(): name for grad_fn, name in interpreter.grad_fn_owner.items()}
        for name, extra in backward_temporaries(allocations, device.type, owners).items():
            records[name].backward_transient_bytes = max(0, extra)
        del interpreter, output
        times: dict[str, list[float]] = {}
        for run in range(warmup + repeats):
            if progress:
                progress(f"timing forward pass {run + 1}/{warmup + repeats}")
            timer = TimingInterpreter(gm, times if run >= warmup else {}, device)
            timer.run(*inputs)
            timer.collect()

    for node in gm.graph.nodes:
        if node.op in COMPUTE_OPS:
            node.meta[META_KEY].forward_ms = statistics.median(times[node.name])
    trainable = [p for p in parameters if p.requires_grad]
    random_nodes = sum(1 for node in gm.graph.nodes if META_KEY in node.meta and node.meta[META_KEY].random)
    return GraphProfile(
        rng_state_bytes=random_nodes * sum(state.nbytes for state in _rng_states()),
        parameter_bytes=storage_bytes(parameters),
        gradient_bytes=sum(p.numel() * p.element_size() for p in trainable),
        buffer_bytes=storage_bytes(buffers),
        input_bytes=storage_bytes(inputs),
        device=device,
        timing="CUDA events" if device.type == "cuda" else "time.perf_counter",
    )
