"""Decision spaces beyond the planner's, on its own measurements: what a missed target of
`benchmarks/compare.py` would take (`benchmarks/keep_gain.py` tabulates them too).

- `without_keeps`: regions of whole submodule calls only (no kept nodes, no runs inside calls);
- `any_run`: whole regions on any run of graph nodes, across submodule calls too (the planner
  applies those only in a model's own forward of at most 200 nodes);
- `every_keep_subset`: the planner's own space (submodule calls, runs inside them), with every
  subset of a call's keepable nodes as a keep choice where it holds at most `EVERY_KEEP_LIMIT`
  (the planner tries a few hundred of them, `Problem.keep_choices`): what wrapping submodule
  calls can reach at all;
- `beyond_the_planner`: at a budget, the lower bound for every plan of whole graph nodes, the
  cheapest plan of `any_run` and that of `every_keep_subset`.

Example:
    >>> bound_ms, any_run_ms, every_keep_ms = beyond_the_planner(p.problem, budget_bytes, with_any_run=True)
"""
from __future__ import annotations

import sys

# Calls of up to this many keepable nodes get every subset as a keep choice (1024: dp solves a
# 6-block ViT in seconds); larger ones (a whole model) keep the planner's choices.
EVERY_KEEP_LIMIT = 10


def every_keep_subset(problem):
    """The same problem, where each submodule call of at most `EVERY_KEEP_LIMIT` keepable nodes
    may keep any subset of them. (The project's imports wait until called, as in the functions
    below: `compare_report` reads the limit from scripts whose path puts this folder first, where
    `solvers` would name `benchmarks/solvers.py`.)"""
    import dataclasses

    from solvers import Problem

    @dataclasses.dataclass(frozen=True)
    class EveryKeepSubset(Problem):
        def keep_candidates(self, region: range) -> tuple[int, ...]:
            keepable = self.keepable_in(region)
            if self.allowed_regions is not None and len(keepable) <= EVERY_KEEP_LIMIT:
                return tuple(keepable)
            return super().keep_candidates(region)

    return EveryKeepSubset(**{f.name: getattr(problem, f.name) for f in dataclasses.fields(problem)})


def without_keeps(problem):
    """The same problem with nothing keepable and no runs inside submodule calls: whole
    submodule calls only."""
    import dataclasses

    allowed = problem.allowed_regions
    if allowed is not None:  # (slices of a Sequential's children are no submodule calls)
        allowed = tuple(region for region in allowed if region not in problem.segment_regions)
    return dataclasses.replace(problem, nodes=tuple(dataclasses.replace(n, keepable=False) for n in problem.nodes),
                               run_spans=(), allowed_regions=allowed, segment_regions=())


def any_run(problem):
    """The same problem with regions on any run of nodes, whole regions only (with keep choices
    too, dp takes minutes per budget on these graphs), including runs that cross submodule
    calls, which the planner applies only in a model's own forward of at most 200 nodes."""
    import dataclasses

    return dataclasses.replace(without_keeps(problem), allowed_regions=None)


def beyond_the_planner(problem, budget: int, with_any_run: bool, bound_time_limit_s: float = 20.0
                       ) -> tuple[float, float | None, float | None]:
    """At a budget, on the planner's measurements: the lower bound for every plan of whole graph
    nodes, with `with_any_run` the cheapest plan of whole regions on any run of nodes (dp;
    None where none fits or not asked), which the planner cannot apply in general, and the
    cheapest plan of `every_keep_subset` (dp; None where none fits or dp could not prove it the
    cheapest). They say why a missed target is missed. The bound's program stops after
    `bound_time_limit_s` with the bound it has proven."""
    from solvers import InfeasibleBudget, Status, solve
    from solvers.bound.recompute import recompute_lower_bound

    bound = recompute_lower_bound(problem, budget, time_limit_s=bound_time_limit_s)
    if not bound.exact:
        print(f"lower bound at {budget} bytes: the time limit stopped SCIP; {bound.recompute_ms:.1f} ms is the "
              "bound it had proven (weaker than the optimum of its program)", file=sys.stderr, flush=True)
    bound_ms = bound.recompute_ms
    any_run_ms = None
    if with_any_run:
        try:
            any_run_ms = solve(any_run(problem), budget, method="dp").recompute_ms
        except InfeasibleBudget:
            pass
    every_keep_ms = None
    try:
        every_keep = solve(every_keep_subset(problem), budget, method="dp")
        every_keep_ms = every_keep.recompute_ms if every_keep.status == Status.OPTIMAL else None
    except InfeasibleBudget:
        pass
    return bound_ms, any_run_ms, every_keep_ms
