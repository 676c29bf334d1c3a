"""The one memory simulator: peak bytes of one forward+backward under a plan.

Time is a list of steps: forward of nodes 0..n-1, the loss (which the caller computes from the
graph's outputs: `Problem.loss_scratch_bytes`), then backward of n-1..0, where a region's
recomputation runs just before the backward of its last node that saves a tensor, and only up
to that node (`Problem.recomputed`: non-reentrant checkpoint's early stop). Every buffer (a
node's output, its internally saved tensors, a gradient) is alive over an interval of steps;
the peak is the largest sum of live buffers at any step plus that step's temporaries, plus
static memory.

A node a region keeps (`kept`: a selective-checkpoint policy caches the ATen calls that make
its output and saved tensors) holds them from its forward on: its output until the region's
recomputation has no more use for it, its saved tensors until its backward. Recomputation
skips it (no time, nothing allocated).

A recomputed node's backward step counts its late gradients (`NodeCost.late_grad_bytes`)
against the recomputed tensors it unpacks last, which are gone by the time autograd makes them.

- `simulate`, `peak_bytes`: live memory per step (`Timeline`) and its peak;
- `plan_buffers`: every buffer of the step under a plan and the node that owns it (`Buffers`,
  which `solvers.bound.recompute` reads);
- `gradient_spans`: the gradients in flight during backward, which no plan changes: where each
  gradient storage is made and freed, derived from the graph (or as measured,
  `Problem.measured_gradients`); `solvers.structure` reads them too;
- `make_solution`: a solver's regions re-checked with the simulator, as a `Solution`.

Example:
    >>> problem = Problem(nodes=(NodeCost("a", 1.0, output_bytes=8, grad_bytes=8),
    ...                          NodeCost("b", 1.0, output_bytes=8, uses=(0,), saves=(0,))))
    >>> simulate(problem).labels
    ('forward a', 'forward b', 'loss', 'backward b', 'backward a')
    >>> peak_bytes(problem)
    16
    >>> gradient_spans(Problem(nodes=(NodeCost("a", 1.0, grad_bytes=8),)))
    [(0, 0, 8)]
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Collection

from solvers.problem import NodeCost, Problem
from solvers.solution import Solution, Status


def gradient_spans(problem: Problem) -> list[tuple[int, int, int]]:
    """(first, last, bytes) of every gradient storage: alive at the backward of nodes
    first..last, whatever the plan; last n (the number of nodes): made by the loss's backward,
    before any node's (a returned tensor's gradient: it is alive while the last node's region
    recomputes).

    Autograd keeps one gradient per *version* of a tensor: an in-place write (`x += y`,
    `relu_`) at node m makes a new version of its owner, which later readers read, and m's
    backward turns the new version's gradient into the old one's. So the gradient of version v
    (an owner j, or the mutator m that made it) appears at the backward of v's last reader
    (n, the loss's, if none and the tensor is returned; none at all for an unread mutated version; a
    node whose backward never runs, `NodeCost.backward_runs`, reads nothing here) and
    is freed after v's own backward. Where that reader is v's only one and hands its result's
    gradient on unchanged (`grad_aliases`: an add, a cat, an in-place add), the two share one
    storage, held until the later of them is done (with other readers autograd sums into a new
    tensor, always where the shared storage is larger: a cat's). A reader's gradient for a view
    it read (`NodeCost.view_grads`) is a storage of its own until the view's backward; where
    that view changes the size (a slice), the owner's gradient is made there. A shared
    parameter's gradient lives from its last user's backward to its first's. What else backward
    holds whatever the plan (`Problem.held_in_backward`: FSDP2's) is added as given.

    Example:
        >>> gradient_spans(Problem(nodes=(NodeCost("a", 1.0, grad_bytes=8),)))
        [(0, 0, 8)]
    """
    if problem.measured_gradients is not None:
        return [*problem.measured_gradients, *problem.held_in_backward]
    nodes = problem.nodes
    n = len(nodes)
    owner_of = list(range(n))  # version -> the owner whose storage it is
    current = list(range(n))  # owner -> its latest version so far in forward
    readers: list[list[int]] = [[] for _ in range(n)]  # per version, in forward order
    through: dict[tuple[int, int], tuple[int, int]] = {}  # (version, reader) -> (its view, gradient bytes)
    for k, node in enumerate(nodes):
        for owner in set(node.uses) if node.backward_runs else ():
            if owner < k:
                readers[current[owner]].append(k)
        for owner, view, view_bytes in node.view_grads if node.backward_runs else ():
            if owner < view < k and owner not in node.grad_aliases:
                through[current[owner], k] = (view, view_bytes)
        if not node.output_bytes:  # a node with outputs of its own keeps its index for them
            for owner in node.mutates:
                if owner < k:
                    current[owner] = k
                    owner_of[k] = owner
    consumer = [r[-1] if r else -1 for r in readers]

    def hands_on(v: int) -> bool:  # v's last reader passes its result's gradient to v uncopied
        return consumer[v] >= 0 and owner_of[v] in nodes[consumer[v]].grad_aliases

    root = list(range(n))  # the version whose gradient storage v's gradient is
    for v in reversed(range(n)):
        if hands_on(v) and len(readers[v]) == 1:
            root[v] = root[consumer[v]]
    first: dict[int, int] = {}
    size: dict[int, int] = {}
    for v in range(n):
        r = root[v]
        first[r] = min(first.get(r, v), v)
        size[r] = max(size.get(r, 0), _version_grad_bytes(nodes, v, owner_of[v], consumer[v], current))
    last_consumer = [c if c >= 0 else n if nodes[owner_of[v]].is_output else n - 1 for v, c in enumerate(consumer)]
    # A reader's gradient for a view it read is a storage of its own until the view's backward
    # hands it on: to the owner's gradient, as a view of it (a transpose) or, where the sizes
    # differ (a slice, an expand), into a new storage of the owner's size made there; else
    # summed into the owner's gradient there.
    view_spans = []
    for (v, reader), (view, view_bytes) in through.items():
        if reader != consumer[v]:
            view_spans.append((view, reader, view_bytes))
        elif view_bytes != _version_grad_bytes(nodes, v, owner_of[v], reader, current):
            view_spans.append((view, reader, view_bytes))
            last_consumer[v] = view  # (the reader hands nothing on uncopied: v is its own root)
    # A version read several times whose last reader hands it a shared gradient holds that
    # storage until the next reader's gradient arrives; autograd then sums out of place into a
    # new storage, unless nothing else holds the shared one any more (it sums in place).
    merged: dict[int, int] = {}  # group -> the group it joined

    def group(r: int) -> int:
        while r in merged:
            r = merged[r]
        return r

    for v in reversed(range(n)):
        if hands_on(v) and len(readers[v]) > 1 and root[v] == v:
            shared, second = group(root[consumer[v]]), readers[v][-2]
            if first[shared] <= second:
                last_consumer[v] = second
            elif size[shared] > size[v]:  # a view of a larger storage (a cat's) is never summed into in place
                first[shared] = second
                last_consumer[v] = second
            else:
                first[shared] = min(first[shared], first.pop(v))
                size[shared] = max(size[shared], size.pop(v))
                merged[v] = shared
    spans = [(first[r], last_consumer[r], size[r]) for r in sorted(first)] + view_spans
    spans += [(user, k, shared) for k, node in enumerate(nodes) for user, shared in node.shared_grads]
    return spans + list(problem.held_in_backward)


def _version_grad_bytes(nodes: tuple[NodeCost, ...], version: int, owner: int, consumer: int,
                        current: list[int]) -> int:
    """Bytes of the gradient of one version: its owner's gradient size, except where no gradient
    reaches it: a version made in place that nothing reads and that is not returned, or one whose
    node's backward never runs (an output the loss does not read)."""
    if not nodes[version].backward_runs:
        return 0
    if version == owner:
        return nodes[version].grad_bytes
    returned = nodes[version].is_output or (nodes[owner].is_output and current[owner] == version)
    return nodes[owner].grad_bytes if consumer >= 0 or returned else 0


@dataclass(frozen=True)
class Timeline:
    """Live bytes after each step (static memory excluded) and each step's label.

    Example:
        >>> t = simulate(problem, ())
        >>> max(t.live_bytes) + problem.static_bytes == t.peak_bytes
    """

    labels: tuple[str, ...]
    live_bytes: tuple[int, ...]
    peak_bytes: int
    peak_step: int


def peak_bytes(problem: Problem, regions: tuple[range, ...] = (), kept: Collection[int] = ()) -> int:
    """Peak memory of one training step with `regions` recomputed, keeping `kept`.

    Example:
        >>> peak_bytes(problem, (range(2, 5),)) <= peak_bytes(problem, ())
    """
    return simulate(problem, regions, kept).peak_bytes


def validate_regions(problem: Problem, regions: tuple[range, ...], kept: Collection[int] = ()) -> None:
    """Raise ValueError unless regions are sorted, disjoint, non-empty and startable, and each
    region keeps one of its `Problem.keep_choices`."""
    previous_stop = 0
    for region in regions:
        if region.step != 1 or len(region) == 0:
            raise ValueError(f"region {region} must be a non-empty range with step 1")
        if region.start < previous_stop or region.stop > len(problem):
            raise ValueError(f"region {region} overlaps another or leaves the graph")
        if not problem.can_start_region(region.start):
            raise ValueError(
                f"region {region} starts at node {region.start} "
                f"({problem.nodes[region.start].name!r}), whose inputs are modified in place later"
            )
        if not problem.allows_region(region.start, region.stop):
            raise ValueError(f"region {region} is not one of the problem's allowed regions")
        previous_stop = region.stop
    kept = set(kept)
    outside = sorted(kept - {i for region in regions for i in region})
    if outside:
        raise ValueError(f"node {outside[0]} cannot be kept: it lies in no region")
    for region in regions:
        if not problem.may_keep(region, kept):
            raise ValueError(
                f"nodes {sorted(kept & set(region))} cannot be kept by region {region}: not all are keepable "
                "nodes that its recomputation reaches (`Problem.keepable_in`)"
            )


@dataclass(frozen=True)
class Buffers:
    """Every buffer of one step under a plan: (owner node or -1, kind, bytes, first step, last
    step), alive over first..last inclusive, plus each step's temporaries and the step labels.
    Kinds: "output", "saved" (a node's), "unhooked" (`NodeCost.unhooked_saved_bytes`), "cached"
    (`NodeCost.forward_held_bytes`), "rng" (a region's RNG state), "copies" (what a region copies
    while recomputing: `Problem.recompute_copy_bytes`), "gradient".
    `backward_step[i]` is the step of node i's backward; `loss_step`, between forward and
    backward, that of the loss the caller computes from the outputs (`Problem.loss_scratch_bytes`).
    `simulate` sums them; `solvers.bound.recompute` asks which node owns what at each step."""

    labels: tuple[str, ...]
    held: tuple[tuple[int, str, int, int, int], ...]
    transient: tuple[int, ...]
    backward_step: tuple[int, ...]
    loss_step: int


def simulate(problem: Problem, regions: tuple[range, ...] = (), kept: Collection[int] = ()) -> Timeline:
    """Walk the step timeline of a plan and return live memory per step and its peak."""
    buffers = plan_buffers(problem, regions, kept)
    steps = len(buffers.labels)
    delta = [0] * (steps + 1)  # difference array of live bytes
    for _, _, size, first, last in buffers.held:
        delta[first] += size
        delta[last + 1] -= size
    live: list[int] = []
    running = 0
    for step in range(steps):
        running += delta[step]
        live.append(running)
    with_transient = [live[s] + buffers.transient[s] for s in range(steps)]
    peak_step = max(range(steps), key=with_transient.__getitem__) if steps else 0
    peak = problem.static_bytes + (with_transient[peak_step] if steps else 0)
    return Timeline(buffers.labels, tuple(live), peak, peak_step)


def plan_buffers(problem: Problem, regions: tuple[range, ...] = (), kept: Collection[int] = ()) -> Buffers:
    """The step timeline of a plan: which buffers are alive over which steps, and who owns them."""
    kept = frozenset(kept)
    validate_regions(problem, regions, kept)
    nodes = problem.nodes
    n = len(nodes)
    region_of: dict[int, range] = {i: region for region in regions for i in region}

    # Forward, then the loss the caller computes from the graph's outputs, then backward.
    labels: list[str] = [*(f"forward {node.name}" for node in nodes), "loss"]
    loss_step = n
    backward_step: dict[int, int] = {}
    recompute_step: dict[int, int] = {}
    recomputed_of = {region: problem.recomputed(region) for region in regions}
    for i in reversed(range(n)):
        region = region_of.get(i)
        # Backward reaches a region at its last node that saves a tensor: its unpack recomputes.
        if region is not None and i == recomputed_of[region].stop - 1:
            for k in recomputed_of[region]:
                recompute_step[k] = len(labels)
                labels.append(f"recompute {nodes[k].name}")
        backward_step[i] = len(labels)
        labels.append(f"backward {nodes[i].name}")
    steps = len(labels)

    held: list[tuple[int, str, int, int, int]] = []
    transient = [0] * steps
    transient[loss_step] = problem.loss_scratch_bytes

    def hold(owner: int, kind: str, size: int, first: int, last: int) -> None:
        if size > 0:
            held.append((owner, kind, size, first, last))

    last_forward_use = list(range(n))  # read, or still referenced by the model's code
    for k, node in enumerate(nodes):
        for owner in (*node.uses, *node.holds, *node.arguments):
            last_forward_use[owner] = max(last_forward_use[owner], k)

    # Outputs of the first pass: alive until the last forward use, the last saver's backward,
    # or, for a region's input, until that region's backward is done (checkpoint keeps it, and
    # every tensor a submodule call it checkpoints is passed; a run's tape, what its calls read).
    last = list(last_forward_use)
    for j, node in enumerate(nodes):
        if node.is_output:  # (read by the loss)
            last[j] = max(last[j], loss_step)
    runs = {region for region in regions if problem.run_span_of(region) is not None}
    for k, node in enumerate(nodes):
        region = region_of.get(k)
        if region is None:
            for owner in node.saves:
                last[owner] = max(last[owner], backward_step[k])
        else:
            for owner in node.uses if region in runs else (*node.uses, *node.arguments):
                if owner < region.start:
                    last[owner] = max(last[owner], backward_step[region.start])
    first_copy_until: dict[int, int] = {}  # kept j -> where its recomputed "copy" ends (below)
    for j, node in enumerate(nodes):
        transient[j] += node.transient_bytes
        hold(j, "unhooked", node.unhooked_saved_bytes, j, backward_step[j])  # whatever the plan
        hold(j, "cached", node.forward_held_bytes, j, loss_step)  # whatever the plan
        if j in kept:
            hold(j, "saved", node.saved_bytes, j, backward_step[j])  # cached from forward to its backward
            first_copy_until[j] = last[j]
            continue
        hold(j, "output", node.output_bytes, j, last[j])
        if j in region_of:
            transient[j] += node.saved_bytes  # created, then dropped by checkpoint
        else:
            hold(j, "saved", node.saved_bytes, j, backward_step[j])

    # Recomputation: a second copy of each region's outputs and saved tensors, and the RNG
    # state kept from the region's forward to its backward where it draws random numbers.
    referenced_until = [n if node.is_output else last_forward_use[j] for j, node in enumerate(nodes)]
    unpacked = [0] * steps  # per step: the recomputed tensors that a node's backward unpacks last
    for region in regions:
        rng_bytes = problem.region_rng_bytes(region)
        hold(-1, "rng", rng_bytes, region.start, backward_step[region.start])
        recomputed = recomputed_of[region]
        if not recomputed:
            continue
        stop = recompute_step[recomputed.stop - 1]
        # fork_rng's copy and the written buffers' copies, while recomputing
        hold(-1, "copies", problem.recompute_copy_bytes(region), recompute_step[recomputed.start], stop)
        # A run (`Problem.run_span_of`) replays its recorded calls, not the model's code: it
        # holds a recomputed output only until the last call that reads it.
        replayed = region in runs
        last_copy = {j: recompute_step[j] for j in recomputed}
        for k in recomputed:
            for owner in nodes[k].uses if replayed else (*nodes[k].uses, *nodes[k].holds, *nodes[k].arguments):
                if owner in last_copy and owner < k:
                    last_copy[owner] = max(last_copy[owner], recompute_step[k])
            for owner in nodes[k].saves:
                if owner in last_copy:
                    last_copy[owner] = max(last_copy[owner], backward_step[k])
        # What a node past the stop reads or holds, or what the region returns, is still
        # referenced by the model's code when recomputation stops.
        for j in recomputed:
            if referenced_until[j] >= recomputed.stop and not replayed:
                last_copy[j] = max(last_copy[j], stop)
        for j in recomputed:
            node = nodes[j]
            unpacked[backward_step[j]] += node.saved_bytes
            if j in kept:  # one storage from its forward until recomputation is done with it
                hold(j, "output", node.output_bytes, j, max(first_copy_until[j], last_copy[j]))
                if last_copy[j] >= first_copy_until[j]:
                    unpacked[last_copy[j]] += node.output_bytes
                continue
            # Recomputation stops at its last node, maybe before that node makes its output.
            made = j < recomputed.stop - 1 or not node.stops_before_output
            hold(j, "output", node.output_bytes if made else 0, recompute_step[j], last_copy[j])
            unpacked[last_copy[j]] += node.output_bytes if made else 0
            hold(j, "saved", node.saved_bytes, recompute_step[j], backward_step[j])
            transient[recompute_step[j]] += node.transient_bytes if made else node.stop_transient
        # Its unpacks held the last references: they are gone before autograd makes the node's
        # late gradients (`NodeCost.late_grad_bytes`), which then reuse that room.
        for j in recomputed:
            transient[backward_step[j]] -= min(nodes[j].late_grad_bytes, unpacked[backward_step[j]])

    # Gradients (see `gradient_spans`), and what each node's backward adds while it runs.
    for first, last_node, size in gradient_spans(problem):  # (last n: from backward's first step on)
        hold(-1, "gradient", size, backward_step.get(last_node, loss_step + 1), backward_step[first])
    for j, node in enumerate(nodes):
        transient[backward_step[j]] += node.param_grad_bytes + node.backward_transient_bytes

    return Buffers(tuple(labels), tuple(held), tuple(transient), tuple(backward_step[i] for i in range(n)),
                   loss_step)


def held_after_forward(problem: Problem, regions: tuple[range, ...] = (), kept: Collection[int] = ()) -> int:
    """Activation bytes still alive when forward ends: what checkpointing shrinks."""
    timeline = simulate(problem, regions, kept)
    return timeline.live_bytes[len(problem) - 1] if len(problem) else 0


def make_solution(
    problem: Problem,
    regions: tuple[range, ...],
    budget_bytes: int,
    status: Status,
    solver: str,
    started: float,
    kept: Collection[int] = (),
) -> Solution:
    """Re-check a solver's regions with the simulator and package them as a Solution.

    Raises ValueError if the solver's plan is over budget: no solver can hand back a plan
    that does not fit.

    Example:
        >>> make_solution(problem, (range(0, 4),), 2**30, Status.OPTIMAL, "dp", time.perf_counter())
    """
    regions = tuple(sorted(regions, key=lambda region: region.start))
    kept = tuple(sorted(kept))
    peak = peak_bytes(problem, regions, kept)
    if peak > budget_bytes:
        raise ValueError(
            f"solver {solver!r} returned a plan with simulated peak {peak} bytes "
            f"over the budget {budget_bytes} bytes"
        )
    return Solution(
        regions=regions,
        peak_bytes=peak,
        recompute_ms=problem.recompute_ms(regions, kept),
        status=status,
        solver=solver,
        solve_seconds=time.perf_counter() - started,
        kept=kept,
    )


__all__ = ["Buffers", "Timeline", "gradient_spans", "held_after_forward", "make_solution", "peak_bytes", "plan_buffers",
           "simulate", "validate_regions"]
