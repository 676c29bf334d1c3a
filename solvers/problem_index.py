"""Indexes over a `Problem` that its methods look up many times (the solvers call them in their
inner loops): computed once per problem and cached on it."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from solvers.problem import Problem


def forbidden_starts(problem: Problem) -> frozenset[int]:
    """Nodes where no region may start (`Problem.can_start_region`).

    Example:
        >>> 3 in forbidden_starts(problem)
        False
    """
    cached = problem.__dict__.get("_forbidden_starts")
    if cached is None:
        forbidden: set[int] = set()
        for mutator, node in enumerate(problem.nodes):
            if not node.recomputable:
                forbidden.add(mutator)
            for owner in node.mutates:
                # A region starting in (owner, mutator] could take the storage as an input.
                forbidden.update(range(owner + 1, mutator + 1))
        cached = frozenset(forbidden)
        object.__setattr__(problem, "_forbidden_starts", cached)
    return cached


def unrecomputable(problem: Problem) -> list[int]:
    """The sorted nodes no region may hold (`NodeCost.recomputable` false).

    Example:
        >>> unrecomputable(problem)
        []
    """
    cached = problem.__dict__.get("_unrecomputable")
    if cached is None:
        cached = [i for i, node in enumerate(problem.nodes) if not node.recomputable]
        object.__setattr__(problem, "_unrecomputable", cached)
    return cached


def allowed_stops(problem: Problem) -> dict[int, frozenset[int]]:
    """Start -> the stops of the regions allowed from it: the allowed regions, and the runs of
    replayable nodes inside `Problem.run_spans` (of at most `Problem.max_run_nodes`).

    Example:
        >>> sorted(allowed_stops(problem)[8])[:3]
        [9, 10, 11]
    """
    cached = problem.__dict__.get("_allowed_stops")
    if cached is None:
        stops: dict[int, set[int]] = {}
        for region in problem.allowed_regions or ():
            stops.setdefault(region.start, set()).add(region.stop)
        longest = problem.max_run_nodes or len(problem.nodes)
        for span in problem.run_spans:
            stop = span.stop
            for start in reversed(span):  # runs of replayable nodes
                if not problem.nodes[start].replayable:
                    stop = start
                else:
                    stops.setdefault(start, set()).update(range(start + 1, min(stop, start + longest) + 1))
        cached = {start: frozenset(found) for start, found in stops.items()}
        object.__setattr__(problem, "_allowed_stops", cached)
    return cached


def spans_by_size(problem: Problem) -> tuple[range, ...]:
    """The run spans, smallest first: a run is recorded in the smallest submodule call that
    holds it (`Problem.run_span_of`).

    Example:
        >>> spans_by_size(problem)[0]
        range(38, 42)
    """
    cached = problem.__dict__.get("_spans_by_size")
    if cached is None:
        cached = tuple(sorted(problem.run_spans, key=lambda span: (len(span), span.start)))
        object.__setattr__(problem, "_spans_by_size", cached)
    return cached


def run_structure(problem: Problem) -> tuple[dict[range, tuple[list[range], list[range]]], list[int]]:
    """Per run span, for each of its nodes, the allowed region whose pre-hook starts a recording
    from there and the one whose hook stops a recording that ends there (`Problem.run_windows`);
    and the ATen calls before each node.

    Example:
        >>> windows, calls = run_structure(problem)
    """
    cached = problem.__dict__.get("_run_structure")
    if cached is None:
        windows = {}
        for span in problem.run_spans:
            inside = [r for r in problem.allowed_regions or () if span.start <= r.start and r.stop <= span.stop]
            entry = [max((r for r in inside if r.start <= i), key=lambda r: (r.start, -len(r))) for i in span]
            leave = [min((r for r in inside if r.start <= i < r.stop), key=lambda r: (r.stop, len(r))) for i in span]
            windows[span] = (entry, leave)
        calls = [0]
        for node in problem.nodes:
            calls.append(calls[-1] + node.aten_calls)
        cached = (windows, calls)
        object.__setattr__(problem, "_run_structure", cached)
    return cached


def segment_set(problem: Problem) -> frozenset[range]:
    """The segment regions (`Problem.segment_regions`) as a set."""
    cached = problem.__dict__.get("_segment_set")
    if cached is None:
        cached = frozenset(problem.segment_regions)
        object.__setattr__(problem, "_segment_set", cached)
    return cached


def allowed_set(problem: Problem) -> frozenset[range]:
    """The allowed regions as a set.

    Example:
        >>> range(8, 43) in allowed_set(problem)
        True
    """
    cached = problem.__dict__.get("_allowed_set")
    if cached is None:
        cached = frozenset(problem.allowed_regions or ())
        object.__setattr__(problem, "_allowed_set", cached)
    return cached
