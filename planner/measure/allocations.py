"""Read the allocator through `torch.profiler`: every allocation and free, kernel scratch included.

`planner.measure.memory.LiveBytesTracker` (a `TorchDispatchMode`) follows tensors, which is what
attributing memory to graph nodes needs, but it cannot see memory a kernel allocates and frees
for itself (oneDNN convolutions on CPU, cuDNN workspaces on CUDA), and under `torch.compile`
it sees nothing Inductor's wrapper allocates (Dynamo skips compiled frames while a dispatch mode
is active). The profiler (`profile_memory=True`) records every allocation and free made through
c10's allocators, with pointer, size and a nanosecond timestamp, whoever made it.

- `ProfiledPeakMemory` replays those events in time order and follows only allocations made
  inside the block (a free of a pointer allocated before is ignored): `peak_bytes` is the
  highest point of bytes allocated inside the block and not yet freed, scratch included;
  `peak_bytes_without_scratch` leaves out every allocation freed before the outermost `aten::`
  operator that made it returns, which is the tracker's view.
- `forward_scratch` says, per profiled graph node, how far one operator's scratch raises its
  forward's peak above what the tracker sees (`backward_operator_scratch`: each operator of its
  backward); `backward_memory` measures each node's backward from the allocator alone
  (autograd's own allocations included).

Example:
    >>> with ProfiledPeakMemory() as memory:
    ...     model(x).sum().backward()
    >>> memory.peak_bytes, memory.peak_bytes_without_scratch
"""
from __future__ import annotations

import functools
import heapq
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch._C._profiler import _EventType

from planner.core import NodeProfile, cold_autocast_cache


@dataclass(frozen=True)
class AllocationEvent:
    """One allocation (`size_bytes` > 0) or free (< 0) seen by the profiler."""

    time_ns: int
    size_bytes: int
    pointer: int
    operator_end_ns: int | None  # when the outermost aten:: operator around it returned


class ProfiledPeakMemory:
    """Peak bytes allocated on `device` (default the CPU) inside a `with` block and not yet
    freed, from the profiler's allocation events (eager and `torch.compile`d code alike).

    After the block: `peak_bytes` (kernel scratch included), `peak_bytes_without_scratch`,
    `live_bytes` (allocated inside and still live at the end), `allocations` (count).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device_type = torch.device(device).type
        self.peak_bytes = 0
        self.peak_bytes_without_scratch = 0
        self.live_bytes = 0
        self.allocations = 0
        self._running: Any = None
        self._profile: torch.profiler.profile | None = None

    def __enter__(self) -> "ProfiledPeakMemory":
        self._running = memory_profile()
        self._profile = self._running.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._running.__exit__(*exc)
        events = allocation_events(self._profile, self.device_type)
        self._running = self._profile = None
        self.allocations = sum(1 for event in events if event.size_bytes > 0)
        self.peak_bytes, self.live_bytes = replay(events)
        self.peak_bytes_without_scratch, _ = replay(events, skip_scratch=True)


@contextmanager
def memory_profile() -> Iterator[torch.profiler.profile]:
    """A running profiler that records operators and every allocator event (the CPU and CUDA
    allocators report to it alike; no CUDA activity tracing is needed for memory).

    Example:
        >>> with memory_profile() as profile:
        ...     model(x).sum().backward()
        >>> allocation_events(profile)[:1]
    """
    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    cold_autocast_cache()  # (else casts made before it may be freed inside: memory it never saw allocated)
    with _without_kineto_banner():
        profile.__enter__()
    try:
        yield profile
    finally:
        with _without_kineto_banner():
            profile.__exit__(None, None, None)


@contextmanager
def _without_kineto_banner() -> Iterator[None]:
    """Kineto writes a line to the process's stderr each time a profiler starts and stops,
    whatever the log level; with a profile per measured step they would bury the planner's
    own output, so stderr is closed for just those calls."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def allocation_events(profile: torch.profiler.profile, device_type: str = "cpu") -> list[AllocationEvent]:
    """Every allocation and free on `device_type` the profile recorded, in time order; at equal
    times frees come first (the allocator can hand out a pointer again only after it was freed)."""
    events: list[AllocationEvent] = []
    stack = [(root, None) for root in profile.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, operator_end = stack.pop()
        kind, fields = node.typed
        if kind == _EventType.Allocation:
            if fields.device.type == device_type and fields.alloc_size != 0:
                events.append(AllocationEvent(node.start_time_ns, fields.alloc_size, fields.ptr, operator_end))
            continue
        if operator_end is None and kind == _EventType.TorchOp and node.name.startswith("aten::") \
                and not tracked_through(node):
            operator_end = node.end_time_ns
        stack.extend((child, operator_end) for child in node.children)
    events.sort(key=lambda event: (event.time_ns, event.size_bytes > 0))
    return events


def replay(events: list[AllocationEvent], skip_scratch: bool = False) -> tuple[int, int]:
    """(peak, final) live bytes of the allocations among `events`, in order; frees of pointers
    not allocated among them (memory from before) are ignored. With `skip_scratch`, an
    allocation freed before its operator returned is left out."""
    skipped: set[int] = set()
    if skip_scratch:
        opened: dict[int, tuple[int, AllocationEvent]] = {}
        for index, event in enumerate(events):
            if event.size_bytes > 0:
                opened[event.pointer] = (index, event)
            elif event.pointer in opened:
                start, allocation = opened.pop(event.pointer)
                if allocation.operator_end_ns is not None and event.time_ns <= allocation.operator_end_ns:
                    skipped.update((start, index))
    live: dict[int, int] = {}
    live_bytes = peak = 0
    for index, event in enumerate(events):
        if index in skipped:
            continue
        if event.size_bytes > 0:
            live_bytes += event.size_bytes - live.pop(event.pointer, 0)  # seen twice: a free was missed
            live[event.pointer] = event.size_bytes
            peak = max(peak, live_bytes)
        else:
            live_bytes -= live.pop(event.pointer, 0)
    return peak, live_bytes


def forward_scratch(profile: torch.profiler.profile, device_type: str, label_prefix: str) -> dict[str, int]:
    """How far kernel scratch raises one operator's peak above what the tensor tracker sees,
    at most, per `record_function(label_prefix + name)` range: for every outermost `aten::`
    operator, the peak of all its allocations minus the peak of those it does not free before
    returning (its outputs), both from the operator's start.

    Example:
        >>> with memory_profile() as profile:
        ...     with torch.profiler.record_function("node:conv"):
        ...         y = conv(x)
        >>> forward_scratch(profile, "cpu", "node:")["conv"]
    """
    return {label: max((_scratch_extra(_subtree_allocations(operator, device_type)) for operator in operators),
                       default=0)
            for label, (operators, _) in _labelled_operators(profile, _range_label(label_prefix), None).items()}


def _range_label(label_prefix: str) -> Callable[[Any], str | None]:
    """The label of a `record_function(label_prefix + name)` range: `name`."""
    return lambda node: node.name[len(label_prefix):] if node.name.startswith(label_prefix) else None


def backward_operator_scratch(profile: torch.profiler.profile, device_type: str,
                              owners: dict[int, str]) -> dict[str, list[tuple[str, int]]]:
    """`forward_scratch` for backward, operator by operator: per owner, in the order they ran,
    each outermost `aten::` operator its autograd nodes run (`owners` maps their sequence
    numbers to it, as in `backward_memory`) and how far it raised memory above its outputs. A
    convolution's backward makes its gradient contiguous and fills a workspace before it returns.

    Example:
        >>> with memory_profile() as profile:
        ...     torch.autograd.grad(y, [x, conv.weight], torch.ones_like(y))
        >>> backward_operator_scratch(profile, "cpu", {y.grad_fn._sequence_nr(): "conv"})["conv"]
    """
    def owner_of(node: Any) -> str | None:
        if not node.name.startswith("autograd::engine::evaluate_function"):
            return None
        return owners.get(node.typed[1].sequence_number)

    return {owner: [(operator.name, _scratch_extra(_subtree_allocations(operator, device_type)))
                    for operator in sorted(operators, key=lambda operator: operator.start_time_ns)]
            for owner, (operators, _) in _labelled_operators(profile, owner_of, None).items()}


def scratch_before_mark(profile: torch.profiler.profile, device_type: str, label_prefix: str,
                        mark: str) -> dict[str, int]:
    """`forward_scratch` counting only what is allocated before the last `record_function(mark)`
    inside each labelled range, for the ranges that hold one: the scratch a forward holds
    when it is stopped there (recomputation stops at a node's last saved tensor, raised from
    its pack hook, before the kernel that makes its output allocates anything).

    Example:
        >>> scratch_before_mark(profile, "cpu", "node:", "saved tensor")["conv"]  # saved before its kernel
        0
    """
    scratch: dict[str, int] = {}
    for label, (operators, mark_ns) in _labelled_operators(profile, _range_label(label_prefix), mark).items():
        if mark_ns is None:
            continue
        before = ([event for event in _subtree_allocations(operator, device_type) if event.time_ns < mark_ns]
                  for operator in operators if operator.start_time_ns < mark_ns)
        scratch[label] = max((_scratch_extra(events) for events in before), default=0)
    return scratch


def _labelled_operators(profile: torch.profiler.profile, label_of: Callable[[Any], str | None],
                        mark: str | None) -> dict[str, tuple[list[Any], int | None]]:
    """Per label (`label_of` names the events that open one: a `record_function` range, an
    autograd node): the outermost `aten::` operators under its events, and when the last
    `record_function(mark)` inside them started (None: none, or no `mark`)."""
    found: dict[str, tuple[list[Any], int | None]] = {}
    stack = [(root, None) for root in profile.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, label = stack.pop()
        if node.typed[0] != _EventType.TorchOp:
            continue
        opened = label_of(node)
        if opened is not None:
            label = opened
            marks = _marks_under(node, mark) if mark is not None else []
            found[label] = (found.get(label, ([], None))[0], max(marks, default=None))
        elif node.name.startswith("aten::") and not tracked_through(node):
            if label is not None:
                found[label][0].append(node)
            continue
        stack.extend((child, label) for child in node.children)
    return found


def tracked_through(operator: Any) -> bool:
    """Whether the tensor tracker sees an `aten::` event's children as calls of their own, not
    the event as one: an op that decomposes into others above the dispatch key the tracker works
    at (`CompositeImplicitAutograd`: `aten::layer_norm`, `aten::cross_entropy_loss`), or autocast's
    kernel (`autocast_wrapper`). Its children, not it, are the operators whose scratch counts:
    else a tensor it makes and frees before returning (a float32 copy autocast makes for a loss,
    an intermediate no backward saves) would count twice, as a tensor the tracker saw and as
    its scratch.

    Example:
        >>> with memory_profile() as profile:
        ...     F.cross_entropy(logits, labels)  # aten::cross_entropy_loss > aten::log_softmax, aten::nll_loss
    """
    return operator.name in _composite_operators() or autocast_wrapper(operator)


@functools.cache
def _composite_operators() -> frozenset[str]:
    """The `aten::` names (as the profiler gives them, without an overload) whose every overload
    is `CompositeImplicitAutograd`, leaving out the `out=` variants, which a forward does not
    call (`aten::linear`: its `out` overload has a kernel of its own)."""
    overloads: dict[str, list[bool]] = {}
    for full_name in torch._C._dispatch_get_all_op_names():
        if full_name.startswith("aten::") and not full_name.partition(".")[2].endswith("out"):
            composite = torch._C._dispatch_has_kernel_for_dispatch_key(full_name, "CompositeImplicitAutograd")
            overloads.setdefault(full_name.split(".")[0], []).append(composite)
    return frozenset(name for name, composite in overloads.items() if all(composite))


def autocast_wrapper(operator: Any) -> bool:
    """Whether an `aten::` event is autocast's kernel: it casts its arguments (`aten::to`
    children) and calls the same operator again.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), memory_profile() as profile:
        ...     F.cross_entropy(logits, labels)  # aten::cross_entropy_loss > aten::to, aten::cross_entropy_loss
    """
    return any(child.typed[0] == _EventType.TorchOp and child.name == operator.name for child in operator.children)


def _marks_under(operator: Any, mark: str) -> list[int]:
    """Start times of the `record_function(mark)` ranges anywhere under `operator`."""
    times = []
    stack = [operator]
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.TorchOp:
            if node.name == mark:
                times.append(node.start_time_ns)
            stack.extend(node.children)
    return times


# The owner `BackwardMemory.gradients` names for storages made in backward before the first
# owned backward: the loss's backward made them (the gradient of what the graph returns).
LOSS_BACKWARD = "(the loss's backward)"


@dataclass(frozen=True)
class BackwardMemory:
    """What each graph node's backward does to memory, measured: `temporaries` per owner (the
    most its backward raises memory above what it started with and leaves behind; below 0
    where it freed room before making what it leaves: see `backward_transient_bytes`), and
    `gradients`, every storage one backward leaves for a later one (gradients in flight) as
    (owner that allocated it, owner whose backward freed it, bytes). Storages made before the
    first owned backward (the output's gradient) were allocated by `LOSS_BACKWARD`; storages
    never freed (parameters' `.grad`) are not gradients in flight."""

    temporaries: dict[str, int]
    gradients: list[tuple[str, str, int]]


def backward_memory(profile: torch.profiler.profile, device_type: str, owners: dict[int, str],
                    settled: dict[int, str] | None = None) -> BackwardMemory:
    """Each node's backward temporaries and the gradients passed between nodes, from the
    allocator alone (kernel scratch, temporaries of the autograd formulas and autograd's own
    sums included). `owners` maps autograd sequence numbers (`grad_fn._sequence_nr()`) to the
    graph node that created them. An owner's window opens when one of its autograd nodes
    starts and closes when another owner's does; autograd nodes nobody owns (AccumulateGrad,
    the loss's) count for the window they run in. `settled` maps the storages (pointers) of
    shared parameters' `.grad` to the owner whose backward the gradient is counted at: where
    autograd summed the readers' gradients in place into an earlier reader's buffer (under
    autocast, a tied output layer's), that buffer is a gradient in flight until then.

    Example:
        >>> with memory_profile() as profile:
        ...     loss.backward()
        >>> backward_memory(profile, "cpu", {y.grad_fn._sequence_nr(): "conv"}).temporaries["conv"]
    """
    starts: list[tuple[int, str]] = []
    backward_start: int | None = None
    stack = list(profile.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        kind, fields = node.typed
        if kind != _EventType.TorchOp:
            continue
        if node.name.startswith("autograd::engine::evaluate_function"):
            backward_start = min(node.start_time_ns, backward_start or node.start_time_ns)
            if fields.sequence_number in owners:
                starts.append((node.start_time_ns, owners[fields.sequence_number]))
        stack.extend(node.children)
    return window_memory(allocation_events(profile, device_type), starts, backward_start, settled)


def backward_transient_bytes(temporaries: dict[str, int], name: str, record: NodeProfile) -> int:
    """`NodeProfile.backward_transient_bytes` from a node's window (`window_memory`): what its
    backward raised memory by, beyond what it kept. Below 0, down to minus its parameters'
    gradients made after its backward function returned (those not `late_grad_bytes`), where it
    freed its saved tensors and incoming gradient before making them: under autocast, a cast
    parameter's float32 gradient is made by the cast's backward, after the node's has released
    what it held, so the sum the simulator adds at its step (parameter gradients and this) is
    what the step peaked at.

    Example:
        >>> backward_transient_bytes({"fc2": -163072}, "fc2", record)  # record.param_grad_bytes 1049600
        -163072
    """
    floor = -max(0, record.param_grad_bytes - record.late_grad_bytes)
    return max(floor, temporaries.get(name, 0))


def window_memory(events: list[AllocationEvent], starts: list[tuple[int, str]],
                  backward_start: int | None = None, settled: dict[int, str] | None = None,
                  scratch: list[tuple[int, int]] | None = None) -> BackwardMemory:
    """The window algorithm of `backward_memory` on any event source (`events` in time order,
    `starts` as (time, owner) of each autograd node an owner runs; the fake-tensor profile
    feeds it the tensor tracker's log and the ticks of autograd pre-hooks): per owner, the most
    its window raised memory above what it started with, less what it left behind (below 0
    where it freed room before making what it keeps); and the gradients in flight between
    windows: storages a window allocates and a later one frees, and, where `backward_start`
    (the time backward began) is given, those allocated between it and the first window (named
    `LOSS_BACKWARD`); a storage still live at the end that `settled` names (a shared
    parameter's `.grad`), until the window of the owner it names. `scratch`, as (time, bytes):
    kernel scratch an operator raised memory by beyond its outputs (`backward_operator_scratch`,
    measured elsewhere), counted on top of what is live when the operator returned.

    Example:
        >>> window_memory([AllocationEvent(2, 64, 1, None), AllocationEvent(3, -64, 1, None)],
        ...               [(1, "relu")]).temporaries
        {'relu': 64}
        >>> window_memory([AllocationEvent(2, 64, 1, None), AllocationEvent(5, -64, 1, None)],
        ...               [(1, "add"), (4, "relu")], backward_start=0).gradients
        [('add', 'relu', 64)]
    """
    starts = sorted(starts)
    windows = [start for index, start in enumerate(starts) if index == 0 or start[1] != starts[index - 1][1]]

    temporaries: dict[str, int] = {}
    gradients: list[tuple[str, str, int]] = []
    # pointer -> (bytes, window it was allocated in, window it counts for as a gradient)
    live: dict[int, tuple[int, int, int | None]] = {}
    window = -1
    live_bytes = opened_at = peak = kept = 0  # kept: bytes the open window allocated, still live

    def close() -> None:
        if window >= 0:
            owner = windows[window][1]
            raised = peak - opened_at - kept  # (below 0 where it freed room before making what it keeps)
            temporaries[owner] = max(temporaries.get(owner, raised), raised)

    def forget(pointer: int, freed: bool) -> int:
        nonlocal kept
        size, made_in, gradient_of = live.pop(pointer, (0, -1, None))
        if made_in == window and window >= 0:
            kept -= size
        elif freed and gradient_of is not None and window >= 0:
            made_by = windows[gradient_of][1] if gradient_of >= 0 else LOSS_BACKWARD
            gradients.append((made_by, windows[window][1], size))
        return size

    # (events are in time order already: merged, not sorted; a scratch mark goes before an event at its tick)
    timeline = heapq.merge(((time, 0, nbytes) for time, nbytes in sorted(scratch or ())),
                           ((event.time_ns, 1, event) for event in events), key=lambda item: item[:2])
    for time, _, item in timeline:
        while window + 1 < len(windows) and windows[window + 1][0] <= time:
            close()
            window += 1
            opened_at = peak = live_bytes
            kept = 0
        if not isinstance(item, AllocationEvent):
            peak = max(peak, live_bytes + item)
            continue
        event = item
        if event.size_bytes > 0:
            live_bytes += event.size_bytes - forget(event.pointer, False)  # seen twice: a free was missed
            in_backward = window >= 0 or (backward_start is not None and event.time_ns >= backward_start
                                          and bool(windows))
            live[event.pointer] = (event.size_bytes, window, window if in_backward else None)
            kept += event.size_bytes if window >= 0 else 0
            peak = max(peak, live_bytes)
        else:
            live_bytes -= forget(event.pointer, True)
    close()
    for pointer, owner in (settled or {}).items():
        size, _, gradient_of = live.get(pointer, (0, -1, None))
        if gradient_of is not None and gradient_of >= 0 and windows[gradient_of][1] != owner:
            gradients.append((windows[gradient_of][1], owner, size))
    return BackwardMemory(temporaries, gradients)


def _subtree_allocations(operator: Any, device_type: str) -> list[AllocationEvent]:
    events: list[AllocationEvent] = []
    stack = [operator]
    while stack:
        node = stack.pop()
        kind, fields = node.typed
        if kind == _EventType.Allocation:
            if fields.device.type == device_type and fields.alloc_size != 0:
                events.append(AllocationEvent(node.start_time_ns, fields.alloc_size, fields.ptr, operator.end_time_ns))
        else:
            stack.extend(node.children)
    events.sort(key=lambda event: (event.time_ns, event.size_bytes > 0))
    return events


def _scratch_extra(events: list[AllocationEvent]) -> int:
    if not any(event.size_bytes < 0 for event in events):
        return 0  # nothing freed inside: no scratch
    return replay(events)[0] - replay(events, skip_scratch=True)[0]


__all__ = ["LOSS_BACKWARD", "AllocationEvent", "BackwardMemory", "ProfiledPeakMemory", "allocation_events",
           "backward_memory", "backward_operator_scratch", "forward_scratch", "memory_profile", "replay",
           "scratch_before_mark", "window_memory"]
