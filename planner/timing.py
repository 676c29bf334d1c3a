"""Forward time of each compute node of a graph, measured in one run of the whole graph.

Example:
    >>> times, stop_times = {}, {}
    >>> timer = TimingInterpreter(gm, times, torch.device("cpu"), stop_times)
    >>> timer.run(*inputs); timer.collect()
    >>> times["linear"], stop_times["linear"]
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.fx as fx

from planner.clock import ahead_for, queue_ahead

COMPUTE_OPS = ("call_function", "call_method", "call_module")


class TimingInterpreter(fx.Interpreter):
    """Runs the graph and adds each compute node's forward time (ms) to `times[node.name]`:
    the call alone, not the interpreter's fetching of its arguments (which recomputation under
    checkpoint, compiled code, does not pay), as a node run alone is timed too. The time up to
    the node's last saved tensor goes to `stop_times[node.name]`: non-reentrant checkpoint's
    recomputation stops right there when the node is a region's last saving node.

    On CUDA, CUDA events bracket each node (and mark its last save) and are read after one
    synchronisation; GPU work queued ahead of each node makes them time its kernels alone, as
    backward's queue hides a recomputation's launch work (`planner.clock`). The host's launch
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
