"""Sizes without memory: profile a traced graph on fake tensors (the no-run path's first half).

Shapes, dtypes, storages, aliasing and what autograd saves are the same under
`torch._subclasses.FakeTensorMode` as for real tensors. `profile_sizes` runs the graph's forward
and backward on fake copies of the model's parameters, buffers and inputs (built on the plan's
device; a model on `meta` works the same) and writes every node's `NodeProfile` (outputs, saved
tensors, uses, in-place writes, random draws, tensor temporaries of forward and backward) into
`node.meta`, the ATen calls each node makes (`planner.measure.targets.KernelCounter`, for
roofline times), and the layout of the gradient each node's backward receives (which
`planner.measure.nodes` runs it alone with). Kernel scratch and times are left to
`planner.measure.nodes`. It also says about what measuring the whole step at once would hold.

Backward temporaries at the tensor level come from `BackwardWindows`: `LiveBytesTracker`'s log
of every allocation and free, cut into windows by autograd pre-hooks on the nodes each graph
node created, and read by the allocator's window algorithm
(`planner.measure.allocations.window_memory`). Where a tensor feeds several consumers, real
tensors are summed in place into the gradient autograd holds first, where that is dense, and
fake tensors out of place: those sums are replayed in place, except a sum freed before the
buffer it read (a gradient others still hold, summed into a new tensor on real tensors too).

Example:
    >>> with torch.device("meta"):
    ...     model = build_model()
    >>> traced = trace(model, sample)
    >>> fake = profile_sizes(traced.gm, traced.graph_inputs((), sample), torch.device("cpu"))
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from planner.core import after_autocast, training_loss
from planner.measure.allocations import AllocationEvent, window_memory
from planner.measure.memory import LiveBytesTracker, storage_key
from planner.measure.profile import (
    META_KEY,
    ProfileInterpreter,
    tensors_in,
    training_loss_bytes,
)
from planner.measure.targets import (
    ATTENTION_TARGETS,
    KernelCost,
    KernelCounter,
    target_attention,
)
from planner.trace.fake import fake_like, fake_model_state, fake_state
from planner.trace.structure import COMPUTE_OPS


def _dense(tensor: torch.Tensor) -> bool:
    return is_non_overlapping_and_dense_or_false(tensor)


class _EngineSums(TorchDispatchMode):
    """Notes the out-of-place gradient sums the autograd engine makes for fake tensors (an
    `aten.add.Tensor` between a node's backward (post-hook) and the next one's (pre-hook)), and
    when each operator inside a node's backward returns."""

    def __init__(self, windows: "BackwardWindows") -> None:
        super().__init__()
        self.windows = windows

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if not self.windows.between_nodes and self.windows.starts:
            owner = self.windows.starts[-1][1]
            self.windows.operator_ends.append((self.windows.clock(), owner, func._schema.name))
        if (self.windows.between_nodes and func is torch.ops.aten.add.Tensor and isinstance(result, FakeTensor)
                and all(isinstance(a, torch.Tensor) for a in args[:2])):
            old = args[0]
            # Real dense tensors are summed in place only into the old buffer (autograd's
            # InputBuffer); a new gradient is never the target.
            serials = self.windows.tracker.ordinal
            into, made = serials.get(id(old.untyped_storage())), serials.get(id(result.untyped_storage()))
            if _dense(old) and into is not None and made is not None:
                self.windows.sums.append((self.windows.clock(), into, made))
        return result


_aten = torch.ops.aten
# Norms whose mean and inverse deviation are saved for backward: each op's weight argument.
_NORM_WEIGHTS = {_aten.native_layer_norm: 2, _aten.native_group_norm: 1, _aten.native_batch_norm: 1,
                 _aten._native_batch_norm_legit: 1, _aten._native_batch_norm_legit_functional: 1,
                 _aten._batch_norm_with_update: 1}


class NormStatistics(TorchDispatchMode):
    """Makes the statistics a norm saves for backward (outputs 1 and 2: mean and inverse
    deviation) float32 on fake tensors where the plan's device computes them so: PyTorch's fake
    CPU kernels give them the input's dtype, but the CPU kernels keep float32 for a 16-bit input
    with float32 weights (under autocast), and a CUDA GPU does for any 16-bit input (`cuda`).

    Example:
        >>> with FakeTensorMode(), NormStatistics(cuda=False):
        ...     out, mean, rstd = torch.ops.aten.native_layer_norm(x_bf16, [64], w_fp32, b_fp32, 1e-5)
        >>> mean.dtype
        torch.float32
    """

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        at = _NORM_WEIGHTS.get(func.overloadpacket)
        if at is None or args[0].dtype not in (torch.bfloat16, torch.float16):
            return result
        weight = args[at] if len(args) > at else None
        if not (self.cuda or (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32)):
            return result
        statistics = tuple(t.new_empty(t.shape, dtype=torch.float32) if t.dtype == args[0].dtype else t
                           for t in result[1:3])
        return (result[0], *statistics, *result[3:])


class BackwardWindows:
    """While active (around a backward pass, with `tracker` active too: it enters it), cuts
    `tracker`'s log into one window per owner: a window opens when an autograd node that
    `owners` maps to a graph node starts. `tracker` must be the one that saw the forward, so
    that frees of forward tensors are in its log, and must have a log.

    Example:
        >>> tracker = LiveBytesTracker(log=[])
        >>> ... forward under tracker, owners from planner.measure.profile.claim_autograd_nodes ...
        >>> with BackwardWindows(tracker, owners) as windows:
        ...     loss.backward()
        >>> windows.temporaries()
    """

    def __init__(self, tracker: LiveBytesTracker, owners: dict[Any, str]) -> None:
        if tracker.log is None:
            raise ValueError("BackwardWindows needs a tracker that keeps a log")
        self.tracker = tracker
        self.clock = tracker.clock
        self.owners = owners
        self.starts: list[tuple[int, str]] = []
        self.sums: list[tuple[int, int, int]] = []  # (tick, serial summed into, out-of-place result's)
        self.operator_ends: list[tuple[int, str, str]] = []  # (tick, owner, operator) as one returns
        self.between_nodes = False
        self._handles: list[Any] = []
        self._mode = _EngineSums(self)

    def _opened(self, name: str) -> None:
        self.between_nodes = False
        self.starts.append((self.clock(), name))

    def _closed(self) -> None:
        self.between_nodes = True

    def __enter__(self) -> "BackwardWindows":
        for grad_fn, name in self.owners.items():
            self._handles.append(grad_fn.register_prehook(lambda _, name=name: self._opened(name)))
            self._handles.append(grad_fn.register_hook(lambda *_: self._closed()))
        self.tracker.__enter__()
        self._mode.__enter__()  # inside the tracker: it sees a sum after the tracker logged it
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self.tracker.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def temporaries(self) -> dict[str, int]:
        """`BackwardTimeline.temporaries` of what this saw."""
        return self.timeline().temporaries()

    def timeline(self) -> "BackwardTimeline":
        """What this saw: allocation events (sums replayed in place), window starts, operator ends."""
        return BackwardTimeline(self.events(), list(self.starts), list(self.operator_ends))

    def events(self) -> list[AllocationEvent]:
        """The tracker's log as allocation events, with out-of-place sums replayed in place:
        the sum's allocation and the free of the buffer it replaces are dropped, and the sum's
        later events become that buffer's."""
        log = list(self.tracker.log or [])
        replayed: list[tuple[int, int, int, int]] = []  # (sum's key, buffer's key, from tick, to tick)
        for tick, into, result in self.sums:
            for key, buffer, first, last in replayed:  # summing into an earlier sum: its buffer
                if into == key and first < tick <= last:
                    into = buffer
            made = max((i for i, (t, size, key) in enumerate(log) if t < tick and key == result and size > 0),
                       default=None)
            freed = next((i for i, (t, size, key) in enumerate(log) if t > tick and key == into and size < 0), None)
            if made is None or freed is None:
                continue  # the summed-into buffer outlives the window: nothing to replay
            # The sum's own free ends its life: a later storage may reuse its id.
            end = next((i for i, (_, size, key) in enumerate(log) if i > made and key == result and size < 0),
                       len(log) - 1)
            if freed > end:
                continue  # the sum died first: it replaced nothing (a gradient others hold, summed anew)
            replayed.append((result, into, log[made][0], log[end][0]))
            log = [(t, size, into if key == result and made < i <= end else key)
                   for i, (t, size, key) in enumerate(log) if i not in (made, freed)]
        return [AllocationEvent(tick, size, key, None) for tick, size, key in log]


@dataclass(frozen=True)
class BackwardTimeline:
    """Backward's tensor memory cut into windows per graph node (`BackwardWindows`): allocation
    events (sums replayed in place), when each owner's autograd nodes started, and when each
    operator of an owner's window returned."""

    events: list[AllocationEvent]
    starts: list[tuple[int, str]]
    operator_ends: list[tuple[int, str, str]]

    def temporaries(self, scratch: dict[str, list[tuple[str, int]]] | None = None) -> dict[str, int]:
        """Per owner, the most its backward raised tensor memory above what it started with,
        less what it left behind; below 0 where it freed room before making what it keeps
        (see `planner.measure.allocations.window_memory`). With `scratch`, per owner the kernel
        scratch of each operator its backward ran on real tensors, as (operator, bytes) in order
        (`planner.measure.nodes`): each counted as the same operator returns here, paired in
        order (fake tensors' backward makes calls real ones do not: `prim::device`, `detach`);
        where they do not pair up, the owner's largest at every one of its operators.

        Example:
            >>> timeline.temporaries({"conv": [("aten::convolution_backward", 1329152)]})["conv"]
        """
        by_owner: dict[str, list[tuple[int, str]]] = {}
        for tick, owner, operator in self.operator_ends:
            by_owner.setdefault(owner, []).append((tick, operator))
        marks = []
        for owner, measured in (scratch or {}).items():
            ends = by_owner.get(owner, [])
            paired = _paired(ends, measured)
            if paired is None:
                logger.debug("%s: its backward's operators on real tensors %s do not pair up with those on fake "
                             "ones %s", owner, [name for name, _ in measured], [name for _, name in ends])
                largest = max((nbytes for _, nbytes in measured), default=0)
                paired = [(tick, largest) for tick, _ in ends]
            marks += [(tick, nbytes) for tick, nbytes in paired if nbytes]
        return window_memory(self.events, self.starts, scratch=marks).temporaries


def _paired(ends: list[tuple[int, str]], measured: list[tuple[str, int]]) -> list[tuple[int, int]] | None:
    """Each measured operator's bytes at the tick of the next fake operator of its name, in order;
    None where one finds none."""
    paired, position = [], 0
    for name, nbytes in measured:
        while position < len(ends) and ends[position][1] != name:
            position += 1
        if position == len(ends):
            return None
        paired.append((ends[position][0], nbytes))
        position += 1
    return paired


logger = logging.getLogger(__name__)


KERNELS_KEY = "planner.kernels"  # node.meta: the node's ATen calls, tuple[KernelCost, ...]


# node.meta: the strides of the gradient backward hands each of the node's outputs (in
# `tensors_in` order; None where it gets none), dict[int, tuple[int, ...]]
GRADIENT_STRIDES_KEY = "planner.gradient_strides"


@dataclass
class FakeProfile:
    """The fake values of a profiled graph, kept for running nodes one at a time later.

    `values` maps each fx node to its fake value; `sources` maps the id of a fake parameter,
    buffer, constant or input to the tensor (real or meta) it stands for; `needed_bytes` is
    about what measuring the whole step at once would hold (every value kept, plus static
    memory and gradients).
    """

    values: dict[fx.Node, Any]
    sources: dict[int, torch.Tensor]
    backward: BackwardTimeline  # backward's tensor memory per node, to which measure_nodes adds kernel scratch
    needed_bytes: int = 0
    loss_bytes: int = 0  # held through backward by the loss outside the graph
    loss_output: str | None = None  # the node whose output is the loss, where the graph returns it
    loss_scratch_bytes: int = 0  # the loss's kernel scratch, run on real outputs node by node (measure_nodes)


class _FakeInterpreter(ProfileInterpreter):
    """The profile interpreter on fake tensors: attributes that are not parameters or buffers
    (export's lifted constants) are made fake on first use, every node's ATen calls are
    counted, and attention can run the target's kernel."""

    def __init__(self, gm: fx.GraphModule, static_keys: set[int], tracker: LiveBytesTracker,
                 fake: Callable[[torch.Tensor], torch.Tensor], attention: Callable[..., Any] | None):
        super().__init__(gm, static_keys, tracker)
        self.fake = fake
        self.attention = attention

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            return self.fake(value)
        return value

    def compute(self, n: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with KernelCounter() as counter:
            if self.attention is not None and n.op == "call_function" and n.target in ATTENTION_TARGETS:
                result = self.attention(*args, **kwargs)
            else:
                result = super().compute(n, args, kwargs)
        n.meta[KERNELS_KEY] = tuple(counter.kernels)
        # A kernel's backward may copy a gradient it gets in another layout (a slice of a cat's
        # gradient), scratch that running the node alone on a contiguous gradient would not show.
        strides: dict[int, tuple[int, ...]] = {}
        n.meta[GRADIENT_STRIDES_KEY] = strides

        def note(position: int) -> Callable[[torch.Tensor], None]:
            def hook(grad: torch.Tensor) -> None:
                strides.setdefault(position, tuple(grad.stride()))
            return hook

        for position, tensor in enumerate(tensors_in(result)):
            if tensor.requires_grad and tensor.grad_fn is not None:
                tensor.register_hook(note(position))
        return result


def profile_sizes(
    gm: fx.GraphModule,
    inputs: list[torch.Tensor],
    device: torch.device,
    cuda: bool = False,
    loss: Callable[[Any], torch.Tensor] | None = None,
) -> FakeProfile:
    """Profile `gm` on fake copies of its state and of `inputs` (real or meta) on `device`.

    Writes each compute node's `NodeProfile` (times zero, scratch not included) and its
    `KernelCost`s into `node.meta`; returns the fake values for `planner.measure.nodes`.
    `cuda`: the plan is for a CUDA GPU, whose kernels attention runs (`planner.measure.targets.target_attention`)
    and whose norms keep float32 statistics (`NormStatistics`).
    One backward pass from `loss(output)` (default `planner.core.training_loss`) gives the
    tensor temporaries of each node's backward.

    Example:
        >>> with torch.device("meta"):
        ...     model = build_model()
        >>> traced = trace(model, sample)
        >>> fake = profile_sizes(traced.gm, traced.graph_inputs((), sample), torch.device("cpu"))
    """
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    sources: dict[int, torch.Tensor] = {}
    constants: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in constants:
            constants[id(tensor)] = fake_like(tensor, mode, device)
            sources[id(constants[id(tensor)])] = tensor
        return constants[id(tensor)]

    state = fake_state(gm, mode, device)
    originals = dict(gm.named_parameters()) | dict(gm.named_buffers())
    sources.update((id(state[name]), originals[name]) for name in state)
    fake_inputs = [fake_like(tensor, mode, device) for tensor in inputs]
    sources.update((id(fake_input), tensor) for fake_input, tensor in zip(fake_inputs, inputs))

    tracker = LiveBytesTracker(log=[])
    static_keys = {storage_key(t) for t in (*state.values(), *fake_inputs)}
    with fake_model_state(gm, mode, device, state), mode, NormStatistics(cuda), torch.enable_grad():
        # Built inside: it names the parameters and buffers it sees, the fake ones.
        interpreter = _FakeInterpreter(gm, static_keys, tracker, fake, target_attention if cuda else None)
        output = interpreter.run(*fake_inputs)
        value, loss_bytes = training_loss_bytes(loss or training_loss, output)
        loss_output = next((node.name for node, found in interpreter.env.items() if found is value), None)
        with BackwardWindows(tracker, interpreter.autograd_owners) as windows, after_autocast():
            value.backward()
        del value
        static = sum(t.untyped_storage().nbytes() for t in state.values())
        gradients = sum(p.numel() * p.element_size() for p in state.values()
                        if isinstance(p, nn.Parameter) and p.requires_grad)
    records = {node.name: node.meta[META_KEY] for node in gm.graph.nodes if node.op in COMPUTE_OPS}
    timeline = windows.timeline()
    temporaries = timeline.temporaries()
    for name, record in records.items():
        record.backward_runs = name in temporaries
        # (not below 0, as the allocator's windows may be: fake tensors show no kernel scratch, and
        # an operator's that a node run alone misses would read low)
        record.backward_transient_bytes = max(0, temporaries.get(name, 0))
    kept = sum(r.output_bytes + r.saved_bytes for r in records.values())
    peak_extra = max((r.transient_bytes + r.backward_transient_bytes for r in records.values()), default=0)
    needed = static + gradients + kept + 2 * sum(r.grad_bytes for r in records.values()) + peak_extra
    return FakeProfile(dict(interpreter.env), sources, timeline, needed, loss_bytes, loss_output)


def kernels_of(node: fx.Node) -> tuple[KernelCost, ...]:
    """The ATen calls `profile_sizes` saw node `node` make."""
    return node.meta.get(KERNELS_KEY, ())
