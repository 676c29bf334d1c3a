"""Read the allocator through `torch.profiler`: every allocation and free, kernel scratch included.

`planner.memory.LiveBytesTracker` (a `TorchDispatchMode`) follows tensors, which is what
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
- `operator_scratch` says, per profiled graph node (forward) and per autograd node (backward),
  how far one operator's scratch raises the peak above what the tracker sees.

Example:
    >>> with ProfiledPeakMemory() as memory:
    ...     model(x).sum().backward()
    >>> memory.peak_bytes, memory.peak_bytes_without_scratch
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch._C._profiler import _EventType


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
        if operator_end is None and kind == _EventType.TorchOp and node.name.startswith("aten::"):
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


@dataclass(frozen=True)
class OperatorScratch:
    """How far kernel scratch raises one operator's peak above the tracker's view, at most, per
    forward range (a `record_function` label) and per autograd node (its sequence number)."""

    forward: dict[str, int]
    backward: dict[int, int]


def operator_scratch(profile: torch.profiler.profile, device_type: str, label_prefix: str) -> OperatorScratch:
    """For every outermost `aten::` operator: peak of all its allocations minus peak of those
    it does not free before returning (its outputs), both from the operator's start. Operators
    inside a `record_function(label_prefix + name)` range count for `name`; those an autograd
    node runs in backward count for that node's sequence number (`grad_fn._sequence_nr()`).

    Example:
        >>> with memory_profile() as profile:
        ...     with torch.profiler.record_function("node:conv"):
        ...         y = conv(x)
        ...     y.sum().backward()
        >>> scratch = operator_scratch(profile, "cpu", "node:")
        >>> scratch.forward["conv"], scratch.backward[y.grad_fn._sequence_nr()]
    """
    forward: dict[str, int] = {}
    backward: dict[int, int] = {}
    stack = [(root, None, None) for root in profile.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, label, sequence = stack.pop()
        kind, fields = node.typed
        if kind != _EventType.TorchOp:
            continue
        if node.name.startswith(label_prefix):
            label = node.name[len(label_prefix):]
        elif node.name.startswith("aten::"):
            extra = _scratch_extra(_subtree_allocations(node, device_type))
            if extra and label is not None:
                forward[label] = max(forward.get(label, 0), extra)
            elif extra and sequence is not None:
                backward[sequence] = max(backward.get(sequence, 0), extra)
            continue
        elif fields.sequence_number >= 0 and not node.name.startswith("autograd::"):
            sequence = fields.sequence_number  # an autograd node (ConvolutionBackward0, ...)
        stack.extend((child, label, sequence) for child in node.children)
    return OperatorScratch(forward, backward)


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
