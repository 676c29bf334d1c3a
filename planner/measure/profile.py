"""Measure every compute node of a traced graph in one run of the whole step: time, output
bytes, saved-for-backward bytes, scratch (the "run" path).

`ProfileInterpreter` runs the graph node by node with autograd on, as training would, and
writes one `NodeProfile` per node into `node.meta["planner.profile"]` (it also runs on fake
tensors, for `planner.measure.sizes`). Saved tensors are seen through
`torch.autograd.graph.saved_tensors_hooks` and deduplicated by storage; every storage is
attributed to the node that created it, so views and in-place results point to their owner.
Memory that kernels allocate and free for themselves (scratch) is invisible to tensors; the
profiler's allocator events add it to each node's forward and backward temporaries.
`TimingInterpreter` times each node's forward (CUDA events on a GPU) up to its output and up
to its last saved tensor; identical nodes (`signature`) are priced at the median of all their
runs.

Example:
    >>> summary = profile(gm, [torch.randn(8, 16)])
    >>> gm.graph.find_nodes(op="call_module", target="fc1")[0].meta["planner.profile"].forward_ms
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable, Collection, Iterable

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten

from planner.core import (
    GraphProfile,
    NodeProfile,
    after_autocast,
    autocast_devices,
    cold_autocast_cache,
    training_loss,
)
from planner.measure.allocations import (
    backward_memory,
    backward_transient_bytes,
    forward_scratch,
    memory_profile,
    scratch_before_mark,
)
from planner.measure.clock import ahead_for, queue_ahead
from planner.measure.memory import LiveBytesTracker, storage_bytes, storage_key
from planner.measure.view_gradients import ViewGradients
from planner.trace.structure import COMPUTE_OPS


def _spec(value: Any) -> Any:
    """What about a value decides what a node costs: shapes, strides and dtypes of tensors,
    everything else as it is."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), str(value.dtype), value.requires_grad,
                isinstance(value, nn.Parameter))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_spec(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple((key, _spec(item)) for key, item in value.items()))
    return repr(value)


def signature(gm: fx.GraphModule, node: fx.Node, args: Any, kwargs: Any) -> tuple[Any, ...]:
    """Two nodes with the same signature do the same work: the same function or method (for a
    module: its class, settings and the shapes of its parameters and buffers) on arguments of
    the same shapes, strides and dtypes.

    Example:
        >>> signature(gm, node_of_layer_0, *args0) == signature(gm, node_of_layer_1, *args1)
        True
    """
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        what: Any = (type(module).__qualname__, module.extra_repr(), module.training,
                     tuple(_spec(t) for t in (*module.parameters(), *module.buffers())))
    else:
        what = (node.op, str(node.target))
    return (what, _spec(args), _spec(kwargs))



class TimingInterpreter(fx.Interpreter):
    """Runs the graph and adds each compute node's forward time (ms) to `times[node.name]`:
    the call alone, not the interpreter's fetching of its arguments (which recomputation under
    checkpoint, compiled code, does not pay), as a node run alone is timed too. The time up to
    the node's last saved tensor goes to `stop_times[node.name]`: non-reentrant checkpoint's
    recomputation stops right there when the node is a region's last saving node.

    On CUDA, CUDA events bracket each node (and mark its last save) and are read after one
    synchronisation; GPU work queued ahead of each node makes them time its kernels alone, as
    backward's queue hides a recomputation's launch work (`planner.measure.clock`). The host's launch
    time of each node is kept in `launch_ms` (the longest seen) and sets how far ahead later
    runs queue for it: pass the same dict to every run.
    """

    def __init__(self, gm: fx.GraphModule, times: dict[str, list[float]], device: torch.device,
                 stop_times: dict[str, list[float]] | None = None, launch_ms: dict[str, float] | None = None):
        super().__init__(gm)
        self.times = times
        self.stop_times = {} if stop_times is None else stop_times
        self.launch_ms = {} if launch_ms is None else launch_ms
        self.device = device
        self.events: list[tuple[str, Any, Any, Any]] = []

    def run(self, *args: Any, **kwargs: Any) -> Any:
        cold_autocast_cache()  # (the graph's forward as a training step's finds autocast's cache)
        return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in COMPUTE_OPS:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        call = getattr(self, n.op)
        cuda = self.device.type == "cuda"
        last_save: list[Any] = [None]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if cuda:
                last_save[0] = torch.cuda.Event(enable_timing=True)
                last_save[0].record()
            else:
                last_save[0] = time.perf_counter()
            # Detached: the tensor itself, saved by its own grad_fn, would make a reference cycle
            # that only Python's garbage collector frees, in the middle of later nodes' timings.
            return tensor.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            if cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                queue_ahead(self.device, ahead_for(self.launch_ms.get(n.name, 0.0)))
                start.record()
                launched = time.perf_counter()
                result = call(n.target, args, kwargs)
                end.record()
                launch = (time.perf_counter() - launched) * 1000
                self.launch_ms[n.name] = max(launch, self.launch_ms.get(n.name, 0.0))
                self.events.append((n.name, start, end, last_save[0]))
                return result
            started = time.perf_counter()
            result = call(n.target, args, kwargs)
            ended = time.perf_counter()
        self.times.setdefault(n.name, []).append((ended - started) * 1000)
        if last_save[0] is not None:
            self.stop_times.setdefault(n.name, []).append((last_save[0] - started) * 1000)
        return result

    def collect(self) -> None:
        if self.events:
            torch.cuda.synchronize(self.device)
            for name, start, end, saved in self.events:
                self.times.setdefault(name, []).append(start.elapsed_time(end))
                if saved is not None:
                    self.stop_times.setdefault(name, []).append(start.elapsed_time(saved))
            self.events.clear()


logger = logging.getLogger(__name__)


META_KEY = "planner.profile"
SIGNATURE_KEY = "planner.signature"  # node.meta: what decides its cost (`signature`): equal for identical nodes


NODE_LABEL = "planner.node:"  # record_function label of each node's forward, for the profiler


PACK_MARK = "planner.saved_tensor"  # record_function at each saved tensor, for the profiler

LOSS_LABEL = "planner.loss"  # record_function around the loss computed outside the graph


# Backward kinds that can return the output's gradient (or a view of it) as an input's gradient.
ALIASING_BACKWARDS = ("AddBackward0", "CatBackward0", "CloneBackward0")


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The strided tensors in a (nested) structure, in pytree order."""
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor) and v.layout == torch.strided]


def rng_state_bytes(device: torch.device) -> int:
    """What `checkpoint(preserve_rng_state=True)` copies per call into memory of `device`: the
    CPU generator's state, a CPU tensor, so nothing on a CUDA device (the CUDA generators'
    states it also copies are CPU tensors too)."""
    return torch.get_rng_state().nbytes if device.type == "cpu" else 0


def training_loss_bytes(loss: Callable[[Any], torch.Tensor], output: Any) -> tuple[torch.Tensor, int]:
    """The loss of the graph's `output` and the bytes it holds through backward outside the
    graph: what computing it allocates and keeps (a sum of outputs, say), and the seed gradient
    backward starts from (the loss's size). Where the loss is one of the graph's outputs (a
    Hugging Face model given labels), the caller holds it through backward, where the graph's
    outputs are freed: its storage counts too. Real, meta and fake tensors alike.

    Example:
        >>> value, held = training_loss_bytes(training_loss, torch.ones(3, requires_grad=True))
        >>> held  # the sum's scalar and its seed gradient
        8
    """
    with LiveBytesTracker() as tracker:
        value = loss(output)
    made_here = id(value.untyped_storage()) in tracker.ordinal
    held_output = 0 if made_here else value.untyped_storage().nbytes()
    return value, tracker.live_bytes + held_output + value.numel() * value.element_size()


def claim_autograd_nodes(outputs: list[torch.Tensor], name: str, owners: dict[Any, str]) -> list[Any]:
    """Attribute to node `name`, in `owners`, the autograd nodes its forward created: all those
    reachable from its outputs that no earlier node claimed (parameters' AccumulateGrad aside).
    Returns them.

    Example:
        >>> owners = {}
        >>> claim_autograd_nodes([torch.ones(2, requires_grad=True) * 2], "mul", owners)
        >>> list(owners.values())
        ['mul']
    """
    claimed = []
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        grad_fn = stack.pop()
        if grad_fn is None or grad_fn in owners or not hasattr(grad_fn, "next_functions"):
            continue
        if type(grad_fn).__name__ == "AccumulateGrad":  # a parameter's, not a node's
            continue
        owners[grad_fn] = name
        claimed.append(grad_fn)
        stack.extend(next_fn for next_fn, _ in grad_fn.next_functions)
    return claimed


def unhooked_saved_bytes(grad_fns: list[Any], hooked: Collection[int], device: torch.device) -> int:
    """Bytes on `device` that autograd nodes saved past the saved-tensor hooks (`hooked`: storage
    keys of the strided tensors the hooks packed): Python numbers a call took as tensors (`x * 0.5`
    saves its 0.5, a CPU tensor of 8 bytes), which autograd never hands to hooks, so checkpoint
    cannot drop them.

    Example:
        >>> y = x * 0.5  # (under a pack hook that noted nothing)
        >>> unhooked_saved_bytes([y.grad_fn], set(), torch.device("cpu"))
        8
    """
    found: dict[int, int] = {}
    for grad_fn in grad_fns:
        for name in dir(grad_fn):
            if name.startswith("_saved_"):
                value = getattr(grad_fn, name)
                for tensor in value if isinstance(value, (tuple, list)) else (value,):
                    if (isinstance(tensor, torch.Tensor) and tensor.device == device
                            and tensor.layout == torch.strided and storage_key(tensor) not in hooked):
                        found[storage_key(tensor)] = tensor.untyped_storage().nbytes()
    return sum(found.values())


class ProfileInterpreter(fx.Interpreter):
    """One pass that records sizes, saved tensors and aliasing for every compute node.

    It runs on real tensors (the measured path) and on fake ones under `FakeTensorMode` (the
    no-run path, `planner.measure.sizes`) alike: storages are told apart by `storage_key`,
    random draws and in-place writes are read off the ATen calls (`LiveBytesTracker`), never
    off tensor values. `autograd_owners` maps each autograd node a compute node created to
    that node's name (for backward windows).

    Example:
        >>> ProfileInterpreter(gm, static_keys).run(*inputs)
        >>> gm.graph.nodes[1].meta["planner.profile"].saved_bytes
    """

    def __init__(self, gm: fx.GraphModule, static_keys: set[int], tracker: LiveBytesTracker | None = None):
        # Keep every value alive so storage keys stay unique for the whole pass.
        super().__init__(gm, garbage_collect_values=False)
        self.static_keys = static_keys
        self.owner: dict[int, str] = {}  # storage key -> name of the node that created it
        self.tracker = tracker or LiveBytesTracker()
        self.buffer_names = {storage_key(buffer): name for name, buffer in gm.named_buffers()}
        self.parameter_names = {id(p): name for name, p in gm.named_parameters()}  # tied: one name
        self.trainable_storages = {storage_key(p) for p in gm.parameters() if p.requires_grad}
        self.autograd_owners: dict[Any, str] = {}  # autograd node -> fx node that created it
        self.input_names: dict[int, str] = {}  # storage key of a graph input -> its placeholder
        self.views = ViewGradients(self.autograd_owners, lambda t: self.owner.get(storage_key(t)))

    def run(self, *args: Any, **kwargs: Any) -> Any:
        cold_autocast_cache()  # (the graph's forward as a training step's finds autocast's cache)
        return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "placeholder":
            value = super().run_node(n)
            for tensor in tensors_in(value):
                key = storage_key(tensor)
                if key not in self.buffer_names and id(tensor) not in self.parameter_names:
                    self.input_names.setdefault(key, n.name)
            return value
        if n.op not in COMPUTE_OPS:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        n.meta[SIGNATURE_KEY] = signature(self.module, n, args, kwargs)
        inputs = tensors_in((args, kwargs))
        versions = [t._version for t in inputs]
        producers = [t.grad_fn for t in inputs]  # before an in-place op replaces them
        saved: dict[int, int] = {}
        caching = torch.is_autocast_cache_enabled() and bool(autocast_devices())  # (asked before the node runs)
        tracker = self.tracker
        last_pack = [0]  # tracker.allocations when the node last saved a tensor
        peak_at_pack = [0]  # and tracker.peak_bytes
        packed = [0]  # tensors saved

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            packed[0] += 1
            if tensor.layout == torch.strided:
                saved[storage_key(tensor)] = tensor.untyped_storage().nbytes()
            last_pack[0] = tracker.allocations
            peak_at_pack[0] = tracker.peak_bytes
            with torch.profiler.record_function(PACK_MARK):  # where the kernels' scratch is cut off
                pass
            return tensor

        tracker.reset_peak()
        live_before = tracker.live_bytes
        tracker.written.clear()
        tracker.broadcast.clear()
        tracker.casts.clear()
        tracker.cast_reads.clear()
        tracker.random = False
        try:
            # The label opens first: opened inside the dispatch mode, the profiler's event tree
            # puts the node's operators beside it, not under it, and its scratch is lost.
            with (torch.profiler.record_function(NODE_LABEL + n.name), tracker,
                  torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
                result = self.compute(n, args, kwargs)
        except Exception as error:
            raise RuntimeError(f"profiling node {n.name!r} ({n.format_node()}) failed: {error}") from error
        live_after = tracker.live_bytes

        record = NodeProfile(random=tracker.random, saved_tensors=packed[0])
        made_after_last_save = []
        for tensor in tensors_in(result):
            key = storage_key(tensor)
            if key not in self.owner and key not in self.static_keys:
                self.owner[key] = n.name
                made_after_last_save.append(tracker.ordinal.get(id(tensor.untyped_storage()), 0) > last_pack[0])
                record.output_bytes += tensor.untyped_storage().nbytes()
                if tensor.requires_grad and tensor.is_floating_point():
                    record.grad_bytes += tensor.numel() * tensor.element_size()
        record.uses = self._owners(storage_key(t) for t in inputs)
        written = {storage_key(t) for t, version in zip(inputs, versions) if t._version != version}
        record.mutates = tuple(owner for owner in self._owners(written | tracker.written) if owner != n.name)
        record.mutated_buffers = tuple(sorted({self.buffer_names[key] for key in tracker.written
                                               if key in self.buffer_names}))
        record.input_reads = tuple(sorted({self.input_names[storage_key(t)] for t in inputs
                                           if storage_key(t) in self.input_names}))
        record.input_writes = tuple(sorted({self.input_names[key] for key in written | tracker.written
                                            if key in self.input_names}))
        record.saves = self._owners(saved)
        record.stops_before_output = bool(saved) and bool(made_after_last_save) and all(made_after_last_save)
        if record.output_bytes or record.mutates:
            record.grad_aliases = self._gradient_aliases(n, result, inputs, producers)
        else:
            self.views.made(n.name, tensors_in(result), inputs)
        # (a view's or an in-place write's gradient for what it read is its readers')
        self.views.read(record, inputs, producers, makes_gradients=bool(record.output_bytes and not record.mutates))
        record.saved_bytes = sum(
            nbytes for key, nbytes in saved.items() if key not in self.owner and key not in self.static_keys
        )
        if caching:  # the parameters it cast, saved or not (a bias): autocast's cache holds them
            casts = {key: nbytes for key, nbytes in tracker.casts.items() if key not in self.owner}
            record.cast_bytes = sum(casts.values())
            record.cast_saved_bytes = sum(saved[key] for key in casts if key in saved)
        record.transient_bytes = max(0, tracker.peak_bytes - live_after)
        if record.stops_before_output:  # what a recomputation stopped at its last pack holds
            record.stop_transient_bytes = max(0, peak_at_pack[0] - live_before - record.saved_bytes)
        parameters = self._parameters_read(n)
        record.parameters = tuple(self.parameter_names[id(p)] for p in parameters)
        if caching:
            record.cast_parameters = tuple(self.parameter_names[id(p)] for p in parameters
                                           if storage_key(p) in tracker.cast_reads)
        record.param_grad_bytes = sum(p.numel() * p.element_size() for p in parameters)
        record.late_grad_bytes = sum(nbytes for key, _, nbytes in tracker.broadcast if key in self.trainable_storages)
        logger.debug("profiled %s: %s", n.name, record)
        n.meta[META_KEY] = record
        outputs = tensors_in(result)
        claimed = claim_autograd_nodes(outputs, n.name, self.autograd_owners)
        if outputs:
            record.unhooked_saved_bytes = unhooked_saved_bytes(claimed, saved.keys(), outputs[0].device)
        return result

    def compute(self, n: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one compute node (a hook for subclasses that run some nodes differently)."""
        return getattr(self, n.op)(n.target, args, kwargs)

    def _gradient_aliases(self, n: fx.Node, result: Any, inputs: list[torch.Tensor],
                          producers: list[Any]) -> tuple[str, ...]:
        """Owners of the inputs whose gradient the node's backward returns as the output's
        gradient itself or a view of it (an add of equal shapes, in place or not, a cat, a
        clone): autograd then holds one storage for both. Found by calling the backward on the
        output itself, for those backward kinds only, where it allocates nothing. `producers`
        are the inputs' `grad_fn`s before the node ran (an in-place op replaces its target's).
        An input read twice gets two gradients, which autograd sums into a new tensor."""
        function = result.grad_fn if isinstance(result, torch.Tensor) else None
        kind = type(function).__name__
        if function is None or kind not in ALIASING_BACKWARDS:
            return ()
        if kind == "AddBackward0" and (n.kwargs.get("alpha", 1) != 1 or any(
                t.shape != result.shape or t.dtype != result.dtype for t in inputs if t.requires_grad)):
            return ()  # broadcasting, scaling or a dtype change: the backward makes new tensors
        gradient = result.detach()
        with torch.no_grad():
            returned = function(gradient)
        returned = returned if isinstance(returned, tuple) else (returned,)
        key_of = {id(fn): storage_key(t) for t, fn in zip(inputs, producers) if fn is not None}
        edges = [id(next_function) for next_function, _ in function.next_functions if next_function is not None]
        keys = [key_of[id(next_function)]
                for (next_function, _), grad in zip(function.next_functions, returned)
                if next_function is not None and id(next_function) in key_of and edges.count(id(next_function)) == 1
                and grad is not None and storage_key(grad) == storage_key(gradient)]
        return self._owners(keys)

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


def passes_on(record: NodeProfile) -> bool:
    """Whether a node has nothing of its own (no storage, gradient, saved tensor or node input):
    a view of what it reads, or that tensor itself (dropout at p=0, a cast to its own dtype)."""
    return not (record.output_bytes or record.grad_bytes or record.uses or record.saves)


def reaches_backward(node: fx.Node) -> bool:
    """Whether gradients flow through `node` to what it read: its backward runs, or it passes
    what it read on (`passes_on`: dropout at p=0 hands on the parameter itself, which has no
    backward of its own) to a node that does. A metadata check reading a weight does not.

    Example:
        >>> reaches_backward(dropout_of_weight)  # read by a linear
        True
    """
    record = node.meta.get(META_KEY)
    if record is None:
        return False
    return record.backward_runs or (passes_on(record) and any(reaches_backward(user) for user in node.users))


def parameter_readers(nodes: Iterable[fx.Node], cast: bool = False,
                      backward: bool = False) -> dict[str, list[fx.Node]]:
    """Each parameter's profiled readers in graph order (`NodeProfile.parameters`; with `cast`,
    the nodes that used its autocast copy: `NodeProfile.cast_parameters`; with `backward`, only
    those through which gradients reach it (`reaches_backward`): a metadata check that reads a
    weight makes no gradient).

    Example:
        >>> [n.name for n in parameter_readers(gm.graph.nodes)["head.weight"]]  # tied to the embedding
        ['embed', 'head']
    """
    readers: dict[str, list[fx.Node]] = {}
    for node in nodes:
        record = node.meta.get(META_KEY)
        if record is None or (backward and not reaches_backward(node)):
            continue
        for name in record.cast_parameters if cast else record.parameters:
            readers.setdefault(name, []).append(node)
    return readers


def shared_gradient_owners(gm: fx.GraphModule, backward_owners: Collection[str]) -> dict[int, str]:
    """For each parameter read by several profiled nodes with a backward (`backward_owners`:
    tied weights; a metadata check that reads one is no reader) whose `.grad` is set, its
    storage's pointer -> the first such reader, at whose backward the planner counts the
    gradient (`planner.problem.graph`'s shared gradients): `backward_memory`'s `settled`.

    Example:
        >>> shared_gradient_owners(gm, owners.values())  # GPT-2's tied embedding, after a backward
        {140331042816000: 'transformer_wte'}
    """
    parameters = dict(gm.named_parameters())
    found: dict[int, str] = {}
    for name, users in parameter_readers(gm.graph.nodes).items():
        users = [node for node in users if node.name in backward_owners]
        if len(users) > 1 and parameters[name].grad is not None:
            found[parameters[name].grad.untyped_storage().data_ptr()] = users[0].name
    return found


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
    `loss(graph output)` (default: `planner.core.training_loss`), measures each node's backward
    temporaries; it leaves parameter gradients behind. The caller is responsible for
    restoring state that forward changes (BatchNorm statistics, RNG): see
    `planner.measure.memory.preserved_state`.

    Example:
        >>> summary = profile(gm, [torch.randn(8, 16)])
        >>> summary.parameter_bytes
    """
    parameters = list(gm.parameters())
    buffers = list(gm.buffers())
    device = inputs[0].device
    static_keys = {storage_key(t) for t in tensors_in((parameters, buffers, inputs))}

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
            with torch.profiler.record_function(LOSS_LABEL):
                value, loss_bytes = training_loss_bytes(loss or training_loss, output)
            # Backward as in a training step: forward's values are held by autograd alone, so
            # a node's saved tensors are freed when its backward releases them.
            interpreter.env.clear()
            del output
            with after_autocast():
                value.backward()
            del value
        records = {node.name: node.meta[META_KEY] for node in gm.graph.nodes if META_KEY in node.meta}
        for name, extra in forward_scratch(allocations, device.type, NODE_LABEL).items():
            records[name].transient_bytes += extra
        for name, extra in scratch_before_mark(allocations, device.type, NODE_LABEL, PACK_MARK).items():
            if records[name].stop_transient_bytes is not None:
                records[name].stop_transient_bytes += extra
        owners = {grad_fn._sequence_nr(): name for grad_fn, name in interpreter.autograd_owners.items()}
        backward = backward_memory(allocations, device.type, owners, shared_gradient_owners(gm, set(owners.values())))
        for name, record in records.items():
            record.backward_runs = name in backward.temporaries
            record.backward_transient_bytes = backward_transient_bytes(backward.temporaries, name, record)
        loss_scratch = forward_scratch(allocations, device.type, LOSS_LABEL).get("", 0)
        del interpreter
        times: dict[str, list[float]] = {}
        stop_times: dict[str, list[float]] = {}
        launch_ms: dict[str, float] = {}  # the warm-up run's launch times set how far ahead CUDA queues
        for run in range(warmup + repeats):
            if progress:
                progress(f"timing forward pass {run + 1}/{warmup + repeats}")
            timer = TimingInterpreter(gm, times if run >= warmup else {}, device, stop_times if run >= warmup else {},
                                      launch_ms)
            timer.run(*inputs)
            timer.collect()

    # Identical nodes (the same op on the same shapes: every layer's) do the same work: each is
    # priced at the median of all their runs, so that noise does not make one layer look dearer
    # to recompute than its twin (and plans flip between them from one planning to the next).
    groups: dict[Any, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op in COMPUTE_OPS:
            groups.setdefault(node.meta[SIGNATURE_KEY], []).append(node)
    for group in groups.values():
        forward_ms = statistics.median(t for node in group for t in times[node.name])
        stops = [t for node in group for t in stop_times.get(node.name, ())]
        for node in group:
            record = node.meta[META_KEY]
            record.forward_ms = forward_ms
            if node.name in stop_times:
                record.stop_ms = min(forward_ms, statistics.median(stops))
    return graph_profile(gm, inputs, device, "CUDA events" if device.type == "cuda" else "time.perf_counter",
                         loss_bytes=loss_bytes, loss_scratch_bytes=loss_scratch, gradients=tuple(backward.gradients))


def graph_profile(gm: fx.GraphModule, inputs: list[torch.Tensor], device: torch.device, timing: str,
                  **measurement: Any) -> GraphProfile:
    """The whole-graph figures of a profiled graph (its nodes annotated), on real, meta or fake
    tensors: `measurement` sets the GraphProfile fields that say how the nodes were measured.

    Example:
        >>> graph_profile(gm, inputs, torch.device("cpu"), "time.perf_counter").input_bytes
    """
    parameters = list(gm.parameters())
    return GraphProfile(
        rng_state_bytes=rng_state_bytes(device),
        parameter_bytes=storage_bytes(parameters),
        gradient_bytes=sum(p.numel() * p.element_size() for p in parameters if p.requires_grad),
        buffer_bytes=storage_bytes(list(gm.buffers())),
        input_bytes=storage_bytes(inputs),
        device=device,
        timing=timing,
        **measurement,
    )
