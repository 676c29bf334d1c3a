"""The bytes a region holds itself while it recomputes and while its backward runs: what the
exact solvers add to what the nodes before the region keep (see `solvers.structure`).

`scan_regions` walks regions starting at one node, one more node at a time; `RegionScan` reads
it lazily for the dp solver. A region may keep nodes (`kept`: a selective-checkpoint policy),
whose outputs and saved tensors are alive from before its recomputation starts.

Example:
    >>> scan = RegionScan(Structure.of(problem), problem, 2, floor)
    >>> scan.ensure(5) and scan.peak[5 - 2 - 1] >= 0
    True
"""
from __future__ import annotations

from typing import Collection, Iterator

from solvers.problem import Problem
from solvers.structure import Structure


def scan_regions(structure: Structure, problem: Problem, start: int, kept: Collection[int] = (),
                 replayed: bool = False) -> Iterator[tuple[int, int, int]]:
    """For regions [start, e + 1), e = start, start + 1, ..., yield `(e, backward, recompute)`:

    * `backward`: the region's own bytes at the backward of e once the region has recomputed
      (recomputed saved tensors of [start, e] and the recomputed outputs that some node in
      [j, e] saves), less what e's unpacks free before its late gradients are made (e's saved
      tensors and the outputs no node of [start, e) saves: `NodeCost.late_grad_bytes`);
    * `recompute`: the largest of the region's own bytes over its recomputation steps, for the
      region that ends at e. Recomputation runs up to the region's last node s that saves a
      tensor (`Problem.recomputed`); each recomputed output lives from its recomputation to
      its last consumer's recomputation in the region, or to its saver's backward, and those
      that a node after s reads or holds stay alive until the recomputation stops at s (the
      model's code still references them then); saved tensors and temporaries as in the
      simulator. 0 while the region holds no saving node.

    A kept node (`kept`) allocates nothing when recomputation reaches it: its output and saved
    tensors are counted from the first recomputation step (they are alive since forward).

    Both exclude what earlier nodes hold and the gradients. Amortised cost per step: the node's
    edges plus how far its inputs' lifetimes stretch.

    Example:
        >>> [e for e, _, _ in scan_regions(Structure.of(problem), problem, 2)][:2]
        [2, 3]
    """
    out = structure.output_bytes
    saved = structure.saved_bytes
    transient = [node.transient_bytes for node in problem.nodes]
    kept = frozenset(kept)
    values: list[int] = []  # recompute-step bytes of node start + k, without later-added parts
    covered_until: dict[int, int] = {}  # j -> last recompute step (node index) its copy covers
    permanent: set[int] = set()  # saved inside the region: alive past every recompute step
    permanent_bytes = 0
    saved_running = 0
    best = 0
    late = [node.late_grad_bytes for node in problem.nodes]
    unpacked = 0  # what the backward of the node last added unpacks last (saved_running's and permanent's)

    def recompute(e: int) -> int:
        """Add node e's recomputation step (every node before it added already); return the
        largest value of the steps before it."""
        nonlocal saved_running, permanent_bytes, best, unpacked
        saved_running += saved[e]
        unpacked = saved[e]
        step_bytes = saved_running + (0 if e in kept else transient[e])
        if e in kept:  # cached since forward: alive at every earlier recomputation step too
            for k in range(start, e):
                values[k - start] += out[e] + saved[e]
                if values[k - start] > best:
                    best = values[k - start]
        extra = 0
        # Outputs read (or held) by e stay alive up to e's recomputation.
        for j in reads_before(e):
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
            unpacked += out[j]
        own = 0 if e in permanent else out[e]
        covered_until[e] = e
        value = step_bytes + permanent_bytes + own + extra
        earlier = best
        values.append(value)
        if value > best:
            best = value
        return earlier

    def reads_before(e: int) -> tuple[int, ...]:
        if replayed:  # a run's replay holds an output for the calls that read it alone
            return structure.reads_before[e]
        return (*structure.uses_before[e], *structure.holds_before[e])

    saver = structure.saves_for_backward
    # (a run's replay references nothing past its stop: see `solvers.simulate.plan_buffers`)
    referenced_until = [0] * structure.n if replayed else structure.referenced_until
    last_saver = -1
    pending: list[int] = []  # nodes after the last saver: recomputed only if a later one comes
    # Recomputed outputs that something past the last saver reads, holds or is returned: the
    # model's code still references them when recomputation stops there.
    referenced_later: list[int] = []
    stop_best = 0  # the region's recomputation peak, stopping at the last saver
    random = False  # the region draws random numbers: checkpoint forks the RNG state to recompute
    buffers = 0  # bytes of the buffers its nodes write: copied while it recomputes
    for e in range(start, structure.n):
        random = random or problem.nodes[e].random
        buffers += problem.nodes[e].buffer_bytes
        fork = (problem.rng_state_bytes if random else 0) + buffers  # (`Problem.recompute_copy_bytes`)
        if saver[e]:
            referenced_later += [k for k in (*pending, e) if referenced_until[k] > e]
            for k in pending:
                recompute(k)
            earlier = recompute(e)
            pending.clear()
            referenced_later = [j for j in referenced_later if referenced_until[j] > e and j not in permanent]
            # The steps from `lowest` on as they are when recomputation stops at e (the earlier
            # ones are as in `values`, whose largest is `earlier`): only those are copied.
            lowest = min([e, *(covered_until[j] + 1 for j in referenced_later)])
            stop_values = values[lowest - start:]
            # Stopping at e, maybe before e makes its output (made if a later saver comes).
            if problem.nodes[e].stops_before_output and e not in kept:
                stop_values[-1] -= problem.nodes[e].stop_saving_bytes
            for j in referenced_later:
                for k in range(covered_until[j] + 1, e + 1):
                    stop_values[k - lowest] += out[j]
            stop_best = max(earlier, max(stop_values))
            last_saver = e
            yield e, saved_running + permanent_bytes - min(late[e], unpacked), stop_best + fork
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
    the recomputation and holds none of the region's own tensors but what it keeps (`kept`,
    all at or before its last saver, else the region is not valid); should a longer region
    reach another saver, it runs after one and holds them. `replayed`: for regions that are
    runs (`Problem.run_span_of`), whose replay holds no more than its calls read."""

    def __init__(self, structure: Structure, problem: Problem, start: int, min_recompute_gradients: list[int],
                 kept: Collection[int] = (), replayed: bool = False):
        self.structure = structure
        self.start = start
        self._iterator = scan_regions(structure, problem, start, kept, replayed)
        self._kept_bytes = sum(structure.output_bytes[j] + structure.saved_bytes[j] for j in kept)
        self._floor = min_recompute_gradients
        self.peak: list[int] = []  # index b - start - 1: the region [start, b)'s own peak
        self.lower: list[int] = []  # a lower bound on peak for [start, b') with b' >= b
        self.recomputed_stop: list[int] = []  # the same index: where [start, b)'s recomputation stops
        self.stop_saving: list[float] = []  # the same index: what stopping there saves (NodeCost.stop_ms)
        self.last_saver = -1  # the region's last node that saves, so far (-1: none)
        self._settled = -1  # backward steps up to the last saver, with the region's own tensors
        # Backward steps after it, had a later saver joined: the largest with the region's own
        # tensors (-1: none) and with gradients only.
        self._pending_peak = -1
        self._pending_max = -1
        self._recompute = 0  # the recomputation's own peak for the region so far (scan_regions)

    def ensure(self, stop: int) -> bool:
        """Compute up to the region [start, stop); False when stop is past the graph."""
        structure = self.structure
        gradient_backward = structure.gradient_backward
        gradient_recompute = structure.gradient_recompute
        saves_for_backward = structure.saves_for_backward
        stop_saving_ms = structure.stop_saving_ms
        floor = self._floor
        peak, lower = self.peak, self.lower
        start = self.start
        # (The loop's state in locals, stored back below: this runs once per region the dp tries.)
        settled, pending_peak, pending_max = self._settled, self._pending_peak, self._pending_max
        last_saver, recompute = self.last_saver, self._recompute
        complete = True
        while start + len(peak) < stop:
            try:
                e, backward, recompute = next(self._iterator)
            except StopIteration:
                complete = False
                break
            # (recompute stops at the last saver: see scan_regions)
            if saves_for_backward[e]:
                settled = max(settled, gradient_backward[e] + backward, pending_peak)
                pending_peak = pending_max = -1
                last_saver = e
            else:
                pending_peak = max(pending_peak, gradient_backward[e] + backward)
                pending_max = max(pending_max, gradient_backward[e])
            held = max(settled, pending_max)
            # (Before recomputation, the kept tensors are alive: in the peak, not in the bound.)
            held_peak = max(settled, pending_max + self._kept_bytes if pending_peak >= 0 else -1)
            self.recomputed_stop.append(last_saver + 1 if last_saver >= 0 else start)
            self.stop_saving.append(stop_saving_ms[last_saver] if last_saver >= 0 else 0.0)
            if last_saver < 0:  # nothing to recompute (yet)
                peak.append(held)
                lower.append(held)
                continue
            at_saver = gradient_recompute[last_saver + 1]
            peak.append(max(held_peak, at_saver + recompute))
            # A longer region either keeps this recomputation or recomputes more, later.
            lower.append(max(held, min(at_saver, floor[e + 1]) + recompute))
        self._settled, self._pending_peak, self._pending_max = settled, pending_peak, pending_max
        self.last_saver, self._recompute = last_saver, recompute
        return complete


__all__ = ["RegionScan", "scan_regions"]
