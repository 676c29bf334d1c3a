"""Each node's backward temporaries at the tensor level, from autograd hooks and the tracker.

The allocator's view (`planner.allocations.backward_temporaries`) needs real memory. On fake
tensors the same figure comes from `LiveBytesTracker`'s log of every allocation and free, cut
into windows by autograd pre-hooks on the nodes each graph node created, and read by the same
window algorithm (`planner.allocations.window_temporaries`).

One difference between fake and real tensors must be undone. Where a tensor feeds several
consumers, autograd sums their gradients in a buffer: on real tensors it adds a new gradient
into that buffer in place, so the new gradient is a temporary of its node's backward; on fake
tensors (a tensor subclass) it adds out of place, which would instead look like a new buffer
handed on. `BackwardWindows` notes those out-of-place sums (an `add` made by the engine between
one node's backward and the next) and replays them as the in-place sums real tensors get.

Example:
    >>> with BackwardWindows(tracker, owners) as windows:
    ...     loss.backward()
    >>> windows.temporaries()["layer_norm_3"]
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor

from planner.allocations import AllocationEvent, window_temporaries
from planner.memory import LiveBytesTracker


def _dense(tensor: torch.Tensor) -> bool:
    return is_non_overlapping_and_dense_or_false(tensor)


class _EngineSums(TorchDispatchMode):
    """Notes the out-of-place gradient sums the autograd engine makes for fake tensors: an
    `aten.add.Tensor` between a node's backward (post-hook) and the next one's (pre-hook)."""

    def __init__(self, windows: "BackwardWindows") -> None:
        super().__init__()
        self.windows = windows

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if (self.windows.between_nodes and func is torch.ops.aten.add.Tensor and isinstance(result, FakeTensor)
                and all(isinstance(a, torch.Tensor) for a in args[:2])):
            old, new = args[0], args[1]
            # Real tensors are summed into the old buffer where it is dense, else into the new one.
            into = old if _dense(old) else new if _dense(new) else None
            if into is not None:
                self.windows.sums.append((self.windows.clock(), id(into.untyped_storage()),
                                          id(result.untyped_storage())))
        return result


class BackwardWindows:
    """While active (around a backward pass, with `tracker` active too: it enters it), cuts
    `tracker`'s log into one window per owner: a window opens when an autograd node that
    `owners` maps to a graph node starts. `tracker` must be the one that saw the forward, so
    that frees of forward tensors are in its log, and must have a log.

    Example:
        >>> tracker = LiveBytesTracker(log=[])
        >>> ... forward under tracker, owners from planner.profile.claim_autograd_nodes ...
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
        self.sums: list[tuple[int, int, int]] = []  # (tick, storage summed into, out-of-place result)
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
        """Per owner, the most its backward raised tensor memory above what it started with
        and left behind (see `planner.allocations.backward_temporaries`)."""
        return window_temporaries(self.events(), self.starts)

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
            replayed.append((result, into, log[made][0], log[end][0]))
            log = [(t, size, into if key == result and made < i <= end else key)
                   for i, (t, size, key) in enumerate(log) if i not in (made, freed)]
        return [AllocationEvent(tick, size, key, None) for tick, size, key in log]

