"""What the recompute bound's program (`solvers.bound.recompute`) holds at backward steps
beyond the unplanned step's own buffers: a region's input until the region's backward is done,
a kept output until backward recomputes its region, and what that recomputation brings back
(each recomputed node's saved tensors until its backward, an output until the backward of the
nodes of the region that saved it).

Example:
    >>> class _Program(BackwardHolds): ...  # the program mixes these rows in
"""
from __future__ import annotations

from collections import defaultdict

from solvers.bound.rows import Droppable

# How far after a node the bound looks for the backward of a later node of its region (which
# brings its tensors back, or still finds a kept output held): a shorter look only weakens the
# bound. Looking further adds rows that leave SCIP proving less within its time limit on the
# models' graphs, where this window loses nothing.
REVIVAL_WINDOW = 12


class BackwardHolds:
    """Rows and variables of `solvers.bound.recompute._Program` for what backward holds; the
    program provides `solver`, `problem`, `rows`, `held_until`, `backward_step`, `loss_step`, `node_at`
    (backward step -> its node), `bounded`, the variables `recomputed`, `in_region`, `apart`
    and `keeps`, and `apart_after` (an empty dict that `outside` fills)."""

    def held_inputs(self) -> dict[int, dict[int, object]]:
        """Backward row step -> {kept input i: whether a region still holds it}. A node j in a
        region that reads i from outside it makes i the region's input, which checkpoint keeps
        until the region's backward is done, past j's: alive at every row up to j's backward.
        A node its region keeps holds its output until backward recomputes the region, at the
        region's last node that saves or before: alive at the rows of the nodes past it (within
        `REVIVAL_WINDOW`)."""
        solver, nodes = self.solver, self.problem.nodes
        backward_rows = sorted(step for step, _ in self.rows if step > self.loss_step)
        held: dict[int, dict[int, object]] = defaultdict(dict)
        for i, until in self.held_until.items():
            steps = [step for step in backward_rows if step <= until]
            for step in steps:
                held[step][i] = self.bounded(f"h{i}_{step}")
            for earlier, later in zip(steps, steps[1:]):  # held over one interval
                solver.Add(held[earlier][i] >= held[later][i])
        for j, node in enumerate(nodes):
            reached = [step for step in backward_rows if step <= self.backward_step[j]]
            if j not in self.in_region or not reached:
                continue
            # (an argument j's call is passed without reading it is held by a call region, not by
            # a run: where runs may be chosen, only what j reads is sure to be held)
            inputs = node.uses if self.problem.run_spans else (*node.uses, *node.arguments)
            for i in set(inputs) & self.held_until.keys():
                if i < j:
                    solver.Add(held[reached[-1]][i] >= self.in_region[j] + self.outside(i, j) - 1)
        for i, keeps in self.keeps.items():
            for step, alive in held.items():
                if i in alive and i < self.node_at[step] <= i + REVIVAL_WINDOW:
                    solver.Add(alive[i] >= keeps + self.outside(i, self.node_at[step]) - 1)
        return held

    def outside(self, i: int, j: int):
        """1 where node i lies in no region with node j (a later node): some node in i+1..j does
        not share a region with the one before it (always so where one of them is in none).
        Built as a chain over j, one row per node, shared by every call for i."""
        if any(m not in self.apart for m in range(i + 1, j + 1)):
            return 1.0
        chain = self.apart_after.setdefault(i, [])
        while len(chain) < j - i:
            m = i + 1 + len(chain)
            outside = self.bounded(f"o{i}_{m}")
            self.solver.Add(outside >= self.apart[m])
            if chain:
                self.solver.Add(outside >= chain[-1])
            chain.append(outside)
        return chain[j - i - 1]

    def recomputed_saved(self, j: int, droppable: dict[Droppable, int]) -> list:
        """At node j's backward, the saved tensors of each earlier node i recomputed in a region
        that recomputation has already run are back (held until i's backward): (-bytes,
        variable) terms that take them off what the step drops."""
        terms = []
        for kind, i, savers in droppable:
            saved = self.problem.nodes[i].saved_bytes
            if kind != "x" or savers or not saved:
                continue
            recomputed_by = self.recomputed_before(i, j)
            if recomputed_by is None:
                continue
            back = self.bounded(f"v{i}_{j}")
            self.solver.Add(back >= self.recomputed[i] + recomputed_by - 1)
            terms.append((-saved, back))
        return terms

    def reached_back(self) -> dict[tuple[int, int], object]:
        """(j, j) -> whether node j's region has been recomputed by j's backward: j or a later
        node of it is recomputed (its last node that saves is at or after that node)."""
        reached: dict[tuple[int, int], object] = {}
        for j in sorted(self.recomputed, reverse=True):
            found = reached[j, j] = self.bounded(f"u{j}")
            self.solver.Add(found >= self.recomputed[j])
            if (j + 1, j + 1) in reached:  # j + 1 in j's region, recomputed by then: so is j's
                self.solver.Add(found >= reached[j + 1, j + 1] - self.apart[j + 1])
        return reached

    def recomputed_before(self, i: int, j: int):
        """Whether backward has recomputed node i's region by node j's backward (i <= j; i's
        region is j's, `reached_back`, unless some node in i+1..j starts another): i
        shares a region with j, and j or a later node of it is recomputed (backward reaches a
        region at its last node that saves and recomputes all of it up to there). None where i
        and j cannot share a region or lie over `REVIVAL_WINDOW` apart: no revival is counted."""
        key = (i, j)
        if key in self.recomputed_by or i == j:
            return self.recomputed_by.get(key)
        if i + 1 not in self.apart or j - i > REVIVAL_WINDOW:
            return None
        next_to = self.recomputed_before(i + 1, j)
        if next_to is None:
            return None
        found = self.recomputed_by[key] = self.bounded(f"w{i}_{j}")
        self.solver.Add(found >= next_to - self.apart[i + 1])
        return found


__all__ = ["BackwardHolds", "REVIVAL_WINDOW"]
