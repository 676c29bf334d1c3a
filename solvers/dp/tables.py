"""What the dp search reads that depends on the problem alone, not on the budget or the
search's settings: the frontier sets, running sums of costs, bounds on what later steps need,
and the region scans and other tables the search fills as it goes. Searches given the same
tables share them: `solve_dp` passes its search's to the minimum-peak search after an
infeasible budget (on large DAGs the scans are most of a first search's work). They are not
kept on the problem once solved: they are large (region scans from every start).

Example:
    >>> tables = DpTables(problem)
    >>> tables.mask_bytes(0b11) == problem.nodes[0].output_bytes + problem.nodes[1].output_bytes
    True
"""
from __future__ import annotations

from itertools import accumulate

from solvers.dp.settings import region_keeps
from solvers.problem import Problem
from solvers.region_scan import RegionScan
from solvers.structure import Structure


class DpTables:
    """The budget-free tables of one problem (see the module docstring)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.structure = structure = Structure.of(problem)
        n = structure.n
        self.frontier = [0] * (n + 1)  # bit j set: j < t and last_ref[j] >= t
        mask = 0
        for t in range(n + 1):
            if t > 0:
                mask |= 1 << (t - 1)
                for j in structure.graduates[t - 1]:
                    mask &= ~(1 << j)
            self.frontier[t] = mask
        self.cumulative_ms = [0.0, *accumulate(structure.compute_ms)]
        self.random = [node.random for node in problem.nodes]
        # (without allowed regions; nodes with a keep span are kept only in allowed regions)
        self.keepable = [k for k, node in enumerate(problem.nodes) if node.keepable and node.keep_span is None]
        self.stops_before = [node.stops_before_output for node in problem.nodes]
        self.cumulative_calls = [0, *accumulate(node.aten_calls for node in problem.nodes)]
        self.cumulative_pack_ms = [0.0, *accumulate(problem.saved_tensor_ms * node.saved_tensors
                                                    for node in problem.nodes)]
        floor = list(structure.gradient_recompute)
        for b in range(n - 1, -1, -1):
            floor[b] = min(floor[b], floor[b + 1])
        self.min_recompute_gradients = floor
        # The most that any later step adds to what a state holds, whatever the plan: the forward
        # step of each node k >= t, and its backward (inside a region or not) with the gradients
        # in flight. A state holding more than the budget less this has no way to the end.
        need = [0] * (n + 1)
        if structure.loss_fixed:  # (the loss's step, freeing all it may)
            need[n - 1] = self.loss_need(0, in_region=True)
        for k in range(n - 1, -1, -1):
            need[k] = max(need[k], need[k + 1], structure.forward_fixed[k], structure.gradient_backward[k])
        self.fixed_need = need
        # frontier set -> its outputs' bytes (the search also writes those of the sets it makes)
        self.mask_bytes_table: dict[int, int] = {}
        self._region_keeps: dict[tuple[int, int], list[tuple[tuple[int, ...], int, bool]]] = {}
        self._scans: dict[tuple[int, tuple[int, ...], bool], RegionScan] = {}
        self._is_run: dict[tuple[int, int], bool] = {}
        self._outside_need: dict[tuple[int, int], int] = {}
        self._run_ms: dict[tuple[int, int], float] = {}

    def mask_bytes(self, mask: int) -> int:
        """The bytes of the outputs in frontier set `mask`, cached."""
        cached = self.mask_bytes_table.get(mask)
        if cached is None:
            out = self.structure.output_bytes
            cached = 0
            rest = mask
            while rest:
                low = rest & -rest
                cached += out[low.bit_length() - 1]
                rest ^= low
            self.mask_bytes_table[mask] = cached
        return cached

    def loss_need(self, kept: int, in_region: bool) -> int:
        """What the loss's step holds beyond what the state's held bytes count
        (`Structure.loss_fixed`, `Problem.loss_scratch_bytes`), where the plan keeps frontier set
        `kept` for backward and the last node lies in a region or not: the outputs of
        `Structure.loss_graduates` it does not keep are gone, and in a region the last node's
        saved tensors too."""
        structure = self.structure
        out = structure.output_bytes
        unkept = sum(out[j] for j in structure.loss_graduates if not kept >> j & 1)
        return structure.loss_fixed - unkept - (structure.saved_bytes[-1] if in_region else 0)

    def scan(self, t: int, keep: tuple[int, ...], replayed: bool) -> RegionScan:
        """The region scan from t keeping `keep` (of runs, where `replayed`), cached: it does not
        depend on the budget, so later searches (e.g. for a minimum peak) reuse it."""
        cached = self._scans.get((t, keep, replayed))
        if cached is None:
            cached = self._scans[t, keep, replayed] = RegionScan(
                self.structure, self.problem, t, self.min_recompute_gradients, keep, replayed)
        return cached

    def is_run(self, t: int, b: int) -> bool:
        """Whether region [t, b) is a run (`Problem.run_span_of`), cached."""
        cached = self._is_run.get((t, b))
        if cached is None:
            cached = self._is_run[t, b] = self.problem.run_span_of(range(t, b)) is not None
        return cached

    def run_ms(self, t: int, b: int) -> float:
        """`Problem.run_ms` of region [t, b), cached: each front at t asks again."""
        cached = self._run_ms.get((t, b))
        if cached is None:
            cached = self._run_ms[t, b] = self.problem.run_ms(range(t, b))
        return cached

    def outside_need(self, t: int, key: int) -> int:
        """The live bytes that leaving every node from t on outside any region needs, beyond
        what a state at boundary t with frontier set `key` holds: a plan of that state whose
        held bytes fit `live_budget` less this is complete as it stands, and its cost bounds the
        search's (what the transitions "node k outside every region", k >= t, check one by one).
        Budget-independent, so cached across runs."""
        structure, known, frontier = self.structure, self._outside_need, self.frontier
        out, saved, n = structure.output_bytes, structure.saved_bytes, structure.n
        saves_of, graduates = structure.saves_of, structure.graduates
        forward_fixed, gradient_backward = structure.forward_fixed, structure.gradient_backward
        chain: list[tuple[int, int, int, int]] = []  # (k, key, need at k, held added at k)
        k, mask, mask_bytes = t, key, self.mask_bytes(key)
        while k < n and (k, mask) not in known:
            kept, kept_bytes = mask, mask_bytes
            for j in saves_of[k]:
                if not kept >> j & 1:
                    kept |= 1 << j
                    kept_bytes += out[j]
            resolved = 0
            for g in graduates[k]:
                if kept >> g & 1:
                    resolved += out[g]
            backward = kept_bytes + saved[k] + gradient_backward[k]
            need = backward if backward > forward_fixed[k] else forward_fixed[k]
            if k == n - 1 and structure.loss_fixed:  # (the loss's step)
                need = max(need, self.loss_need(kept, in_region=False))
            chain.append((k, mask, need, resolved + saved[k]))
            k, mask, mask_bytes = k + 1, kept & frontier[k + 1], kept_bytes - resolved
        following = 0 if k == n else known[k, mask]
        for k, mask, need, added in reversed(chain):
            following = known[k, mask] = max(need, following + added)
        return known[t, key] if chain else following

    def region_keeps(self, t: int, last: int) -> list[tuple[tuple[int, ...], int, bool]]:
        """`solvers.dp.settings.region_keeps` from t, cached: it does not depend on the budget."""
        cached = self._region_keeps.get((t, last))
        if cached is None:
            cached = self._region_keeps[t, last] = region_keeps(self.problem, self.keepable, t, last)
        return cached


__all__ = ["DpTables"]
