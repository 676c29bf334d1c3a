"""The cost of a checkpoint call beyond its recomputation, measured on the plan's device.

Each region runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`, which costs
work beyond recomputing its nodes: a fixed part per call (the recompute dispatch, a copy of the
RNG state where the region draws random numbers) and a part per tensor its nodes save (the
saved-tensor hooks pack each one in forward, recomputation stores it again, backward unpacks
it: about 11 us each on this CPU, so a block that saves a hundred tensors pays about 1 ms).
The solvers add both per region (`Problem.region_overhead_ms`, `Problem.saved_tensor_ms`).

They are measured as the step-time difference of tiny modules of two depths run with and
without checkpoint (their recomputation is subtracted), in alternating rounds (the median of
paired differences, `planner.clock`); the line through the two gives both figures. Both are
measured once per device and process.

A region that keeps nodes runs under a selective-checkpoint policy: a dispatch mode that sees
every ATen call of its forward and of its recomputation. `selective_overhead_ms` measures what
that adds, per region and per call, from tiny modules of two lengths; and, where the model
runs here, per call on the model's own submodule with the most keepable nodes
(`selective_overhead_for_plan`): its real ops cost the policy more, about twice as much per
call on this CPU.

Example:
    >>> checkpoint_overhead_ms(torch.device("cpu"))    # per call, per saved tensor
    (0.14, 0.011)
    >>> selective_overhead_ms(torch.device("cpu"))
    (0.01, 0.012)
"""
from __future__ import annotations

import contextlib
import functools
import logging
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from planner.clock import paired_difference, timed_rounds
from planner.run_checkpoint import RunRecorder, counted_call
from planner.apply import ModuleCheckpoint
from planner.keep_policy import keep_contexts
from planner.memory import preserved_state
from planner.profile import tensors_in
from solvers import Problem
from solvers.problem import MAX_RUN_CANDIDATES

logger = logging.getLogger(__name__)

_WIDTH = 8  # the tiny module: recomputation is negligible next to checkpoint's own work
_CALLS = 50  # checkpoint calls per timed step
_ROUNDS = 7
# Where a small difference is read off larger steps (checkpoint's cost per saved tensor, the
# policy's cost per call inside a real submodule), more rounds.
_FINE_ROUNDS = 15
_FORWARDS = 4  # forwards per timed step where a dispatch mode's cost is read off forwards alone


class _Layers(nn.Module):
    """`depth` tiny linear + tanh layers, then a dropout if `dropout`: saved tensors and ATen
    calls in proportion to depth."""

    def __init__(self, depth: int, dropout: bool = False) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(_WIDTH, _WIDTH), nn.Tanh()) for _ in range(depth)))
        self.dropout = nn.Dropout(0.1) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.layers(x))


def _line(short: tuple[int, float], long: tuple[int, float]) -> tuple[float, float]:
    """The line through two (count, ms) points: (ms at count 0, ms per count), both at least 0."""
    slope = max(0.0, (long[1] - short[1]) / (long[0] - short[0]))
    return max(0.0, short[1] - slope * short[0]), slope


@functools.lru_cache(maxsize=None)  # a property of the device and this process, not of the model
def checkpoint_overhead_ms(device: torch.device) -> tuple[float, float]:
    """Milliseconds one checkpoint call adds to a training step on `device` beyond the
    recomputed forward (RNG state preserved, as for a region with dropout): per call, and per
    tensor saved inside it (both at least 0).

    Example:
        >>> per_call, per_saved_tensor = checkpoint_overhead_ms(torch.device("cpu"))
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        return _line(_measure(device, 1), _measure(device, 12))


def _saved_tensors(module: nn.Module, x: torch.Tensor) -> int:
    """Tensors autograd saves in one forward of `module` with grad on."""
    count = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return count


def _measure(device: torch.device, depth: int) -> tuple[int, float]:
    """(tensors saved per checkpoint call, ms checkpoint adds per call beyond recomputation)."""
    module = _Layers(depth, dropout=True).to(device)
    x = torch.randn(4, _WIDTH, device=device, requires_grad=True)
    saved = _saved_tensors(module, x)

    def plain() -> None:
        h = x
        for _ in range(_CALLS):
            h = module(h)
        h.sum().backward()

    def checkpointed() -> None:
        h = x
        for _ in range(_CALLS):
            h = checkpoint(module, h, use_reentrant=False)
        h.sum().backward()

    def forward_only() -> None:  # what recomputation itself costs
        with torch.no_grad():
            h = x
            for _ in range(_CALLS):
                h = module(h)

    times = timed_rounds(device, {"plain": plain, "checkpointed": checkpointed, "forward": forward_only}, _FINE_ROUNDS)
    return saved, (paired_difference(times, "checkpointed", "plain") - statistics.median(times["forward"])) / _CALLS


class _CallCounter(TorchDispatchMode):
    """Names the ATen calls dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _recompute_everything(ctx, func, *args, **kwargs):  # type: ignore[no-untyped-def]
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():  # type: ignore[no-untyped-def]
    return create_selective_checkpoint_contexts(_recompute_everything)


def _forward_calls(module: nn.Module, *args: Any, **kwargs: Any) -> list[str]:
    """The ATen calls of one forward of `module` with grad on, as `NodeCost.aten_calls` counts
    them (`planner.holds`: a no-grad forward may dispatch other kernels). A region's policy is
    charged for twice as many per checkpoint call: the forward's and the recomputation's."""
    counter = _CallCounter()
    with counter:
        module(*args, **kwargs)
    return counter.names


@functools.lru_cache(maxsize=None)  # a property of the device and this process, not of the model
def selective_overhead_ms(device: torch.device) -> tuple[float, float]:
    """Milliseconds a selective-checkpoint policy adds to a checkpoint call on `device`: per
    region, and per ATen call it sees (forward and recomputation; both at least 0). Measured as
    the step-time difference between plain and selective checkpoint of tiny modules of two
    lengths, in alternating rounds (paired differences); the line through the two gives both figures.

    Example:
        >>> per_region, per_call = selective_overhead_ms(torch.device("cpu"))
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        return _line(_measure_selective(device, 1), _measure_selective(device, 6))


@dataclass(frozen=True)
class SelectiveCost:
    """What a selective policy costs inside one of the model's own submodules: per ATen call it
    sees (forward and recomputation) and per node it keeps, both at least 0."""

    per_call_ms: float
    per_kept_ms: float = 0.0
    # what recording runs costs it (`planner.run_checkpoint`): per ATen call of its forward
    # (the dispatch mode), and per call recorded and replayed beyond its node time (its record,
    # its saved tensors dropped and handed back, replay's Python work)
    per_counted_call_ms: float = 0.0
    per_recorded_call_ms: float = 0.0


@dataclass(frozen=True)
class KeptCalls:
    """Nodes a region keeps (indices), the calls its policy caches for them, and the
    recomputation time that skips (predicted)."""

    nodes: tuple[int, ...]
    calls: tuple[tuple[str, int], ...]
    skipped_ms: float


def _backward(module: nn.Module, output: Any) -> None:
    """Backward from `output` (a sum of its tensors that need grad); `module`'s gradients reset."""
    loss = sum(t.float().sum() for t in tensors_in(output) if t.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    for parameter in module.parameters():
        parameter.grad = None


def selective_costs_on(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], per_region_ms: float,
                       device: torch.device, kept: KeptCalls | None = None) -> SelectiveCost:
    """What a selective policy adds inside one of the model's own submodules (called with `args`,
    `kwargs` as captured from a forward). Per call: the step-time difference between plain and
    selective checkpoint of it (recomputing everything), less `per_region_ms`, over the calls
    the policy sees (its forward's and its recomputation's). Real ops cost the policy more than
    the tiny modules' (more arguments to inspect, colder caches). Per kept node, with `kept`:
    what keeping `kept.nodes` (caching `kept.calls`) costs beyond the policy's calls, less the
    recomputation it skips (`kept.skipped_ms`, predicted from node times): caching and handing
    back outputs, and holding them through the step. Recording runs: per call counted, forwards
    alone with and without a `RunRecorder`; per call recorded, forwards recording every call,
    each replayed at once, against forwards only counting, less the forwards' time (what node
    times predict the replay at). Differences are medians over rounds of paired times. The caller restores the
    module's state (buffers, RNG).

    Example:
        >>> selective_costs_on(model.blocks[0], (h,), {}, 0.07, torch.device("cpu")).per_call_ms
        0.012
    """
    forward_names = _forward_calls(module, *args, **kwargs)
    calls_per_step = 2 * len(forward_names)
    names = [name for name in forward_names if counted_call(name)]  # as a RunRecorder counts them

    def fresh_inputs() -> tuple[Any, ...]:  # new non-leaf inputs: the forward may write them in place
        return tuple(a.clone() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)

    def step(context_fn: Callable[[], Any] | None) -> Callable[[], None]:
        options: dict[str, Any] = {"use_reentrant": False}
        if context_fn is not None:
            options["context_fn"] = context_fn

        def run() -> None:
            _backward(module, checkpoint(module, *fresh_inputs(), **options, **kwargs))
        return run

    def bare(count: bool) -> Callable[[], None]:
        # Forwards alone, maybe under a RunRecorder recording no run (which changes nothing in
        # backward): a small difference, read off the least noise.
        def run() -> None:
            for _ in range(_FORWARDS):
                inputs = fresh_inputs()  # (outside the mode: it would count the copies)
                with RunRecorder(names, ()) if count else contextlib.nullcontext():
                    module(*inputs, **kwargs)
        return run

    def recorded() -> Callable[[], None]:
        # Forwards alone, each recording every call, then replaying them (as backward would).
        def run() -> None:
            for _ in range(_FORWARDS):
                inputs = fresh_inputs()
                recorder = RunRecorder(names, ((0, len(names)),))
                with recorder:
                    module(*inputs, **kwargs)
                if recorder.mismatch is not None:
                    raise RuntimeError(f"its forward differs from its counted calls: {recorder.mismatch}")
                for tape in recorder.tapes:
                    tape.replay()
        return run

    steps = {"plain": step(None), "selective": step(_selective_contexts), "bare": bare(False), "counted": bare(True),
             "recorded": recorded()}
    if kept is not None and kept.nodes:
        steps["keeping"] = step(functools.partial(keep_contexts, kept.calls))
    times = timed_rounds(device, steps, _FINE_ROUNDS)
    per_call = max(0.0, (paired_difference(times, "selective", "plain") - per_region_ms) / max(1, calls_per_step))
    forward_calls = max(1, _FORWARDS * len(names))
    per_counted = max(0.0, paired_difference(times, "counted", "bare") / forward_calls)
    # Beyond counting: the calls' recomputation as node times predict it (forwards with grad),
    # and what recording and replay add per call.
    replayed_ms = paired_difference(times, "recorded", "counted") - statistics.median(times["bare"])
    per_recorded = max(0.0, replayed_ms / forward_calls)
    if "keeping" not in times or kept is None:
        return SelectiveCost(per_call, 0.0, per_counted, per_recorded)
    per_kept = (paired_difference(times, "keeping", "selective") + kept.skipped_ms) / len(kept.nodes)
    return SelectiveCost(per_call, max(0.0, per_kept), per_counted, per_recorded)


def selective_costs_in_model(model: nn.Module, path: str, run_model: Callable[[], Any], per_region_ms: float,
                             device: torch.device, kept: KeptCalls | None = None) -> SelectiveCost:
    """`selective_costs_on` for the submodule `path` of `model`, called as one forward
    (`run_model()`) calls it. The caller restores the model's state (buffers, RNG).

    Example:
        >>> selective_costs_in_model(model, "blocks.0", lambda: model(x), 0.07, torch.device("cpu"))
    """
    module = model.get_submodule(path)
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def capture(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not captured:
            captured.append((args, dict(kwargs)))

    handle = module.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            run_model()
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{path!r} was not called by the model's forward")

    def activation(value: Any) -> Any:  # like an intermediate activation: a leaf that needs grad
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.detach().requires_grad_(True)
        return value

    args, kwargs = captured[0]
    return selective_costs_on(module, tuple(activation(a) for a in args), kwargs, per_region_ms, device, kept)


def _measure_selective(device: torch.device, depth: int) -> tuple[int, float]:
    """(ATen calls seen per checkpoint call, ms the policy adds per checkpoint call)."""
    module = _Layers(depth).to(device)
    x = torch.randn(4, _WIDTH, device=device, requires_grad=True)
    seen = 2 * len(_forward_calls(module, x))

    def step(selective: bool) -> Callable[[], None]:
        def run() -> None:
            h = x
            for _ in range(_CALLS):
                if selective:
                    h = checkpoint(module, h, use_reentrant=False, context_fn=_selective_contexts)
                else:
                    h = checkpoint(module, h, use_reentrant=False)
            h.sum().backward()
        return run

    times = timed_rounds(device, {"plain": step(False), "selective": step(True)}, _ROUNDS)
    return seen, paired_difference(times, "selective", "plain") / _CALLS


def selective_overhead_for_plan(model: nn.Module, problem: Problem, wrapped: dict[range, ModuleCheckpoint],
                                device: torch.device, runs_here: bool, run_model: Callable[[], Any],
                                calls_of: Callable[[range, tuple[int, ...]], tuple[tuple[str, int], ...]]
                                ) -> tuple[float, float, float, float, float]:
    """A selective policy's cost per region, per ATen call and per kept node
    (`Problem.keep_region_ms`, `keep_call_ms`, `kept_node_ms`): from tiny modules and, where the
    model runs here, on its own submodule with the most keepable nodes, a block (its real ops
    cost the policy more), keeping all of them (`calls_of(region, kept)`: the calls to cache).
    (0, 0, 0) where nothing is keepable. Fourth and fifth, what recording runs costs per ATen
    call of the submodule and per call recorded (`Problem.run_call_ms`, `recorded_call_ms`),
    measured on that block; else the policy's cost per call stands in for both.

    Example:
        >>> selective_overhead_for_plan(model, problem, wrapped, torch.device("cpu"), True, lambda: model(x),
        ...                             lambda region, kept: saved_calls(gm, region, kept))
        (0.01, 0.012, 0.05, 0.009, 0.03)
    """
    if not any(node.keepable for node in problem.nodes) and not problem.run_spans:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    per_region, per_call = selective_overhead_ms(device)
    per_kept = 0.0
    per_counted = per_recorded = per_call
    # a block: the regions that may keep (at most MAX_RUN_CANDIDATES keepable nodes) of a class
    # the model calls more than once, not the whole model (which would take a step per round)
    candidates = [r for r in wrapped if problem.allows_region(r.start, r.stop)
                  and (0 < len(problem.keepable_in(r)) <= MAX_RUN_CANDIDATES or r in problem.run_spans)]
    classes = Counter(spec.module_class for spec in wrapped.values())
    candidates = [r for r in candidates if classes[wrapped[r].module_class] > 1] or candidates
    if runs_here and candidates:
        region = max(candidates, key=lambda r: (len(problem.keepable_in(r)), len(r)))
        nodes = tuple(problem.keepable_in(region))
        kept = KeptCalls(nodes, calls_of(region, nodes),
                         problem.region_recompute_ms(region) - problem.region_recompute_ms(region, nodes))
        try:
            with preserved_state(model, [device]):
                cost = selective_costs_in_model(model, wrapped[region].module, run_model, per_region, device, kept)
            per_call, per_kept = cost.per_call_ms, cost.per_kept_ms
            per_counted, per_recorded = cost.per_counted_call_ms, cost.per_recorded_call_ms
        except RuntimeError as error:  # a forward that cannot run alone under checkpoint
            logger.warning("the selective policy's cost per call could not be measured on %s (%s); using the "
                           "tiny modules' %.4f ms", wrapped[region].module, error, per_call)
    return per_region, per_call, per_kept, per_counted, per_recorded


__all__ = ["KeptCalls", "SelectiveCost", "checkpoint_overhead_ms", "selective_costs_in_model", "selective_costs_on",
           "selective_overhead_for_plan", "selective_overhead_ms"]
