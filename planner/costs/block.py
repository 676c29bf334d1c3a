"""What checkpoint, a selective policy and run recording cost inside one of the model's own
blocks, measured where the model runs (`planner.costs.overhead` measures them on tiny modules).

A real block's ops cost a selective policy more per ATen call than a tiny module's do (more
arguments to inspect, colder caches), and checkpoint more per saved tensor, so these costs are
read on one of the model's own blocks, taken out of the model to be timed alone:

- `captured_call`, `fresh_inputs`, `backward_from`: a submodule call's arguments captured from
  a forward, fresh copies of them for each timed call, and a backward through what it returned
  (`planner.costs.calls` times its calls with them too);
- `selective_costs_on` (and `selective_costs_in_model`, on a submodule of the model): a block's
  steps and forwards timed in alternating rounds (plain, checkpointed, under a policy, under a
  `RunRecorder` counting or recording and replaying every call), read as a `SelectiveCost`;
- `selective_overhead_for_plan`: picks the block and turns its figures into the problem's cost
  terms (`MeasuredCosts`).

Example:
    >>> args, kwargs = captured_call(model, "blocks.0", lambda: model(x))
    >>> block = model.get_submodule("blocks.0")
    >>> backward_from(block, block(*fresh_inputs(args), **kwargs))
    >>> costs = selective_overhead_for_plan(model, problem, wrapped, torch.device("cpu"), True,
    ...                                     lambda: model(x), lambda region, kept: saved_calls(gm, region, kept))
    >>> problem = dataclasses.replace(problem, **dataclasses.asdict(costs))
"""
from __future__ import annotations

import contextlib
import functools
import logging
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.apply.policy import keep_contexts
from planner.apply.runs import RunRecorder
from planner.core import ModuleCheckpoint, after_autocast, cold_autocast_cache, counted_call
from planner.costs.overhead import (
    FINE_ROUNDS,
    forward_calls,
    selective_contexts,
    selective_overhead_ms,
)
from planner.measure.clock import (
    READING_LEVEL,
    holds,
    median_interval,
    reading_or_price,
    timed_until_decided,
)
from planner.measure.memory import preserved_state
from planner.measure.profile import tensors_in
from solvers import Problem
from solvers.problem import MAX_RUN_CANDIDATES


def captured_call(model: nn.Module, path: str, run_model: Callable[[], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of the first call of `model`'s submodule `path` in one forward
    (`run_model()`, under no_grad), each floating-point tensor made a leaf that needs grad,
    like an intermediate activation. Raises RuntimeError where the forward does not call it.

    Example:
        >>> args, kwargs = captured_call(model, "blocks.0", lambda: model(x))
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
    args, kwargs = captured[0]
    return tuple(a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args), kwargs


def fresh_inputs(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """New non-leaf copies of the captured arguments that need grad, for one call: its forward
    may write them in place. Autocast's cache is emptied too, as a training step's forward finds it.

    Example:
        >>> block(*fresh_inputs(args), **kwargs)
    """
    cold_autocast_cache()
    return tuple(a.clone() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)


def backward_from(module: nn.Module, output: Any) -> None:
    """Backward from `output` (a sum of its tensors that need grad); `module`'s gradients reset.

    Example:
        >>> backward_from(block, block(*fresh_inputs(args), **kwargs))
    """
    loss = sum(t.float().sum() for t in tensors_in(output) if t.requires_grad)
    if isinstance(loss, torch.Tensor):
        with after_autocast():
            loss.backward()
    clear_grads(module)


def clear_grads(module: nn.Module) -> None:
    """`module`'s parameters without gradients, as a training loop's `set_to_none` leaves them."""
    for parameter in module.parameters():
        parameter.grad = None


logger = logging.getLogger(__name__)

_FORWARDS = 4  # forwards per timed step where a dispatch mode's cost is read off forwards alone
# Rounds of a block's steps at most, while its policy's cost per ATen call cannot be told from
# the tiny modules' (`selective_overhead_for_plan`): a real block's cost per call can be about
# twice the tiny modules', a difference `FINE_ROUNDS` rounds often leave undecided, and the tiny
# price standing for it prices plans that keep many nodes far below what they measure.
MAX_BLOCK_ROUNDS = 3 * FINE_ROUNDS
# A block's rounds tell its figures from the tiny modules' only where what those prices add to its
# checkpointed step (its calls under the policy, its saved tensors) is at least this share of its
# forward: paired steps on a CPU differ by about a percent of their time from round to round. The
# benchmark models' blocks stake 2-30% of their forward; a GPT-2 124M block at 4 x 1024 tokens
# stakes 0.2%, and a round of its steps takes about 40 s.
READABLE_SHARE = 0.01


@dataclass(frozen=True)
class MeasuredCosts:
    """The problem's cost terms measured on the model's block (`Problem` fields of the same names)."""

    keep_region_ms: float
    keep_call_ms: float
    kept_node_ms: float
    run_call_ms: float
    recorded_call_ms: float
    saved_tensor_ms: float


@dataclass(frozen=True)
class SelectiveCost:
    """What a selective policy costs inside one of the model's own submodules: per ATen call it
    sees (forward and recomputation) and per node it keeps, both at least 0."""

    per_call_ms: float
    per_kept_ms: float = 0.0
    # what recording runs costs it (`planner.apply.runs`): per ATen call of its forward
    # (the dispatch mode), and per call recorded and replayed beyond its node time (its record,
    # its saved tensors dropped and handed back, replay's Python work; None where its forward
    # could not be recorded whole)
    per_counted_call_ms: float = 0.0
    per_recorded_call_ms: float | None = 0.0
    # checkpoint's own cost for one call of the submodule (no policy), beyond its forward
    checkpoint_ms: float | None = None
    # each figure's interval at `clock.READING_LEVEL`, by field name, in its own units
    # (`clock.median_interval`, before the floor at 0; absent: too few rounds for one)
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)

    def figure(self, name: str, price_ms: float, what: str) -> float:
        """The figure `name`, or `price_ms` where its interval holds that price: its rounds
        cannot tell the two apart (`clock.reading_or_price`).

        Example:
            >>> SelectiveCost(0.03, intervals={"per_call_ms": (-0.01, 0.08)}).figure("per_call_ms", 0.02, "calls")
            0.02
        """
        return reading_or_price(getattr(self, name), self.intervals.get(name), price_ms, what)

    def undecided(self, name: str, price_ms: float) -> bool:
        """Whether the figure `name`'s interval holds `price_ms` (`clock.holds`).

        Example:
            >>> SelectiveCost(0.03, intervals={"per_call_ms": (-0.01, 0.08)}).undecided("per_call_ms", 0.02)
            True
        """
        return holds(self.intervals.get(name), price_ms)


@dataclass(frozen=True)
class KeptCalls:
    """Nodes a region keeps (indices), the calls its policy caches for them, and the
    recomputation time that skips (predicted)."""

    nodes: tuple[int, ...]
    calls: tuple[tuple[str, int], ...]
    skipped_ms: float


def recomputed_share(problem: Problem, region: range) -> float:
    """The share of `region`'s forward node time that its recomputation runs: it stops at the
    last node that saves a tensor for backward (`Problem.region_recompute_ms`). A ViT or
    Llama layer ends in a linear and a residual add whose outputs nothing saves, so its
    recomputation (and a run's replay) skips the last matmul.

    Example:
        >>> recomputed_share(problem, range(0, 39))
        0.87
    """
    forward_ms = sum(problem.nodes[i].compute_ms for i in region)
    return problem.region_recompute_ms(region) / forward_ms if forward_ms > 0 else 1.0


def selective_costs_on(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], per_region_ms: float,
                       device: torch.device, kept: KeptCalls | None = None, replayed_share: float = 1.0,
                       undecided: Callable[[SelectiveCost], bool] | None = None, max_rounds: int = FINE_ROUNDS
                       ) -> SelectiveCost:
    """What a selective policy adds inside one of the model's own submodules (called with `args`,
    `kwargs` as captured from a forward). Per call: the step-time difference between plain and
    selective checkpoint of it (the plans' policy keeping nothing), less `per_region_ms`, over the
    calls the policy sees (its forward's and its recomputation's), pooled round by round with the
    difference between forwards alone with and without the policy's forward mode, over their calls
    (either alone is noisy in few rounds; pooled, they halve each other's noise). Real ops cost the
    policy more than the tiny modules' (more arguments to inspect, colder caches). Per kept node,
    with `kept`: what keeping `kept.nodes` (caching `kept.calls`) costs beyond the policy's calls,
    less the recomputation it skips (`kept.skipped_ms`, predicted from node times): caching and
    handing back outputs, and holding them through the step. Recording runs: per call counted,
    forwards alone with and without a `RunRecorder`; per call recorded, a step recording every call
    (its backward replays them) against one only counting, less a forward's time (what node times
    predict the replay at). Checkpoint's own cost per call: a checkpointed step against an unchecked
    one, less a forward. Recomputation and replay stop at the last call that makes a saved tensor (a
    block ending in a linear and a residual add skips both), so "a forward" is the forward's
    measured time times `replayed_share`, the share of its node time that recomputation runs
    (`recomputed_share`). Differences are medians over rounds of paired times, each with its
    interval (`SelectiveCost.intervals`, at `clock.READING_LEVEL`), over `FINE_ROUNDS` rounds, and
    `FINE_ROUNDS` more at a time, up to `max_rounds`, while `undecided(cost)` says a figure the
    caller needs cannot yet be told from its price. The caller restores the module's state (buffers,
    RNG).

    Example:
        >>> selective_costs_on(model.blocks[0], (h,), {}, 0.07, torch.device("cpu")).per_call_ms
        0.012
    """
    forward_names = forward_calls(module, *args, **kwargs)
    calls_per_step = 2 * len(forward_names)
    names = [name for name in forward_names if counted_call(name)]  # as a RunRecorder counts them

    def step(context_fn: Callable[[], Any] | None) -> Callable[[], None]:
        options: dict[str, Any] = {"use_reentrant": False}
        if context_fn is not None:
            options["context_fn"] = context_fn

        def run() -> None:
            backward_from(module, checkpoint(module, *fresh_inputs(args), **options, **kwargs))
        return run

    def bare(mode: Callable[[], Any] | None) -> Callable[[], None]:
        # Forwards alone, maybe under a dispatch mode (a RunRecorder recording no run, which
        # changes nothing in backward; the policy's forward mode): a small difference, read off
        # the least noise.
        def run() -> None:
            for _ in range(_FORWARDS):
                inputs = fresh_inputs(args)  # (outside the mode: it would count the copies)
                with mode() if mode is not None else contextlib.nullcontext():
                    module(*inputs, **kwargs)
        return run

    def recording(runs: tuple[tuple[int, int], ...]) -> Callable[[], None]:
        # A step whose forward counts calls and records `runs`; its backward replays them (with
        # the run's inputs long out of cache, as in a training step).
        def run() -> None:
            inputs = fresh_inputs(args)
            recorder = RunRecorder(names, runs)
            with recorder:
                output = module(*inputs, **kwargs)
            if recorder.mismatch is not None:
                raise RuntimeError(f"its forward differs from its counted calls: {recorder.mismatch}")
            backward_from(module, output)
        return run

    def unchecked() -> None:
        backward_from(module, module(*fresh_inputs(args), **kwargs))

    steps = {"unchecked": unchecked, "plain": step(None), "selective": step(selective_contexts), "bare": bare(None),
             "counted": bare(lambda: RunRecorder(names, ())), "policy forwards": bare(lambda: selective_contexts()[0])}
    try:  # one try first: a forward that writes in place what it read cannot be recorded whole
        recording(((0, len(names)),))()
        steps.update({"counted step": recording(()), "recorded step": recording(((0, len(names)),))})
    except RuntimeError as error:
        clear_grads(module)
        logger.info("recording runs could not be measured on the whole %s (%s)", type(module).__name__, error)
    if kept is not None and kept.nodes:
        steps["keeping"] = step(functools.partial(keep_contexts, kept.calls))
    # On a GPU, kernel time alone, as `planner.costs.overhead` measures: backward's queue hides host work.
    figures = functools.partial(_figures, per_region_ms=per_region_ms, calls_per_step=calls_per_step,
                                forward_count=len(forward_names), counted_count=len(names),
                                replayed_share=replayed_share, kept=kept)
    times = timed_until_decided(device, steps, FINE_ROUNDS, FINE_ROUNDS,
                                lambda so_far: undecided is not None and undecided(figures(so_far)), max_rounds)
    cost = figures(times)
    logger.info("%s: the selective policy's and runs' costs read off %d rounds", type(module).__name__,
                len(times["plain"]))
    return cost


def _figures(times: dict[str, list[float]], per_region_ms: float, calls_per_step: int, forward_count: int,
             counted_count: int, replayed_share: float, kept: KeptCalls | None) -> SelectiveCost:
    """`selective_costs_on`'s figures, read off the times of its rounds."""
    intervals: dict[str, tuple[float, float]] = {}

    def read(name: str, *readings: tuple[str, str, float, int]) -> float:
        # The median over rounds of each (slower, faster, offset_ms, units) reading's paired
        # difference less `offset_ms`, per unit, all readings pooled; its interval kept under `name`.
        values = [(a - b - offset_ms) / units for slower, faster, offset_ms, units in readings
                  for a, b in zip(times[slower], times[faster])]
        interval = median_interval(values, READING_LEVEL)
        if interval is not None:
            intervals[name] = interval
        return statistics.median(values)

    # Per call, the policy: on steps (its forward and recomputation, beyond its fixed cost) and on
    # forwards alone (its forward mode), pooled round by round: the two halve each other's noise.
    per_call = max(0.0, read("per_call_ms", ("selective", "plain", per_region_ms, max(1, calls_per_step)),
                             ("policy forwards", "bare", 0.0, max(1, _FORWARDS * forward_count))))
    # what node times predict a recomputation at: the measured forward, up to where it stops
    forward_ms = replayed_share * statistics.median(times["bare"]) / _FORWARDS
    # checkpoint itself: a checkpointed step against an unchecked one, less the recomputation
    checkpoint_ms = read("checkpoint_ms", ("plain", "unchecked", forward_ms, 1))
    per_counted = max(0.0, read("per_counted_call_ms", ("counted", "bare", 0.0, max(1, _FORWARDS * counted_count))))
    # Beyond counting: the calls' recomputation as node times predict it (forwards with grad),
    # and what recording and replay add per call.
    per_recorded = None
    if "recorded step" in times:
        per_recorded = max(0.0, read("per_recorded_call_ms", ("recorded step", "counted step", forward_ms,
                                                               max(1, counted_count))))
    per_kept = 0.0
    if "keeping" in times and kept is not None:
        per_kept = max(0.0, read("per_kept_ms", ("keeping", "selective", -kept.skipped_ms, len(kept.nodes))))
    return SelectiveCost(per_call, per_kept, per_counted, per_recorded, checkpoint_ms, intervals)


def selective_costs_in_model(model: nn.Module, path: str, run_model: Callable[[], Any], per_region_ms: float,
                             device: torch.device, kept: KeptCalls | None = None, replayed_share: float = 1.0,
                             undecided: Callable[[SelectiveCost], bool] | None = None, max_rounds: int = FINE_ROUNDS
                             ) -> SelectiveCost:
    """`selective_costs_on` for the submodule `path` of `model`, called as one forward
    (`run_model()`) calls it. The caller restores the model's state (buffers, RNG).

    Example:
        >>> selective_costs_in_model(model, "blocks.0", lambda: model(x), 0.07, torch.device("cpu"))
    """
    module = model.get_submodule(path)
    args, kwargs = captured_call(model, path, run_model)
    return selective_costs_on(module, args, kwargs, per_region_ms, device, kept,
                              replayed_share, undecided, max_rounds)


def readable_on(problem: Problem, region: range, per_call_ms: float) -> bool:
    """Whether rounds of `region`'s steps can read the policy's and checkpoint's costs there: what
    the prices so far (`per_call_ms` per ATen call of its forward and recomputation,
    `Problem.saved_tensor_ms` per tensor it saves) add is at least `READABLE_SHARE` of its
    forward's node time. Where it is not, no number of rounds tells a reading from those prices
    and the block's steps are not timed.

    Example:
        >>> readable_on(problem, range(0, 39), 0.011)
        True
    """
    calls = 2 * sum(problem.nodes[i].aten_calls for i in region)
    saved = sum(problem.nodes[i].saved_tensors for i in region)
    forward_ms = sum(problem.nodes[i].compute_ms for i in region)
    return per_call_ms * calls + problem.saved_tensor_ms * saved >= READABLE_SHARE * forward_ms


def selective_overhead_for_plan(model: nn.Module, problem: Problem, wrapped: dict[range, ModuleCheckpoint],
                                device: torch.device, runs_here: bool, run_model: Callable[[], Any],
                                calls_of: Callable[[range, tuple[int, ...]], tuple[tuple[str, int], ...]],
                                max_rounds: int = MAX_BLOCK_ROUNDS) -> MeasuredCosts:
    """A selective policy's cost per region, per ATen call and per kept node
    (`Problem.keep_region_ms`, `keep_call_ms`, `kept_node_ms`): from tiny modules and, where the
    model runs here, on its own submodule with the most keepable nodes, a block (its real ops cost
    the policy more), keeping all of them (`calls_of(region, kept)`: the calls to cache). (0, 0, 0)
    where nothing is keepable. What recording runs costs per ATen call of the submodule and per call
    recorded (`Problem.run_call_ms`, `recorded_call_ms`), measured on that block. And checkpoint's
    cost per saved tensor (`Problem.saved_tensor_ms`): the tiny modules' unless checkpoint of that
    block costs more than the tiny modules' figures predict for it (a real block's can cost about
    twice as much). Each figure read off the block stands only where its rounds tell it from its
    price, else that price does (`SelectiveCost.figure`): the tiny modules' figures; per kept node,
    nothing; per call counted or recorded, the policy's cost per call (the block's, where read),
    which also stands in for both where no block is measured. The block is timed in more rounds, up
    to `MAX_BLOCK_ROUNDS`, while its policy's cost per call cannot be told from the tiny modules'
    figure, on which the other prices hang. A block too big for its rounds to read these costs
    (`readable_on`) is not timed. (Where the model's whole step runs here,
    `planner.costs.step` reads the cost per call and per saved tensor off that step instead, and
    what a run costs beyond them, `Problem.run_region_ms`.)

    Example:
        >>> selective_overhead_for_plan(model, problem, wrapped, torch.device("cpu"), True, lambda: model(x),
        ...                             lambda region, kept: saved_calls(gm, region, kept))
        MeasuredCosts(keep_region_ms=0.01, keep_call_ms=0.012, kept_node_ms=0.05, ...)
    """
    if not any(node.keepable for node in problem.nodes) and not problem.run_spans:
        return MeasuredCosts(0.0, 0.0, 0.0, 0.0, 0.0, problem.saved_tensor_ms)
    per_region, per_call = selective_overhead_ms(device)
    per_kept = 0.0
    per_counted = per_recorded = per_call
    per_saved_tensor = problem.saved_tensor_ms
    # a block: the regions that may keep (at most MAX_RUN_CANDIDATES keepable nodes) of a class
    # the model calls more than once, not the whole model (which would take a step per round)
    candidates = [r for r in wrapped if problem.allows_region(r.start, r.stop)
                  and (0 < len(problem.keepable_in(r)) <= MAX_RUN_CANDIDATES or r in problem.run_spans)]
    classes = Counter(spec.module_class for spec in wrapped.values())
    candidates = [r for r in candidates if classes[wrapped[r].module_class] > 1] or candidates
    if runs_here and candidates:
        region = max(candidates, key=lambda r: (len(problem.keepable_in(r)), len(r)))
        if not readable_on(problem, region, per_call):
            logger.info("%s is too big for its steps to read a selective policy's and checkpoint's costs: the tiny "
                        "modules' prices stand", wrapped[region].module)
            return MeasuredCosts(per_region, per_call, per_kept, per_counted, per_recorded, per_saved_tensor)
        nodes = tuple(problem.keepable_in(region))
        kept = KeptCalls(nodes, calls_of(region, nodes),
                         problem.region_recompute_ms(region) - problem.region_recompute_ms(region, nodes))
        tiny_call = per_call
        try:
            with preserved_state(model, [device]):
                cost = selective_costs_in_model(model, wrapped[region].module, run_model, per_region, device, kept,
                                                recomputed_share(problem, region),
                                                lambda read: read.undecided("per_call_ms", tiny_call), max_rounds)
            # Each figure as read, unless its rounds cannot tell it from what the figures held so
            # far price it at (per kept node: nothing); then that price stands. Counting and
            # recording runs are priced by the policy's cost per call in this block, not the tiny
            # modules': all three are a dispatch mode's Python work per ATen call, and in a block
            # each costs two to three times the tiny modules', though few rounds rarely tell
            # counting's or recording's reading from the tiny price alone.
            name = wrapped[region].module
            per_call = cost.figure("per_call_ms", per_call, f"a selective policy per ATen call in {name}")
            per_kept = cost.figure("per_kept_ms", 0.0, f"a selective policy per node kept in {name}")
            per_counted = cost.figure("per_counted_call_ms", per_call, f"counting runs per ATen call in {name}")
            per_recorded = per_call if cost.per_recorded_call_ms is None else cost.figure(
                "per_recorded_call_ms", per_call, f"recording and replaying runs per ATen call in {name}")
            saved = sum(problem.nodes[i].saved_tensors for i in region)
            if cost.checkpoint_ms is not None and saved:
                checkpoint_ms = cost.figure("checkpoint_ms", problem.region_overhead_ms + saved * problem.saved_tensor_ms,
                                            f"checkpoint of {name} beyond its forward")
                calibrated = (checkpoint_ms - problem.region_overhead_ms) / saved
                logger.info("checkpoint of %s measured %.3f ms beyond its forward (%d saved tensors): %.4f ms per "
                            "saved tensor, tiny modules %.4f ms", name, cost.checkpoint_ms, saved,
                            calibrated, problem.saved_tensor_ms)
                per_saved_tensor = max(per_saved_tensor, calibrated)
        except RuntimeError as error:  # a forward that cannot run alone under checkpoint
            logger.warning("the selective policy's cost per call could not be measured on %s (%s); using the "
                           "tiny modules' %.4f ms", wrapped[region].module, error, per_call)
    return MeasuredCosts(per_region, per_call, per_kept, per_counted, per_recorded, per_saved_tensor)


__all__ = ["KeptCalls", "MAX_BLOCK_ROUNDS", "MeasuredCosts", "READABLE_SHARE", "SelectiveCost", "backward_from",
           "captured_call", "clear_grads", "fresh_inputs", "readable_on", "recomputed_share",
           "selective_costs_in_model", "selective_costs_on", "selective_overhead_for_plan"]
