"""The simulator against peaks computed by hand.

Conventions of the hand computations: steps are forward 0..n-1, the loss, then backward n-1..0, with a
region's recomputation just before the backward of its last node. An output lives from its
node until its last forward use, its last saver's backward, or (as a region input) the end of
that region's backward. A gradient lives from its last consumer's backward to its owner's; a
returned tensor's from backward's first step (the loss's backward makes it, before any node's).
"""
import dataclasses

import pytest

from solvers import NodeCost, Problem, peak_bytes, simulate
from solvers.simulate import gradient_spans, plan_buffers, validate_regions


def node(name, size, uses=(), saves=(), **extra):
    return NodeCost(name, compute_ms=1.0, output_bytes=size, grad_bytes=size, uses=uses, saves=saves, **extra)


def chain4() -> Problem:
    return Problem((
        node("a", 10),
        node("b", 10, uses=(0,), saves=(0,)),
        node("c", 10, uses=(1,), saves=(1,)),
        node("d", 10, uses=(2,), saves=(2,), is_output=True),
    ))


def test_chain_without_plan():
    # F0..F3: a, a+b, a+b+c, a+b+c+d.  The loss: the same.  B3: a,b,c + grads c,d.
    # B2: a,b + grads b,c.  B1: a + grads a,b.  B0: grad a.
    timeline = simulate(chain4(), ())
    assert timeline.live_bytes == (10, 20, 30, 40, 40, 50, 40, 30, 10)
    assert timeline.peak_bytes == 50


def test_chain_with_one_region():
    # Region {b, c}: a is its input (held until B1); b is dropped after c's forward; c is kept
    # because d (outside) saves it. Steps F0-F3, the loss, B3, RC-b, RC-c, B2, B1, B0.
    timeline = simulate(chain4(), (range(1, 3),))
    assert timeline.labels[4:9] == ("loss", "backward d", "recompute b", "recompute c", "backward c")
    assert timeline.live_bytes == (10, 20, 30, 30, 30, 40, 30, 40, 40, 30, 10)
    assert timeline.peak_bytes == 40


def test_region_whose_input_is_another_regions_output():
    # Regions {a, b} and {c, d}: b is the second region's input, held until B2. d's gradient
    # (10) is alive while {c, d} recomputes: the loss's backward made it before d's backward.
    # At the loss, c (read by d alone, in its region) is gone: b and d are left.
    timeline = simulate(chain4(), (range(0, 2), range(2, 4)))
    assert timeline.labels[4:8] == ("loss", "recompute c", "recompute d", "backward d")
    assert timeline.live_bytes == (10, 20, 20, 30, 20, 30, 40, 40, 30, 20, 30, 30, 10)
    assert timeline.peak_bytes == 40


def test_diamond():
    problem = Problem((
        node("a", 10),
        node("b", 20, uses=(0,), saves=(0,)),
        node("c", 30, uses=(0,), saves=(0,)),
        node("d", 5, uses=(1, 2), saves=(1, 2), is_output=True),
    ))
    # B3 holds a, b, c and the gradients of b, c, d: 10+20+30 + 20+30+5 = 115.
    assert simulate(problem, ()).live_bytes == (10, 30, 60, 65, 65, 115, 70, 40, 10)
    assert peak_bytes(problem) == 115


def test_skip_connection():
    problem = Problem((
        node("a", 10),
        node("b", 10, uses=(0,), saves=(0,)),
        node("c", 10, uses=(0, 1), saves=(1,), is_output=True),
    ))
    # a's gradient starts at c's backward (its last consumer), not at b's.
    assert simulate(problem, ()).live_bytes == (10, 20, 30, 30, 50, 30, 10)


def test_the_loss_runs_after_forward_with_what_forward_leaves_for_backward():
    # The loss's scratch (40) comes once the last node's temporaries (25) are gone, and b, which
    # only c read and nothing saved, with them: a (saved by b) and c (returned) are left.
    problem = Problem((
        node("a", 10),
        node("b", 10, uses=(0,), saves=(0,)),
        node("c", 10, uses=(1,), transient_bytes=25, is_output=True),
    ), loss_scratch_bytes=40)
    timeline = simulate(problem, ())
    assert timeline.labels[2:4] == ("forward c", "loss")
    assert timeline.live_bytes[2:4] == (30, 20)
    assert timeline.peak_bytes == 20 + 40 and timeline.peak_step == 3  # (forward c: 30 + 25)
    # With b in a region, its input a is held for it, and it saves nothing: the same at the loss.
    assert simulate(problem, (range(1, 2),)).live_bytes[3] == 20


def test_static_saved_transient_and_parameter_gradients():
    problem = Problem(
        (
            NodeCost("a", 1.0, output_bytes=10, saved_bytes=7, transient_bytes=100),
            NodeCost("b", 1.0, output_bytes=10, uses=(0,), saves=(0,), param_grad_bytes=50, is_output=True),
        ),
        static_bytes=1000,
    )
    # F0: a + its saved 7, plus 100 of temporaries -> 117. F1 and the loss: a, 7, b -> 27. B1: b
    # is not saved, so it is gone: a (saved by b) + 7, plus 50 of parameter gradients -> 67. B0: 7.
    timeline = simulate(problem, ())
    assert timeline.live_bytes == (17, 27, 27, 17, 7)
    assert timeline.peak_bytes == 1000 + 117
    # In a region, a's saved bytes are created and dropped in forward, then held again from
    # its recomputation until its backward.
    assert simulate(problem, (range(0, 1),)).peak_bytes == 1000 + 117


def test_shared_parameter_gradient_lives_from_last_to_first_user():
    # A weight read by a (an embedding) and c (the tied output layer): c's backward, which runs
    # first, creates a 40-byte gradient that is held until B0, where autograd adds a's
    # contribution (a temporary of B0, param_grad_bytes) and hands the sum to `.grad`.
    problem = Problem((
        node("a", 10, param_grad_bytes=40),
        node("b", 10, uses=(0,), saves=(0,)),
        node("c", 10, uses=(1,), saves=(1,), is_output=True, shared_grads=((0, 40),)),
    ))
    # Without sharing: F 10,20,30; the loss 30; B2: a,b + grads b,c = 40; B1: a + grads a,b = 30;
    # B0: 10. With it: 40 more from B2 to B0, and B0's 40-byte temporary on top of its 50.
    timeline = simulate(problem, ())
    assert timeline.live_bytes == (10, 20, 30, 30, 80, 70, 50)
    assert timeline.peak_bytes == 90
    # In a region, the hold is the same: it does not depend on the plan.
    assert simulate(problem, (range(1, 2),)).live_bytes[-1] == 50


def test_gradients_for_views_live_until_the_views_backward():
    # a (16 B) is read by c through view b (a transpose), then by d: c's gradient for the view
    # is a storage of its own from B2 until B1, where it is summed into a's (made at B3). d is
    # read by f through slice s (8 B): f's gradient for the slice lives from B5 to B4, where
    # the slice's backward makes d's (16 B), which lives until B3.
    problem = Problem((
        node("a", 16),
        node("b", 0, uses=(0,)),
        node("c", 16, uses=(0,), view_grads=((0, 1, 16),)),
        node("d", 16, uses=(0, 2)),
        node("s", 0, uses=(3,)),
        node("f", 8, uses=(3,), view_grads=((3, 4, 8),), is_output=True),
    ))
    spans = gradient_spans(problem)
    assert (1, 2, 16) in spans and (3, 4, 16) in spans and (4, 5, 8) in spans
    assert (3, 5, 16) not in spans
    assert (1, 2, 16) not in gradient_spans(dataclasses.replace(problem, nodes=tuple(
        dataclasses.replace(n, view_grads=()) for n in problem.nodes)))


def test_regions_must_be_disjoint_sorted_and_startable():
    problem = Problem((
        node("a", 10),
        node("b", 10, uses=(0,)),
        NodeCost("relu_", 1.0, uses=(1,), mutates=(1,)),  # writes b in place
        node("c", 10, uses=(1,)),
    ))
    with pytest.raises(ValueError, match="overlaps"):
        validate_regions(problem, (range(0, 2), range(1, 3)))
    with pytest.raises(ValueError, match="in place"):
        validate_regions(problem, (range(2, 4),))
    validate_regions(problem, (range(0, 3), range(3, 4)))


def test_problem_rejects_forward_references():
    with pytest.raises(ValueError, match="not an earlier node"):
        Problem((node("a", 1, uses=(1,)), node("b", 1)))


def test_recomputation_stopping_at_a_node_pays_it_up_to_its_last_save_and_never_makes_its_output():
    # a -> linear (saves a, stops before its output) -> b: checkpoint stops at the linear's save.
    nodes = (NodeCost("a", 1.0, output_bytes=4, grad_bytes=4),
             NodeCost("linear", 2.0, output_bytes=8, grad_bytes=8, uses=(0,), saves=(0,), stops_before_output=True,
                      stop_ms=0.25),
             NodeCost("b", 4.0, output_bytes=4, grad_bytes=4, uses=(1,), is_output=True))
    problem = Problem(nodes)
    assert problem.recomputed(range(0, 3)) == range(0, 2)
    assert problem.recompute_ms((range(0, 3),)) == 1.25
    timeline = simulate(problem, (range(0, 3),))
    recompute_linear = timeline.labels.index("recompute linear")
    # a's copy (4) is held for the linear's backward; the linear's output (8) is never made.
    assert timeline.live_bytes[recompute_linear] - timeline.live_bytes[recompute_linear - 1] == 0
    # With a later saving node in the region, the linear runs whole.
    with_later_saver = Problem((*nodes[:2], NodeCost("b", 4.0, output_bytes=4, uses=(1,), saves=(1,), is_output=True)))
    assert with_later_saver.recompute_ms((range(0, 3),)) == 7.0


def test_recomputation_stopping_before_a_kernel_holds_only_the_temporaries_made_before_its_last_save():
    # A convolution saves its input, then its kernel allocates 100 B of scratch: stopped at the
    # save, the scratch never comes (stop_transient_bytes 0); run whole, in forward, it does.
    nodes = (NodeCost("a", 1.0, output_bytes=4, grad_bytes=4),
             NodeCost("conv", 2.0, output_bytes=8, grad_bytes=8, transient_bytes=100, uses=(0,), saves=(0,),
                      stops_before_output=True, stop_transient_bytes=0),
             NodeCost("b", 4.0, output_bytes=4, grad_bytes=4, uses=(1,), is_output=True))
    problem = Problem(nodes)
    buffers = plan_buffers(problem, (range(0, 3),))
    assert buffers.transient[buffers.labels.index("forward conv")] == 100
    assert buffers.transient[buffers.labels.index("recompute conv")] == 0
    unmeasured = Problem((nodes[0], dataclasses.replace(nodes[1], stop_transient_bytes=None), nodes[2]))
    buffers = plan_buffers(unmeasured, (range(0, 3),))
    assert buffers.transient[buffers.labels.index("recompute conv")] == 100  # all of it, where not measured


def test_a_recomputed_nodes_late_gradients_reuse_what_its_unpacks_free():
    # b is a linear whose 4-byte bias gradient autograd sums from b's output gradient after b's
    # backward function returns. Not recomputed, b releases what it saved after that sum; in a
    # region, b's unpack held the last reference to a's recomputed copy, freed before the sum.
    def problem(a_bytes: int, late: int) -> Problem:
        return Problem((
            NodeCost("a", 1.0, output_bytes=a_bytes, grad_bytes=a_bytes),
            NodeCost("b", 1.0, output_bytes=10, grad_bytes=10, uses=(0,), saves=(0,), param_grad_bytes=50,
                     late_grad_bytes=late, is_output=True),
        ))

    region = (range(0, 2),)
    # B1 holds a (10), the gradients of b and a (20) and b's parameter gradients (50).
    assert peak_bytes(problem(10, 4)) == peak_bytes(problem(10, 0)) == 80
    assert peak_bytes(problem(10, 0), region) == 80
    assert peak_bytes(problem(10, 4), region) == 76
    assert peak_bytes(problem(2, 4), region) == 64 - 2  # no more than a's copy frees
    # b alone recomputes nothing it unpacks: a is its region's input, kept by checkpoint.
    assert peak_bytes(problem(10, 4), (range(1, 2),)) == 80


def test_what_autograd_saves_past_the_hooks_is_held_to_the_nodes_backward_whatever_the_plan():
    # b is `a * 0.5`: its 0.5 (8 bytes) is saved past checkpoint's hooks, from F1 to B1.
    problem = Problem((
        NodeCost("a", 1.0, output_bytes=10, grad_bytes=10),
        NodeCost("b", 1.0, output_bytes=10, grad_bytes=10, uses=(0,), unhooked_saved_bytes=8),
        NodeCost("c", 1.0, output_bytes=10, grad_bytes=10, uses=(1,), saves=(1,), is_output=True),
    ))
    plain = dataclasses.replace(problem, nodes=tuple(
        dataclasses.replace(node, unhooked_saved_bytes=0) for node in problem.nodes))
    for regions in ((), (range(0, 2),), (range(1, 3),)):
        held = [a - b for a, b in zip(simulate(problem, regions).live_bytes, simulate(plain, regions).live_bytes)]
        labels = simulate(problem, regions).labels
        assert held == [8 * (labels.index("forward b") <= step <= labels.index("backward b"))
                        for step in range(len(labels))], regions
