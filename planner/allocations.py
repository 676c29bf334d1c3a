"""Peak of live CPU bytes during a block, read from `torch.profiler`'s allocator events.

Why not `planner.memory.LiveBytesTracker` (a `TorchDispatchMode`) for `torch.compile`d code:
while a dispatch mode is active, Dynamo skips compiled frames and runs the original Python
(`torch._dynamo.config.inline_torch_dispatch_torch_compile`), so the tracker silently measures
the *eager* model; and with a mode that Dynamo does not skip for, Inductor's generated wrapper
allocates its buffers with `empty_strided_cpu` below the dispatcher, where no mode sees them.

The profiler (`profile_memory=True`) records every allocation and free made through c10's CPU
allocator, with its pointer, size and a nanosecond timestamp, whoever made it: eager kernels,
autograd, Inductor's wrapper. `ProfiledPeakMemory` replays those events in time order and
follows only allocations made inside the block (a free of a pointer allocated before the block
is ignored), so `peak_bytes` has the tracker's meaning: the highest point of the bytes
allocated inside the block and not yet freed.

The one thing the profiler sees that the tracker cannot: scratch buffers a kernel allocates and
frees for itself (oneDNN convolution backward does, for example). They are real memory, so
`peak_bytes` counts them. `peak_bytes_without_scratch` leaves out every allocation that is freed
before the outermost `aten::` operator that made it returns; that is the tracker's view, and
what to compare with it.

Example:
    >>> with ProfiledPeakMemory() as memory:
    ...     model(x).sum().backward()
    >>> memory.peak_bytes, memory.peak_bytes_without_scratch
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch._C._profiler import _EventType


@dataclass(frozen=True)
class AllocationEvent:
    """One CPU allocation (`size_bytes` > 0) or free (< 0) seen by the profiler."""

    time_ns: int
    size_bytes: int
    pointer: int
    operator_end_ns: int | None  # when the outermost aten:: operator around it returned


class ProfiledPeakMemory:
    """Peak bytes allocated on the CPU inside a `with` block and not yet freed, from the
    profiler's allocation events (works for eager and `torch.compile`d code alike).

    After the block: `peak_bytes` (kernel scratch included), `peak_bytes_without_scratch`,
    `live_bytes` (allocated inside and still live at the end), `allocations` (count).
    """

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.peak_bytes_without_scratch = 0
        self.live_bytes = 0
        self.allocations = 0
        self._profile: torch.profiler.profile | None = None

    def __enter__(self) -> "ProfiledPeakMemory":
        self._profile = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._profile is not None
        self._profile.__exit__(*exc)
        events = allocation_events(self._profile)
        self._profile = None
        self.allocations = sum(1 for event in events if event.size_bytes > 0)
        self.peak_bytes, self.live_bytes = replay(events)
        self.peak_bytes_without_scratch, _ = replay(events, skip_scratch=True)


def allocation_events(profile: torch.profiler.profile) -> list[AllocationEvent]:
    """Every CPU allocation and free the profile recorded, in time order; at equal times frees
    come first (the allocator can hand out a pointer again only after it was freed)."""
    events: list[AllocationEvent] = []
    stack = [(root, None) for root in profile.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, operator_end = stack.pop()
        kind, fields = node.typed
        if kind == _EventType.Allocation:
            if fields.device.type == "cpu" and fields.alloc_size != 0:
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
