"""What a checkpoint call, each tensor it saves, a run recomputed alone and a region keeping
nodes cost inside the model's own training step, beyond the figures that price their parts
(`Problem.region_overhead_ms`, `Problem.saved_tensor_ms`, `Problem.run_region_ms`,
`Problem.recorded_call_ms`, `Problem.keep_region_ms`).

Those figures (nodes' forward times; checkpoint's cost per call, on tiny modules and on the
model's smallest repeated submodule, `planner.costs.calls`, and per saved tensor, on a block; a
run's recording per ATen call, on a block) are measured with warm caches. Inside a step a region
costs more, or less: its recomputation in backward reads inputs long out of cache, what it drops
is freed and allocated again, and on a GPU the step's queue hides host work. So these figures
are read where they are paid, each set of regions in the model's step against the unplanned
step in paired rounds:

- the regions timed: every call of the repeated submodule that recomputes least (a norm,
  `small_calls`) and most (a block, `large_calls`), one short run alone in each call of a
  repeated submodule (`lone_short_runs`), the run that records most calls in each block
  (`long_runs`), and every call of the repeated submodule that keeps most, keeping all it may
  (`keeping_calls`). Runs are only those that replay (`frees_saved`), so that each costs what
  it is priced at;
- two figures at once from two sets (`fit_two`): each set gives one equation, measured_ms -
  predicted_ms = regions * a + units * b, and the two differ in units per region (norms save few
  tensors, blocks many; short runs record few calls, long runs many), so the two fix both
  figures. Neither falls below its floor: where one would, it is held there and the other
  fitted alone, by least squares over both sets. A call's cost and a saved tensor's come from
  the norms and the blocks (`call_and_tensor_ms`; tighter with checkpoint's own cost per block
  read within one step, `planner.costs.block_price`), a run's cost and a recorded call's from
  the short and the long runs (`run_and_recorded_call_ms`); a keeping region's residual is what
  it costs beyond the figures so corrected;
- whether the step says the node times are too high (`node_times_high`), and by how much to
  scale them down then (`node_time_scale`, `scaled_node_times`);
- `step_residuals`, which reads them all into a `StepResiduals`.

Where a set's rounds cannot tell what it measured from what the figures held so far price it
at, the price stands (`planner.measure.clock.reading_or_price`): such differences are noise.

Example:
    >>> found = step_residuals(model, problem, wrapped, checkpoints_of, keeping_of,
    ...                        lambda m: training_loss(m(x)).backward(), torch.device("cpu"))
    >>> found.per_call_ms, found.saved_tensor_ms, found.per_run_ms
    (0.61, 0.021, 0.49)
    >>> fit_two([(13, 26, 8.0), (6, 120, 9.6)], floors=(0.0, 0.0))  # 13 norms, 6 blocks
    (0.506, 0.0547)
"""
from __future__ import annotations

import logging
import statistics
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
from torch import nn

from planner.apply.checkpoints import apply_plan, shallow_clone
from planner.core import ModuleCheckpoint
from planner.costs.block_price import within_step_block_ms
from planner.costs.node_rounds import NodeRounds, NodeTimes, with_node_times
from planner.measure.clock import (
    READING_LEVEL,
    paired_difference,
    paired_interval,
    reading_or_price,
    timed_rounds,
)
from planner.measure.memory import preserved_state
from solvers import Problem
from solvers.problem import allowed_stops, run_structure

Row = tuple[float, float, float]  # (regions, units, measured beyond what is already priced), ms

# Recomputing every block costs a step at least about its nodes' forward times: a step that
# measured this share less says the node times are high.
NODE_TIMES_HIGH = 0.15


def fit_two(rows: list[Row], floors: tuple[float, float]) -> tuple[float, float]:
    """The per-region and per-unit figures (a, b) that fit both rows, each at least its floor.

    Example:
        >>> fit_two([(2, 2, 3.0), (2, 24, 7.4)], floors=(0.0, 0.0))
        (1.3, 0.2)
    """
    (n1, s1, m1), (n2, s2, m2) = rows
    floor_a, floor_b = floors
    determinant = n1 * s2 - n2 * s1  # 0 where both sets hold as many units per region
    if determinant:
        a = (m1 * s2 - m2 * s1) / determinant
        b = (n1 * m2 - n2 * m1) / determinant
        if a >= floor_a and b >= floor_b:
            return a, b
    if not determinant or b < floor_b:  # the per-region figure alone beyond the units' floor
        return max(floor_a, _least_squares(rows, 0, 1, floor_b)), floor_b
    return floor_a, max(floor_b, _least_squares(rows, 1, 0, floor_a))


def _least_squares(rows: list[Row], fitted: int, held: int, value: float) -> float:
    """The figure in column `fitted` that best fits the rows with column `held`'s at `value`."""
    denominator = sum(row[fitted] ** 2 for row in rows)
    if not denominator:
        return 0.0
    return sum(row[fitted] * (row[2] - row[held] * value) for row in rows) / denominator


def node_times_high(recompute_ms: float, measured_ms: float, blocks: int) -> str | None:
    """A warning where checkpointing `blocks` blocks measured `measured_ms` in the model's step,
    more than `NODE_TIMES_HIGH` below `recompute_ms`, what their nodes' forward times say their
    recomputation costs; else None. (Node times measured while the machine is busy can sum to
    far more than a quiet forward takes.)

    Example:
        >>> node_times_high(285.0, 166.0, 6) is not None
        True
    """
    if recompute_ms <= 0 or measured_ms >= (1 - NODE_TIMES_HIGH) * recompute_ms:
        return None
    return (f"checkpointing every one of the {blocks} blocks added {measured_ms:.1f} ms to the model's step, "
            f"{1 - measured_ms / recompute_ms:.0%} less than the {recompute_ms:.1f} ms its graph nodes' forward "
            "times give for recomputing them: those times are too high here (the machine was busy while they were "
            "measured, or the graph's operations differ from the model's own).")


def node_time_scale(recompute_ms: float, measured_ms: float, checkpoint_ms: float) -> float:
    """What to multiply node times by where checkpointing blocks whose nodes' forward times give
    `recompute_ms` measured `measured_ms` in the model's step, of which checkpoint's own figures
    account for `checkpoint_ms`: so that the blocks' predicted overhead is what was measured
    (at most 1: this only scales down, where `node_times_high` says the times are high; 1 where
    the step leaves nothing for recomputation, which says nothing about how much to scale).

    Example:
        >>> node_time_scale(285.0, 166.0, 6.0)
        0.5614035087719298
    """
    left = measured_ms - checkpoint_ms
    if recompute_ms <= 0 or left <= 0:
        return 1.0
    return min(1.0, left / recompute_ms)


def scaled_node_times(problem: Problem, scale: float) -> Problem:
    """`problem` with every node's forward time (and the part recomputation that stops at it
    spends) multiplied by `scale`.

    Example:
        >>> scaled_node_times(problem, 0.5).nodes[0].compute_ms == 0.5 * problem.nodes[0].compute_ms
        True
    """
    if scale == 1.0:
        return problem
    nodes = tuple(replace(node, compute_ms=scale * node.compute_ms,
                          stop_ms=None if node.stop_ms is None else scale * node.stop_ms) for node in problem.nodes)
    return replace(problem, nodes=nodes)


def frees_saved(problem: Problem, run: range) -> bool:
    """Whether a run on `run` frees a storage it saves, and so replays in backward: one of its
    nodes saves a storage that one of its nodes owns. A run keeps what its nodes save of its
    inputs (`planner.apply.runs`); where that is all they save (GPT-2's GELU: `x * 0.5`,
    then `x.pow(3)`, which saves x), it frees nothing and replays nothing (or a view of an
    input), though `Problem.region_recompute_ms` prices it up to its last saving node. Such
    runs would tell the step's fit that runs cost less than they are priced at.

    Example:
        >>> frees_saved(problem, range(39, 41))  # GPT-2's mul and pow_1: pow_1 saves its input
        False
    """
    return any(problem.nodes[k].saved_bytes or any(j in run for j in problem.nodes[k].saves) for k in run)


def timeable_run(problem: Problem, run: range, span: range) -> bool:
    """Whether `run` may be timed as a run recomputed alone inside the submodule call `span`
    (not in a smaller one): an allowed region that recomputes something and replays
    (`frees_saved`).

    Example:
        >>> timeable_run(problem, range(10, 12), range(8, 43))
        True
    """
    return (problem.allows_region(run.start, run.stop) and problem.run_span_of(run) == span
            and problem.region_recompute_ms(run) > 0 and frees_saved(problem, run))


def short_runs(problem: Problem, span: range) -> list[range]:
    """Runs of two nodes recomputed alone inside the submodule call `span` (not in a smaller
    one), one after another from its start, each recomputing something and replaying
    (`frees_saved`): the runs plans pick (a norm and the next linear's input, an activation).

    Example:
        >>> short_runs(problem, range(8, 43))
        [range(8, 10), range(11, 13), ...]
    """
    found: list[range] = []
    start = span.start
    while start + 2 <= span.stop:
        run = range(start, start + 2)
        if timeable_run(problem, run, span):
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


def long_runs(problem: Problem, wrapped: dict[range, ModuleCheckpoint]) -> list[range]:
    """In each call of the repeated submodule whose calls hold most nodes (the blocks), the run
    recomputed alone that records most ATen calls (`longest_run`): set against `lone_short_runs`,
    what a run costs per call it records.

    Example:
        >>> [(r.start, r.stop) for r in long_runs(problem, wrapped)]  # a 2-block GPT
        [(9, 42), (44, 77)]
    """
    blocks = _every_call_of_one_class({span: () for span in problem.run_spans if span in wrapped}, wrapped,
                                      lambda pairs: -statistics.median(len(span) for span, _ in pairs))
    return [run for span, _ in blocks if (run := longest_run(problem, span)) is not None]


def longest_run(problem: Problem, span: range) -> range | None:
    """The run recomputed alone inside the submodule call `span` (not in a smaller one) that
    records most ATen calls, recomputes something and replays (`frees_saved`); None where it
    has none.

    Example:
        >>> longest_run(problem, range(8, 43))
        range(9, 42)
    """
    calls = run_structure(problem)[1]
    best: range | None = None
    for start in span:
        for stop in sorted(allowed_stops(problem).get(start, ()), reverse=True):
            run = range(start, stop)
            if stop <= span.stop and timeable_run(problem, run, span):
                if best is None or calls[stop] - calls[start] > calls[best.stop] - calls[best.start]:
                    best = run
                break  # (the longest from this start)
    return best


def small_calls(problem: Problem, wrapped: dict[range, ModuleCheckpoint]) -> list[range]:
    """Every call of the submodule class, called more than once, whose calls recompute least
    (by the median of their recomputation: a norm, an activation), where each is a region that
    recomputes something; none sharing a node with another.

    Example:
        >>> [wrapped[r].module for r in small_calls(problem, wrapped)]
        ['blocks.0.norm1', 'blocks.0.norm2', 'blocks.1.norm1', 'blocks.1.norm2', 'norm']
    """
    return _calls_ranked(problem, wrapped, 1.0)


def large_calls(problem: Problem, wrapped: dict[range, ModuleCheckpoint]) -> list[range]:
    """As `small_calls`, the class whose calls recompute most: the model's blocks.

    Example:
        >>> [wrapped[r].module for r in large_calls(problem, wrapped)]
        ['blocks.0', 'blocks.1']
    """
    return _calls_ranked(problem, wrapped, -1.0)


def _calls_ranked(problem: Problem, wrapped: dict[range, ModuleCheckpoint], sign: float) -> list[range]:
    """Every call of the repeated class that ranks first by `sign` times its calls' median recomputation."""
    calls = {region: () for region in wrapped
             if problem.allows_region(region.start, region.stop) and problem.region_recompute_ms(region) > 0}
    return [region for region, _ in _every_call_of_one_class(
        calls, wrapped, lambda pairs: sign * statistics.median(problem.region_recompute_ms(r) for r, _ in pairs))]


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


logger = logging.getLogger(__name__)

STEP_ROUNDS = 9  # paired rounds of whole steps: each residual is read off a difference of steps
_NODE_PASS = "node times"  # each round's pass over the graph that times every node (`NodeRounds`)


@dataclass(frozen=True)
class StepResiduals:
    """What each region costs a training step beyond the problem's other figures: a checkpoint
    call (added to `Problem.region_overhead_ms`; at least its negative, so a call costs at least
    0), each tensor its nodes save (`saved_tensor_ms`, at least 0: replaces
    `Problem.saved_tensor_ms`; None where not measured), a run recomputed alone beyond a call
    (`Problem.run_region_ms`) and a region keeping nodes beyond a call (added to
    `Problem.keep_region_ms`): neither has a fixed cost below the call's, before correction or
    after, whichever is lower. `recorded_call_ms` (at least 0; None where not measured) replaces
    `Problem.recorded_call_ms`. `calls`, `runs`, `keeps`, `blocks` and `long_runs` say how many
    regions each was read off (0: not measured), `within_blocks` how many blocks checkpoint's
    own cost was read on within one step (`planner.costs.block_price`). `node_times` are the
    nodes' times measured in the same rounds (`planner.costs.node_rounds`; empty: not measured),
    which replace the problem's before anything else; `node_time_scale` (at most 1) multiplies
    every node's time where the blocks measured far under them (`node_times_high`): the other
    figures were read beyond the times so replaced and scaled."""

    per_call_ms: float = 0.0
    per_run_ms: float = 0.0
    calls: int = 0
    runs: int = 0
    per_keep_ms: float = 0.0
    keeps: int = 0
    saved_tensor_ms: float | None = None
    blocks: int = 0
    recorded_call_ms: float | None = None
    long_runs: int = 0
    node_time_scale: float = 1.0
    node_times: NodeTimes = field(default_factory=dict)
    within_blocks: int = 0

    def priced(self, problem: Problem) -> Problem:
        """`problem` with these residuals in its figures.

        Example:
            >>> StepResiduals(0.5, saved_tensor_ms=0.02).priced(problem).saved_tensor_ms
            0.02
        """
        problem = scaled_node_times(with_node_times(problem, self.node_times), self.node_time_scale)
        return replace(problem, region_overhead_ms=problem.region_overhead_ms + self.per_call_ms,
                       saved_tensor_ms=problem.saved_tensor_ms if self.saved_tensor_ms is None else self.saved_tensor_ms,
                       run_region_ms=self.per_run_ms, keep_region_ms=max(0.0, problem.keep_region_ms + self.per_keep_ms),
                       recorded_call_ms=problem.recorded_call_ms if self.recorded_call_ms is None
                       else self.recorded_call_ms)


def step_residuals(model: nn.Module, problem: Problem, wrapped: dict[range, ModuleCheckpoint],
                   checkpoints_of: Callable[[Sequence[range]], Sequence[ModuleCheckpoint]],
                   keeping_of: Callable[[Sequence[tuple[range, tuple[int, ...]]]], Sequence[ModuleCheckpoint]],
                   train_step: Callable[[nn.Module], None], device: torch.device,
                   rounds: int | None = None, node_rounds: NodeRounds | None = None) -> StepResiduals:
    """What a checkpoint call, a saved tensor, a run and a region keeping nodes cost a training step
    beyond `problem`'s other figures, read off the model's own step, `train_step(module)` (forward,
    loss, backward), on copies sharing the parameters: with `small_calls` and with `large_calls`
    checkpointed (a call's cost and a saved tensor's, `call_and_tensor_ms`), with `lone_short_runs`
    and with `long_runs` recomputed (`checkpoints_of(runs)` applies them; a run's cost and a
    recorded call's, `run_and_recorded_call_ms`) and with `keeping_calls` under their selective
    policies (`keeping_of(pairs)`), each against the unplanned step, in `rounds` paired rounds
    (default `STEP_ROUNDS`). A run's and a keeping region's residuals are what they cost beyond a
    checkpoint call's corrected cost. With `node_rounds`, every node is also timed once per round,
    and the figures are read beyond those times (means over the rounds), not the problem's, measured
    apart from these rounds. Checkpoint's own cost per block is read first, within one step
    (`planner.costs.block_price.within_step_block_ms`), and stands for the blocks in the split of a
    call's cost from a saved tensor's. A set whose rounds cannot tell its measurement from its price
    under the figures held so far is taken at that price (`planner.measure.clock.reading_or_price`).
    Where the blocks measured far under their nodes' times, those are scaled down first
    (`node_time_scale`). The model, its gradients, buffers and the RNG are left as they were.

    Example:
        >>> step_residuals(model, problem, wrapped, checkpoints_of, keeping_of,
        ...                lambda m: training_loss(m(x)).backward(), torch.device("cpu"))
        StepResiduals(per_call_ms=0.61, per_run_ms=0.49, calls=13, runs=18, per_keep_ms=1.2, keeps=6,
                      saved_tensor_ms=0.021, blocks=6, recorded_call_ms=0.035, long_runs=6, node_time_scale=1.0)
    """
    rounds = STEP_ROUNDS if rounds is None else rounds  # (read here, so a test may set fewer)
    within = within_step_block_ms(model, problem, large_calls(problem, wrapped), wrapped, train_step, device)
    calls = small_calls(problem, wrapped)
    blocks = [region for region in large_calls(problem, wrapped) if region not in calls] if calls else []
    runs = lone_short_runs(problem, wrapped)
    longs = long_runs(problem, wrapped) if runs else []
    keeps = keeping_calls(problem, wrapped)
    planned = {}
    for name, regions in (("calls", calls), ("blocks", blocks)):
        if regions:
            planned[name] = apply_plan(shallow_clone(model), [wrapped[region] for region in regions])
    if runs:
        planned["runs"] = apply_plan(shallow_clone(model), tuple(dict.fromkeys(checkpoints_of(runs))))
    if longs:
        planned["long runs"] = apply_plan(shallow_clone(model), tuple(dict.fromkeys(checkpoints_of(longs))))
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

    calls_in_round = {"unplanned": step(model), **{name: step(m) for name, m in planned.items()}}
    if node_rounds is not None:  # (last in each round: its own time is not read, only its nodes')
        calls_in_round[_NODE_PASS] = node_rounds.measure
    with preserved_state(model, [device]):
        times = timed_rounds(device, calls_in_round, rounds, closing="unplanned")
    node_times = node_rounds.means() if node_rounds is not None else {}
    problem = with_node_times(problem, node_times)
    measured = {name: paired_difference(times, name, "unplanned") for name in planned}
    intervals = {name: paired_interval(times, name, "unplanned", READING_LEVEL) for name in planned}

    def reading(name: str, regions: list[range], pricing: Problem, kept: Sequence[tuple[int, ...]] = ()) -> float:
        price_ms = sum(pricing.region_cost_ms(region, nodes) for region, nodes in zip(regions, kept or [()] * len(regions)))
        return reading_or_price(measured[name], intervals[name], price_ms, f"{len(regions)} {name} in the model's step")

    scale = 1.0
    if blocks:
        recompute_ms = sum(map(problem.region_recompute_ms, blocks))
        blocks_high = intervals["blocks"][1] if intervals["blocks"] else measured["blocks"]  # (the rounds' upper end)
        if high := node_times_high(recompute_ms, blocks_high, len(blocks)):
            # Every figure below is read beyond the nodes' recomputation: on times this high, all
            # come out negative and are held at their floors, pricing plans with no call, tensor or
            # recording cost at all. So the node times are scaled to what the blocks measured, no
            # further than the rounds' upper end allows.
            scale = node_time_scale(recompute_ms, blocks_high, sum(map(problem.checkpoint_ms, blocks)))
            warnings.warn(f"{high} The plan's node times are scaled by {scale:.2f} to what the step measured."
                          if scale < 1.0 else f"{high} They stand: the step left nothing beyond checkpoint's own "
                          "cost to scale them to.")
            problem = scaled_node_times(problem, scale)
    priced = replace(problem, run_region_ms=0.0)  # (a run's own figure is measured here)
    within_row = None if within is None else (list(within.blocks), within.figure(problem))
    if calls:
        per_call, per_tensor = call_and_tensor_ms(problem, calls, reading("calls", calls, problem), blocks,
                                                  reading("blocks", blocks, problem) if blocks else None, within_row)
        priced = replace(priced, region_overhead_ms=per_call, saved_tensor_ms=per_tensor)
    elif within_row is not None:  # (no calls to split it with: the call's figure stands)
        priced = replace(priced, saved_tensor_ms=tensor_ms_within(problem, *within_row))
    # A run or a keeping region pays a checkpoint call's corrected cost (`Problem.checkpoint_ms`)
    # too: its own residual is what it costs beyond that, negative where a call's is larger,
    # but its fixed cost is no less than the call's figure before correction (or the corrected
    # one, where that is lower): lone short runs, which cost least, would otherwise price the
    # longer runs plans choose at nothing.
    floor = min(priced.region_overhead_ms, problem.region_overhead_ms) - priced.region_overhead_ms
    runs_as_were = replace(priced, run_region_ms=max(floor, problem.run_region_ms))  # (the floor holds both)
    per_run, recorded = 0.0, None
    if longs:  # (a cost per run and per call it records, from short runs and long ones)
        per_run, recorded = run_and_recorded_call_ms(priced, runs, reading("runs", runs, runs_as_were), longs,
                                                     reading("long runs", longs, runs_as_were), floor)
    elif runs:
        per_run = _residual(priced, runs, reading("runs", runs, runs_as_were), "short runs", floor)
    per_keep = 0.0
    if keeps:
        regions, kept = [r for r, _ in keeps], [nodes for _, nodes in keeps]
        per_keep = _residual(priced, regions, reading("keeps", regions, priced, kept), "regions keeping nodes", floor,
                             kept)
    return StepResiduals(priced.region_overhead_ms - problem.region_overhead_ms, per_run, len(calls), len(runs),
                         per_keep, len(keeps), priced.saved_tensor_ms if calls or within else None, len(blocks),
                         recorded, len(longs), scale, node_times, 0 if within is None else len(within.blocks))


def call_and_tensor_ms(problem: Problem, calls: list[range], calls_ms: float, blocks: list[range],
                       blocks_ms: float | None, within: tuple[list[range], float] | None = None
                       ) -> tuple[float, float]:
    """A checkpoint call's cost and a saved tensor's in the model's step, where checkpointing
    `calls` measured `calls_ms` and `blocks` `blocks_ms` beyond the unplanned step.

    What each set recomputes, plus a cost per call and per tensor its nodes save, fits both (two
    equations, two unknowns; calls few tensors each, blocks many; neither below 0: where one
    would be, the other alone fits). Where that puts a saved tensor below the problem's figure
    (read off one block's steps, which on a GPU counts host work the step's queue hides), both
    are taken. Otherwise the problem's per-tensor figure stands: a fit above it also charges
    to saved tensors what recomputation costs blocks beyond their node times (inputs out of
    cache), which regions other than blocks do not pay in proportion, and would price runs too low.
    The call's cost is then what the calls leave beyond their tensors, at least the problem's.
    Without blocks, the same; and where the blocks measured less than their recomputation as the
    nodes' times give it (those times are high, or the rounds noisy: a reading below them would
    price every call and tensor at 0), which says nothing of what a tensor costs.

    `within` (blocks, checkpoint's own cost per block read within one step,
    `planner.costs.block_price`) replaces the blocks' row: read beyond the blocks' timed
    recomputation, it holds no recomputation, so its fit is taken whichever way it moves the
    tensor's figure.

    Example:
        >>> call_and_tensor_ms(problem, norms, 8.0, blocks, 60.0)
        (0.55, 0.021)
    """
    def beyond_recompute(regions: list[range], measured_ms: float) -> tuple[int, int, float]:
        saved = sum(problem.nodes[i].saved_tensors for region in regions for i in region)
        return len(regions), saved, measured_ms - sum(problem.region_recompute_ms(region) for region in regions)

    n1, s1, m1 = beyond_recompute(calls, calls_ms)
    if within is not None:
        within_blocks, block_ms = within
        n2, s2 = len(within_blocks), sum(problem.nodes[i].saved_tensors for region in within_blocks for i in region)
        per_call, per_tensor = fit_two([(n1, s1, m1), (n2, s2, n2 * block_ms)], floors=(0.0, 0.0))
        logger.info("in the model's step, %d calls saving %d tensors measured %+.2f ms beyond their recomputation; "
                    "within one step, %d blocks saving %d cost %.3f ms each beyond theirs: %.3f ms per call, %.4f ms "
                    "per saved tensor (figure so far: %.4f ms)", n1, s1, m1, n2, s2, block_ms, per_call, per_tensor,
                    problem.saved_tensor_ms)
        return per_call, per_tensor
    n2, s2, m2 = beyond_recompute(blocks, blocks_ms) if blocks and blocks_ms is not None else (0, 0, 0.0)
    if m2 < 0:  # (blocks cheaper than their nodes: node times high, or noise; not a cost)
        logger.info("in the model's step, %d calls saving %d tensors measured %+.2f ms beyond their recomputation: "
                    "no reading of a saved tensor's cost", n2, s2, m2)
    elif n2:
        per_call, per_tensor = fit_two([(n1, s1, m1), (n2, s2, m2)], floors=(0.0, 0.0))
        logger.info("in the model's step, %d calls saving %d tensors measured %+.2f ms beyond their recomputation "
                    "and %d calls saving %d %+.2f ms: %.3f ms per call, %.4f ms per saved tensor (figure read off "
                    "a block: %.4f ms)", n1, s1, m1, n2, s2, m2, per_call, per_tensor, problem.saved_tensor_ms)
        if per_tensor < problem.saved_tensor_ms:
            return per_call, per_tensor
    per_call = max(problem.region_overhead_ms, (m1 - s1 * problem.saved_tensor_ms) / n1)
    logger.info("%d calls in the model's step measured %+.2f ms beyond their recomputation: %.3f ms per call",
                n1, m1, per_call)
    return per_call, problem.saved_tensor_ms


def tensor_ms_within(problem: Problem, blocks: list[range], block_ms: float) -> float:
    """A saved tensor's cost where checkpoint's own cost per block of `blocks`, read within one
    step, is `block_ms`, and a call costs `problem`'s figure: what a block costs beyond that call,
    per tensor it saves (at least 0).

    Example:
        >>> tensor_ms_within(problem, blocks, 1.7)  # 0.5 ms per call, 40 tensors a block
        0.03
    """
    saved = sum(problem.nodes[i].saved_tensors for region in blocks for i in region)
    if not saved:  # (nothing to put it on)
        return problem.saved_tensor_ms
    per_tensor = max(0.0, len(blocks) * (block_ms - problem.region_overhead_ms) / saved)
    logger.info("within one step, %d blocks saving %d tensors cost %.3f ms each beyond their recomputation: %.4f ms "
                "per saved tensor (figure so far: %.4f ms)", len(blocks), saved, block_ms, per_tensor,
                problem.saved_tensor_ms)
    return per_tensor


def run_and_recorded_call_ms(problem: Problem, short: list[range], short_ms: float, long: list[range],
                             long_ms: float, floor: float) -> tuple[float, float]:
    """A run's cost beyond a checkpoint call (`Problem.run_region_ms`, at least `floor`) and per
    ATen call it records (`Problem.recorded_call_ms`, at least 0) in the model's step, where
    recomputing `short` runs measured `short_ms` and `long` runs `long_ms` beyond the unplanned
    step (`fit_two`). Replaces the recorded call's figure read off a block, whose warm caches
    and short runs price the longer runs plans choose too low. Where the long runs measured less
    than their nodes' times (those are high, or the rounds noisy), the block's figure per
    recorded call stands, and a run's cost is what the short runs leave beyond it.

    Example:
        >>> run_and_recorded_call_ms(problem, short, 4.0, long, 12.0, floor=-0.3)
        (-0.12, 0.035)
    """
    unpriced = replace(problem, run_region_ms=0.0, recorded_call_ms=0.0)
    calls = run_structure(problem)[1]

    def row(runs: list[range], measured_ms: float) -> tuple[float, float, float]:
        recorded = sum(calls[run.stop] - calls[run.start] for run in runs)
        return len(runs), recorded, measured_ms - unpriced.recompute_ms(tuple(runs))

    rows = [row(short, short_ms), row(long, long_ms)]
    if long_ms < sum(map(problem.region_recompute_ms, long)):  # (node times high, or noise: not a cost)
        per_recorded = problem.recorded_call_ms
        per_run = max(floor, (rows[0][2] - rows[0][1] * per_recorded) / rows[0][0])
    else:
        per_run, per_recorded = fit_two(rows, floors=(floor, 0.0))
    logger.info("in the model's step, %d short runs recording %d calls measured %+.2f ms beyond their other figures "
                "and %d long runs recording %d %+.2f ms: %+.3f ms per run, %.4f ms per recorded call (figure read "
                "off a block: %.4f ms)", *rows[0], *rows[1], per_run, per_recorded, problem.recorded_call_ms)
    return per_run, per_recorded


def _residual(problem: Problem, regions: list[range], measured_ms: float, what: str, floor: float,
              kept: Sequence[tuple[int, ...]] = ()) -> float:
    """What each of `regions` (keeping `kept`, one tuple per region, where given) cost beyond
    what `problem` predicts for it, at least `floor`."""
    kept = kept or [()] * len(regions)
    predicted_ms = sum(problem.region_cost_ms(region, nodes) for region, nodes in zip(regions, kept))
    residual = max(floor, (measured_ms - predicted_ms) / len(regions))
    logger.info("%d %s in the model's step measured %+.2f ms against %.2f ms predicted: %+.3f ms each beyond",
                len(regions), what, measured_ms, predicted_ms, residual)
    return residual


__all__ = ["NODE_TIMES_HIGH", "Row", "STEP_ROUNDS", "StepResiduals", "call_and_tensor_ms", "fit_two", "frees_saved",
           "keeping_calls", "large_calls", "lone_short_runs", "long_runs", "longest_run", "node_time_scale",
           "node_times_high", "run_and_recorded_call_ms", "scaled_node_times", "short_runs", "small_calls",
           "step_residuals", "tensor_ms_within", "timeable_run"]
