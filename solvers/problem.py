"""What the solvers are asked: the graph's nodes and their costs (`NodeCost`) and the memory no
plan changes (`Problem`), as plain data (no torch here); their answer is `solvers.solution`.

`Problem`'s methods price a region (`region_cost_ms`: its recomputation, checkpoint's own cost,
a selective policy's and a run's recording), say which regions a plan may hold
(`allows_region`, `run_span_of`) and what a region may keep (`keep_choices`). The indexes they
look up many times, in the solvers' inner loops (`allowed_stops`, `forbidden_starts`,
`run_structure`, `spans_by_size`, ...), are computed once per problem and cached on it.

Example:
    >>> problem = Problem(nodes=(NodeCost("a", 1.0, output_bytes=8, saves=(0,)), NodeCost("b", 2.0, uses=(0,))))
    >>> problem.region_recompute_ms(range(0, 2))  # b saves nothing: recomputation stops after a
    1.0
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import combinations
from typing import Collection

from solvers.solution import InfeasibleBudget, format_bytes

# What a region may keep (a selective-checkpoint policy), `Problem.keep_choices`: any subset of
# its keepable nodes where it holds at most MAX_KEEP_CANDIDATES (the solvers try each); in a
# larger allowed region (a block), any subset of its KEEP_COSTLIEST costliest ones, and, where
# it holds at most MAX_RUN_CANDIDATES, its k costliest for every k (keeping every matmul and
# the attention, recomputing the norms, adds and activations between them) or all of them but
# a run of consecutive ones (recomputing a run inside the block: its norm and the next linear's
# input, an activation).
MAX_KEEP_CANDIDATES = 8
KEEP_COSTLIEST = 5
MAX_RUN_CANDIDATES = 40


@dataclass(frozen=True)
class NodeCost:
    """What one compute node costs, as measured (or read from a graph file).

    Node indices refer to positions in `Problem.nodes`. A node "owns" the storages it creates;
    views and in-place results point back at the owner, so `uses`, `saves` and `mutates` are
    always lists of owners.

    Example:
        >>> NodeCost("fc1", compute_ms=0.4, output_bytes=4096, uses=(0,), saves=(0,))
        NodeCost(name='fc1', ...)
    """

    name: str
    compute_ms: float
    output_bytes: int = 0  # new storages this node creates
    grad_bytes: int = 0  # size of the gradient of those outputs (0 if not differentiable)
    saved_bytes: int = 0  # storages saved for backward that the node creates and does not return
    transient_bytes: int = 0  # temporaries alive only while the node's forward runs
    param_grad_bytes: int = 0  # parameter gradients produced by this node's backward
    # Of those, the bytes autograd makes after the node's backward function has returned: the
    # gradient of a parameter its forward broadcast (a linear's bias in `addmm`, a scale in `mul`)
    # summed to the parameter's shape. A recomputed node has freed its recomputed saved tensors
    # by then (its unpack held the last reference); any other node frees them after.
    late_grad_bytes: int = 0
    backward_transient_bytes: int = 0  # temporaries alive only while the node's backward runs
    # (earlier node, bytes) per parameter gradient this node's backward makes and autograd holds
    # until the earlier node's backward has run: a tied weight's, until its first reader's adds
    # the sum to `.grad`; one for a view of a parameter, until the view's backward hands it on.
    shared_grads: tuple[tuple[int, int], ...] = ()
    # what autograd saves for its backward past the saved-tensor hooks (a Python number a call
    # took as a tensor: `x * 0.5` saves its 0.5), so no region drops it: held from its forward to
    # its backward whatever the plan
    unhooked_saved_bytes: int = 0
    # what it holds from its forward to the end of forward, whatever the plan, and not after:
    # autocast's cached casts of parameters it does not save (a bias), which the cache drops when
    # the forward's autocast exits
    forward_held_bytes: int = 0
    uses: tuple[int, ...] = ()  # owners of the storages this node reads in forward
    saves: tuple[int, ...] = ()  # owners of the outputs autograd saves for this node's backward
    mutates: tuple[int, ...] = ()  # owners of the storages this node writes in place
    # owners whose gradient this node's backward hands on without copying: the gradient of its
    # output itself (an add) or a view of it (a cat); they then share one storage
    grad_aliases: tuple[int, ...] = ()
    # (owner, view, bytes) per view of an owner's output it reads, where it is the view's last
    # reader: its backward's gradient for the view is a storage of that size until the backward
    # of node `view` (a transpose passes it on to the owner, a slice copies it into a new one)
    view_grads: tuple[tuple[int, int, int], ...] = ()
    # owners whose output the model's own code still references while this node runs, though
    # it does not read them (a local variable, a list of tensors): they stay alive through its
    # forward, and through its recomputation where both lie in one region
    holds: tuple[int, ...] = ()
    # owners passed to a submodule call that starts at this node without being read by it:
    # checkpoint keeps a region's arguments, so a region starting here keeps them too
    arguments: tuple[int, ...] = ()
    is_output: bool = False  # returned by the graph: alive until backward starts
    # False where no gradient reaches it (an output the loss does not read, a metadata check): its
    # backward never runs, so it makes no gradient for what it read
    backward_runs: bool = True
    random: bool = False  # draws random numbers: a region holding it keeps a copy of the RNG state
    # bytes of the buffers it writes in place (BatchNorm's running statistics): a region holding
    # it copies them while it recomputes, to put them back after
    # (`planner.apply.checkpoints.restored_buffers`)
    buffer_bytes: int = 0
    # Its last saved tensor is packed before it makes its output (an input or an intermediate,
    # saved before its last kernel runs: a linear, a GELU, dropout's product): recomputation that
    # stops at it (`Problem.recomputed`) never makes its output. Not with itself in `saves`.
    stops_before_output: bool = False
    # Forward time up to its last saved tensor, where measured: what recomputation that stops
    # at it costs (a linear: almost nothing; dropout: its mask). None: all of compute_ms.
    stop_ms: float | None = None
    # Temporaries of its forward up to its last saved tensor, where measured: what
    # recomputation that stops before making its output holds beyond its saved tensors (the
    # last kernel's scratch never comes). None: all of transient_bytes.
    stop_transient_bytes: int | None = None
    # Its output may be kept inside a region (a selective-checkpoint policy caches the ATen
    # calls that make its output and saved tensors): the region's recomputation then skips it.
    keepable: bool = False
    # (start, stop): it may be kept only in allowed regions within these nodes (the submodule
    # calls whose ATen calls the model's forward makes as the graph does); None: in any region
    keep_span: tuple[int, int] | None = None
    aten_calls: int = 0  # ATen calls its forward makes: a selective region's policy sees each one
    # tensors autograd saves for its backward: in a region, checkpoint packs and unpacks each
    saved_tensors: int = 0
    # False: no run inside a submodule call (`Problem.run_spans`) may hold it: replaying its
    # calls would write a buffer again (BatchNorm's running statistics)
    replayable: bool = True
    # False: it may lie in no region. It writes a graph input in place (recomputing it would
    # write it again), or reads one that is written in place at or after it (checkpoint would
    # keep that input for recomputation, and autograd would see it modified). Or its backward
    # never runs and it saves storages of its own (dropped at once in a region; the problem holds them).
    recomputable: bool = True

    @property
    def stop_cost_ms(self) -> float:
        """What recomputation that stops at this node spends on it: `stop_ms`, at most
        `compute_ms`."""
        return self.compute_ms if self.stop_ms is None else min(self.stop_ms, self.compute_ms)

    @property
    def stop_transient(self) -> int:
        """The temporaries of a recomputation that stops at this node before it makes its
        output: `stop_transient_bytes`, else `transient_bytes`."""
        return self.transient_bytes if self.stop_transient_bytes is None else self.stop_transient_bytes

    @property
    def stop_saving_bytes(self) -> int:
        """What a recomputation that stops at this node before it makes its output holds less
        there than one that runs it whole: its output, and its temporaries beyond
        `stop_transient`."""
        return self.output_bytes + self.transient_bytes - self.stop_transient

    @property
    def saves_for_backward(self) -> bool:
        """Whether its backward needs a tensor (recomputation runs up to the last such node)."""
        return bool(self.saves or self.saved_bytes)


@dataclass(frozen=True)
class Problem:
    """A graph in topological order plus the memory that never changes with the plan.

    `static_bytes` covers parameters, their gradients, buffers, the inputs and any reserve.

    Example:
        >>> Problem(nodes=(NodeCost("a", 1.0, output_bytes=8),), static_bytes=0)
    """

    nodes: tuple[NodeCost, ...]
    static_bytes: int = 0
    # Where given, a region must be one of these node ranges (the planner's submodule calls: a
    # plan is applied by wrapping a submodule's forward); None allows any run of nodes.
    allowed_regions: tuple[range, ...] | None = None
    region_overhead_ms: float = 0.0  # fixed cost of each region (checkpoint's own work per call)
    # checkpoint's cost per tensor saved inside a region (its pack and unpack hooks, and the
    # recomputed tensor's bookkeeping): regions that hold many saved tensors cost more
    saved_tensor_ms: float = 0.0
    # A region with a random node keeps a copy of the RNG state (to replay it when recomputing)
    # from its forward to its backward: this many bytes.
    rng_state_bytes: int = 0
    # Gradients in flight as measured (first, last, bytes): alive at the backward of nodes
    # first..last (last n: from before the first node's, the loss's backward made it). None:
    # derived from the graph (`gradient_spans`).
    measured_gradients: tuple[tuple[int, int, int], ...] | None = None
    # Memory backward holds whatever the plan beyond the gradients in flight: (first, last,
    # bytes) alive at the backward of nodes first..last: FSDP2's unsharded parameter gradients
    # and reduce-scatter buffers (`planner.problem.fsdp`). `gradient_spans` adds them to the
    # gradients in flight.
    held_in_backward: tuple[tuple[int, int, int], ...] = ()
    # The loss the caller computes from the graph's outputs when forward is done, before any
    # backward: its kernel scratch (under CUDA's casts a CPU sum of bfloat16 logits copies them
    # to float32). At that point the last node's temporaries, and the outputs no later step
    # needs (read last by the last node, not returned, not kept for backward), are gone.
    loss_scratch_bytes: int = 0
    # A region that keeps nodes runs under a selective-checkpoint policy: a dispatch mode that
    # costs this much per region and per ATen call it sees (forward and recomputation).
    keep_region_ms: float = 0.0
    keep_call_ms: float = 0.0
    # and this much per node it keeps: caching its calls' outputs and handing them back, and
    # what holding them costs the step (measured on a block against the model's prediction)
    kept_node_ms: float = 0.0
    # Submodule calls (allowed regions) inside which any run of nodes may also be a region,
    # recomputed alone (`planner.apply.runs`): a dispatch mode over the call's forward
    # records the run and costs `run_call_ms` per ATen call of the call, and `recorded_call_ms`
    # per call of the run (recording it, dropping what it saved), and `run_region_ms` per run
    # beyond those (hooks starting and stopping its recording, its replay's set-up and the
    # replayed calls' dispatch, inputs out of cache). Such a region keeps nothing. A run also
    # pays `region_overhead_ms` (`checkpoint_ms`), so `run_region_ms` may be negative where a
    # checkpoint call costs more than a run's fixed work: down to -region_overhead_ms.
    run_spans: tuple[range, ...] = ()
    run_call_ms: float = 0.0
    recorded_call_ms: float = 0.0
    run_region_ms: float = 0.0
    max_run_nodes: int | None = None  # the most nodes such a run holds (None: any run of the call)
    # Allowed regions that are consecutive children of an `nn.Sequential` (one checkpoint call
    # around them, not a submodule's forward): they keep nothing.
    segment_regions: tuple[range, ...] = ()

    def __post_init__(self) -> None:
        if self.run_spans and self.allowed_regions is None:
            raise ValueError("run_spans need allowed_regions: they are allowed regions")
        if self.run_region_ms < -self.region_overhead_ms:
            raise ValueError(f"run_region_ms is {self.run_region_ms}: a run's fixed cost, region_overhead_ms + "
                             "run_region_ms, would be negative")
        if self.max_run_nodes is not None and self.max_run_nodes < 1:
            raise ValueError(f"max_run_nodes is {self.max_run_nodes}: a run holds a node at least")
        allowed = set(self.allowed_regions or ())
        for region in (*self.run_spans, *self.segment_regions):
            if region not in allowed:
                raise ValueError(f"run span or segment {region} is not one of the allowed regions")
        for region in self.allowed_regions or ():
            if region.step != 1 or len(region) == 0 or region.start < 0 or region.stop > len(self.nodes):
                raise ValueError(f"allowed region {region} is not a non-empty run of the {len(self.nodes)} nodes")
        if self.loss_scratch_bytes < 0:
            raise ValueError(f"loss_scratch_bytes is {self.loss_scratch_bytes}: a size is at least 0")
        for first, last, size in self.held_in_backward:
            if not 0 <= first <= last < len(self.nodes) or size < 0:
                raise ValueError(f"held_in_backward span ({first}, {last}, {size}) is not a run of the "
                                 f"{len(self.nodes)} nodes' backward with a size")
        for index, node in enumerate(self.nodes):
            if node.keepable and node.mutates:
                raise ValueError(f"node {index} ({node.name!r}) writes in place, so its output cannot be kept")
            if node.keep_span is not None and not node.keep_span[0] <= index < node.keep_span[1]:
                raise ValueError(f"node {index} ({node.name!r}) lies outside its keep span {node.keep_span}")
            if not 0 <= node.late_grad_bytes <= max(node.param_grad_bytes, 0):
                raise ValueError(f"node {index} ({node.name!r}): late_grad_bytes {node.late_grad_bytes} is not "
                                 f"part of its param_grad_bytes {node.param_grad_bytes}")
            if node.stops_before_output and index in node.saves:
                raise ValueError(f"node {index} ({node.name!r}) saves its own output, so it makes it before it stops")
            for owner in (*node.uses, *node.saves, *node.mutates, *node.grad_aliases, *node.holds, *node.arguments,
                          *(user for user, _ in node.shared_grads)):
                if not 0 <= owner <= index:
                    raise ValueError(
                        f"node {index} ({node.name!r}) refers to node {owner}, "
                        "which is not an earlier node"
                    )

    def __len__(self) -> int:
        return len(self.nodes)

    def recompute_ms(self, regions: tuple[range, ...], kept: Collection[int] = ()) -> float:
        """Added step time of a plan: what each region costs (`region_cost_ms`)."""
        kept = frozenset(kept)
        return sum(self.region_cost_ms(region, kept) for region in regions)

    def region_cost_ms(self, region: range, kept: Collection[int] = ()) -> float:
        """What one region adds to a step: its recomputation (`region_recompute_ms`), the
        cost of a checkpoint call (`region_overhead_ms`, and `saved_tensor_ms` per tensor its
        nodes save) and, where it keeps nodes, its policy's cost (`selective_ms`) and
        `kept_node_ms` per kept node."""
        kept = frozenset(kept)
        count = sum(i in kept for i in region)
        selective = self.selective_ms(region) + self.kept_node_ms * count if count else 0.0
        return self.region_recompute_ms(region, kept) + self.checkpoint_ms(region) + selective + self.run_ms(region)

    def run_ms(self, region: range) -> float:
        """What recording `region` as a run costs (0 where it is no run, `run_span_of`): the
        dispatch mode sees every ATen call of its submodule call's forward, `run_call_ms` each,
        and records the run's own, `recorded_call_ms` each; and `run_region_ms` per run."""
        windows = self.run_windows(region)
        if windows is None:
            return 0.0
        calls = run_structure(self)[1]
        return (self.run_region_ms + self.run_call_ms * (calls[windows[1].stop] - calls[windows[0].start])
                + self.recorded_call_ms * (calls[region.stop] - calls[region.start]))

    def run_windows(self, region: range) -> tuple[range, range] | None:
        """Where the dispatch mode recording run `region` is on (None where it is no run): from
        the forward pre-hook of the latest-starting allowed region inside its submodule call that
        starts at or before it (the innermost of those) to the forward hook of the one holding its
        last node that stops first (the innermost): (that first region, that last one)."""
        span = self.run_span_of(region)
        if span is None:
            return None
        entry, leave = run_structure(self)[0][span]
        return entry[region.start - span.start], leave[region.stop - 1 - span.start]

    def run_span_of(self, region: range) -> range | None:
        """The smallest submodule call (`run_spans`) inside which `region` is a run recomputed
        alone; None for a region that is itself an allowed region (or where there are none)."""
        if not self.run_spans or region in allowed_set(self):
            return None
        return next((span for span in spans_by_size(self) if span.start <= region.start and region.stop <= span.stop),
                    None)

    def checkpoint_ms(self, region: range) -> float:
        """checkpoint's own cost for one region: `region_overhead_ms` per call and
        `saved_tensor_ms` per tensor saved by its nodes."""
        return self.region_overhead_ms + self.saved_tensor_ms * sum(self.nodes[i].saved_tensors for i in region)

    def selective_ms(self, region: range) -> float:
        """What a selective-checkpoint policy costs a region that keeps nodes: `keep_region_ms`,
        and `keep_call_ms` per ATen call of its forward and of its recomputation."""
        calls = sum(self.nodes[i].aten_calls for i in region) + sum(
            self.nodes[i].aten_calls for i in self.recomputed(region))
        return self.keep_region_ms + self.keep_call_ms * calls

    def region_recompute_ms(self, region: range, kept: Collection[int] = ()) -> float:
        """Forward time a region's recomputation costs: its nodes up to its last saving node
        (`recomputed`) that it does not keep, the last one only up to its last saved tensor
        (`NodeCost.stop_ms`)."""
        recomputed = self.recomputed(region)
        if not recomputed:
            return 0.0
        kept = frozenset(kept)
        last = recomputed.stop - 1
        return (sum(self.nodes[i].compute_ms for i in recomputed[:-1] if i not in kept)
                + (0.0 if last in kept else self.nodes[last].stop_cost_ms))

    def keepable_in(self, region: range) -> list[int]:
        """The keepable nodes of `region` that recomputation reaches (and asks for: not a last
        node it stops before) and whose `keep_span` holds the region (with no allowed regions,
        only nodes without a span)."""
        recomputed = self.recomputed(region)
        if not recomputed or self.run_span_of(region) is not None or region in segment_set(self):
            return []
        last = recomputed.stop - 1
        # Recomputation that stops before its last node makes its output never asks for that
        # output: kept, it would stay cached until the region's backward, saving no time.
        skipped = last if self.nodes[last].stops_before_output else -1
        found = []
        for i in recomputed:
            node = self.nodes[i]
            if not node.keepable or i == skipped:
                continue
            span = node.keep_span
            if span is None or (self.allowed_regions is not None and span[0] <= region.start
                                and region.stop <= span[1]):
                found.append(i)
        return found

    def keep_candidates(self, region: range) -> tuple[int, ...]:
        """The nodes of which a region may keep any subset: its `keepable_in` nodes where at
        most `MAX_KEEP_CANDIDATES`; in a larger allowed region its `KEEP_COSTLIEST` costliest
        (by forward time, then position); else none (every solver tries each subset).

        Example:
            >>> problem.keep_candidates(range(10, 24))  # a block's four linears and attention
            (12, 15, 18, 20, 22)
        """
        if self.allowed_regions is None:  # counted over the whole region, as dp finds them
            if sum(self.nodes[i].keepable and self.nodes[i].keep_span is None for i in region) > MAX_KEEP_CANDIDATES:
                return ()
            return tuple(self.keepable_in(region))
        keepable = self.keepable_in(region)
        if len(keepable) <= MAX_KEEP_CANDIDATES:
            return tuple(keepable)
        return tuple(sorted(self._by_cost(keepable)[:KEEP_COSTLIEST]))

    def _by_cost(self, nodes: list[int]) -> list[int]:
        """`nodes` costliest first (by forward time, then position)."""
        return sorted(nodes, key=lambda i: (-self.nodes[i].compute_ms, i))

    def keep_choices(self, region: range) -> list[tuple[int, ...]]:
        """Every set of nodes `region` may keep (sorted tuples, each once, the empty one first):
        the subsets of its `keep_candidates` and, in an allowed region with over
        `MAX_KEEP_CANDIDATES` and at most `MAX_RUN_CANDIDATES` `keepable_in` nodes, its k
        costliest of those for every k, and those nodes less each run of consecutive ones (the
        empty run too).

        Example:
            >>> problem.keep_choices(range(0, 2))
            [(), (0,), (1,), (0, 1)]
        """
        candidates = self.keep_candidates(region)
        choices = [keep for size in range(len(candidates) + 1) for keep in combinations(candidates, size)]
        keepable = self.keepable_in(region)
        count = len(keepable)
        if self.allowed_regions is None or not MAX_KEEP_CANDIDATES < count <= MAX_RUN_CANDIDATES:
            return choices
        by_cost = self._by_cost(keepable)
        costliest = [tuple(sorted(by_cost[:size])) for size in range(KEEP_COSTLIEST + 1, count)]
        runs = [(first, stop) for first in range(count) for stop in range(first + 1, count + 1)]
        # (the empty run keeps them all)
        all_but_runs = [(*keepable[:first], *keepable[stop:]) for first, stop in [*runs, (count, count)]]
        seen = set(choices)
        for keep in [*costliest, *all_but_runs]:
            if keep not in seen:
                seen.add(keep)
                choices.append(keep)
        return choices

    def may_keep(self, region: range, kept: Collection[int]) -> bool:
        """Whether `region` may keep its nodes in `kept`: any of its `keepable_in` nodes (the
        solvers search its `keep_choices`, a part of these)."""
        return {i for i in kept if i in region} <= set(self.keepable_in(region))

    def region_rng_bytes(self, region: range) -> int:
        """The RNG state a region keeps: `rng_state_bytes` if one of its nodes is random."""
        return self.rng_state_bytes if any(self.nodes[i].random for i in region) else 0

    def recompute_copy_bytes(self, region: range) -> int:
        """What a region holds while it recomputes besides the recomputed tensors: a copy of the
        RNG state where it is random (`fork_rng`), and of the buffers its nodes write (a run's
        replay copies them one call at a time: counted over its whole recomputation, a bound)."""
        return self.region_rng_bytes(region) + sum(self.nodes[i].buffer_bytes for i in region)

    def recomputed(self, region: range) -> range:
        """The nodes of `region` that recomputation runs: up to the last one that saves a
        tensor for backward. Non-reentrant checkpoint stops recomputing there (early stop): the
        nodes after it only fed the region's outputs, which backward does not need again."""
        stop = region.start
        for k in region:
            if self.nodes[k].saves_for_backward:
                stop = k + 1
        return range(region.start, stop)

    def can_start_region(self, index: int) -> bool:
        """False where a region starting here would recompute from a storage that is written
        in place at or after `index` (autograd would see a mutated input)."""
        if index in forbidden_starts(self):
            return False
        return self.allowed_regions is None or index in allowed_stops(self)

    def allows_region(self, start: int, stop: int) -> bool:
        """True where [start, stop) may be a region: a startable start, only recomputable nodes
        and, where `allowed_regions` is given, one of them."""
        if not self.can_start_region(start) or stop > self.last_region_stop(start):
            return False
        return self.allowed_regions is None or stop in allowed_stops(self)[start]

    def last_region_stop(self, start: int) -> int:
        """The largest stop of a region that may start at `start`: n, or the largest allowed
        region's, and before the first node from `start` on that is not `recomputable`."""
        last = len(self.nodes) if self.allowed_regions is None else max(allowed_stops(self).get(start, (start,)))
        fixed = unrecomputable(self)
        first_fixed = fixed[bisect.bisect_left(fixed, start)] if fixed and fixed[-1] >= start else last
        return min(last, first_fixed)


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


__all__ = ["InfeasibleBudget", "KEEP_COSTLIEST", "MAX_KEEP_CANDIDATES", "MAX_RUN_CANDIDATES", "NodeCost", "Problem",
           "allowed_set", "allowed_stops", "forbidden_starts", "format_bytes", "run_structure", "segment_set",
           "spans_by_size", "unrecomputable"]
