"""Property tests: the exact solvers against brute force where regions are a model's submodule
calls (`solver_strategies.module_problems`): with checkpoint's per-region cost, slices of a
Sequential, runs recomputed alone inside calls, and nodes kept under a selective policy.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Iterator
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from solver_strategies import (
    SETTINGS,
    Truth,
    budgets,
    check_against_truth,
    module_problems,
)

import solvers.problem
from solvers import InfeasibleBudget, NodeCost, Problem, solve


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
        # five keepable nodes: subsets of the costliest (node 2), the k costliest for every k
        # (node 2, then the ties in order: (0, 2) is new, the larger ones are all but a run),
        # or all but a run (the whole run keeps nothing, already there)
        choices = problem.keep_choices(range(0, 5))
        assert choices[:3] == [(), (2,), (0, 2)]
        assert (0, 1, 4) in choices and (1, 2, 3, 4) in choices and (0, 4) in choices
        assert (0, 2, 4) not in choices and len(choices) == len(set(choices)) == 2 + 1 + 16 - 1
        # any keepable nodes make a valid plan; the solvers search the choices
        assert problem.may_keep(range(0, 5), (0, 2, 4))
        spanned = Problem(tuple(replace(node, keep_span=(0, 2)) if i == 1 else node for i, node in enumerate(nodes)),
                          allowed_regions=problem.allowed_regions)
        assert 1 in spanned.keepable_in(range(0, 2)) and 1 not in spanned.keepable_in(range(0, 5))
        assert spanned.may_keep(range(0, 2), (1,)) and not spanned.may_keep(range(0, 5), (1,))
