"""Keep-inside-region choices (selective checkpointing) in the CP-SAT model of `solvers.ilp.model`.

A region may keep some of its keep candidates (`Problem.keep_candidates`, the simulator's
`kept`): a kept node's output and saved tensors stay alive from its forward until the region's
recomputation is done with them, and recomputation skips it. The decision is `keep[j][s]`: node
j is kept, and its region's last saving node is s (the region recomputes just before the
backward of s). At most one of them is 1 per node (`kept_of`).

Against the same region keeping nothing, keeping j changes only this (positions as in
`solvers.structure`):

* forward steps after j hold j's saved tensors, and its output past its last forward use;
* so do the backward of every i > s and the recomputations there (the region has not
  recomputed yet): j's window is open at i, 1 iff keep[j][s] for some s < i, which also bounds
  `alive[j][i]` below (`alive[j][s + 1] >= keep[j][s]`, and the row is monotone);
* the region's own recomputation: its steps before j hold j's output and saved tensors, and
  j's own step allocates nothing (no temporaries: the one place where keeping saves memory);
* from then on j's tensors live as a recomputed copy would.

So where a region may keep, its recomputation peak is not one number: `recompute_loads` splits
the constraint at its last saving node by steps, around its keep candidates (`KeepSteps`): the
steps between two of them, each candidate's own step, and the steps after the last one, each
group plus what the nodes kept after it hold (one constraint per group and candidate c, over
the regions that may end there). A region without candidates (a run inside a submodule call,
or one holding too many keepable nodes) keeps the one term of its largest step. A group around
a candidate c that a region does not hold (it starts after c) weighs less than that region's
first step, which holds at least what its first node allocates and what it keeps after it: no
constraint cuts off a plan, and together they give each region's exact peak for each choice of
kept nodes.

Validity: keep[j][s] <= [the plan has a region that has j among its keep candidates and s
as its last saving node]; a region that cannot fit whatever it keeps has no keep variables.

Example:
    >>> ends = keep_ends(problem, Structure.of(problem), backward_table, live_budget)
    >>> keep = add_keep_variables(model, problem, member, in_region, ends)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import solvers.problem as problem_module
from solvers.problem import Problem
from solvers.structure import Structure


@dataclasses.dataclass(frozen=True)
class KeepSteps:
    """The own bytes of the recomputation of a region from `start` whose last saving node is
    `saver` (RNG copy excluded, nothing kept), grouped around its keep candidates."""

    candidates: tuple[int, ...]  # `Problem.keep_candidates` of the region: at least one
    before: dict[int, int]  # per candidate c: the most at the steps after the previous one, before c (0: none)
    at: dict[int, int]  # per candidate c: its own step
    after: int  # the most at the steps after the last candidate (0: none)
    lowest: int  # the recomputation's own peak is at least this, whatever the region keeps


@dataclasses.dataclass(frozen=True)
class KeepEnd:
    """A region that may keep, seen from its last node: its recomputation's steps (up to its last
    saving node `saver`), the copies it holds while recomputing (`Problem.recompute_copy_bytes`:
    the RNG state's and the written buffers'), and whether some choice of kept nodes may fit
    the budget."""

    saver: int
    steps: KeepSteps
    copy_bytes: int
    fits: bool


class RecomputeSteps:
    """The own bytes at each recomputation step of the regions from one start, nothing kept, as
    the simulator counts them, grown one saving node at a time (`stop_at`): each recomputed
    output from its step to its last reader's step in the region (to the end where a node of the
    region saves it, or something past the stop still references it), saved tensors from their
    step on, and each step's temporaries. The stop makes its output only if it saves a tensor
    after making it. (`solvers.region_scan.scan_regions` gives the largest of these.)

    Example:
        >>> len(RecomputeSteps(problem, Structure.of(problem), 2).stop_at(5))  # steps of nodes 2..5
        4
    """

    def __init__(self, problem: Problem, structure: Structure, start: int) -> None:
        self.problem = problem
        self.structure = structure
        self.start = start
        self.values: list[int] = []  # per step so far; outputs counted up to their last reader so far
        self.covered: dict[int, int] = {}  # output -> the last step it is counted at (unless saved)
        self.saved_bytes = 0  # saved tensors and outputs that a node of the region saves, so far
        self.referenced: list[int] = []  # outputs that a node past the steps so far may reference

    def _stretch(self, j: int, to: int) -> None:
        """Count output j at the steps after the last it is counted at, up to `to` - 1."""
        for step in range(self.covered[j] + 1, to):
            self.values[step - self.start] += self.structure.output_bytes[j]
        self.covered[j] = to

    def _add(self, k: int) -> None:
        structure = self.structure
        out = structure.output_bytes
        self.saved_bytes += structure.saved_bytes[k]
        read = 0
        for j in (*structure.uses_before[k], *structure.holds_before[k]):
            if j in self.covered:
                self._stretch(j, k)
                read += out[j]
        for j in structure.saves_of[k]:
            if j in self.covered:  # a recomputed output, saved: alive from here on
                if self.covered[j] < k:
                    self._stretch(j, k)
                else:
                    read -= out[j]  # read by k too: counted once, as saved
                del self.covered[j]
                self.saved_bytes += out[j]
            elif j == k:
                self.saved_bytes += out[k]
        own = 0
        if k not in structure.saves_of[k]:
            own = out[k]
            self.covered[k] = k
        self.values.append(self.saved_bytes + own + read + self.problem.nodes[k].transient_bytes)
        self.referenced.append(k)

    def stop_at(self, saver: int) -> list[int]:
        """The step values of the recomputation that stops at `saver` (a saving node after
        the last one asked for), one per node from the start."""
        for k in range(self.start + len(self.values), saver + 1):
            self._add(k)
        values = list(self.values)
        if self.problem.nodes[saver].stops_before_output:
            values[-1] -= self.problem.nodes[saver].stop_saving_bytes
        referenced_until = self.structure.referenced_until
        self.referenced = [j for j in self.referenced if referenced_until[j] > saver]
        for j in self.referenced:
            if j in self.covered:  # still referenced when recomputation stops
                for step in range(self.covered[j] + 1, saver + 1):
                    values[step - self.start] += self.structure.output_bytes[j]
        return values


def kept_step_change(problem: Problem, node: int, saver: int) -> int:
    """How a node's own recomputation step changes when its region keeps it: no temporaries,
    and its output, which a last node that stops before making it would not have made, is
    there (held since its forward)."""
    cost = problem.nodes[node]
    if node == saver and cost.stops_before_output:
        return cost.output_bytes - cost.stop_transient
    return -cost.transient_bytes


def keep_steps(problem: Problem, values: list[int], start: int, saver: int,
               candidates: tuple[int, ...]) -> KeepSteps:
    """The recomputation of a region from `start` with last saving node `saver` (its step
    values, `RecomputeSteps.stop_at`), grouped around its keep `candidates` (at least one)."""

    def most(low: int, high: int) -> int:  # over the steps of nodes low..high - 1
        return max(values[low - start:high - start], default=0)

    before: dict[int, int] = {}
    at: dict[int, int] = {}
    previous = start - 1
    lowest = 0
    for c in candidates:
        before[c] = most(previous + 1, c)
        at[c] = values[c - start]
        # Keeping others only adds to a step; keeping c itself may lower its own.
        lowest = max(lowest, before[c], at[c] + min(0, kept_step_change(problem, c, saver)))
        previous = c
    after = most(previous + 1, saver + 1)
    return KeepSteps(candidates, before, at, after, max(lowest, after))


def keep_ends(
    problem: Problem, structure: Structure, backward_table: list[dict[int, int]], limit: int
) -> list[dict[int, KeepEnd]]:
    """Per node e, per start a: the regions [a, e] of the model that have keep candidates
    (`Problem.keep_candidates` of that very region: none for a run inside a submodule call), and
    their recomputation's steps (`keep_steps`). `fits` is False where no choice of kept nodes
    fits `limit` with the region's inputs and the gradients in flight held.

    Example:
        >>> ends = keep_ends(problem, Structure.of(problem), backward_table, live_budget)
        >>> ends[5][2].steps.candidates  # the region [2, 5] may keep node 3
        (3,)
    """
    n = structure.n
    ends: list[dict[int, KeepEnd]] = [{} for _ in range(n)]
    if not any(node.keepable for node in problem.nodes):
        return ends
    for a in range(n):
        inputs: set[int] = set()
        inputs_bytes = 0
        random = False
        buffers = 0
        saver = -1
        scan = RecomputeSteps(problem, structure, a)
        values: list[int] | None = None  # the steps up to `saver`, once asked for
        grouped: dict[tuple[int, ...], KeepSteps] = {}  # per candidate set, for this saver
        free = 0  # keepable nodes without a keep span in [a, e]
        for e in range(a, n):
            free += problem.nodes[e].keepable and problem.nodes[e].keep_span is None
            if a not in backward_table[e]:
                break
            if problem.allowed_regions is None and free > problem_module.MAX_KEEP_CANDIDATES:
                break  # no longer region from a has candidates (`Problem.keep_candidates`)
            for j in structure.uses_before[e]:
                if j < a and j not in inputs:
                    inputs.add(j)
                    inputs_bytes += structure.output_bytes[j]
            random = random or problem.nodes[e].random
            buffers += problem.nodes[e].buffer_bytes
            if structure.saves_for_backward[e]:
                saver, values, grouped = e, None, {}
            if saver < 0 or not problem.allows_region(a, e + 1):
                continue
            candidates = problem.keep_candidates(range(a, e + 1))
            if not candidates:
                continue
            if candidates not in grouped:
                values = scan.stop_at(saver) if values is None else values
                grouped[candidates] = keep_steps(problem, values, a, saver, candidates)
            steps = grouped[candidates]
            copy_bytes = (problem.rng_state_bytes if random else 0) + buffers  # (`Problem.recompute_copy_bytes`)
            needs = steps.lowest + copy_bytes + structure.gradient_recompute[saver + 1] + inputs_bytes
            ends[e][a] = KeepEnd(saver, steps, copy_bytes, needs <= limit)
    return ends


def add_keep_variables(
    model: Any,
    problem: Problem,
    member: list[dict[int, Any]],
    in_region: list[Any],
    ends: list[dict[int, KeepEnd]],
) -> dict[int, dict[int, Any]]:
    """keep[j][s] for each node j and saving node s such that j is a keep candidate of some
    region [a, e] that has s as its last saving node and may fit (`keep_ends`), with
    `keep[j][s] <= [the plan has one of those regions]` (a region ends at e where node e is in
    it and node e + 1 is not).

    Example:
        >>> keep = add_keep_variables(model, problem, member, in_region, ends)
        >>> sorted(keep[3])  # node 3 may be kept by a region whose last saving node is 4 or 6
        [4, 6]
    """
    n = len(problem.nodes)
    holders: dict[tuple[int, int], list[Any]] = {}  # (kept node, saver) -> the regions' end indicators
    for e in range(n):
        following = member[e + 1] if e + 1 < n else {}
        for a, end in ends[e].items():
            if not end.fits:
                continue
            ending = member[e][a] - following.get(a, 0)
            for j in end.steps.candidates:
                holders.setdefault((j, end.saver), []).append(ending)
    keep: dict[int, dict[int, Any]] = {}
    for (j, s), terms in sorted(holders.items()):
        var = model.new_bool_var(f"keep_{j}_{s}")
        model.add(var <= sum(terms))
        keep.setdefault(j, {})[s] = var
    for j, row in keep.items():
        model.add(sum(row.values()) <= in_region[j])
    return keep


def kept_of(keep: dict[int, dict[int, Any]], j: int) -> Any:
    """1 iff node j is kept (0 where it cannot be)."""
    return sum(keep[j].values()) if j in keep else 0


def held_saved(keep: dict[int, dict[int, Any]], problem: Problem, scaled: Any) -> tuple[list[Any], list[Any]]:
    """The saved tensors of kept nodes, in `scaled` units: per forward step t, those of the nodes
    before t; per backward step i, those whose window is open at i (kept by a region whose last
    saving node is before i: it has not recomputed yet)."""
    forward: list[Any] = [0]
    backward: list[Any] = [0]
    for t, node in enumerate(problem.nodes):
        size = scaled(node.saved_bytes)
        forward.append(forward[-1] + size * kept_of(keep, t) if size else forward[-1])
        backward.append(backward[-1] + sum(scaled(problem.nodes[j].saved_bytes) * row[t]
                                           for j, row in keep.items() if t in row))
    return forward[:-1], backward[:-1]


def recompute_loads(
    i: int,
    stop: int,
    member: list[dict[int, Any]],
    recompute_table: list[dict[int, int]],
    ends: list[dict[int, KeepEnd]],
    keep: dict[int, dict[int, Any]],
    problem: Problem,
    scaled: Any,
) -> list[Any]:
    """The own bytes of the recomputation at saving node i, of the region whose last saving
    node it is (it ends before `stop`, the next saving node), as expressions: the largest
    step where the region cannot keep (`recompute_table`), and one per group of steps where it
    may (see the module docstring). Each must fit with what the backward of i holds."""
    n = len(member)
    plain: list[Any] = []
    keeping: list[tuple[KeepEnd, Any]] = []  # (region, 1 iff it ends there)
    for e in range(i, stop):
        following = member[e + 1] if e + 1 < n else {}
        for a, var in member[e].items():
            if a > i:
                continue
            ending = var - following.get(a, 0)
            end = ends[e].get(a)
            if end is not None:
                if end.fits:  # (else the region cannot end at e)
                    keeping.append((end, ending))
            elif recompute_table[e].get(a):
                plain.append(scaled(recompute_table[e][a]) * ending)
    if not keeping:
        return [sum(plain)]
    nodes = problem.nodes

    def kept_after(c: int, inclusive: bool) -> Any:  # what the nodes kept after c's step hold
        return sum(scaled(nodes[j].output_bytes + nodes[j].saved_bytes) * keep[j][i]
                   for j in range(c if inclusive else c + 1, i + 1) if i in keep.get(j, {}))

    def grouped(value: Callable[[KeepSteps], int]) -> Any:  # over the regions that may end here
        return sum(scaled(value(end.steps) + end.copy_bytes) * ending for end, ending in keeping)

    loads = [sum(plain) + grouped(lambda steps: steps.after)]
    for c in sorted({c for end, _ in keeping for c in end.steps.candidates}):
        # (0 for a region that starts after c: see the module docstring)
        loads.append(grouped(lambda steps, c=c: steps.before.get(c, 0)) + kept_after(c, True))
        own = scaled(kept_step_change(problem, c, i)) * keep[c][i] if i in keep.get(c, {}) else 0
        loads.append(grouped(lambda steps, c=c: steps.at.get(c, 0)) + kept_after(c, False) + own)
    return loads


def keep_hints(
    keep: dict[int, dict[int, Any]], saver_of: list[int], kept: frozenset[int]
) -> list[tuple[Any, bool]] | None:
    """The keep variables' values for a plan whose regions' last saving node is `saver_of[j]`
    for each node j in one; None if a kept node has no variable for it."""
    if any(saver_of[j] not in keep.get(j, {}) for j in kept):
        return None
    return [(var, j in kept and saver_of[j] == s) for j, row in keep.items() for s, var in row.items()]


__all__ = ["KeepEnd", "KeepSteps", "RecomputeSteps", "add_keep_variables", "held_saved", "keep_ends", "keep_hints",
           "keep_steps", "kept_of", "kept_step_change", "recompute_loads"]
