"""Plan-independent quantities derived from a Problem, shared by the exact solvers.

The simulator (`solvers.simulate`) walks a step timeline. For the exact solvers it helps to
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
  [a, i] and the recomputed outputs that a node in [j, i] saves, less what i's late gradients
  reuse of those it unpacks last (`solvers.region_scan.scan_regions`);
* the recomputation of a region [a, b) runs between the backward of s + 1 and that of s, so it
  holds what the backward of s holds from earlier nodes, the gradients in flight there, and
  the region's own recomputed tensors (`solvers.region_scan.scan_regions`).

`solvers.region_scan` computes a region's own bytes from these facts.

Example:
    >>> structure = Structure.of(problem)
    >>> structure.gradient_backward[0] >= 0
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from solvers.problem import Problem
from solvers.simulate import gradient_spans


@dataclass(frozen=True)
class Structure:
    """Per-node facts about a Problem that do not depend on the plan.

    Attributes (all tuples indexed by node unless said otherwise):
        consumers: later nodes that read j in forward.
        savers: nodes (j itself included) that save j for their backward.
        uses_before: distinct owners < k that node k reads or is passed as a module call's
            arguments (k's region inputs if k starts it).
        reads_before: those of uses_before that node k reads: a run's inputs (a run's replay
            keeps what its calls read, not what the model's code passes to a submodule call).
        readers: later nodes that read j in forward (consumers that are not passed j alone).
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
        gradient_backward: gradients in flight plus parameter gradients at the backward of i
            (and what autograd holds past the hooks, `NodeCost.unhooked_saved_bytes`, of 0..i).
        gradient_recompute: (length n + 1) gradients in flight while a region ending at b
            (exclusive) recomputes, i.e. between the backward of b and that of b - 1 (and the
            unhooked bytes of 0..b - 1).
        forward_fixed: bytes at forward step t that are alive whatever the plan (outputs with
            `last_ref >= t`, node t's saved tensors and temporaries, the unhooked bytes and
            `NodeCost.forward_held_bytes` of 0..t).
        unhooked_through: `NodeCost.unhooked_saved_bytes` of nodes 0..t, per t.
        forward_held_through: `NodeCost.forward_held_bytes` of nodes 0..t, per t (held in forward only).
        loss_fixed: bytes alive whatever the plan while the loss runs after the last forward step
            (`Problem.loss_scratch_bytes`): `forward_fixed[n - 1]` less the last node's temporaries,
            plus the loss's scratch. Of those, the last node's saved tensors are dropped where it
            lies in a region, and the outputs in `loss_graduates` are freed unless the plan keeps
            them for backward (0 where the loss has no scratch: the last forward step covers it).
        loss_graduates: outputs the last node reads last that are not returned (`graduates[n - 1]`).
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
    reads_before: tuple[tuple[int, ...], ...]
    readers: tuple[tuple[int, ...], ...]
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
    unhooked_through: tuple[int, ...]
    forward_held_through: tuple[int, ...]
    loss_fixed: int
    loss_graduates: tuple[int, ...]
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
    reads_before: list[tuple[int, ...]] = []
    readers: list[list[int]] = [[] for _ in range(n)]
    holds_before: list[tuple[int, ...]] = []
    held_until = list(range(n))
    saves_of: list[tuple[int, ...]] = []
    for k, node in enumerate(nodes):
        inputs = tuple(sorted({owner for owner in (*node.uses, *node.arguments) if owner < k}))
        uses_before.append(inputs)
        reads_before.append(tuple(sorted({owner for owner in node.uses if owner < k})))
        for owner in reads_before[-1]:
            readers[owner].append(k)
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

    # Gradients: j's lives from the backward of its last consumer (the loss's if none) to its own, a
    # shared parameter's from the backward of its last user to that of its first.
    grad_delta = [0] * (n + 2)  # over backward positions i: alive for first <= i <= last (<= n)
    spans = gradient_spans(problem)
    for first, last, size in spans:
        grad_delta[first] += size
        grad_delta[last + 1] -= size
    # What autograd holds past the hooks (`NodeCost.unhooked_saved_bytes`) of nodes 0..i, which
    # every plan holds at forward step i and at the backward of i (and while a region ending at
    # i + 1 recomputes): these count it as the gradients are counted.
    unhooked = tuple(accumulate(node.unhooked_saved_bytes for node in nodes))
    forward_held = tuple(accumulate(node.forward_held_bytes for node in nodes))  # (to the end of forward)
    gradient_backward = []
    running = 0
    for i, node in enumerate(nodes):
        running += grad_delta[i]
        gradient_backward.append(running + node.param_grad_bytes + node.backward_transient_bytes + unhooked[i])
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
        gradient_recompute.append(running + (unhooked[b - 1] if b else 0))

    alive_delta = [0] * (n + 1)
    for j, node in enumerate(nodes):
        alive_delta[j] += node.output_bytes
        alive_delta[last_ref[j] + 1] -= node.output_bytes
    forward_fixed = []
    running = 0
    for t, node in enumerate(nodes):
        running += alive_delta[t]
        forward_fixed.append(running + node.saved_bytes + node.transient_bytes + unhooked[t] + forward_held[t])
    loss_fixed = (forward_fixed[-1] - nodes[-1].transient_bytes + problem.loss_scratch_bytes
                  if n and problem.loss_scratch_bytes else 0)

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
        reads_before=tuple(reads_before),
        readers=tuple(map(tuple, readers)),
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
        unhooked_through=unhooked,
        forward_held_through=forward_held,
        loss_fixed=loss_fixed,
        loss_graduates=tuple(j for j in graduates[n - 1] if not nodes[j].is_output) if n else (),
        graduates=tuple(map(tuple, graduates)),
        startable=tuple(startable),
        useful_start=tuple(useful_start),
    )


__all__ = ["Structure"]
