"""Plan-independent quantities derived from a Problem, shared by the exact solvers.

The simulator (solvers/simulate.py) walks a step timeline. For the exact solvers it helps to
read that timeline by *position* instead. With a plan fixed, let `rho[j]` be the smallest index
that keeps node j's first-pass output alive into backward: a saver of j that is not in a region,
or the start of a region that is not j's own and contains a consumer of j. Then:

* forward step t holds every output with `forward_until[j] >= t` (still read in forward, or
  returned), every kept output (`rho[j]` exists), the saved tensors of the nodes before t that
  are not in a region, and node t's own saved tensors and temporaries;
* the backward of node i holds the outputs with `rho[j] <= i`, the saved tensors of the nodes
  `<= i` outside regions, the gradients in flight (`gradient_spans`, independent of the plan)
  and node i's parameter gradients; if i lies in a region [a, b) that has recomputed by then
  (its last saving node s is >= i) it also holds the region's recomputed saved tensors of
  [a, i] and the recomputed outputs that a node in [j, i] saves (`scan_regions` below);
* the recomputation of a region [a, b) runs between the backward of s + 1 and that of s, so it
  holds what the backward of s holds from earlier nodes, the gradients in flight there, and
  the region's own recomputed tensors (`scan_regions` below).

`RegionScan` reads `scan_regions` lazily for the dp solver.

Example:
    >>> structure = Structure.of(problem)
    >>> structure.gradient_backward[0] >= 0
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from solvers.problem import Problem, gradient_spans


@dataclass(frozen=True)
class Structure:
    """Per-node facts about a Problem that do not depend on the plan.

    Attributes (all tuples indexed by node unless said otherwise):
        consumers: later nodes that read j in forward.
        savers: nodes (j itself included) that save j for their backward.
        uses_before: distinct owners < k that node k reads or is passed as a module call's
            arguments (k's region inputs if k starts it).
        holds_before: distinct owners < k that the model's code holds while k runs, not read by k.
        saves_of: distinct owners that node k saves.
        saves_for_backward: `NodeCost.saves_for_backward` (recomputation runs up to such nodes).
        stop_saving_ms: what recomputation that stops at node k saves on it: compute_ms less
            `NodeCost.stop_cost_ms`.
        forward_until: last forward step at which j's output is alive whatever the plan.
        referenced_until: last node that reads, holds or is passed j's output (n if returned):
            a recomputation that stops before it still references j when it stops.
        keep_until: largest index of a node that could keep j alive into backward (-1: none).
        last_ref: max(forward_until, keep_until).
        gradient_backward: gradients in flight plus parameter gradients at the backward of i.
        gradient_recompute: (length n + 1) gradients in flight while a region ending at b
            (exclusive) recomputes, i.e. between the backward of b and that of b - 1.
        forward_fixed: bytes at forward step t that are alive whatever the plan (outputs with
            `last_ref >= t`, node t's saved tensors and temporaries).
        graduates: nodes j with `last_ref[j] == t`, per t.
        startable: `Problem.can_start_region`, per node.
        useful_start: startable, and not a start that another plan beats for sure (see _build).
    """

    n: int
    output_bytes: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    compute_ms: tuple[float, ...]
    consumers: tuple[tuple[int, ...], ...]
    savers: tuple[tuple[int, ...], ...]
    uses_before: tuple[tuple[int, ...], ...]
    holds_before: tuple[tuple[int, ...], ...]
    saves_of: tuple[tuple[int, ...], ...]
    saves_for_backward: tuple[bool, ...]
    stop_saving_ms: tuple[float, ...]
    forward_until: tuple[int, ...]
    referenced_until: tuple[int, ...]
    keep_until: tuple[int, ...]
    last_ref: tuple[int, ...]
    gradient_backward: tuple[int, ...]
    gradient_recompute: tuple[int, ...]
    forward_fixed: tuple[int, ...]
    graduates: tuple[tuple[int, ...], ...]
    startable: tuple[bool, ...]
    useful_start: tuple[bool, ...]

    @staticmethod
    def of(problem: Problem) -> "Structure":
        """Derive (and cache on the problem) the plan-independent facts of `problem`.

        Example:
            >>> Structure.of(problem).n == len(problem)
            True
        """
        cached = problem.__dict__.get("_structure")
        if cached is None:
            cached = _build(problem)
            object.__setattr__(problem, "_structure", cached)
        return cached

    @property
    def frontier_width(self) -> int:
        """Most outputs that are still referenced across one boundary between nodes: the
        number of bits in the dp solver's state (1 on chains, a few on transformers)."""
        delta = [0] * (self.n + 2)
        for j, last in enumerate(self.last_ref):
            if last > j:
                delta[j + 1] += 1
                delta[last + 1] -= 1
        width = running = 0
        for t in range(self.n + 1):
            running += delta[t]
            width = max(width, running)
        return width

    @property
    def saves_only_what_it_reads(self) -> bool:
        """True when every saved owner is read by (or is) its saver, as in traced graphs.

        Then a kept output is alive in forward until its last forward use anyway, and the dp
        solver's forward check is exact."""
        return all(k <= f for k, f in zip(self.keep_until, self.forward_until))


def _build(problem: Problem) -> Structure:
    nodes = problem.nodes
    n = len(nodes)
    consumers: list[list[int]] = [[] for _ in range(n)]
    savers: list[list[int]] = [[] for _ in range(n)]
    uses_before: list[tuple[int, ...]] = []
    holds_before: list[tuple[int, ...]] = []
    held_until = list(range(n))
    saves_of: list[tuple[int, ...]] = []
    for k, node in enumerate(nodes):
        inputs = tuple(sorted({owner for owner in (*node.uses, *node.arguments) if owner < k}))
        uses_before.append(inputs)
        holds_before.append(tuple(sorted({owner for owner in node.holds if owner < k} - set(inputs))))
        for owner in holds_before[-1]:
            held_until[owner] = max(held_until[owner], k)
        for owner in inputs:
            consumers[owner].append(k)
        saved = tuple(sorted(set(node.saves)))
        saves_of.append(saved)
        for owner in saved:
            savers[owner].append(k)

    forward_until = []
    referenced_until = []
    keep_until = []
    for j, node in enumerate(nodes):
        last_use = max([held_until[j], *consumers[j]])
        forward_until.append(n - 1 if node.is_output else last_use)
        referenced_until.append(n if node.is_output else last_use)
        keep_until.append(max([-1, *consumers[j], *savers[j]]))
    last_ref = [max(f, k) for f, k in zip(forward_until, keep_until)]

    # Gradients: j's lives from the backward of its last consumer (n - 1 if none) to its own, a
    # shared parameter's from the backward of its last user to that of its first.
    grad_delta = [0] * (n + 1)  # over backward positions i: alive for first <= i <= last
    spans = gradient_spans(problem)
    for first, last, size in spans:
        grad_delta[first] += size
        grad_delta[last + 1] -= size
    gradient_backward = []
    running = 0
    for i, node in enumerate(nodes):
        running += grad_delta[i]
        gradient_backward.append(running + node.param_grad_bytes + node.backward_transient_bytes)
    # While a region ending at b recomputes: gradients with j <= b - 1 and last consumer >= b.
    recompute_delta = [0] * (n + 2)
    for first, last, size in spans:
        if last >= first + 1:
            recompute_delta[first + 1] += size
            recompute_delta[last + 1] -= size
    gradient_recompute = []
    running = 0
    for b in range(n + 1):
        running += recompute_delta[b]
        gradient_recompute.append(running)

    alive_delta = [0] * (n + 1)
    for j, node in enumerate(nodes):
        alive_delta[j] += node.output_bytes
        alive_delta[last_ref[j] + 1] -= node.output_bytes
    forward_fixed = []
    running = 0
    for t, node in enumerate(nodes):
        running += alive_delta[t]
        forward_fixed.append(running + node.saved_bytes + node.transient_bytes)

    graduates: list[list[int]] = [[] for _ in range(n)]
    for j in range(n):
        graduates[last_ref[j]].append(j)

    # A region never needs to start at a node that holds no memory and saves nothing (a view,
    # a shape query): starting one node later, or dropping a one-node region, recomputes less
    # and keeps less (its inputs are no longer region inputs), at the same recomputation time.
    startable = [problem.can_start_region(i) for i in range(n)]
    useful_start = []
    for i, node in enumerate(nodes):
        memoryless = not (
            node.output_bytes or node.grad_bytes or node.saved_bytes or node.transient_bytes
            or node.param_grad_bytes or node.backward_transient_bytes or node.saves or node.shared_grads
        )
        later = i == n - 1 or startable[i + 1]
        # With allowed regions, the shorter region may not be one of them: no pruning.
        useful_start.append(startable[i] and not (memoryless and later and problem.allowed_regions is None))

    return Structure(
        n=n,
        output_bytes=tuple(node.output_bytes for node in nodes),
        saved_bytes=tuple(node.saved_bytes for node in nodes),
        compute_ms=tuple(node.compute_ms for node in nodes),
        consumers=tuple(map(tuple, consumers)),
        savers=tuple(map(tuple, savers)),
        uses_before=tuple(uses_before),
        holds_before=tuple(holds_before),
        saves_of=tuple(saves_of),
        saves_for_backward=tuple(node.saves_for_backward for node in nodes),
        stop_saving_ms=tuple(node.compute_ms - node.stop_cost_ms for node in nodes),
        forward_until=tuple(forward_until),
        referenced_until=tuple(referenced_until),
        keep_until=tuple(keep_until),
        last_ref=tuple(last_ref),
        gradient_backward=tuple(gradient_backward),
        gradient_recompute=tuple(gradient_recompute),
        forward_fixed=tuple(forward_fixed),
        graduates=tuple(map(tuple, graduates)),
        startable=tuple(startable),
        useful_start=tuple(useful_start),
    )


def scan_regions(structure: Structure, problem: Problem, start: int) -> Iterator[tuple[int, int, int]]:
    """For regions [start, e + 1), e = start, start + 1, ..., yield `(e, backward, recompute)`:

    * `backward`: the region's own bytes at the backward of e once the region has recomputed
      (recomputed saved tensors of [start, e] and the recomputed outputs that some node in
      [j, e] saves);
    * `recompute`: the largest of the region's own bytes over its recomputation steps, for the
      region that ends at e. Recomputation runs up to the region's last node s that saves a
      tensor (`Problem.recomputed`); each recomputed output lives from its recomputation to
      its last consumer's recomputation in the region, or to its saver's backward, and those
      that a node after s reads or holds stay alive until the recomputation stops at s (the
      model's code still references them then); saved tensors and temporaries as in the
      simulator. 0 while the region holds no saving node.

    Both exclude what earlier nodes hold and the gradients. Amortised cost per step: the node's
    edges plus how far its inputs' lifetimes stretch.

    Example:
        >>> [e for e, _, _ in scan_regions(Structure.of(problem), problem, 2)][:2]
        [2, 3]
    """
    out = structure.output_bytes
    saved = structure.saved_bytes
    transient = [node.transient_bytes for node in problem.nodes]
    values: list[int] = []  # recompute-step bytes of node start + k, without later-added parts
    covered_until: dict[int, int] = {}  # j -> last recompute step (node index) its copy covers
    permanent: set[int] = set()  # saved inside the region: alive past every recompute step
    permanent_bytes = 0
    saved_running = 0
    best = 0

    def recompute(e: int) -> int:
        """Add node e's recomputation step (every node before it added already); return the
        largest value of the steps before it."""
        nonlocal saved_running, permanent_bytes, best
        saved_running += saved[e]
        step_bytes = saved_running + transient[e]
        extra = 0
        # Outputs read (or held) by e stay alive up to e's recomputation.
        for j in (*structure.uses_before[e], *structure.holds_before[e]):
            if j < start or j in permanent:
                continue
            first = covered_until[j] + 1
            for k in range(first, e):
                values[k - start] += out[j]
                if values[k - start] > best:
                    best = values[k - start]
            covered_until[j] = e
            extra += out[j]
        # Outputs saved by e stay alive until e's backward: past every later recompute step.
        for j in structure.saves_of[e]:
            if j < start or j in permanent:
                continue
            if j < e:
                if covered_until[j] < e:  # not read by e: stretch it over the gap as well
                    for k in range(covered_until[j] + 1, e):
                        values[k - start] += out[j]
                        if values[k - start] > best:
                            best = values[k - start]
                    covered_until[j] = e
                    extra += out[j]
                extra -= out[j]  # counted through permanent_bytes from now on
            permanent.add(j)
            permanent_bytes += out[j]
        own = 0 if e in permanent else out[e]
        covered_until[e] = e
        value = step_bytes + permanent_bytes + own + extra
        earlier = best
        values.append(value)
        if value > best:
            best = value
        return earlier

    saver = structure.saves_for_backward
    referenced_until = structure.referenced_until
    last_saver = -1
    pending: list[int] = []  # nodes after the last saver: recomputed only if a later one comes
    # Recomputed outputs that something past the last saver reads, holds or is returned: the
    # model's code still references them when recomputation stops there.
    referenced_later: list[int] = []
    stop_best = 0  # the region's recomputation peak, stopping at the last saver
    random = False  # the region draws random numbers: checkpoint forks the RNG state to recompute
    for e in range(start, structure.n):
        random = random or problem.nodes[e].random
        fork = problem.rng_state_bytes if random else 0
        if saver[e]:
            referenced_later += [k for k in (*pending, e) if referenced_until[k] > e]
            for k in pending:
                recompute(k)
            earlier = recompute(e)
            pending.clear()
            stop_values = list(values)
            # Stopping at e, maybe before e makes its output (made if a later saver comes).
            if problem.nodes[e].stops_before_output:
                stop_values[-1] -= out[e]
            referenced_later = [j for j in referenced_later if referenced_until[j] > e and j not in permanent]
            lowest = e  # the first step these change
            for j in referenced_later:
                for k in range(covered_until[j] + 1, e + 1):
                    stop_values[k - start] += out[j]
                lowest = min(lowest, covered_until[j] + 1)
            stop_best = max(earlier, max(stop_values[lowest - start:]))
            last_saver = e
            yield e, saved_running + permanent_bytes, stop_best + fork
            continue
        pending.append(e)
        if last_saver < 0:
            yield e, saved_running + permanent_bytes, 0
            continue
        yield e, saved_running + permanent_bytes, stop_best + fork


class RegionScan:
    """Region peaks for regions starting at one node, computed lazily as they are needed.

    A region recomputes up to its last node that saves a tensor, just before that node's
    backward (`Problem.recomputed`). The backward of a later node in the region runs before
    the recomputation and holds none of the region's own tensors; should a longer region
    reach another saver, it runs after one and holds them."""

    def __init__(self, structure: Structure, problem: Problem, start: int, min_recompute_gradients: list[int]):
        self.structure = structure
        self.start = start
        self._iterator = scan_regions(structure, problem, start)
        self._floor = min_recompute_gradients
        self.peak: list[int] = []  # index b - start - 1: the region [start, b)'s own peak
        self.lower: list[int] = []  # a lower bound on peak for [start, b') with b' >= b
        self.recomputed_stop: list[int] = []  # the same index: where [start, b)'s recomputation stops
        self.stop_saving: list[float] = []  # the same index: what stopping there saves (NodeCost.stop_ms)
        self.last_saver = -1  # the region's last node that saves, so far (-1: none)
        self._settled = -1  # backward steps up to the last saver, with the region's own tensors
        self._pending: list[int] = []  # backward steps after it, had a later saver joined
        self._pending_max = -1  # the same steps as they are: gradients only
        self._recompute = 0  # the recomputation's own peak for the region so far (scan_regions)

    def ensure(self, stop: int) -> bool:
        """Compute up to the region [start, stop); False when stop is past the graph."""
        gradient_backward = self.structure.gradient_backward
        gradient_recompute = self.structure.gradient_recompute
        while self.start + len(self.peak) < stop:
            try:
                e, backward, recompute = next(self._iterator)
            except StopIteration:
                return False
            self._recompute = recompute  # stops at the last saver (see scan_regions)
            if self.structure.saves_for_backward[e]:
                self._settled = max(self._settled, gradient_backward[e] + backward, *self._pending)
                self._pending.clear()
                self._pending_max = -1
                self.last_saver = e
            else:
                self._pending.append(gradient_backward[e] + backward)
                self._pending_max = max(self._pending_max, gradient_backward[e])
            held = max(self._settled, self._pending_max)
            self.recomputed_stop.append(self.last_saver + 1 if self.last_saver >= 0 else self.start)
            self.stop_saving.append(self.structure.stop_saving_ms[self.last_saver] if self.last_saver >= 0 else 0.0)
            if self.last_saver < 0:  # nothing to recompute (yet)
                self.peak.append(held)
                self.lower.append(held)
                continue
            at_saver = gradient_recompute[self.last_saver + 1]
            self.peak.append(max(held, at_saver + self._recompute))
            # A longer region either keeps this recomputation or recomputes more, later.
            self.lower.append(max(held, min(at_saver, self._floor[e + 1]) + self._recompute))
        return True
