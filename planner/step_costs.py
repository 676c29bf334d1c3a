"""What a checkpoint call and a run recomputed alone cost inside the model's own training step,
beyond the figures that price their parts (`Problem.region_overhead_ms`, `Problem.run_region_ms`).

The other figures (nodes' forward times; checkpoint's cost per call, on tiny modules, and per
saved tensor, on a block; a run's recording per ATen call, on a block) are measured with warm
caches. Inside a step each region costs more: its recomputation in backward reads inputs long
out of cache, and what it drops is freed and allocated again. On Llama, checkpointing each
RMSNorm cost 0.61-0.64 ms per call more than those figures predict; on ViT, the block-level
figure for a run read 0.006 to 0.38 ms in four plans, while the runs plans chose cost 0.6-0.7 ms
each more than predicted with it. So both residuals are measured where they are paid: the
model's step with every call of its repeated submodule that recomputes least (a norm)
checkpointed, with one short run alone in each call of its repeated submodules, and with
every call of the repeated submodule that keeps most keeping all it may under its selective
policy (on Llama, an MLP keeping two linears saved 2.1 ms of recomputation against 6.8 ms
predicted), each against the unplanned step in paired rounds; what each adds beyond the
problem's other figures, per region, is its residual.

Example:
    >>> found = step_residuals(model, problem, wrapped, checkpoints_of, keeping_of,
    ...                        lambda m: training_loss(m(x)).backward(), torch.device("cpu"))
    >>> found.per_call_ms, found.per_run_ms
    (0.61, 0.49)
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from planner.apply import ModuleCheckpoint, apply_plan, shallow_clone
from planner.clock import paired_difference, timed_rounds
from planner.memory import preserved_state
from solvers import Problem

logger = logging.getLogger(__name__)

STEP_ROUNDS = 9  # paired rounds of whole steps: each residual is read off a difference of steps


@dataclass(frozen=True)
class StepResiduals:
    """What each region costs a training step beyond the problem's other figures: a checkpoint
    call (at least 0; added to `Problem.region_overhead_ms`), and beyond that a run recomputed
    alone (`Problem.run_region_ms`) and a region keeping nodes under a selective policy (added
    to `Problem.keep_region_ms`): each its residual, at least 0, less the call's, so at least
    `-per_call_ms`. `calls`, `runs` and `keeps` say how many each was read off (0: not
    measured, 0.0)."""

    per_call_ms: float = 0.0
    per_run_ms: float = 0.0
    calls: int = 0
    runs: int = 0
    per_keep_ms: float = 0.0
    keeps: int = 0


def short_runs(problem: Problem, span: range) -> list[range]:
    """Runs of two nodes recomputed alone inside the submodule call `span` (not in a smaller
    one), one after another from its start, each recomputing something: the runs plans pick
    (a norm and the next linear's input, an activation).

    Example:
        >>> short_runs(problem, range(8, 43))
        [range(8, 10), range(11, 13), ...]
    """
    found: list[range] = []
    start = span.start
    while start + 2 <= span.stop:
        run = range(start, start + 2)
        if (problem.allows_region(run.start, run.stop) and problem.run_span_of(run) == span
                and problem.region_recompute_ms(run) > 0):
            found.append(run)
            start += 2
        else:
            start += 1
    return found


def lone_short_runs(problem: Problem, wrapped: dict[range, ModuleCheckpoint]) -> list[range]:
    """One short run (`short_runs`) in each submodule call whose class the model calls more than
    once (its blocks and their parts), none sharing a node with another: each alone in its call.

    Example:
        >>> lone_short_runs(problem, wrapped)  # a 2-block GPT: each block's first run and its MLP's
        [range(8, 10), range(20, 22), range(44, 46), range(56, 58)]
    """
    classes = Counter(wrapped[span].module_class for span in problem.run_spans)
    taken: set[int] = set()
    found = []
    for span in problem.run_spans:
        if classes[wrapped[span].module_class] < 2:
            continue
        run = next((r for r in short_runs(problem, span) if taken.isdisjoint(r)), None)
        if run is not None:
            found.append(run)
            taken.update(run)
    return sorted(found, key=lambda r: r.start)


def small_calls(problem: Problem, wrapped: dict[range, ModuleCheckpoint]) -> list[range]:
    """Every call of the submodule class, called more than once, whose calls recompute least
    (by the median of their recomputation: a norm, an activation), where each is a region that
    recomputes something; none sharing a node with another.

    Example:
        >>> [wrapped[r].module for r in small_calls(problem, wrapped)]
        ['blocks.0.norm1', 'blocks.0.norm2', 'blocks.1.norm1', 'blocks.1.norm2', 'norm']
    """
    calls = {region: () for region in wrapped
             if problem.allows_region(region.start, region.stop) and problem.region_recompute_ms(region) > 0}
    return [region for region, _ in _every_call_of_one_class(
        calls, wrapped, lambda pairs: statistics.median(problem.region_recompute_ms(r) for r, _ in pairs))]


def keeping_calls(problem: Problem, wrapped: dict[range, ModuleCheckpoint]) -> list[tuple[range, tuple[int, ...]]]:
    """Every call of the submodule class, called more than once, whose calls keep most (by the
    median size of their fullest `Problem.keep_choices`), each keeping its fullest choice;
    none sharing a node with another.

    Example:
        >>> [(wrapped[r].module, len(kept)) for r, kept in keeping_calls(problem, wrapped)]
        [('blocks.0', 5), ('blocks.1', 5)]
    """
    fullest = {region: max(problem.keep_choices(region), key=len) for region in wrapped
               if problem.allows_region(region.start, region.stop) and problem.keepable_in(region)}
    return _every_call_of_one_class({region: kept for region, kept in fullest.items() if kept}, wrapped,
                                    lambda pairs: -statistics.median(len(kept) for _, kept in pairs))


def _every_call_of_one_class(kept: dict[range, tuple[int, ...]], wrapped: dict[range, ModuleCheckpoint],
                             rank: Callable[[list[tuple[range, tuple[int, ...]]]], float]
                             ) -> list[tuple[range, tuple[int, ...]]]:
    """The (region, kept) pairs of the submodule class, among those `kept` has more than one
    call of, that `rank` puts first (lowest), in order, none sharing a node with another."""
    by_class: dict[str, list[tuple[range, tuple[int, ...]]]] = {}
    for region, nodes in kept.items():
        by_class.setdefault(wrapped[region].module_class, []).append((region, nodes))
    repeated = {name: pairs for name, pairs in by_class.items() if len(pairs) > 1}
    if not repeated:
        return []
    chosen = min(repeated, key=lambda name: (rank(repeated[name]), name))
    found: list[tuple[range, tuple[int, ...]]] = []
    for region, nodes in sorted(repeated[chosen], key=lambda pair: (pair[0].start, -len(pair[0]))):
        if not found or found[-1][0].stop <= region.start:
            found.append((region, nodes))
    return found


def step_residuals(model: nn.Module, problem: Problem, wrapped: dict[range, ModuleCheckpoint],
                   checkpoints_of: Callable[[Sequence[range]], Sequence[ModuleCheckpoint]],
                   keeping_of: Callable[[Sequence[tuple[range, tuple[int, ...]]]], Sequence[ModuleCheckpoint]],
                   train_step: Callable[[nn.Module], None], device: torch.device,
                   rounds: int = STEP_ROUNDS) -> StepResiduals:
    """What a checkpoint call, a run and a region keeping nodes cost a training step beyond
    `problem`'s other figures, read off the model's own step, `train_step(module)` (forward,
    loss, backward), on copies sharing the parameters: with `small_calls` checkpointed, with
    `lone_short_runs` recomputed (`checkpoints_of(runs)` applies them) and with `keeping_calls`
    under their selective policies (`keeping_of(pairs)`), each against the unplanned step, in
    `rounds` paired rounds. A run's and a keeping region's residuals are what they cost beyond a
    checkpoint call's, residual included (negative where a call's residual is the larger). The
    model, its gradients, buffers and the RNG are left as they were.

    Example:
        >>> step_residuals(model, problem, wrapped, checkpoints_of, keeping_of,
        ...                lambda m: training_loss(m(x)).backward(), torch.device("cpu"))
        StepResiduals(per_call_ms=0.61, per_run_ms=0.49, calls=13, runs=18, per_keep_ms=1.2, keeps=6)
    """
    calls = small_calls(problem, wrapped)
    runs = lone_short_runs(problem, wrapped)
    keeps = keeping_calls(problem, wrapped)
    planned = {}
    if calls:
        planned["calls"] = apply_plan(shallow_clone(model), [wrapped[region] for region in calls])
    if runs:
        planned["runs"] = apply_plan(shallow_clone(model), tuple(dict.fromkeys(checkpoints_of(runs))))
    if keeps:
        planned["keeps"] = apply_plan(shallow_clone(model), list(keeping_of(keeps)))
    if not planned:
        return StepResiduals()

    def step(module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            train_step(module)
            for parameter in model.parameters():  # zeroed with set_to_none, as a training loop does
                parameter.grad = None
        return run

    with preserved_state(model, [device]):
        times = timed_rounds(device, {"unplanned": step(model), **{name: step(m) for name, m in planned.items()}},
                             rounds)
    per_call = _residual(problem, calls, paired_difference(times, "calls", "unplanned"), "calls") if calls else 0.0
    unpriced = dataclasses.replace(problem, run_region_ms=0.0)
    per_run = _residual(unpriced, runs, paired_difference(times, "runs", "unplanned"), "short runs") if runs else 0.0
    per_keep = _residual(problem, [r for r, _ in keeps], paired_difference(times, "keeps", "unplanned"),
                         "regions keeping nodes", [kept for _, kept in keeps]) if keeps else 0.0
    # A run or a keeping region pays checkpoint's per-call figure too (`Problem.checkpoint_ms`),
    # raised by `per_call`: its own residual is what it costs beyond that, negative where a
    # call's is larger.
    return StepResiduals(per_call, per_run - per_call, len(calls), len(runs),
                         per_keep - per_call if keeps else 0.0, len(keeps))


def _residual(problem: Problem, regions: list[range], measured_ms: float, what: str,
              kept: Sequence[tuple[int, ...]] = ()) -> float:
    """What each of `regions` (keeping `kept`, one tuple per region, where given) cost beyond
    what `problem` predicts for it, at least 0."""
    kept = kept or [()] * len(regions)
    predicted_ms = sum(problem.region_cost_ms(region, nodes) for region, nodes in zip(regions, kept))
    residual = max(0.0, (measured_ms - predicted_ms) / len(regions))
    logger.info("%d %s in the model's step measured %+.2f ms against %.2f ms predicted: %.3f ms each beyond",
                len(regions), what, measured_ms, predicted_ms, residual)
    return residual


__all__ = ["STEP_ROUNDS", "StepResiduals", "keeping_calls", "lone_short_runs", "short_runs", "small_calls",
           "step_residuals"]
