"""Random small solver problems and the brute-force truth the property tests check every exact
solver against (`test_solver_properties`, `test_solver_module_properties`, `test_recompute_bound`).

Graphs are random chains and DAGs of at most 9 nodes (at most 4 181 plans, so enumerating them
stays fast) with random output, saved, temporary and gradient bytes (late ones too), memoryless views, skip
connections, several consumers per output, in-place writes, returned outputs and static memory. Compute times are
multiples of 1/4 ms, so sums are exact and ties are real ties.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck
from hypothesis import strategies as st

from solvers import InfeasibleBudget, NodeCost, Problem, Status, peak_bytes, solve
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
        param_grad_bytes = draw(st.sampled_from([0, 0, 3]))
        nodes.append(
            NodeCost(
                f"n{i}",
                compute_ms=draw(st.integers(0, 12)) / 4,
                output_bytes=draw(sizes),
                grad_bytes=draw(sizes),
                saved_bytes=draw(st.sampled_from([0, 0, 2, 5])),
                transient_bytes=draw(st.sampled_from([0, 0, 0, 7])),
                param_grad_bytes=param_grad_bytes,
                # a linear's bias: summed after its backward returns, once its unpacks have freed
                late_grad_bytes=draw(st.integers(0, param_grad_bytes)),
                # `x * 0.5`'s number, saved past checkpoint's hooks: held whatever the plan
                unhooked_saved_bytes=draw(st.sampled_from([0, 0, 0, 8])),
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
                # an output the loss does not read: no gradient reaches it, nor through it
                backward_runs=i == n - 1 or draw(st.integers(0, 9)) != 0,
                random=draw(st.integers(0, 4)) == 0,  # dropout: its region keeps an RNG state
                # BatchNorm's running statistics: a region holding it copies them to recompute
                buffer_bytes=draw(st.sampled_from([0, 0, 0, 0, 2])),
                # a linear or GELU: recomputation stopping here never makes its output
                stops_before_output=i not in saves and draw(st.booleans()),
                # forward time up to its last save (a dropout's mask: most of it; a linear: none)
                stop_ms=draw(st.sampled_from([None, 0.0, 0.25, 1.0])),
                # its temporaries up to its last save (a convolution's scratch comes after it)
                stop_transient_bytes=draw(st.sampled_from([None, 0, 9])),
                # a matmul: a region may keep its output (a selective-checkpoint policy)
                keepable=not mutates and draw(st.integers(0, keepable_odds - 1)) == 0,
                aten_calls=draw(st.integers(0, 3)),
                saved_tensors=draw(st.integers(0, 3)),  # checkpoint packs each (Problem.saved_tensor_ms)
                # reads or writes a graph input written in place later: in no region
                recomputable=draw(st.integers(0, 14)) != 0,
            )
        )
    # Gradients in flight as measured (planner.measure.allocations.BackwardMemory), sometimes: any
    # spans of backward steps, which replace the ones derived from the graph.
    span = st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), sizes).map(
        lambda t: (min(t[0], t[1]), max(t[0], t[1]), t[2]))
    measured = tuple(draw(st.lists(span, max_size=4))) if draw(st.integers(0, 2)) == 0 else None
    # and memory backward holds beside them whatever the plan (FSDP2's unsharded gradients)
    held = tuple(draw(st.lists(span, max_size=2))) if draw(st.integers(0, 3)) == 0 else ()
    return Problem(tuple(nodes), static_bytes=draw(st.sampled_from([0, 100])),
                   rng_state_bytes=draw(st.sampled_from([0, 3, 6])), measured_gradients=measured,
                   held_in_backward=held,
                   # the loss outside the graph: its scratch when forward is done
                   loss_scratch_bytes=draw(st.sampled_from([0, 0, 5, 40])))


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
    if options.get("keep_spans"):  # kept only in allowed regions within a span (planner.measure.holds)
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
        # a call passed outputs it does not read: a region that is the call keeps them, a run
        # through its first node does not
        starts = {r.start for r in allowed if r.start > 0}
        nodes = tuple(replace(node, arguments=tuple(sorted(draw(st.sets(st.integers(0, i - 1), min_size=1, max_size=2)))))
                      if i in starts and draw(st.booleans()) else node for i, node in enumerate(nodes))
    # with `segments`, some allowed regions are slices of a Sequential's children: they keep nothing
    segments = tuple(r for r in allowed if r not in run_spans and draw(st.booleans())) if options.get("segments") else ()
    return Problem(nodes, problem.static_bytes, allowed_regions=allowed, region_overhead_ms=overhead,
                   rng_state_bytes=problem.rng_state_bytes, measured_gradients=problem.measured_gradients,
                   held_in_backward=problem.held_in_backward, loss_scratch_bytes=problem.loss_scratch_bytes,
                   keep_region_ms=keep_region_ms,
                   keep_call_ms=keep_call_ms, saved_tensor_ms=saved_tensor_ms,
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
