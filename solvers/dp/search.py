"""The search behind `solvers.dp.solve`: dynamic programming over region boundaries in the fixed
topological order.

The DP walks the boundaries t = 0..n between nodes. Moving from t either leaves node t outside
every region (to t + 1) or runs a region [t, b) (to b). The simulator's peak splits into checks
that each transition can make on its own (see `solvers.structure` for the derivation):

* the forward step of node t, and the backward of a node outside any region, only see what
  nodes before them keep, plus plan-independent bytes;
* a region's recomputation and backward see what the nodes before the region keep, the
  region's inputs, the gradients in flight and the region's own recomputed tensors.
* the loss's step, after the last node (where the loss has scratch,
  `Problem.loss_scratch_bytes`), sees what the whole plan keeps for backward and the outputs
  the graph returns: it is checked with the last node's transitions.

So the state at boundary t is the memory that the prefix keeps alive into backward. It is a sum
of per-buffer contributions, except that an output can be kept by several later nodes (a
saver outside a region, or a later region that reads it) and must be counted once. The state
therefore carries, as a bit set, which still-referenced outputs ("the frontier": outputs of
nodes before t that a node at or after t reads or saves) are already kept, plus the bytes of
everything else kept (an int). For each frontier set the DP keeps the Pareto front of
(kept bytes, recompute ms). On chains and transformer-like graphs the frontier is a handful of
outputs and the DP is exact and fast. On wide DAGs the number of frontier sets can explode:
past `max_states` sets at a boundary, the DP keeps the cheapest ones and merges the rest into
their common subset, counting the dropped members as always kept. That over-estimates memory
(plans stay within budget, and the simulator re-checks them) and the result is reported as
FEASIBLE instead of OPTIMAL. `DpSettings.for_problem` picks exact settings for narrow graphs,
bounded ones (fewer sets, thinned fronts, boundaries on a grid) for wide DAGs, where `ilp` is
the exact solver, and for chains of over 1000 nodes (regions of at most 128 nodes).

A region [t, b) may also keep nodes (a selective-checkpoint policy;
`solvers.dp.settings.region_keeps`). A kept node's output enters the frontier set like a region
input (it is alive from its forward on), its saved tensors join the bytes the region keeps, the
region's own scan counts both from its first recomputation step (`solvers.region_scan`), and
its time leaves the region's cost (the selective policy's own cost joins it).

A state whose held bytes leave room for what the rest of the graph needs with no further region
(`DpTables.outside_need`) is a complete plan already: its cost bounds the search from there on,
so that costlier partial plans are dropped long before the last boundary. Held bytes only grow
along a plan, so while the search is exact it also drops states holding more than the budget
less what some later step needs whatever the plan (`DpTables.fixed_need`).

Regions never start at memoryless nodes (views, shape queries) when the next node could start
them instead. A run inside a submodule call (`Problem.run_spans`) also pays its recording
(`Problem.run_ms`), outside the bounds that stop the scan of longer regions; its inputs are only
what its nodes read (its tape keeps no argument of a call it is only passed), and its replay
holds a recomputed output only until its last reader (`RegionScan`'s `replayed`).

What the search reads that depends on the problem alone (frontier sets, region scans) is
`solvers.dp.tables`, which searches of the same problem may share.
"""
from __future__ import annotations

import bisect
import logging
import math

from solvers.dp.pareto import Entry, Front, Stair, merge_fronts, weaken_states
from solvers.dp.settings import DpSettings, region_boundaries
from solvers.dp.tables import DpTables
from solvers.problem import Problem, allowed_stops

SCAN_AHEAD = 16  # regions a scan computes past the one asked for

logger = logging.getLogger(__name__)


class DpSearch:
    """The DP over boundaries for one problem; `run` solves it for one budget."""

    def __init__(self, problem: Problem, max_states: int, max_front: int | None = None, stride: int = 1,
                 max_region_nodes: int | None = None, boundary_fraction: float = 0.0, tables: DpTables | None = None):
        self.problem = problem
        self.stride = stride
        self.max_region_nodes = max_region_nodes
        # Allowed regions (submodule calls) bound the search themselves; any boundary may do.
        self.boundary = (region_boundaries(problem, stride, boundary_fraction) if problem.allowed_regions is None
                         else [True] * (len(problem) + 1))
        self.max_states = max_states
        self.max_front = max_front
        self.tables = DpTables(problem) if tables is None else tables
        self.structure = self.tables.structure

    def _regions_from(self, t: int, keep: tuple[int, ...], last: int, fronts: dict[int, Front],
                      pending: list[dict[int, list[Stair]] | None], live_budget: int, bound: float, slack: float,
                      feasibility_only: bool, only_last: bool = False) -> float:
        """Add the transitions of the regions [t, b), b <= last (`only_last`: b = last), that
        keep `keep` to `pending`; return the cost bound, lowered where a region reaches the end
        of the graph."""
        if not self.problem.can_start_region(t):
            return bound
        structure = self.structure
        n = structure.n
        out = structure.output_bytes
        saved = structure.saved_bytes
        compute_ms = structure.compute_ms
        tables = self.tables
        frontier = tables.frontier
        cumulative_ms = tables.cumulative_ms
        mask_bytes = tables.mask_bytes_table
        overhead_ms = self.problem.region_overhead_ms
        if keep:  # the selective policy's fixed costs (its per-call cost grows with b, below)
            overhead_ms += self.problem.keep_region_ms + self.problem.kept_node_ms * len(keep)
        keep_call_ms = self.problem.keep_call_ms if keep else 0.0
        calls = tables.cumulative_calls
        pack_ms = tables.cumulative_pack_ms  # checkpoint's cost per saved tensor, summed
        rng_state_bytes = self.problem.rng_state_bytes
        random = tables.random
        kept_nodes = frozenset(keep)
        last_kept = keep[-1] if keep else -1
        stops_before = tables.stops_before
        uses_before, reads_before = structure.uses_before, structure.reads_before
        forward_fixed, graduates, boundary = structure.forward_fixed, structure.graduates, self.boundary
        # Where regions must be allowed ones, the stops allowed from t (`Problem.allows_region`;
        # the caller's `last` already respects `Problem.last_region_stop`).
        allowed = None if self.problem.allowed_regions is None else allowed_stops(self.problem).get(t, frozenset())
        scan = tables.scan(t, keep, False)
        # Regions that are runs replay their calls and hold less (`RegionScan`); no less than
        # that bounds every region from t.
        replayed = tables.scan(t, keep, True) if self.problem.run_spans and not keep else None
        for key, front in fronts.items():
            inputs = key
            inputs_bytes = mask_bytes[key]
            released = 0  # kept bytes of inputs (and kept nodes) whose last reference has passed
            kept_out = kept_saved = 0  # what the kept nodes so far hold from their forward on
            kept_ms = 0.0  # what recomputation skips on them
            forward_max = 0
            rng = 0  # the RNG state the region keeps once it holds a random node
            # The same for a run, whose tape keeps only what its calls read (`reads_before`);
            # no more than a call region's, so they bound every region from t.
            run_inputs, run_bytes, run_released, run_forward_max = inputs, inputs_bytes, 0, 0
            for k in range(t, last):
                if random[k]:
                    rng = rng_state_bytes
                for j in uses_before[k]:  # (ascending: those from t on are the region's own)
                    if j >= t:
                        break
                    if not inputs >> j & 1:
                        inputs |= 1 << j
                        inputs_bytes += out[j]
                forward = forward_fixed[k] + released + kept_saved
                if forward > forward_max:
                    forward_max = forward
                if replayed is not None:
                    for j in reads_before[k]:
                        if j >= t:
                            break
                        if not run_inputs >> j & 1:
                            run_inputs |= 1 << j
                            run_bytes += out[j]
                    run_forward_max = max(run_forward_max, forward_fixed[k] + run_released)
                if k in kept_nodes:  # its output is kept like an input: one frontier bit
                    inputs |= 1 << k
                    inputs_bytes += out[k]
                    kept_out += out[k]
                    kept_saved += saved[k]
                    kept_ms += compute_ms[k]
                if k == n - 1 and structure.loss_fixed:  # the loss's step (before k's graduates go)
                    forward_max = max(forward_max, tables.loss_need(inputs, True) + released + kept_saved)
                    if replayed is not None:
                        run_forward_max = max(run_forward_max, tables.loss_need(run_inputs, True) + run_released)
                for g in graduates[k]:
                    if inputs >> g & 1:
                        released += out[g]
                    if replayed is not None and run_inputs >> g & 1:
                        run_released += out[g]
                b = k + 1
                # Only stops a region may have are checked: the bounds below hold for every longer
                # region, so checking them at the next such stop prunes the same transitions.
                if not boundary[b] or (only_last and b != last) or (allowed is not None and b not in allowed):
                    continue
                index = b - t - 1
                if index >= len(scan.peak):  # (a few regions at a time: each call has set-up costs)
                    scan.ensure(min(b + SCAN_AHEAD, last))
                    if replayed is not None:
                        replayed.ensure(min(b + SCAN_AHEAD, last))
                stop = scan.recomputed_stop[index]
                region_ms = (cumulative_ms[stop] - cumulative_ms[t] - kept_ms + overhead_ms + pack_ms[b] - pack_ms[t]
                             - (0.0 if stop - 1 in kept_nodes else scan.stop_saving[index]))
                if keep_call_ms:
                    region_ms += keep_call_ms * (calls[b] + calls[stop] - 2 * calls[t])
                # Entries cheap enough for this region (and so for any longer one) ...
                lo = bisect.bisect_left(front.negative_costs, region_ms - bound)
                # ... and light enough for any region [t, b') with b' >= b.
                if replayed is None:
                    floor = max(forward_max, inputs_bytes - kept_out + scan.lower[index]) + rng
                else:
                    floor = max(run_forward_max, run_bytes + replayed.lower[index]) + rng
                if lo >= len(front.helds) or front.helds[lo] > live_budget - floor:
                    break
                # (The kept nodes must be keep candidates: `Problem.keep_candidates`, inline.)
                if stop == t or last_kept >= stop or (last_kept == stop - 1 and stops_before[last_kept]):
                    continue  # (a region that saves nothing recomputes and frees nothing)
                if replayed is not None and tables.is_run(t, b):
                    held, held_bytes, held_released = run_inputs, run_bytes, run_released
                    limit = live_budget - max(run_forward_max, run_bytes + replayed.peak[index]) - rng
                else:
                    held, held_bytes, held_released = inputs, inputs_bytes, released
                    limit = live_budget - max(forward_max, inputs_bytes - kept_out + scan.peak[index]) - rng
                hi = bisect.bisect_right(front.helds, limit)
                run_ms = tables.run_ms(t, b) if self.problem.run_spans else 0.0
                if run_ms:  # (not in the bounds above: the longer submodule call pays none)
                    lo = max(lo, bisect.bisect_left(front.negative_costs, region_ms + run_ms - bound))
                if lo >= hi:
                    continue
                new_key = held & frontier[b]
                mask_bytes[new_key] = held_bytes - held_released
                # The RNG state and the kept saved tensors stay until the region's backward.
                pending[b].setdefault(new_key, []).append(
                    (front, lo, hi, held_released + rng + kept_saved, region_ms + run_ms, (t, b, keep)))
                if b == n and not feasibility_only:
                    bound = min(bound, front.cost(hi - 1) + region_ms + run_ms + slack)
        return bound

    def run(
        self, live_budget: int, cost_bound: float = float("inf"), feasibility_only: bool = False
    ) -> tuple[Entry | None, bool]:
        """Cheapest plan whose live bytes (static excluded) stay <= live_budget; the flag says
        whether the search was exact (no frontier sets merged)."""
        structure = self.structure
        n = structure.n
        out = structure.output_bytes
        saved = structure.saved_bytes
        tables = self.tables
        frontier = tables.frontier
        bisect_right = bisect.bisect_right
        slack = 1e-9 * max(1.0, abs(cost_bound)) if cost_bound != float("inf") else 0.0
        bound = cost_bound + slack
        exact = True
        bucket_bytes = 0 if self.max_front is None else max(1, live_budget // self.max_front)
        pending: list[dict[int, list[Stair]] | None] = [{} for _ in range(n + 1)]
        pending[0][0] = [(Front.start(), 0, 1, 0, 0.0, None)]
        # The cheapest state that needed no further region (`outside_need`): its plan is complete.
        # A bounded search (merged sets, thinned fronts) may lose its path after it lowered the
        # bound, so it stands as a plan of its own.
        completed: tuple[float, Front, int] | None = None  # (its cost, its front, its point there)
        tables.mask_bytes_table[0] = 0
        for t in range(n):
            states = pending[t]
            pending[t] = None
            if not states:
                continue
            if len(states) > self.max_states:
                states = weaken_states(states, self.max_states, tables.mask_bytes)
                exact = False
            # States with no way to the end are dropped only while the search is exact: in a
            # bounded one, that changes which sets it merges, and its plans on wide DAGs come
            # out dearer.
            held_limit = live_budget - tables.fixed_need[t] if exact and not bucket_bytes else math.inf
            fronts = {}
            for key in sorted(states):
                front = merge_fronts(states[key], bound, feasibility_only, bucket_bytes, held_limit)
                if len(front):
                    fronts[key] = front
            if not feasibility_only:  # a state that fits without further regions is a plan already
                for key, front in fronts.items():
                    fitting = bisect_right(front.helds, live_budget - tables.outside_need(t, key))
                    if fitting and (completed is None or front.cost(fitting - 1) < completed[0]):
                        completed = (front.cost(fitting - 1), front, fitting - 1)
                        # (with room for its own cost: later merges keep only costs below the bound)
                        bound = min(bound, completed[0] + max(slack, 1e-9 * max(1.0, abs(completed[0]))))
            next_states = pending[t + 1]
            # Node t outside every region.
            forward_need = structure.forward_fixed[t]
            loss_after = t == n - 1 and structure.loss_fixed
            backward_fixed = saved[t] + structure.gradient_backward[t]
            mask_bytes = tables.mask_bytes_table
            for key, front in fronts.items():
                kept = key
                kept_bytes = mask_bytes[key]
                for j in structure.saves_of[t]:
                    if not kept >> j & 1:
                        kept |= 1 << j
                        kept_bytes += out[j]
                limit = live_budget - max(forward_need, kept_bytes + backward_fixed)
                if loss_after:  # (the loss's step: what is not kept is gone)
                    limit = min(limit, live_budget - tables.loss_need(kept, False))
                hi = bisect_right(front.helds, limit)
                if hi == 0:
                    continue
                resolved = 0
                for g in structure.graduates[t]:
                    if kept >> g & 1:
                        resolved += out[g]
                new_key = kept & frontier[t + 1]
                mask_bytes[new_key] = kept_bytes - resolved
                next_states.setdefault(new_key, []).append((front, 0, hi, resolved + saved[t], 0.0, None))
                if t + 1 == n and not feasibility_only:
                    bound = min(bound, front.cost(hi - 1) + slack)
            # A region [t, b), keeping what it may.
            if not structure.useful_start[t] or not self.boundary[t]:
                continue
            last = self.problem.last_region_stop(t)
            if self.max_region_nodes is not None:
                last = min(last, t + self.max_region_nodes)
            for keep, stop, only_last in tables.region_keeps(t, last):
                bound = self._regions_from(t, keep, stop, fronts, pending, live_budget, bound, slack,
                                           feasibility_only, only_last)
        # (a point becomes an Entry, its whole path made, only once it has won)
        best: tuple[tuple[float, int, int], Stair] | None = None
        finals = pending[n] or {}
        for key in sorted(finals):
            for stair in finals[key]:
                front, lo, hi, held, cost, _ = stair
                if lo < hi:
                    rank = (front.cost(hi - 1) + cost, front.helds[hi - 1] + held, key)
                    if best is None or rank < best[0]:
                        best = (rank, stair)
        if completed is not None and (best is None or completed[0] < best[0][0]):
            return completed[1].entry(completed[2]), exact
        if best is None:
            return None, exact
        (cost, held, _), (front, _, hi, _, _, region) = best
        return Entry(held, cost, front.entry(hi - 1), region), exact


def dp_search(problem: Problem, settings: DpSettings, tables: DpTables | None = None) -> DpSearch:
    """The search for `problem` with `settings`, reading `tables` (shared with another search of
    the same problem) or its own.

    Example:
        >>> found, exact = dp_search(problem, dp_settings(problem, {})).run(budget_bytes - problem.static_bytes)
    """
    return DpSearch(problem, settings.max_states, settings.max_front, settings.stride, settings.max_region_nodes,
                    settings.boundary_fraction, tables)


__all__ = ["DpSearch", "SCAN_AHEAD", "dp_search"]
