"""Solver layer: hand-made cases and the public API (the literature's graph files: test_graph_files.py)."""
from __future__ import annotations

import ast
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import solvers
from solvers import (
    SOLVERS,
    InfeasibleBudget,
    NodeCost,
    Problem,
    Status,
    minimum_peak_bytes,
    peak_bytes,
    simulate,
    solve,
)
from solvers.brute_force import solve_brute_force
from solvers.region_scan import scan_regions
from solvers.sqrt import max_segments, segments
from solvers.structure import Structure

ROOT = Path(__file__).resolve().parents[1]
EXACT = ("dp", "ilp", "brute_force")


def node(name: str, size: int, ms: float = 1.0, uses=(), saves=(), **extra) -> NodeCost:
    return NodeCost(name, compute_ms=ms, output_bytes=size, grad_bytes=size, uses=uses, saves=saves, **extra)


def chain(sizes: list[int], costs: list[float]) -> Problem:
    """Each node reads and saves its predecessor (like a stack of linear layers)."""
    nodes = [node("n0", sizes[0], costs[0])]
    for i in range(1, len(sizes)):
        nodes.append(node(f"n{i}", sizes[i], costs[i], uses=(i - 1,), saves=(i - 1,)))
    nodes[-1] = NodeCost(**{**nodes[-1].__dict__, "is_output": True})
    return Problem(tuple(nodes))


def test_chain_picks_the_cheap_region():
    # Budget 40 (one below the unplanned peak 50, see tests/test_simulate.py): recompute some
    # of a, b, c. a is expensive, so the optimum recomputes {b, c} (cost 2) and nothing else.
    problem = chain([10, 10, 10, 10], [5.0, 1.0, 1.0, 1.0])
    assert peak_bytes(problem) == 50
    for method in EXACT:
        solution = solve(problem, 40, method=method)
        assert solution.regions == (range(1, 3),), method
        assert solution.recompute_ms == 2.0 and solution.peak_bytes == 40 and solution.status == Status.OPTIMAL


def test_checkpoints_cost_per_saved_tensor_steers_the_plan():
    # Two regions fit at budget 40 for the same compute, {a, b} and {b, c}; c saves 40 tensors,
    # which checkpoint packs and unpacks at 0.1 ms each, so only {a, b} is the optimum.
    plain = chain([10, 10, 10, 10], [1.0, 1.0, 1.0, 1.0])
    assert solve(plain, 40, method="dp").regions == (range(1, 3),)
    nodes = list(plain.nodes)
    nodes[2] = NodeCost(**{**nodes[2].__dict__, "saved_tensors": 40})
    problem = Problem(tuple(nodes), saved_tensor_ms=0.1)
    assert math.isclose(problem.recompute_ms((range(1, 3),)), 6.0)
    for method in EXACT:
        solution = solve(problem, 40, method=method)
        assert solution.regions == (range(0, 2),) and solution.recompute_ms == 2.0, method


def test_budget_at_the_unplanned_peak_needs_no_regions():
    problem = chain([10, 20, 30], [1.0, 1.0, 1.0])
    for method in (*EXACT, "sqrt", "auto"):
        solution = solve(problem, peak_bytes(problem), method=method)
        assert solution.regions == () and solution.recompute_ms == 0.0, method


def test_skip_connection_input_is_counted_once():
    # a feeds b and d; b, c and d form a region that keeps a once, as its input.
    problem = Problem((
        node("a", 10),
        node("b", 10, uses=(0,), saves=(0,)),
        node("c", 10, uses=(1,), saves=(1,)),
        node("d", 10, uses=(0, 2), saves=(0, 2), is_output=True),
    ))
    for budget in range(minimum_peak_bytes(problem), peak_bytes(problem) + 1):
        truth = solve_brute_force(problem, budget)
        for method in ("dp", "ilp"):
            assert solve(problem, budget, method=method).recompute_ms == truth.recompute_ms, method


def test_in_place_writes_forbid_region_starts():
    # relu_ writes b in place, so no region may start at relu_ or c (they would recompute
    # from the mutated b).
    problem = Problem((
        node("a", 10),
        node("b", 10, uses=(0,), saves=(0,)),
        NodeCost("relu_", 0.1, uses=(1,), mutates=(1,)),
        node("c", 10, uses=(1,), saves=(1,), is_output=True),
    ))
    minimum = minimum_peak_bytes(problem)
    for method in EXACT:
        solution = solve(problem, minimum, method=method)
        assert all(problem.can_start_region(region.start) for region in solution.regions), method


def test_infeasible_budget_carries_the_minimum():
    problem = chain([10, 10, 10, 10], [1.0, 1.0, 1.0, 1.0])
    minimum = minimum_peak_bytes(problem)
    assert minimum == min(peak_bytes(problem, plan) for plan in solvers.brute_force.all_plans(problem))
    for method in (*EXACT, "auto"):
        with pytest.raises(InfeasibleBudget) as raised:
            solve(problem, minimum - 1, method=method)
        assert raised.value.minimum_bytes == minimum and raised.value.proven, method
        assert method.replace("auto", "dp") in str(raised.value)


def test_sqrt_tries_up_to_four_sqrt_n_segments_and_calls_its_minimum_unproven(monkeypatch):
    problem = chain([10] * 400, [1.0] * 400)
    assert max_segments(len(problem)) == 80 and max_segments(100) == 64 and max_segments(20) == 20
    peaks = {count: peak_bytes(problem, segments(problem, count)[:-1]) for count in range(1, 81)}
    least = min(peaks.values())
    # on a chain, more segments only hold more
    assert all(peak_bytes(problem, segments(problem, count)[:-1]) > least for count in range(81, 401, 8))
    simulated = []
    monkeypatch.setattr(solvers.sqrt, "peak_bytes", lambda *args: simulated.append(args) or peak_bytes(*args))
    with pytest.raises(InfeasibleBudget) as raised:
        solve(problem, least - 1, method="sqrt")
    assert raised.value.minimum_bytes == least and not raised.value.proven
    assert "the least it reached: another solver may fit less" in str(raised.value)
    assert len(simulated) <= 81  # no plan at all, then 1..80 segments
    fitted = solve(problem, least, method="sqrt")
    assert fitted.peak_bytes == least and len(fitted.regions) + 1 <= 80


def test_budget_below_static_memory():
    problem = Problem((node("a", 10, saves=(0,), is_output=True),), static_bytes=1000)
    for method in (*EXACT, "sqrt"):
        with pytest.raises(InfeasibleBudget, match="static memory dominates"):
            solve(problem, 500, method=method)


def test_empty_graph():
    problem = Problem((), static_bytes=7)
    for method in EXACT:
        assert solve(problem, 7, method=method).regions == ()
        with pytest.raises(InfeasibleBudget):
            solve(problem, 6, method=method)


def test_api_errors():
    problem = chain([1] * 13, [1.0] * 13)
    with pytest.raises(ValueError, match="refuses graphs over 12 nodes"):
        solve(problem, 100, method="brute_force")
    with pytest.raises(ValueError, match="unknown solver"):
        solve(problem, 100, method="greedy")
    with pytest.raises(TypeError, match="dp got unknown options"):
        solve(problem, 100, method="dp", time_limit_s=3)
    with pytest.raises(TypeError, match="ilp got unknown options"):
        solve(problem, 100, method="ilp", max_states=3)
    assert set(SOLVERS) == {"sqrt", "dp", "ilp", "brute_force"}


def test_ilp_reports_gap_and_time_limit():
    problem = chain([4, 9, 3, 8, 7, 2, 9, 5], [1.0, 2.0, 0.5, 3.0, 1.0, 1.5, 2.0, 1.0])
    budget = (minimum_peak_bytes(problem) + peak_bytes(problem)) // 2
    solution = solve(problem, budget, method="ilp")
    assert solution.status == Status.OPTIMAL and solution.gap == 0.0
    assert solution.recompute_ms == solve(problem, budget, method="dp").recompute_ms


def test_ilp_without_ortools_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    monkeypatch.setitem(sys.modules, "ortools.sat.python.cp_model", None)
    problem = chain([10, 10, 10], [1.0, 1.0, 1.0])
    with pytest.raises(ImportError, match="OR-Tools"):
        solve(problem, peak_bytes(problem) - 1, method="ilp")


def test_dp_status_on_a_wide_graph_is_honest():
    # 14 independent branches joined at the end: more frontier sets than dp keeps when capped.
    branches = [node(f"b{i}", 10 + i, ms=1.0 + i / 8, saves=(i,)) for i in range(14)]
    problem = Problem((*branches, node("join", 1, uses=tuple(range(14)), saves=tuple(range(14)), is_output=True)))
    budget = (minimum_peak_bytes(problem) + peak_bytes(problem)) // 2
    capped = solve(problem, budget, method="dp", max_states=2)
    exact = solve(problem, budget, method="dp")
    assert exact.status == Status.OPTIMAL
    assert capped.recompute_ms >= exact.recompute_ms
    assert capped.status == Status.OPTIMAL or capped.status == Status.FEASIBLE


def test_dp_bounds_its_search_on_long_chains_and_says_so():
    import random

    rng = random.Random(0)
    sizes = [rng.choice([0, 64, 256, 1024]) for _ in range(1200)]
    problem = chain(sizes, [rng.uniform(0.1, 2.0) for _ in sizes])
    budget = (minimum_peak_bytes(problem) + peak_bytes(problem)) // 2
    bounded = solve(problem, budget, method="dp")
    assert bounded.status == Status.FEASIBLE and bounded.peak_bytes <= budget
    assert all(len(region) <= 128 for region in bounded.regions)
    assert all(problem.nodes[region.start].output_bytes >= 1024 * 0.01 for region in bounded.regions)
    assert bounded.recompute_ms <= solve(problem, budget, method="sqrt").recompute_ms


def test_solvers_never_import_torch_and_never_print():
    code = "import sys, solvers; assert 'torch' not in sys.modules and 'ortools' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    for path in (ROOT / "solvers").glob("*.py"):
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "print"]
        assert not calls, f"{path.name} prints"


def test_lp_relaxation_is_silent_and_bounds_the_optimum(capfd):
    # HiGHS prints a banner on stdout unless told not to; the bound is at most the optimum.
    from solvers.ilp.lp_relaxation import LinearRelaxation
    from solvers.ilp.model import build_model

    chain = [NodeCost(f"n{i}", 1.0 + i, output_bytes=8, uses=(i - 1,) if i else (), saves=(i,)) for i in range(6)]
    problem = Problem(tuple(chain))
    budget = peak_bytes(problem) * 2 // 3
    live = budget - problem.static_bytes
    built = build_model(problem, live, live)
    relaxation = LinearRelaxation(built.model).solve(time_limit_s=10.0)
    assert relaxation is not None
    optimum = solve(problem, budget, method="brute_force").recompute_ms
    assert relaxation.objective / built.objective_scale <= optimum
    out, err = capfd.readouterr()
    assert out == "" and "HiGHS" not in err


def test_branching_node_parts_a_mix_of_plans_at_its_long_regions_costliest_node():
    # Half of region [0, 6) and half of [2, 6): the LP takes half of the long region from node
    # 0, and of the nodes it leaves half out (0 and 1) the costlier one is where to branch.
    from solvers.ilp.model import build_model
    from solvers.ilp.warm_start import branching_node as _branching_node
    from solvers.ilp.warm_start import hint_plan

    chain = [NodeCost(f"n{i}", [5.0, 9.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0][i], output_bytes=8,
                      uses=(i - 1,) if i else (), saves=(i,)) for i in range(8)]
    problem = Problem(tuple(chain))
    live = peak_bytes(problem) - problem.static_bytes
    built = build_model(problem, live, live)

    def values(plan: tuple[range, ...]) -> list[float]:
        built.model.clear_hints()
        assert hint_plan(built, problem, plan)
        vector = [0.0] * len(built.model.proto.variables)
        for index, value in zip(built.model.proto.solution_hint.vars, built.model.proto.solution_hint.values):
            vector[index] = float(value)
        return vector

    long, short = values((range(0, 6),)), values((range(2, 6),))
    assert _branching_node(built, tuple(long)) is None  # an integral solution: nothing to part
    assert _branching_node(built, tuple(0.5 * a + 0.5 * b for a, b in zip(long, short))) == 1


def test_rounded_lp_plan_leaves_out_regions_the_problem_does_not_allow():
    # LP values can round to a region the problem does not allow (here [1, 2) of a call [0, 3)
    # with no runs): the rounded plan leaves it out, so the search it hints does not fail on it.
    from solvers.ilp.model import build_model
    from solvers.ilp.warm_start import rounded_plan, search_restricted

    problem = replace(chain([10, 10, 10, 10], [5.0, 1.0, 1.0, 1.0]), allowed_regions=(range(0, 3), range(1, 3)))
    assert not problem.allows_region(1, 2)
    built = build_model(problem, 40, 40)

    def values(*members: tuple[int, int]) -> tuple[float, ...]:
        vector = [0.0] * len(built.model.proto.variables)
        for i, a in members:
            vector[built.member[i][a].index] = 1.0
        return tuple(vector)

    assert rounded_plan(built, values((1, 1), (2, 1))) == (range(1, 3),)
    hint = rounded_plan(built, values((1, 1))), ()
    assert hint == ((), ())
    (regions, kept), proven = search_restricted(problem, 40, 3, frozenset(), hint, 10.0, 1)
    assert regions == (range(1, 3),) and kept == () and proven


def test_ilp_recomputes_a_run_inside_a_call_and_pays_its_recording():
    # The call [0, 4) may recompute its run [1, 3) alone: the cheapest plan at budget 40 (as in
    # test_chain_picks_the_cheap_region), at 2 ms of recomputation, 0.5 ms per region and the
    # run's recording: 0.25 per call of the call's forward and 0.125 per call of the run.
    nodes = chain([10, 10, 10, 10], [5.0, 1.0, 1.0, 1.0]).nodes
    problem = Problem(tuple(replace(n, aten_calls=2) for n in nodes), allowed_regions=(range(0, 4),),
                      run_spans=(range(0, 4),), region_overhead_ms=0.5, run_call_ms=0.25, recorded_call_ms=0.125)
    assert problem.run_span_of(range(1, 3)) == range(0, 4)
    for method in EXACT:
        solution = solve(problem, 40, method=method, **({"hint": False} if method == "ilp" else {}))
        assert solution.regions == (range(1, 3),), method
        assert solution.recompute_ms == 2.0 + 0.5 + 0.25 * 8 + 0.125 * 4 and solution.status == Status.OPTIMAL


def _block(keepable: bool) -> Problem:
    """x -> matmul -> gelu -> matmul -> sum: the matmuls are dear to recompute, gelu is cheap."""
    return Problem(nodes=(
        node("x", 4),
        node("mm1", 8, 8.0, uses=(0,), saves=(0,), keepable=keepable),
        node("gelu", 8, 1.0, uses=(1,), saves=(1,)),
        node("mm2", 4, 8.0, uses=(2,), saves=(2,), keepable=keepable),
        node("out", 4, 1.0, uses=(3,), is_output=True),
    ))


@pytest.mark.parametrize("method", EXACT)
def test_keeping_a_matmul_inside_a_region_is_cheaper_where_it_fits(method):
    selective, whole = _block(True), _block(False)
    cheaper = []
    for budget in range(minimum_peak_bytes(whole), peak_bytes(whole)):
        with_keeps = solve(selective, budget, method=method)
        without = solve_brute_force(whole, budget)
        assert with_keeps.peak_bytes <= budget
        assert with_keeps.recompute_ms <= without.recompute_ms + 1e-9
        if with_keeps.recompute_ms < without.recompute_ms - 1e-9:
            cheaper.append(with_keeps)
    assert cheaper, "no budget where keeping a matmul's output beats recomputing it"
    assert all(solution.kept and set(solution.kept) <= {1, 3} for solution in cheaper)
    # Recomputation skips what a region keeps.
    plan = cheaper[0]
    assert plan.recompute_ms == selective.recompute_ms(plan.regions, plan.kept) < selective.recompute_ms(plan.regions)


def test_a_region_keeps_only_its_first_candidates_that_recomputation_reaches():
    many = Problem(nodes=tuple(node(f"mm{i}", 4, 2.0, uses=(i - 1,) if i else (), saves=(i - 1,) if i else (),
                                    keepable=True) for i in range(solvers.problem.MAX_KEEP_CANDIDATES + 2)))
    whole = range(0, len(many))
    assert many.keep_candidates(whole) == ()  # more keepable nodes than a region may choose among
    # recomputation of [0, 3) runs up to node 2, the last that saves a tensor (node 1)
    assert many.keep_candidates(range(0, 3)) == (0, 1, 2)
    # any keepable node makes a valid plan, though the solvers search only `keep_choices`
    assert peak_bytes(many, (whole,), (1,)) >= peak_bytes(many, (whole,))
    with pytest.raises(ValueError, match="cannot be kept"):
        peak_bytes(many, (range(0, 3),), (5,))


def test_a_runs_fixed_cost_may_not_be_negative():
    nodes = (NodeCost("a", 1.0, output_bytes=8), NodeCost("b", 1.0, output_bytes=8, uses=(0,), saves=(0,)))
    allowed = (range(0, 2),)
    # a run's residual may lie under a checkpoint call's, down to -region_overhead_ms
    Problem(nodes, allowed_regions=allowed, run_spans=allowed, region_overhead_ms=0.5, run_region_ms=-0.5)
    with pytest.raises(ValueError, match="run_region_ms"):
        Problem(nodes, allowed_regions=allowed, run_spans=allowed, region_overhead_ms=0.5, run_region_ms=-0.75)


def test_a_run_holds_a_recomputed_output_only_until_its_last_read():
    # x is read by y alone, but the model's code holds it while z runs (a local variable).
    # Recomputing the submodule call [1, 4) runs that code again and holds x's copy until z;
    # the run [1, 4) inside the call [0, 5) replays recorded calls and frees it after y.
    nodes = (NodeCost("a", 1.0, output_bytes=4, grad_bytes=4),
             NodeCost("x", 1.0, output_bytes=100, grad_bytes=100, uses=(0,), saves=(0,)),
             NodeCost("y", 1.0, output_bytes=8, grad_bytes=8, uses=(1,)),
             NodeCost("z", 1.0, output_bytes=8, grad_bytes=8, uses=(2,), saves=(2,), holds=(1,)),
             NodeCost("out", 1.0, output_bytes=4, grad_bytes=4, uses=(3,), saves=(3,), is_output=True))
    call, region = range(1, 4), range(0, 5)
    as_call = Problem(nodes, allowed_regions=(call,))
    as_run = Problem(nodes, allowed_regions=(region,), run_spans=(region,))
    step = simulate(as_call, (call,)).labels.index("recompute z")
    assert simulate(as_call, (call,)).live_bytes[step] - simulate(as_run, (call,)).live_bytes[step] == 100
    # The region scans that dp and ilp share: the recomputation's own peak of [1, 4) is x, y
    # and z at z's step (116) as a call; x and y at y's step (108) as a run.
    recompute = {replayed: {e: bytes_ for e, _, bytes_ in scan_regions(Structure.of(as_run), as_run, 1, (), replayed)}
                 for replayed in (False, True)}
    assert (recompute[False][3], recompute[True][3]) == (116, 108)
    # The solvers' region scans agree with the simulator: at every budget, dp and ilp find
    # the plan brute force finds.
    low, high = minimum_peak_bytes(as_run), peak_bytes(as_run)
    for budget in range(low, high + 1):
        truth = solve_brute_force(as_run, budget)
        for method in ("dp", "ilp"):
            found = solve(as_run, budget, method=method)
            assert found.recompute_ms == pytest.approx(truth.recompute_ms), (method, budget)


def test_a_run_keeps_no_input_that_a_submodule_call_is_only_passed():
    # c1 starts a submodule call passed a and x that reads only x (`arguments`). Checkpointing
    # a region [1, 4) keeps a until the region's backward, as checkpoint keeps what a call it
    # wraps is passed; a run [1, 4) inside the call [0, 5) records ATen calls, and its tape
    # keeps only what they read: a is freed once the forward is done.
    nodes = (NodeCost("a", 1.0, output_bytes=100, grad_bytes=100),
             NodeCost("x", 1.0, output_bytes=8, grad_bytes=8),
             NodeCost("c1", 1.0, output_bytes=500, grad_bytes=500, uses=(1,), saves=(1,), arguments=(0, 1)),
             NodeCost("c2", 1.0, output_bytes=8, grad_bytes=8, uses=(2,), saves=(2,)),
             NodeCost("out", 1.0, output_bytes=4, grad_bytes=4, uses=(3, 0), saves=(3,), is_output=True))
    region = range(1, 4)
    as_call = Problem(nodes, allowed_regions=(region,))
    as_run = Problem(nodes, allowed_regions=(range(0, 5), range(2, 4)), run_spans=(range(0, 5),))
    assert as_run.run_span_of(region) is not None and as_call.run_span_of(region) is None
    call, run = simulate(as_call, (region,)), simulate(as_run, (region,))
    step = call.labels.index("backward c2")
    assert call.live_bytes[step] - run.live_bytes[step] == 100
    # dp and ilp (its own model, not dp's plan) hold what the simulator holds: at every budget
    # they find brute force's plan.
    low, high = minimum_peak_bytes(as_run), peak_bytes(as_run)
    for budget in range(low, high + 1):
        truth = solve_brute_force(as_run, budget)
        for method, options in (("dp", {}), ("ilp", {"hint": False})):
            found = solve(as_run, budget, method=method, **options)
            assert found.recompute_ms == pytest.approx(truth.recompute_ms), (method, budget)
