"""Property tests: every exact solver against brute force on random small graphs of nodes
(`solver_strategies`): dp and ilp equal the optimum, the baselines fit and never beat it, more
budget never costs more, and ilp's warm starts and bounds hold.
"""
from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from solver_strategies import SETTINGS, Truth, budgets, check_against_truth, problems

from solvers import (
    InfeasibleBudget,
    Problem,
    Status,
    minimum_peak_bytes,
    peak_bytes,
    solve,
)


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
    from solvers.ilp.model import build_model
    from solvers.ilp.warm_start import cp_sat_solver as _solver
    from solvers.ilp.warm_start import hint_plan
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
    # (budgets from the least peak to the unplanned one; whether dp's costs are the optimum's is
    # `test_dp_equals_brute_force`'s to check, on every plan's peak and cost)
    least, unplanned = minimum_peak_bytes(problem), peak_bytes(problem)
    previous = math.inf
    for budget in range(least, unplanned + 1, max(1, (unplanned - least) // 12)):
        cost = solve(problem, budget, method="dp").recompute_ms
        assert cost <= previous + 1e-9, f"dp: {cost} ms at budget {budget}, {previous} ms with less"
        previous = cost


@settings(max_examples=40, **SETTINGS)
@given(problem=problems(max_nodes=9), data=st.data())
def test_dp_search_reused_across_budgets_equals_a_fresh_one(problem: Problem, data: st.DataObject) -> None:
    # Searches may share their dp tables, region scans included (the search for a minimum peak
    # reuses those of the search that found no plan, and runs at many budgets on a coarser
    # grid): a scan extended further by an earlier run, at a larger budget or another stride,
    # must give a later run what a fresh search would.
    from dataclasses import replace

    from solvers.dp.search import dp_search
    from solvers.dp.settings import dp_settings
    from solvers.dp.tables import DpTables

    truth = Truth.of(problem)
    exact = dp_settings(problem, {})
    coarse = replace(exact, stride=2)
    tables = DpTables(problem)
    reused = {exact: dp_search(problem, exact, tables), coarse: dp_search(problem, coarse, tables)}
    live = sorted(budgets(truth, data), reverse=data.draw(st.booleans(), label="descending"))
    for budget in [*live, *reversed(live)]:
        for (settings_, search), feasibility_only in itertools.product(reused.items(), (False, True)):
            found, _ = search.run(budget - problem.static_bytes, feasibility_only=feasibility_only)
            fresh, _ = dp_search(problem, settings_).run(budget - problem.static_bytes, feasibility_only=feasibility_only)
            assert (found is None) == (fresh is None)
            if settings_ == exact:
                assert (found is None) == (truth.optimum(budget) is None)
            if found is not None:
                assert (found.regions(), found.kept(), found.cost) == (fresh.regions(), fresh.kept(), fresh.cost)


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
    from solvers.ilp.model import bound_by_optimum, build_model, scaled_cost

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
    from solvers.ilp.warm_start import greedy_single_nodes as _greedy_single_nodes

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
    from solvers.ilp.warm_start import single_node_optimum as _single_node_optimum

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

    from solvers.ilp.lp_relaxation import LinearRelaxation
    from solvers.ilp.model import build_model, scaled_cost
    from solvers.ilp.warm_start import lp_guided_plan as _lp_guided_plan

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
