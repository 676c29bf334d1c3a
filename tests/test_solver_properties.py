"""Property tests: every exact solver against brute force on random small graphs.

Graphs are random chains and DAGs of at most 9 nodes (at most 4 181 plans, so enumerating them
stays fast) with random output, saved, temporary and gradient bytes, memoryless views, skip
connections, several consumers per output, in-place writes, returned outputs and static memory. Compute times are
multiples of 1/4 ms, so sums are exact and ties are real ties.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Iterator
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solvers import InfeasibleBudget, NodeCost, Problem, Status, minimum_peak_bytes, peak_bytes, solve
import solvers.problem
from solvers.brute_force import all_plans_with_keeps

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@st.composite
def problems(
    draw: st.DrawFn, max_nodes: int = 8, unread_saves: bool = False, self_saves: bool = False,
    keepable_odds: int = 3,
) -> Problem:
    """A random graph in topological order. Saves are owners a node reads or itself (as in
    traced graphs), unless `unread_saves`, which also lets nodes save outputs they never read;
    `self_saves` makes every node save its own output too (as in the literature graphs). One
    node in `keepable_odds` is keepable (1: all that write nothing in place)."""
    n = draw(st.integers(1, max_nodes))
    chain = draw(st.booleans())
    sizes = st.sampled_from([0, 1, 2, 3, 8, 16])
    nodes = []
    for i in range(n):
        if i == 0:
            uses: tuple[int, ...] = ()
        elif chain:
            uses = (i - 1,)
        else:
            uses = tuple(sorted(draw(st.sets(st.integers(0, i - 1), min_size=1, max_size=min(3, i)))))
        savable = sorted({*uses, i} | ({*range(i)} if unread_saves else set()))
        saves = tuple(sorted(draw(st.sets(st.sampled_from(savable), max_size=3)) | ({i} if self_saves else set())))
        mutates = (uses[-1],) if uses and draw(st.integers(0, 9)) == 0 else ()
        if draw(st.integers(0, 4)) == 0:  # a view or shape query: no memory of its own
            nodes.append(NodeCost(f"view{i}", compute_ms=draw(st.integers(0, 2)) / 4, uses=uses, mutates=mutates))
            continue
        nodes.append(
            NodeCost(
                f"n{i}",
                compute_ms=draw(st.integers(0, 12)) / 4,
                output_bytes=draw(sizes),
                grad_bytes=draw(sizes),
                saved_bytes=draw(st.sampled_from([0, 0, 2, 5])),
                transient_bytes=draw(st.sampled_from([0, 0, 0, 7])),
                param_grad_bytes=draw(st.sampled_from([0, 0, 3])),
                # a weight shared with an earlier node (tied embeddings): its gradient is held
                shared_grads=((draw(st.integers(0, i - 1)), 4),) if i and draw(st.integers(0, 5)) == 0 else (),
                uses=uses,
                saves=saves,
                mutates=mutates,
                grad_aliases=(uses[0],) if uses and draw(st.integers(0, 3)) == 0 else (),
                # outputs the model's code keeps referencing while this node runs (not read)
                holds=tuple(sorted(draw(st.sets(st.integers(0, i - 1), max_size=2)))) if i and draw(
                    st.integers(0, 3)) == 0 else (),
                # a module call's arguments that it does not read (a region starting here keeps them)
                arguments=(draw(st.integers(0, i - 1)),) if i and draw(st.integers(0, 5)) == 0 else (),
                is_output=i == n - 1 or draw(st.integers(0, 9)) == 0,
                random=draw(st.integers(0, 4)) == 0,  # dropout: its region keeps an RNG state
                # a linear or GELU: recomputation stopping here never makes its output
                stops_before_output=i not in saves and draw(st.booleans()),
                # forward time up to its last save (a dropout's mask: most of it; a linear: none)
                stop_ms=draw(st.sampled_from([None, 0.0, 0.25, 1.0])),
                # a matmul: a region may keep its output (a selective-checkpoint policy)
                keepable=not mutates and draw(st.integers(0, keepable_odds - 1)) == 0,
                aten_calls=draw(st.integers(0, 3)),
                saved_tensors=draw(st.integers(0, 3)),  # checkpoint packs each (Problem.saved_tensor_ms)
                # reads or writes a graph input written in place later: in no region
                recomputable=draw(st.integers(0, 14)) != 0,
            )
        )
    # Gradients in flight as measured (planner.allocations.BackwardMemory), sometimes: any
    # spans of backward steps, which replace the ones derived from the graph.
    span = st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), sizes).map(
        lambda t: (min(t[0], t[1]), max(t[0], t[1]), t[2]))
    measured = tuple(draw(st.lists(span, max_size=4))) if draw(st.integers(0, 2)) == 0 else None
    return Problem(tuple(nodes), static_bytes=draw(st.sampled_from([0, 100])),
                   rng_state_bytes=draw(st.sampled_from([0, 3, 6])), measured_gradients=measured)


@st.composite
def module_problems(draw: st.DrawFn, max_nodes: int = 9, **options: object) -> Problem:
    """A random problem whose regions are limited to random node ranges (like submodule calls:
    some nested, some overlapping) and whose regions each cost a fixed overhead; with
    `keep_spans`, some keepable nodes may be kept only within a random span of nodes."""
    problem = draw(problems(max_nodes=max_nodes, **{k: v for k, v in options.items()
                                                    if k not in ("keep_spans", "run_spans", "segments")}))
    n = len(problem)
    spans = st.tuples(st.integers(0, n - 1), st.integers(1, n)).map(lambda ab: range(ab[0], max(ab[0] + 1, min(n, ab[0] + ab[1]))))
    drawn = set(draw(st.lists(spans, min_size=1, max_size=6)))
    if options.get("keep_spans"):  # a block holding most nodes, which may keep all but a run
        drawn.add(range(draw(st.integers(0, min(2, n - 1))), n))
    allowed = tuple(sorted(drawn, key=lambda r: (r.start, r.stop)))
    overhead = draw(st.sampled_from([0.0, 0.25, 1.0]))
    # a selective region's policy: a cost per region and per ATen call it sees
    keep_region_ms, keep_call_ms = draw(st.sampled_from([(0.0, 0.0), (0.5, 0.0), (0.25, 0.25)]))
    kept_node_ms = draw(st.sampled_from([0.0, 0.25]))  # and per node it keeps
    # checkpoint's cost per saved tensor in a region
    saved_tensor_ms = draw(st.sampled_from([0.0, 0.25]))
    nodes = problem.nodes
    if options.get("keep_spans"):  # kept only in allowed regions within a span (planner.holds)
        nodes = tuple(replace(node, keep_span=(draw(st.integers(0, i)), draw(st.integers(i + 1, n))))
                      if node.keepable and draw(st.integers(0, 3)) == 0 else node for i, node in enumerate(nodes))
    run_spans: tuple[range, ...] = ()
    run_call_ms = recorded_call_ms = run_region_ms = 0.0
    max_run_nodes = None
    if options.get("run_spans"):  # any run inside some calls is a region too, not through buffer writers
        run_spans = tuple(r for r in allowed if len(r) > 1 and draw(st.booleans()))
        run_call_ms = draw(st.sampled_from([0.0, 0.125]))
        recorded_call_ms = draw(st.sampled_from([0.0, 0.25]))
        # (negative down to -overhead: a checkpoint call's residual in the step beyond a run's)
        run_region_ms = draw(st.sampled_from([0.0, 0.5, -overhead]))
        max_run_nodes = draw(st.sampled_from([None, 1, 2]))
        nodes = tuple(replace(node, replayable=draw(st.integers(0, 4)) > 0) for node in nodes)
    # with `segments`, some allowed regions are slices of a Sequential's children: they keep nothing
    segments = tuple(r for r in allowed if r not in run_spans and draw(st.booleans())) if options.get("segments") else ()
    return Problem(nodes, problem.static_bytes, allowed_regions=allowed, region_overhead_ms=overhead,
                   rng_state_bytes=problem.rng_state_bytes, measured_gradients=problem.measured_gradients,
                   keep_region_ms=keep_region_ms, keep_call_ms=keep_call_ms, saved_tensor_ms=saved_tensor_ms,
                   kept_node_ms=kept_node_ms, run_spans=run_spans, run_call_ms=run_call_ms,
                   recorded_call_ms=recorded_call_ms, run_region_ms=run_region_ms, max_run_nodes=max_run_nodes,
                   segment_regions=segments)


@dataclass
class Truth:
    """Every plan's peak and cost, from the simulator."""

    plans: list[tuple[tuple[range, ...], tuple[int, ...], int, float]]  # regions, kept, peak, cost

    @staticmethod
    def of(problem: Problem) -> "Truth":
        return Truth([(plan, kept, peak_bytes(problem, plan, kept), problem.recompute_ms(plan, kept))
                      for plan, kept in all_plans_with_keeps(problem)])

    @property
    def minimum(self) -> int:
        return min(peak for _, _, peak, _ in self.plans)

    @property
    def maximum(self) -> int:
        return max(peak for _, _, peak, _ in self.plans)

    def optimum(self, budget: int) -> float | None:
        costs = [cost for _, _, peak, cost in self.plans if peak <= budget]
        return min(costs) if costs else None


def budgets(truth: Truth, data: st.DataObject) -> list[int]:
    low, high = truth.minimum, truth.maximum
    return sorted({low - 1, low, (low + high) // 2, high, data.draw(st.integers(low, high), label="budget")})


def check_against_truth(problem: Problem, truth: Truth, budget: int, method: str, **options: object) -> None:
    optimum = truth.optimum(budget)
    if optimum is None:
        with pytest.raises(InfeasibleBudget) as raised:
            solve(problem, budget, method=method, **options)
        assert raised.value.minimum_bytes == truth.minimum, (
            f"{method}: minimum {raised.value.minimum_bytes} != true minimum {truth.minimum}"
        )
        return
    solution = solve(problem, budget, method=method, **options)
    assert solution.solver == method
    assert solution.peak_bytes <= budget, f"{method}: peak {solution.peak_bytes} over budget {budget}"
    assert solution.peak_bytes == peak_bytes(problem, solution.regions, solution.kept), (
        f"{method}: peak not from the simulator")
    assert math.isclose(solution.recompute_ms, optimum, abs_tol=1e-9), (
        f"{method}: recompute {solution.recompute_ms} ms at budget {budget}, optimum {optimum} ms "
        f"(plan {solution.regions})"
    )
    assert solution.status == Status.OPTIMAL, f"{method}: status {solution.status} on a small graph"


@settings(max_examples=150, **SETTINGS)
@given(problem=problems(max_nodes=9), data=st.data())
def test_dp_equals_brute_force(problem: Problem, data: st.DataObject) -> None:
    truth = Truth.of(problem)
    for budget in budgets(truth, data):
        check_against_truth(problem, truth, budget, "dp")


@settings(max_examples=80, **SETTINGS)
# The second kind is like the literature's graphs, where the model adds its triangle cuts.
@given(
    problem=st.one_of(problems(max_nodes=8, unread_saves=True), problems(max_nodes=8, self_saves=True)),
    data=st.data(),
)
def test_ilp_equals_brute_force(problem: Problem, data: st.DataObject) -> None:
    truth = Truth.of(problem)
    for budget in budgets(truth, data):
        check_against_truth(problem, truth, budget, "ilp", hint=False)


@settings(max_examples=30, **SETTINGS)
@given(problem=problems(max_nodes=7, self_saves=True), data=st.data())
def test_ilp_model_admits_every_plan_that_fits(problem: Problem, data: st.DataObject) -> None:
    # Every fitting plan, with the model's variables fixed to its values, satisfies every
    # constraint of the model, the valid inequalities (triangle cuts) included.
    # (Regions that start at a memoryless node, and regions that save nothing, are left out of
    # the model on purpose: another plan beats them for sure.)
    from solvers.ilp_warm_start import cp_sat_solver as _solver
    from solvers.ilp_model import build_model, hint_plan
    from solvers.structure import Structure

    truth = Truth.of(problem)
    budget = data.draw(st.integers(truth.minimum, truth.maximum), label="budget")
    live = budget - problem.static_bytes
    useful = Structure.of(problem).useful_start
    for plan, kept, peak, _ in truth.plans:
        if peak > budget or not all(useful[region.start] and problem.recomputed(region) for region in plan):
            continue
        built = build_model(problem, live, live)
        assert hint_plan(built, problem, plan, kept), (plan, kept)
        solver = _solver(10.0, 1)
        solver.parameters.fix_variables_to_their_hinted_value = True
        status = solver.solve(built.model)
        assert solver.status_name(status) in ("OPTIMAL", "FEASIBLE"), f"ilp model cuts off plan {plan} keeping {kept}"


@settings(max_examples=40, **SETTINGS)
@given(problem=problems(max_nodes=8, unread_saves=True), data=st.data())
def test_dp_with_unread_saves_fits_and_never_beats_the_optimum(problem: Problem, data: st.DataObject) -> None:
    # A saver that does not read what it saves makes dp's forward check conservative: its
    # plans still fit and are reported FEASIBLE unless the graph has no such save.
    truth = Truth.of(problem)
    for budget in budgets(truth, data):
        optimum = truth.optimum(budget)
        try:
            solution = solve(problem, budget, method="dp")
        except InfeasibleBudget as error:
            assert error.minimum_bytes >= truth.minimum, "dp: minimum below the true minimum"
            continue
        assert optimum is not None, "dp: found a plan where none fits"
        assert solution.peak_bytes <= budget, "dp: plan over budget"
        assert solution.recompute_ms >= optimum - 1e-9, "dp: cheaper than the optimum"
        if solution.status == Status.OPTIMAL:
            assert math.isclose(solution.recompute_ms, optimum, abs_tol=1e-9), "dp: OPTIMAL but not optimal"


@settings(max_examples=80, **SETTINGS)
@given(problem=problems(max_nodes=9), data=st.data())
def test_sqrt_and_auto_fit_and_sqrt_never_beats_the_optimum(problem: Problem, data: st.DataObject) -> None:
    truth = Truth.of(problem)
    for budget in budgets(truth, data):
        optimum = truth.optimum(budget)
        for method in ("sqrt", "auto"):
            try:
                solution = solve(problem, budget, method=method)
            except InfeasibleBudget as error:
                assert error.minimum_bytes >= truth.minimum, f"{method}: minimum below the true minimum"
                assert method == "sqrt" or optimum is None, f"{method}: no plan, but one fits"
                continue
            assert optimum is not None, f"{method}: found a plan where none fits"
            assert solution.peak_bytes <= budget, f"{method}: plan over budget"
            assert solution.recompute_ms >= optimum - 1e-9, f"{method}: cheaper than the optimum"
            if method == "auto":
                assert math.isclose(solution.recompute_ms, optimum, abs_tol=1e-9), "auto: not optimal"


@settings(max_examples=60, **SETTINGS)
@given(problem=problems(max_nodes=9))
def test_more_budget_never_costs_more(problem: Problem) -> None:
    truth = Truth.of(problem)
    previous = math.inf
    for budget in range(truth.minimum, truth.maximum + 1, max(1, (truth.maximum - truth.minimum) // 12)):
        cost = solve(problem, budget, method="dp").recompute_ms
        assert cost <= previous + 1e-9, f"dp: {cost} ms at budget {budget}, {previous} ms with less"
        previous = cost


@settings(max_examples=25, **SETTINGS)
@given(problem=problems(max_nodes=7))
def test_infeasible_budget_raises_for_every_method(problem: Problem) -> None:
    truth = Truth.of(problem)
    for method in ("sqrt", "dp", "ilp", "brute_force", "auto"):
        with pytest.raises(InfeasibleBudget) as raised:
            solve(problem, truth.minimum - 1, method=method)
        assert raised.value.budget_bytes == truth.minimum - 1
        assert raised.value.static_bytes == problem.static_bytes
        if method != "sqrt":
            assert raised.value.minimum_bytes == truth.minimum, f"{method}: wrong minimum"
    assert minimum_peak_bytes(problem) == truth.minimum


@settings(max_examples=20, **SETTINGS)
@given(problem=problems(max_nodes=9), data=st.data())
def test_results_are_deterministic(problem: Problem, data: st.DataObject) -> None:
    truth = Truth.of(problem)
    budget = data.draw(st.integers(truth.minimum, truth.maximum), label="budget")
    for method in ("dp", "ilp", "auto", "sqrt"):
        try:
            first = solve(problem, budget, method=method).regions
        except InfeasibleBudget:
            assert method == "sqrt", f"{method}: no plan, but one fits"
            continue
        assert solve(problem, budget, method=method).regions == first, f"{method}: not deterministic"


@settings(max_examples=40, **SETTINGS)
@given(problem=problems(max_nodes=8), data=st.data())
def test_ilp_bound_from_dp_never_exceeds_any_plan(problem: Problem, data: st.DataObject) -> None:
    # ilp takes dp's cost as its objective's lower bound when dp proves it optimal: that bound
    # (in the model's scaled units, less its rounding slack) must be at most every fitting
    # plan's scaled cost, and ilp with that bound must still find the true optimum.
    from solvers.ilp_model import bound_by_optimum, build_model, scaled_cost

    truth = Truth.of(problem)
    for budget in budgets(truth, data):
        if truth.optimum(budget) is None or peak_bytes(problem) <= budget:
            continue
        dp = solve(problem, budget, method="dp")
        if dp.status != Status.OPTIMAL:
            continue
        live = budget - problem.static_bytes
        built = build_model(problem, live, live)
        slack = bound_by_optimum(built, dp.regions, dp.kept)
        bound = scaled_cost(built, dp.regions, dp.kept) - slack
        for plan, kept, peak, _ in truth.plans:
            if peak <= budget:
                assert scaled_cost(built, plan, kept) >= bound, (plan, kept)
        check_against_truth(problem, truth, budget, "ilp")  # hint=True: dp's bound in use


@settings(max_examples=60, **SETTINGS)
@given(problem=problems(max_nodes=9), data=st.data())
def test_ilp_greedy_warm_start_fits_and_never_beats_the_optimum(problem: Problem, data: st.DataObject) -> None:
    from solvers.ilp_warm_start import greedy_single_nodes as _greedy_single_nodes

    truth = Truth.of(problem)
    for budget in budgets(truth, data):
        plan = _greedy_single_nodes(problem, budget)
        if plan is None:
            continue
        optimum = truth.optimum(budget)
        assert optimum is not None, "greedy: a plan where none fits"
        assert peak_bytes(problem, plan) <= budget, "greedy: plan over budget"  # also validates starts
        assert all(len(region) == 1 for region in plan)
        assert problem.recompute_ms(plan) >= optimum - 1e-9, "greedy: cheaper than the optimum"


@settings(max_examples=40, **SETTINGS)
@given(problem=problems(max_nodes=8), data=st.data())
def test_ilp_one_node_warm_start_is_the_best_plan_of_one_node_regions(problem: Problem, data: st.DataObject) -> None:
    from solvers.ilp_warm_start import single_node_optimum as _single_node_optimum

    truth = Truth.of(problem)
    for budget in budgets(truth, data):
        costs = [cost for plan, kept, peak, cost in truth.plans
                 if peak <= budget and not kept and all(len(r) == 1 for r in plan)]
        plan = _single_node_optimum(problem, budget, None, time_limit_s=10.0, workers=1)
        if not costs:
            assert plan is None, "one-node regions: a plan where none fits"
            continue
        assert plan is not None, "one-node regions: none found where one fits"
        assert all(len(region) == 1 for region in plan)
        assert peak_bytes(problem, plan) <= budget, "one-node regions: plan over budget"
        assert math.isclose(problem.recompute_ms(plan), min(costs), abs_tol=1e-9), (plan, min(costs))


@settings(max_examples=30, **SETTINGS)
@given(problem=problems(max_nodes=8, self_saves=True), data=st.data())
def test_ilp_lp_relaxation_bounds_and_guided_plan_fit(problem: Problem, data: st.DataObject) -> None:
    # The LP relaxation's objective, and that of each half of a branch on any node, never
    # exceed the cost of a fitting plan in it (in the model's scaled units); the LP-guided warm
    # start fits, never beats the optimum, and its bound (the root's raised by a branch, solved
    # beside the search) is at most the optimum.
    import time

    from solvers.ilp_warm_start import lp_guided_plan as _lp_guided_plan
    from solvers.ilp_model import build_model, scaled_cost
    from solvers.lp_relaxation import LinearRelaxation

    truth = Truth.of(problem)
    for budget in budgets(truth, data):
        live = budget - problem.static_bytes
        if live < 0:
            continue
        built = build_model(problem, live, live)
        relaxation = LinearRelaxation(built.model)
        root = relaxation.solve(time_limit_s=10.0)
        optimum = truth.optimum(budget)
        if optimum is None:
            continue  # the LP may or may not be feasible
        assert root is not None and root.feasible, "LP relaxation: none where a plan fits"
        node = data.draw(st.integers(0, len(problem) - 1), label="branch node")
        index = built.in_region[node].index
        down, up = (relaxation.solve(10.0, {index: value}) for value in (0.0, 1.0))
        assert down is not None and up is not None, "LP relaxation: a half of a branch unsolved"
        costs = []
        for plan, kept, peak, _ in truth.plans:
            if peak <= budget:
                cost = scaled_cost(built, plan, kept)
                costs.append(cost)
                assert root.objective <= cost, f"LP bound {root.objective} above plan {plan} keeping {kept} ({cost})"
                # Plans the model leaves out (a region starting at a memoryless node, or one that
                # saves nothing) have an equal or cheaper one in it, so only the smaller half
                # bounds them.
                if all(region.start in built.member[i] and problem.recomputed(region)
                       for region in plan for i in region):
                    half = up if any(node in region for region in plan) else down
                    assert half.objective <= cost, (
                        f"half of the branch on {node}: {half.objective} above {plan} keeping {kept}")
        assert min(down.objective, up.objective) <= min(costs), f"branch on {node}: both halves above the optimum"
        # Told that a plan of one-node regions fits, it may skip its search: the bound still holds.
        short_fit = data.draw(st.booleans(), label="a plan of one-node regions fits")
        deadline = time.perf_counter() + 10.0
        plan, bound = _lp_guided_plan(problem, budget, built, 10.0, workers=2, deadline=deadline, short_regions_fit=short_fit)
        assert bound is not None and bound <= min(costs) + 1e-6, f"LP-guided bound {bound} above {min(costs)}"
        if plan is not None:
            assert peak_bytes(problem, *plan) <= budget, "LP-guided plan over budget"
            assert problem.recompute_ms(*plan) >= optimum - 1e-9, "LP-guided plan cheaper than the optimum"


@settings(max_examples=120, **SETTINGS)
@given(problem=module_problems(max_nodes=9), data=st.data())
def test_dp_equals_brute_force_with_allowed_regions_and_region_overhead(problem: Problem, data: st.DataObject) -> None:
    truth = Truth.of(problem)
    assert all(problem.allows_region(r.start, r.stop) for plan, _, _, _ in truth.plans for r in plan)
    for budget in budgets(truth, data):
        check_against_truth(problem, truth, budget, "dp")


@settings(max_examples=60, **SETTINGS)
@given(problem=module_problems(max_nodes=8, self_saves=True), data=st.data())
def test_ilp_equals_brute_force_with_allowed_regions_and_region_overhead(problem: Problem, data: st.DataObject) -> None:
    truth = Truth.of(problem)
    for budget in budgets(truth, data):
        check_against_truth(problem, truth, budget, "ilp", hint=False)


@settings(max_examples=60, **SETTINGS)
@given(problem=module_problems(max_nodes=9, run_spans=True, segments=True), data=st.data())
def test_dp_equals_brute_force_with_segments_that_keep_nothing(problem: Problem, data: st.DataObject) -> None:
    truth = Truth.of(problem)
    assert all(not set(kept) & set(r) for plan, kept, _, _ in truth.plans for r in plan if r in problem.segment_regions)
    for budget in budgets(truth, data):
        check_against_truth(problem, truth, budget, "dp")


@settings(max_examples=40, **SETTINGS)
@given(problem=module_problems(max_nodes=8, self_saves=True, segments=True), data=st.data())
def test_ilp_equals_brute_force_with_segments_that_keep_nothing(problem: Problem, data: st.DataObject) -> None:
    truth = Truth.of(problem)
    for budget in budgets(truth, data):
        check_against_truth(problem, truth, budget, "ilp", hint=False)


@settings(max_examples=60, **SETTINGS)
@given(problem=module_problems(max_nodes=9), data=st.data())
def test_allowed_regions_sqrt_fits_and_more_budget_never_costs_more(problem: Problem, data: st.DataObject) -> None:
    truth = Truth.of(problem)
    previous = math.inf
    for budget in budgets(truth, data):
        optimum = truth.optimum(budget)
        if optimum is None:
            continue
        assert optimum <= previous
        previous = optimum
        try:
            solution = solve(problem, budget, method="sqrt")
        except InfeasibleBudget:
            continue
        assert solution.peak_bytes <= budget and solution.recompute_ms >= optimum - 1e-9
        assert all(problem.allows_region(r.start, r.stop) for r in solution.regions)
    assert problem.recompute_ms(()) == 0


@settings(max_examples=150, **SETTINGS)
@given(problem=module_problems(max_nodes=9, run_spans=True), data=st.data())
def test_dp_equals_brute_force_with_runs_inside_calls(problem: Problem, data: st.DataObject) -> None:
    truth = Truth.of(problem)
    runs = {r for plan, _, _, _ in truth.plans for r in plan if problem.run_span_of(r) is not None}
    assert all(problem.nodes[i].replayable for r in runs for i in r)
    assert all(i not in r for plan, kept, _, _ in truth.plans for r in set(plan) & runs for i in kept)
    for budget in budgets(truth, data):
        check_against_truth(problem, truth, budget, "dp")


@settings(max_examples=40, **SETTINGS)
@given(problem=module_problems(max_nodes=8, run_spans=True), data=st.data())
def test_ilp_equals_brute_force_with_runs_inside_calls(problem: Problem, data: st.DataObject) -> None:
    truth = Truth.of(problem)
    for budget in budgets(truth, data):
        check_against_truth(problem, truth, budget, "ilp", hint=False)


def test_run_cost_is_the_recording_of_the_smallest_call_holding_it() -> None:
    nodes = tuple(NodeCost(f"n{i}", compute_ms=1.0, output_bytes=8, uses=(i - 1,) if i else (), saves=(i,),
                           aten_calls=2, replayable=i != 4) for i in range(6))
    problem = Problem(nodes, allowed_regions=(range(0, 6), range(1, 4)), run_spans=(range(0, 6), range(1, 4)),
                      run_call_ms=0.5, recorded_call_ms=0.25, run_region_ms=0.125)
    assert problem.run_span_of(range(1, 4)) is None  # a call itself: checkpointed, not recorded
    assert problem.run_span_of(range(2, 3)) == range(1, 4) and problem.run_ms(range(2, 3)) == 0.125 + 0.5 * 6 + 0.25 * 2
    # recorded from the start of the call (0, 6) to the end of (1, 4), which holds its last node
    assert problem.run_span_of(range(0, 2)) == range(0, 6) and problem.run_windows(range(0, 2)) == (
        range(0, 6), range(1, 4))
    assert problem.run_ms(range(0, 2)) == 0.125 + 0.5 * 8 + 0.25 * 4
    assert problem.region_cost_ms(range(2, 3)) == 1.0 + 3.625
    assert problem.run_ms(range(1, 4)) == 0.0  # (no run: the call itself)
    assert problem.allows_region(0, 4) and not problem.allows_region(3, 5) and not problem.allows_region(4, 5)
    assert problem.keepable_in(range(2, 3)) == []


@contextlib.contextmanager
def small_keep_limits() -> Iterator[None]:
    """Keep-choice limits small enough that 9-node regions reach every tier of
    `Problem.keep_choices`: any subset of one, else subsets of the costliest one or all but a run."""
    with mock.patch.multiple(solvers.problem, MAX_KEEP_CANDIDATES=1, KEEP_COSTLIEST=1, MAX_RUN_CANDIDATES=6):
        yield


@settings(max_examples=200, **SETTINGS)
@given(problem=module_problems(max_nodes=9, keep_spans=True, keepable_odds=1), data=st.data())
def test_dp_equals_brute_force_keeping_all_but_a_run(problem: Problem, data: st.DataObject) -> None:
    check_keeping_all_but_a_run(problem, data, "dp")


def check_keeping_all_but_a_run(problem: Problem, data: st.DataObject, method: str) -> None:
    with small_keep_limits():
        truth = Truth.of(problem)
        for budget in budgets(truth, data):
            check_against_truth(problem, truth, budget, method)


@settings(max_examples=40, **SETTINGS)
@given(problem=module_problems(max_nodes=8, keep_spans=True, keepable_odds=1), data=st.data())
def test_ilp_equals_brute_force_over_subsets_of_keep_candidates(problem: Problem, data: st.DataObject) -> None:
    # ilp chooses subsets of `Problem.keep_candidates`, not "all but a run": the optimum over those
    with small_keep_limits():
        subsets = Truth([plan for plan in Truth.of(problem).plans if all(
            set(plan[1]) & set(region) <= set(problem.keep_candidates(region)) for region in plan[0])])
        for budget in budgets(subsets, data):
            check_against_truth(problem, subsets, budget, "ilp", hint=False)


def _all_but_a_run_cases() -> list[Problem]:
    """Two problems (found by hypothesis) whose optimum, under `small_keep_limits`, keeps all
    but a run: the cheapest plan at 7 bytes, and the smallest peak (7 bytes, where plans
    keeping subsets of the candidates reach 9)."""
    flags = dict(is_output=True, random=True)
    cheapest = Problem((
        NodeCost("n0", 0.0, saves=(0,), keepable=True, recomputable=False, **flags),
        NodeCost("n1", 0.25, uses=(0,), grad_aliases=(0,), keepable=True, **flags),
        NodeCost("n2", 0.25, shared_grads=((0, 4),), uses=(1,), grad_aliases=(1,), keepable=True, **flags),
        NodeCost("n3", 0.0, saved_bytes=2, shared_grads=((0, 4),), uses=(2,), grad_aliases=(2,), keepable=True,
                 **flags),
        NodeCost("n4", 0.0, transient_bytes=7, uses=(3,), saves=(3, 4), mutates=(3,), grad_aliases=(3,),
                 recomputable=False, **flags),
    ), allowed_regions=(range(0, 5), range(1, 4)), measured_gradients=())
    smallest = Problem((
        NodeCost("n0", 0.0, saves=(0,), keepable=True, recomputable=False, **flags),
        NodeCost("n1", 0.0, uses=(0,), grad_aliases=(0,), keepable=True, recomputable=False, **flags),
        NodeCost("n2", 0.0, saved_bytes=2, shared_grads=((0, 4),), uses=(1,), grad_aliases=(1,), keepable=True,
                 **flags),
        NodeCost("view3", 0.0, uses=(2,), mutates=(2,)),
        NodeCost("n4", 0.0, transient_bytes=7, uses=(3,), saves=(4,), grad_aliases=(3,), arguments=(0,),
                 keepable=True, **flags),
    ), allowed_regions=(range(0, 1), range(2, 5)), measured_gradients=())
    return [cheapest, smallest]


@pytest.mark.parametrize("case", [0, 1])
def test_ilp_returns_dp_plan_keeping_all_but_a_run(case: int) -> None:
    # CP-SAT's model keeps subsets of the candidates only; its dp warm start may keep all but a
    # run, and where that is cheaper (or reaches a smaller peak) ilp returns it
    problem = _all_but_a_run_cases()[case]
    with small_keep_limits():
        check_against_truth(problem, Truth.of(problem), 7, "ilp")


@settings(max_examples=40, **SETTINGS)
@given(problem=module_problems(max_nodes=8, keep_spans=True, keepable_odds=1), data=st.data())
def test_ilp_equals_brute_force_keeping_all_but_a_run(problem: Problem, data: st.DataObject) -> None:
    # as above, on random problems: ilp with its dp warm start is the optimum over every choice
    check_keeping_all_but_a_run(problem, data, "ilp")


def test_keep_choices_tiers() -> None:
    nodes = tuple(NodeCost(f"n{i}", compute_ms=1.0 + (i == 2), output_bytes=8, uses=(i - 1,) if i else (),
                           saves=(i - 1,) if i else (), keepable=True) for i in range(5))
    problem = Problem(nodes, allowed_regions=(range(0, 5), range(0, 2)))
    with small_keep_limits():
        # the costlier (a tie: the first), or all but a run
        assert problem.keep_choices(range(0, 2)) == [(), (0,), (1,), (0, 1)]
        # five keepable nodes: subsets of the costliest (node 2), or all but a run (the whole
        # run keeps nothing, already there)
        choices = problem.keep_choices(range(0, 5))
        assert choices[:2] == [(), (2,)]
        assert (0, 1, 4) in choices and (1, 2, 3, 4) in choices and (0, 4) in choices
        assert (0, 2, 4) not in choices and len(choices) == len(set(choices)) == 2 + 16 - 1
        # any keepable nodes make a valid plan; the solvers search the choices
        assert problem.may_keep(range(0, 5), (0, 2, 4))
        spanned = Problem(tuple(replace(node, keep_span=(0, 2)) if i == 1 else node for i, node in enumerate(nodes)),
                          allowed_regions=problem.allowed_regions)
        assert 1 in spanned.keepable_in(range(0, 2)) and 1 not in spanned.keepable_in(range(0, 5))
        assert spanned.may_keep(range(0, 2), (1,)) and not spanned.may_keep(range(0, 5), (1,))
