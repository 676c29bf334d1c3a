"""Which regions `planner.step_costs` times in the model's own step: the calls of the repeated
submodule that recomputes least (a norm) and most (a block), one short run alone in each call of
a repeated submodule, the run that records most calls in each block, and the calls of the
repeated submodule that keeps most, keeping all they may. Runs are only those that replay
(`frees_saved`), so that each costs what it is priced at.

Example:
    >>> [wrapped[r].module for r in large_calls(problem, wrapped)]
    ['blocks.0', 'blocks.1']
    >>> lone_short_runs(problem, wrapped)
    [range(8, 10), range(20, 22), range(44, 46), range(56, 58)]
"""
from __future__ import annotations

import statistics
from collections import Counter
from typing import Callable

from planner.apply import ModuleCheckpoint
from solvers import Problem
from solvers.problem_index import allowed_stops, run_structure


def frees_saved(problem: Problem, run: range) -> bool:
    """Whether a run on `run` frees a storage it saves, and so replays in backward: one of its
    nodes saves a storage that one of its nodes owns. A run keeps what its nodes save of its
    inputs (`planner.run_checkpoint`); where that is all they save (GPT-2's GELU: `x * 0.5`,
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


__all__ = ["frees_saved", "keeping_calls", "large_calls", "long_runs", "lone_short_runs", "longest_run", "short_runs",
           "small_calls", "timeable_run"]
