"""One training step of a configuration in `benchmarks/compare.py`: running it, its peak
memory as `p.verify()` measures it (and as live tensors alone), its time, and the Inductor
backend per memory budget of the `torch.compile` configurations.

Example:
    >>> timed_step(model, sample)  # ms
    412.3
    >>> measure_allocator(model, sample)  # (peak, peak without kernel scratch), bytes
"""
from __future__ import annotations

import gc


def step(module, sample) -> None:
    """One training step (`planner.core.training_step`)."""
    from planner.core import training_step

    training_step(module, sample)


def measure_tensors(module, sample) -> int:
    from planner.measure.memory import LiveBytesTracker
    from planner.measure.steps import static_bytes

    gc.collect()
    with LiveBytesTracker() as tracker:
        step(module, sample)
    return static_bytes(module, sample) + tracker.peak_bytes


def measure_allocator(module, sample) -> tuple[int, int]:
    """The peak as p.verify() measures it (PeakMemory), and without kernel scratch (on CUDA the
    allocator cannot tell scratch apart: both are `torch.cuda.max_memory_allocated`)."""
    from planner.measure.allocations import ProfiledPeakMemory
    from planner.measure.memory import PeakMemory
    from planner.measure.steps import static_bytes

    gc.collect()
    static = static_bytes(module, sample)
    device = next(module.parameters()).device
    if device.type == "cuda":
        with PeakMemory(device) as peak:
            step(module, sample)
        return static + peak.peak_bytes, static + peak.peak_bytes
    with ProfiledPeakMemory() as memory:
        step(module, sample)
    return static + memory.peak_bytes, static + memory.peak_bytes_without_scratch


def timed_step(module, sample) -> float:
    """One step's time (ms; `planner.measure.steps.step_ms`: the wall clock, or CUDA events on a GPU),
    with the garbage collector off while it runs, as `timeit` does: a collection inside one
    configuration's step would count against it alone."""
    from planner.measure.steps import step_ms

    gc.collect()
    gc.disable()
    try:
        return step_ms(module, sample, next(module.parameters()).device)
    finally:
        gc.enable()


def inductor_with_budget(budget: float):
    """A distinct Inductor backend per budget: Dynamo guards on the backend, so each compiled
    copy gets its own graphs (copies of one class would otherwise share cache entries)."""
    import torch

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        backend.graphs += 1
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    backend.graphs = 0
    return backend
