"""The recompute lower bound against brute force: no plan that fits costs less than it."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from solver_strategies import SETTINGS, Truth, budgets, module_problems, problems

from solvers import NodeCost, Problem, minimum_peak_bytes, peak_bytes, solve
from solvers.bound.recompute import recompute_lower_bound


def check_bound(problem: Problem, data: st.DataObject) -> None:
    truth = Truth.of(problem)
    previous = math.inf
    for budget in budgets(truth, data):
        bound = recompute_lower_bound(problem, budget).recompute_ms
        optimum = truth.optimum(budget)
        if optimum is not None:
            assert bound <= optimum + 1e-9, f"bound {bound} ms over the optimum {optimum} ms at budget {budget}"
        assert bound <= previous + 1e-9, "more budget raised the bound"
        previous = bound
    assert recompute_lower_bound(problem, peak_bytes(problem, ())).recompute_ms == 0.0


@settings(max_examples=200, **SETTINGS)
# (8 nodes: 1597 plans of any regions to simulate per example; 9 took a minute of the suite)
@given(problem=problems(max_nodes=8), data=st.data())
def test_no_plan_of_any_regions_costs_less_than_the_bound(problem: Problem, data: st.DataObject) -> None:
    check_bound(problem, data)


@settings(max_examples=80, **SETTINGS)
@given(problem=module_problems(max_nodes=9, self_saves=True), data=st.data())
def test_no_plan_of_allowed_regions_costs_less_than_the_bound(problem: Problem, data: st.DataObject) -> None:
    check_bound(problem, data)


def test_the_bound_is_the_cheapest_drop_on_a_chain():
    # Three nodes, each saving 10 bytes until its backward; the budget forces 10 bytes out at
    # the end of forward. The cheapest node to recompute costs 1 ms: that is the bound, and the
    # plan recomputing it alone fits (its saved tensors come back only at its own backward).
    nodes = tuple(NodeCost(f"n{i}", compute_ms=ms, output_bytes=0, saved_bytes=10, uses=(i - 1,) if i else ())
                  for i, ms in enumerate((3.0, 1.0, 2.0)))
    problem = Problem(nodes)
    budget = peak_bytes(problem, ()) - 10
    assert recompute_lower_bound(problem, budget).recompute_ms == 1.0 * (1 - 1e-6)
    assert peak_bytes(problem, (range(1, 2),)) <= budget
    assert recompute_lower_bound(problem, -1).recompute_ms == math.inf


def test_recomputing_a_node_needs_its_input_back():
    # A matmul's output (freed once the softmax has read it) feeds a softmax that saves its
    # own output. Freeing the softmax's output needs the matmul's output again at recompute
    # time: kept from forward (as large: no gain) or recomputed, so the bound is both nodes'
    # cost, not the softmax's alone. (The budget bites when forward ends, at the head.)
    nodes = (NodeCost("matmul", compute_ms=3.0, output_bytes=10),
             NodeCost("softmax", compute_ms=1.0, output_bytes=10, uses=(0,), saves=(1,)),
             NodeCost("sum", compute_ms=0.1, output_bytes=1, uses=(1,), is_output=True),
             NodeCost("head", compute_ms=0.1, output_bytes=25, uses=(2,), is_output=True))
    problem = Problem(nodes)
    budget = peak_bytes(problem, ()) - 10
    assert peak_bytes(problem, (range(0, 2),)) <= budget
    assert problem.recompute_ms((range(0, 2),)) == 4.0
    assert recompute_lower_bound(problem, budget).recompute_ms == 4.0 * (1 - 1e-6)


@settings(max_examples=80, **SETTINGS)
@given(problem=module_problems(max_nodes=8, keep_spans=True, run_spans=True), data=st.data())
def test_no_plan_with_kept_nodes_or_runs_costs_less_than_the_bound(problem: Problem, data: st.DataObject) -> None:
    # regions' own costs (checkpoint calls, a run's negative residual, kept nodes) are in the bound
    check_bound(problem, data)


def test_each_region_costs_its_checkpoint_call():
    # Two nodes each save 10 bytes, a 5 ms node between them; at the head the budget lets no
    # plan keep either's saved bytes, so any plan recomputes both: one region spanning the two
    # also recomputes the 5 ms node, two regions pay two checkpoint calls (2 ms each). The
    # bound counts the calls: 1 + 1 + 2 * 2 = 6 ms, the cheapest plan's cost.
    nodes = (NodeCost("a", compute_ms=1.0, saved_bytes=10),
             NodeCost("mid", compute_ms=5.0, uses=(0,), output_bytes=1),
             NodeCost("b", compute_ms=1.0, saved_bytes=10, uses=(1,), output_bytes=1),
             NodeCost("head", compute_ms=0.1, output_bytes=25, uses=(2,), is_output=True))
    problem = Problem(nodes, region_overhead_ms=2.0)
    both = (range(0, 1), range(2, 3))
    budget = peak_bytes(problem, both)
    assert peak_bytes(problem, (range(0, 1),)) > budget and peak_bytes(problem, (range(2, 3),)) > budget
    assert problem.recompute_ms(both) == 6.0 and problem.recompute_ms((range(0, 3),)) == 9.0
    assert recompute_lower_bound(problem, budget).recompute_ms == 6.0 * (1 - 1e-6)


def _residual_then_norm(between: tuple[NodeCost, ...]) -> Problem:
    """x (5 ms, 10 bytes, freed in forward), the nodes `between`, a residual add reading x, a
    norm saving the add's output (its recomputation stops before its own), and a head whose
    backward is the peak."""
    add = 1 + len(between)
    return Problem((NodeCost("x", compute_ms=5.0, output_bytes=10), *between,
                    NodeCost("add", compute_ms=1.0, output_bytes=10, uses=(0,)),
                    NodeCost("norm", compute_ms=1.0, output_bytes=1, uses=(add,), saves=(add,),
                             stops_before_output=True, stop_ms=0.0),
                    NodeCost("head", compute_ms=0.1, output_bytes=1, backward_transient_bytes=30, uses=(add + 1,),
                             is_output=True)))


def test_a_regions_input_stays_until_its_backward():
    # A residual add reads x, which forward frees at once; a norm saves the add's output. The
    # peak is the head's backward. Recomputing the add alone makes x the region's input, which
    # checkpoint keeps until the add's backward, through the peak: no gain. Only recomputing x
    # too (5 ms) frees the 10 bytes, so the bound is 6 ms, not the add's 1 ms.
    problem = _residual_then_norm(between=())
    budget = peak_bytes(problem, ()) - 10
    assert peak_bytes(problem, (range(1, 3),)) > budget
    assert peak_bytes(problem, (range(0, 3),)) <= budget and problem.recompute_ms((range(0, 3),)) == 6.0
    assert recompute_lower_bound(problem, budget).recompute_ms == 6.0 * (1 - 1e-6)


def test_an_input_across_a_node_no_region_holds_is_always_held():
    # As above, but a node that no region may hold lies between x and the add: no region can
    # recompute x with the add, so recomputing the add always holds x through the peak, and no
    # plan fits the budget. The bound says so rather than pricing the add alone (1 ms).
    problem = _residual_then_norm(between=(NodeCost("seed", compute_ms=0.0, recomputable=False),))
    budget = peak_bytes(problem, ()) - 10
    assert minimum_peak_bytes(problem) > budget
    assert recompute_lower_bound(problem, budget).recompute_ms == math.inf


def test_a_node_outside_every_region_holds_what_it_saved():
    # `big`'s output (10 bytes) is saved by `user`, which keeps it from forward to its backward
    # unless `user` is recomputed too (50 ms): recomputing `big` (5 ms) alone frees nothing.
    nodes = (NodeCost("big", compute_ms=5.0, output_bytes=10),
             NodeCost("user", compute_ms=50.0, output_bytes=1, uses=(0,), saves=(0,)),
             NodeCost("head", compute_ms=0.1, output_bytes=1, backward_transient_bytes=30, uses=(1,), is_output=True))
    problem = Problem(nodes)
    budget = peak_bytes(problem, ()) - 10
    optimum = solve(problem, budget, method="brute_force").recompute_ms
    assert optimum == 55.0
    assert recompute_lower_bound(problem, budget).recompute_ms == optimum * (1 - 1e-6)


def test_a_region_recomputes_in_full_what_its_later_nodes_read():
    # `a` saves 10 bytes and stops early (0.1 ms; 3 ms in full); `b` reads and saves its
    # output and saves 10 bytes of its own. Both 10s must go. One region recomputes `a` in
    # full, since `b`'s recomputation reads its output (3 + 1 + one 2 ms call); two regions
    # stop `a` early but pay two calls (0.1 + 1 + 2 * 2): 5.1 ms, not 0.1 + 1 + 2.
    nodes = (NodeCost("a", compute_ms=3.0, stop_ms=0.1, output_bytes=1, saved_bytes=10),
             NodeCost("b", compute_ms=1.0, output_bytes=1, saved_bytes=10, uses=(0,), saves=(0,)),
             NodeCost("head", compute_ms=0.1, output_bytes=1, backward_transient_bytes=30, uses=(1,), is_output=True))
    problem = Problem(nodes, region_overhead_ms=2.0)
    budget = peak_bytes(problem, ()) - 20
    optimum = solve(problem, budget, method="brute_force").recompute_ms
    assert optimum == pytest.approx(5.1)
    assert recompute_lower_bound(problem, budget).recompute_ms == pytest.approx(optimum * (1 - 1e-6))


def test_a_region_that_keeps_pays_for_its_policy():
    # `w`'s output (10 bytes) is saved by `x` (10 ms, keepable). Dropping it means recomputing
    # `x` (in a region with `w`: 1 + 10 ms) or keeping `x` under a selective policy while `w` is
    # recomputed: 1 ms and the policy's 3 ms per region, 0.5 ms per ATen call of its nodes in
    # forward and again in recomputation (2 calls each way) and 0.5 ms per kept node.
    nodes = (NodeCost("w", compute_ms=1.0, output_bytes=10, aten_calls=1),
             NodeCost("x", compute_ms=10.0, output_bytes=2, uses=(0,), saves=(0,), keepable=True, aten_calls=1),
             NodeCost("y", compute_ms=1.0, output_bytes=1, uses=(1,), saves=(1,), aten_calls=1),
             NodeCost("head", compute_ms=0.1, output_bytes=1, backward_transient_bytes=30, uses=(2,), is_output=True))
    problem = Problem(nodes, keep_region_ms=3.0, keep_call_ms=0.5, kept_node_ms=0.5)
    budget = peak_bytes(problem, ()) - 10
    plan = solve(problem, budget, method="brute_force")
    assert plan.kept == (1,) and plan.recompute_ms == 1.0 + 3.0 + 0.5 * 4 + 0.5
    assert recompute_lower_bound(problem, budget).recompute_ms == pytest.approx(plan.recompute_ms * (1 - 1e-6))


def test_a_kept_output_stays_until_backward_recomputes_its_region():
    # `gelu`'s output (20 bytes) is saved by `fc2` (10 ms, keepable), whose own output (5 bytes)
    # forward frees after `add`. Keeping `fc2` in a region [gelu, fc2] recomputes only `gelu`
    # (1 ms) but caches `fc2`'s output until backward reaches the region, through the head's
    # backward, the peak: 15 bytes gone, not 20. The cheapest plan that fits runs the region on
    # to `norm`, which drops `add`'s output too (3 ms). Before, the bound said 1 ms.
    nodes = (NodeCost("gelu", compute_ms=1.0, output_bytes=20, aten_calls=1),
             NodeCost("fc2", compute_ms=10.0, output_bytes=5, uses=(0,), saves=(0,), keepable=True, aten_calls=1),
             NodeCost("add", compute_ms=1.0, output_bytes=5, uses=(1,), aten_calls=1),
             NodeCost("norm", compute_ms=1.0, output_bytes=1, uses=(2,), saves=(2,), aten_calls=1),
             NodeCost("head", compute_ms=0.1, output_bytes=1, backward_transient_bytes=40, uses=(3,), is_output=True))
    problem = Problem(nodes)
    budget = peak_bytes(problem, ()) - 20
    assert peak_bytes(problem, (range(0, 2),), kept=(1,)) > budget
    plan = solve(problem, budget, method="brute_force")
    assert plan.regions == (range(0, 4),) and plan.kept == (1,) and plan.recompute_ms == 3.0
    assert recompute_lower_bound(problem, budget).recompute_ms == pytest.approx(3.0 * (1 - 1e-6))


def test_recomputation_brings_back_what_the_region_dropped():
    # Region [a, b] drops `a`'s output and saved tensors and `b`'s output until backward reaches
    # `b`, which recomputes them all: at `b`'s backward (its parameter gradients, the gradient
    # from the head) they are back, as in the unplanned step. So nothing frees 14 bytes there,
    # and no plan fits; before, the bound priced [a, b] at 2 ms as if they were still gone.
    nodes = (NodeCost("a", compute_ms=1.0, output_bytes=8, saved_bytes=5, grad_bytes=2),
             NodeCost("b", compute_ms=1.0, output_bytes=2, uses=(0,), saves=(0, 1), param_grad_bytes=3),
             NodeCost("head", compute_ms=1.0, output_bytes=16, grad_bytes=2, uses=(1,), saves=(2,), is_output=True))
    problem = Problem(nodes)
    budget = peak_bytes(problem, ()) - 14
    assert minimum_peak_bytes(problem) == budget + 1
    assert recompute_lower_bound(problem, budget).recompute_ms == math.inf
