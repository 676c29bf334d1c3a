"""What checkpoint calls and runs recomputed alone (`planner.apply.runs`) cost inside the
model's own training step (`planner.costs.step`, `planner.costs.step`): the rounds each figure is
read off, the figures' floors, and the plan priced with them. (The runs themselves:
tests/test_run_checkpoint.py.)"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import norms_and_blocks, small_gpt
from torch import nn

from planner import plan
from planner.core import counted_call
from planner.costs.overhead import forward_calls
from planner.examples import Block
from solvers import NodeCost, Problem
from solvers.problem import run_structure


def _count_replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of calls each replayed run recorded, as runs replay from now on."""
    from planner.apply.runs import RunTape

    replayed: list[int] = []
    original = RunTape.replay

    def counting(self: RunTape) -> None:
        replayed.append(len(self.calls))
        original(self)

    monkeypatch.setattr(RunTape, "replay", counting)
    return replayed


def test_recording_cost_is_measured_on_recorded_and_replayed_forwards(monkeypatch):
    # The cost per recorded call comes from steps that record every call and replay them:
    # a recorder that saw other calls than the block's (its inputs' copies) would record
    # nothing, replay nothing and measure nothing.
    from planner.costs import block as block_costs

    replayed = _count_replays(monkeypatch)
    monkeypatch.setattr(block_costs, "FINE_ROUNDS", 2)
    torch.manual_seed(0)
    block = Block(32, 4, dropout=0.1).train()
    mask = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
    x = torch.randn(2, 16, 32, requires_grad=True)
    names = [name for name in forward_calls(block, x, mask) if counted_call(name)]
    cost = block_costs.selective_costs_on(block, (x, mask), {}, 0.0, torch.device("cpu"))
    assert replayed == [len(names)] * 4  # a first try, warm-up and two rounds, every call each
    assert cost.per_counted_call_ms >= 0 and cost.per_recorded_call_ms >= 0


def test_what_calls_and_runs_cost_is_measured_in_the_models_step(monkeypatch):
    # Every call of the repeated submodule that recomputes least (a norm) checkpointed, and one
    # short run (two nodes) alone in each call of a repeated submodule recomputed, in the model's
    # own training step as a plan applies them: every run records and replays in each timed step,
    # and the model's gradients, buffers and RNG are left as they were.
    from planner.core import training_loss
    from planner.costs import step as step_costs
    from planner.costs import step as step_regions
    from planner.problem.graph import run_checkpoints, saved_calls

    model, tokens = small_gpt()
    p = plan(model, tokens, budget_gb=80, repeats=1, selective=True)
    problem, wrapped = p.problem, p.wrapped
    calls = step_regions.small_calls(problem, wrapped)
    assert len(calls) >= 2 and len({wrapped[call].module_class for call in calls}) == 1
    assert all(problem.region_recompute_ms(call) > 0 for call in calls)
    assert all(first.stop <= second.start for first, second in zip(calls, calls[1:]))
    runs = step_regions.lone_short_runs(problem, wrapped)
    spans = [problem.run_span_of(run) for run in runs]
    assert len(runs) >= 2 and all(len(run) == 2 for run in runs)
    assert len(set(spans)) == len(spans)  # each alone in its submodule call
    assert all(first.stop <= second.start for first, second in zip(runs, runs[1:]))
    assert {wrapped[span].module for span in spans} >= {"blocks.0", "blocks.1"}
    longs = step_regions.long_runs(problem, wrapped)  # one in each block, recording more calls than any short run
    long_spans = [problem.run_span_of(run) for run in longs]
    assert [wrapped[span].module for span in long_spans] == [f"blocks.{i}" for i in range(len(model.blocks))]
    calls_in = run_structure(problem)[1]
    assert min(calls_in[r.stop] - calls_in[r.start] for r in longs) > max(calls_in[r.stop] - calls_in[r.start] for r in runs)
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 0.5)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    rng = torch.get_rng_state()
    keeps = step_regions.keeping_calls(problem, wrapped)
    assert len(keeps) >= 2 and all(kept and set(kept) <= set(region) for region, kept in keeps)
    assert len({wrapped[region].module_class for region, _ in keeps}) == 1
    replayed = _count_replays(monkeypatch)
    cached: list[int] = []

    def keeping_of(pairs):
        found = [replace(wrapped[region], saved_calls=saved_calls(p.traced.gm, region, kept))
                 for region, kept in pairs]
        cached.extend(len(spec.saved_calls) for spec in found)
        return found

    found = step_costs.step_residuals(
        model, problem, wrapped, lambda regions: run_checkpoints(p.traced.gm, problem, regions, wrapped).values(),
        keeping_of, lambda module: training_loss(module(tokens)).backward(), torch.device("cpu"), rounds=2)
    assert (found.calls, found.runs, found.keeps) == (len(calls), len(runs), len(keeps))
    assert len(cached) == len(keeps) and all(cached)  # each keeping region caches some ATen calls
    blocks = step_regions.large_calls(problem, wrapped)
    assert {wrapped[region].module for region in blocks} == {f"blocks.{i}" for i in range(len(model.blocks))}
    assert found.blocks == len(blocks) and found.saved_tensor_ms is not None and found.saved_tensor_ms >= 0
    call_ms = problem.region_overhead_ms + found.per_call_ms  # a call's corrected cost: never below 0
    floor = min(call_ms, problem.region_overhead_ms) - call_ms  # a run's or a keeping region's: no less than a call's
    assert call_ms >= 0 and found.per_run_ms >= floor and found.per_keep_ms >= floor
    assert found.within_blocks == len(blocks)  # checkpoint's cost per block read within one step too
    assert len(replayed) == (len(runs) + len(longs)) * 3  # a warm-up and two rounds, every run each
    assert found.long_runs == len(longs) and found.recorded_call_ms is not None and found.recorded_call_ms >= 0
    assert all(torch.equal(parameter.grad, torch.full_like(parameter, 0.5)) for parameter in model.parameters())
    assert all(torch.equal(buffer, buffers[name]) for name, buffer in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_runs_the_step_is_read_off_each_replay(monkeypatch):
    # GPT-2's GELU (`x * 0.5`, then `x.pow(3)`, which saves x) has runs that save only their
    # input: a run keeps that, so it replays nothing, though it is priced up to pow. Read off
    # the step among the others, such runs made runs look cheaper than they are; the runs the
    # fit uses now each replay, and one of GPT-2's calls would otherwise have given one.
    from models_hf import gpt2

    from planner.apply.checkpoints import apply_plan, shallow_clone
    from planner.core import training_loss
    from planner.costs import step as step_regions
    from planner.problem.graph import run_checkpoints

    torch.manual_seed(0)
    model, sample = gpt2()
    p = plan(model, sample, budget_gb=80, repeats=1)
    problem, wrapped = p.problem, p.wrapped
    runs = [*step_regions.lone_short_runs(problem, wrapped), *step_regions.long_runs(problem, wrapped)]
    assert len(runs) >= 4 and all(step_regions.frees_saved(problem, run) for run in runs)
    phantom = [run for span in problem.run_spans if wrapped[span].module.endswith("mlp.act")
               for run in [range(start, start + 2) for start in span if start + 2 <= span.stop]
               if problem.allows_region(run.start, run.stop) and problem.run_span_of(run) == span
               and problem.region_recompute_ms(run) > 0 and not step_regions.frees_saved(problem, run)]
    assert phantom  # (GELU's `mul` and `pow`: before, the first run of each GELU call)
    replayed = _count_replays(monkeypatch)
    for run in [*runs, phantom[0]]:
        replayed.clear()
        module = apply_plan(shallow_clone(model), list(run_checkpoints(p.traced.gm, problem, [run], wrapped).values()))
        training_loss(module(**sample)).backward()
        assert len(replayed) == (0 if run is phantom[0] else 1), run


@pytest.mark.full_timing_rounds  # (with 3 rounds, the planning's own step fit may scale the node times first)
def test_node_times_far_above_what_the_step_measured_are_reported():
    # Node times far above the clock's (a machine busy while they were timed): checkpointing
    # every block then measures far below what they say its recomputation costs, and plan()
    # says so rather than pricing plans on them in silence. Fifty times, not a plausible three:
    # on this small model the checkpoint calls' own cost puts the blocks' measured overhead at
    # 2-3 times their nodes' recompute (2.0-3.0 in seven runs), so with three the warning's
    # threshold (2.55) was a coin toss and CI missed it once.
    from planner.core import training_loss
    from planner.costs import step as step_costs
    from planner.costs.step import node_times_high, scaled_node_times
    from planner.problem.graph import run_checkpoints

    assert node_times_high(100.0, 86.0, 6) is None and node_times_high(100.0, 84.0, 6) is not None
    model, tokens = small_gpt()
    p = plan(model, tokens, budget_gb=80, repeats=1)
    # checkpoint's own figures set to nothing: as measured by a single probe they were once above
    # all the blocks measured (13.1 ms), leaving nothing to scale to and the other branch taken.
    problem = replace(scaled_node_times(p.problem, 50.0), region_overhead_ms=0.0, saved_tensor_ms=0.0,
                      run_region_ms=0.0)
    slow = problem.nodes
    with pytest.warns(UserWarning, match="forward times give for recomputing them.*scaled by"):
        found = step_costs.step_residuals(
            model, problem, p.wrapped, lambda regions: run_checkpoints(p.traced.gm, problem, regions, p.wrapped).values(),
            lambda pairs: [], lambda module: training_loss(module(tokens)).backward(), torch.device("cpu"), rounds=3)
    # (three rounds, not two: on a busy machine one step's stall read the blocks at -447 ms, and a
    # median of two is their mean; of three, the middle one)
    # The node times are scaled back towards the clock's (the true ratio is 1/50 to 3/50 here),
    # and the other figures read beyond the times so scaled, not held at their floors by them.
    assert 0 < found.node_time_scale < 0.2
    priced = found.priced(problem)
    assert [n.compute_ms for n in priced.nodes] == pytest.approx([found.node_time_scale * n.compute_ms for n in slow])
    assert found.priced(p.problem).nodes != p.problem.nodes  # (priced() applies the scale to any problem)


def test_node_times_are_scaled_to_what_the_blocks_measured_beyond_their_calls():
    # 285 ms of node times, blocks measured at 166 ms, 6 ms of it checkpoint's own: the times
    # are scaled so that the blocks' recomputation is the 160 ms left. Never scaled up, and not
    # at all where the step leaves nothing for recomputation.
    from planner.costs.step import node_time_scale, scaled_node_times

    assert node_time_scale(285.0, 166.0, 6.0) == pytest.approx(160 / 285)
    assert node_time_scale(100.0, 130.0, 6.0) == 1.0 and node_time_scale(100.0, 5.0, 6.0) == 1.0
    problem, _, blocks = norms_and_blocks()
    half = scaled_node_times(problem, 0.5)
    assert half.region_recompute_ms(blocks[0]) == pytest.approx(0.5 * problem.region_recompute_ms(blocks[0]))
    assert half.checkpoint_ms(blocks[0]) == problem.checkpoint_ms(blocks[0])


@pytest.mark.parametrize("per_call, per_tensor", [(0.8, 0.02), (0.1, 0.0), (0.0, 0.04), (0.4, 0.08)])
def test_a_call_and_a_saved_tensor_are_priced_by_what_norms_and_blocks_cost_in_the_step(per_call, per_tensor):
    # Norms save one tensor per call, blocks twelve: their two measured overheads fix both
    # figures where a saved tensor costs less than the figure read off a block (50 us); where
    # more, that figure stands and the call's is what the norms leave beyond their tensors,
    # never below the one it had (0.3 ms).
    from planner.costs.step import call_and_tensor_ms

    problem, norms, blocks = norms_and_blocks()

    def measured(regions: list[range]) -> float:
        return sum(problem.region_recompute_ms(r) + per_call + per_tensor * sum(
            problem.nodes[i].saved_tensors for i in r) for r in regions)

    found = call_and_tensor_ms(problem, norms, measured(norms), blocks, measured(blocks))
    standing = (pytest.approx(max(0.3, per_call + per_tensor - 0.05)), 0.05)
    assert found == ((pytest.approx(per_call), pytest.approx(per_tensor, abs=1e-12)) if per_tensor < 0.05
                     else standing)
    assert call_and_tensor_ms(problem, norms, measured(norms), [], None) == standing  # without blocks


def test_neither_figure_read_off_the_step_falls_below_zero():
    from planner.costs.step import call_and_tensor_ms

    problem, norms, blocks = norms_and_blocks()
    recompute = sum(problem.region_recompute_ms(r) for r in blocks)
    # blocks cheaper than their recomputation, norms dearer: that reading is no cost (node times
    # high, or noise), so the block's figure per tensor stands and a call costs what the norms
    # leave beyond it (before, both were fitted: no tensor cost anything, a call 0.125 ms)
    per_call, per_tensor = call_and_tensor_ms(problem, norms, 2 + 1.0, blocks, recompute - 0.5)
    assert per_tensor == 0.05 and per_call == pytest.approx((1.0 - 2 * 0.05) / 2)
    # norms cheaper than their recomputation, blocks dearer: no call costs less than nothing
    per_call, per_tensor = call_and_tensor_ms(problem, norms, 2 - 1.0, blocks, recompute + 1.0)
    assert per_call == 0.0 and per_tensor == pytest.approx((2 * -1.0 + 24 * 1.0) / (2 ** 2 + 24 ** 2))


def _runs_in_two_blocks() -> tuple[Problem, list[range], list[range]]:
    """Two blocks of six nodes (each a run span; 1 ms and 3 ATen calls a node, but the third
    makes 1 call and is no replayable run node), the short runs and the long runs of both."""
    nodes = [NodeCost(f"op{i}", 1.0, output_bytes=8, saved_bytes=8, saved_tensors=1, aten_calls=1 if i % 6 == 2 else 3,
                      replayable=i % 6 != 2) for i in range(12)]
    blocks = (range(0, 6), range(6, 12))
    problem = Problem(tuple(nodes), allowed_regions=blocks, run_spans=blocks, region_overhead_ms=0.3,
                      recorded_call_ms=0.01)
    from planner.costs.step import longest_run
    return problem, [range(0, 2), range(6, 8)], [longest_run(problem, span) for span in blocks]


def test_the_long_run_of_a_block_is_the_one_that_records_most_calls():
    from planner.costs.step import longest_run

    problem, _, longs = _runs_in_two_blocks()
    calls = run_structure(problem)[1]
    for span, found in zip((range(0, 6), range(6, 12)), longs):
        candidates = [range(a, b) for a in span for b in range(a + 1, span.stop + 1)
                      if problem.allows_region(a, b) and problem.run_span_of(range(a, b)) == span]
        assert found in candidates
        assert calls[found.stop] - calls[found.start] == max(calls[r.stop] - calls[r.start] for r in candidates)
    assert longs == [range(3, 6), range(9, 12)]  # (the block itself is a region, not a run)
    assert longest_run(problem, range(0, 1)) is None


@pytest.mark.parametrize("per_run, per_recorded", [(0.4, 0.02), (-0.3, 0.05), (0.2, 0.0), (-0.3, 0.0)])
def test_a_run_and_a_recorded_call_are_priced_by_what_short_and_long_runs_cost_in_the_step(per_run, per_recorded):
    # Short runs record 6 calls each, long runs 9: their two measured overheads fix both figures;
    # a run may cost less than a call (down to the floor), a recorded call never less than nothing.
    from planner.costs.step import run_and_recorded_call_ms

    problem, short, longs = _runs_in_two_blocks()
    calls = run_structure(problem)[1]
    base = replace(problem, recorded_call_ms=0.0)

    def measured(runs: list[range]) -> float:
        return sum(base.region_cost_ms(r) + per_run + per_recorded * (calls[r.stop] - calls[r.start]) for r in runs)

    found = run_and_recorded_call_ms(problem, short, measured(short), longs, measured(longs), floor=-0.3)
    assert found == (pytest.approx(per_run), pytest.approx(per_recorded, abs=1e-12))
    below = run_and_recorded_call_ms(problem, short, measured(short) - 2.0, longs, measured(longs) - 2.0, floor=-0.3)
    assert below[0] >= -0.3 and below[1] >= 0.0


def test_long_runs_cheaper_than_their_nodes_leave_the_blocks_figure_per_recorded_call():
    # Long runs measured 1 ms under their nodes' recomputation: no reading of a recorded call's
    # cost, so the block's (0.01 ms) stands, and a run costs what the short runs leave beyond it.
    from planner.costs.step import run_and_recorded_call_ms

    problem, short, longs = _runs_in_two_blocks()
    calls = run_structure(problem)[1]
    base = replace(problem, recorded_call_ms=0.0)
    short_ms = sum(base.region_cost_ms(r) for r in short) + 2 * 0.2 + 0.05 * (calls[2] - calls[0] + calls[8] - calls[6])
    long_nodes_ms = base.recompute_ms(tuple(longs)) - len(longs) * base.region_overhead_ms
    per_run, per_recorded = run_and_recorded_call_ms(problem, short, short_ms, longs, long_nodes_ms - 1.0, floor=-0.3)
    assert per_recorded == 0.01
    assert per_run == pytest.approx(0.2 + (0.05 - 0.01) * (calls[2] - calls[0]))


def test_plan_prices_calls_and_runs_with_the_residuals_measured_in_the_step(monkeypatch):
    import planner.planning
    from planner.costs.block import MeasuredCosts
    from planner.costs.step import StepResiduals

    model, tokens = small_gpt()
    monkeypatch.setattr(planner.planning, "checkpoint_overhead_ms", lambda device: (0.25, 0.01))  # tiny modules'
    measured = MeasuredCosts(0.25, 0.001, 0.01, 0.001, 0.002, 0.01)
    monkeypatch.setattr(planner.planning, "selective_overhead_for_plan", lambda *args: measured)
    # a call as read on the model's own small submodules (`planner.costs.calls`), before the step's residuals
    monkeypatch.setattr(planner.planning, "small_call_cost", lambda model, problem, *args: problem.region_overhead_ms + 0.25)
    monkeypatch.setattr(planner.planning, "step_residuals", lambda *args, **kwargs: StepResiduals(0.5, 0.125, 4, 4, 1.5, 2))
    p = plan(model, tokens, budget_gb=80, repeats=1, effort="thorough")
    assert p.problem.run_spans and p.problem.run_region_ms == 0.125
    assert p.problem.region_overhead_ms == 1.0
    assert p.problem.keep_region_ms == 1.75
    monkeypatch.setattr(planner.planning, "step_residuals", lambda *args, **kwargs: StepResiduals(0.5, 0.125, 4, 4, -0.5, 2))
    assert plan(model, tokens, budget_gb=80, repeats=1, effort="thorough").problem.keep_region_ms == 0.0  # never below 0
    # The default effort reads no step: the block's figures stand.
    unread = lambda *args, **kwargs: pytest.fail("effort='normal' reads the model's steps")  # noqa: E731
    monkeypatch.setattr(planner.planning, "small_call_cost", unread)
    monkeypatch.setattr(planner.planning, "step_residuals", unread)
    p = plan(model, tokens, budget_gb=80, repeats=1)
    assert p.problem.region_overhead_ms == 0.25 and p.problem.run_region_ms == 0.0


def test_a_block_that_cannot_be_recorded_whole_still_has_its_checkpoint_cost_measured(monkeypatch):
    # A forward that reads a buffer and then writes it in place cannot be replayed as one run
    # (replay would read the written value): what checkpoint costs it is measured all the same.
    from planner.costs import block as block_costs

    class Rescaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)
            self.register_buffer("scale", torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.linear(x + self.scale))
            self.scale.mul_(0.5)
            return y

    monkeypatch.setattr(block_costs, "FINE_ROUNDS", 2)
    cost = block_costs.selective_costs_on(Rescaled(), (torch.randn(4, 8, requires_grad=True),), {}, 0.0,
                                          torch.device("cpu"))
    assert cost.per_recorded_call_ms is None
    assert cost.checkpoint_ms is not None and cost.per_call_ms >= 0


def test_the_share_of_a_forward_that_recomputation_runs_stops_at_the_last_saving_node():
    # A layer ending in a linear and a residual add: nothing saves the add's inputs, so
    # recomputation stops after the node before them (the fc2 matmul itself is skipped where
    # only its input is saved, as `stop_ms` says).
    from planner.costs.block import recomputed_share

    nodes = (NodeCost("norm", 1.0, output_bytes=8, saves=()),
             NodeCost("fc1", 2.0, output_bytes=8, uses=(0,), saves=(0,)),
             NodeCost("fc2", 3.0, output_bytes=8, uses=(1,), saves=(1,), stop_ms=0.5),
             NodeCost("add", 4.0, output_bytes=8, uses=(2,)))
    problem = Problem(nodes)
    assert recomputed_share(problem, range(0, 4)) == pytest.approx((1.0 + 2.0 + 0.5) / 10.0)
    assert recomputed_share(problem, range(3, 4)) == 0.0  # an add alone recomputes nothing


def test_a_blocks_readings_subtract_only_the_forward_its_recomputation_runs(monkeypatch):
    # Fixed times: a forward of 10 ms of which recomputation and replay run half; checkpoint
    # costs 1 ms beyond that, and recording 0.05 ms per call. Subtracting the whole forward
    # instead would read checkpoint at -4 ms and recording at nothing.
    from planner.costs import block as block_costs
    from planner.measure import clock

    block = Block(32, 4, dropout=0.0).train()
    mask = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
    x = torch.randn(2, 16, 32, requires_grad=True)
    calls = len([name for name in forward_calls(block, x, mask) if counted_call(name)])
    base = {"unchecked": 50.0, "bare": 10.0 * block_costs._FORWARDS, "counted": 10.0 * block_costs._FORWARDS,
            "policy forwards": 10.0 * block_costs._FORWARDS, "plain": 50.0 + 5.0 + 1.0, "selective": 56.0,
            "counted step": 60.0, "recorded step": 60.0 + 5.0 + 0.05 * calls}

    def fixed(device, steps, rounds, kernels_only=False):
        return {name: [base[name] + 0.001 * k for k in range(rounds)] for name in steps}

    monkeypatch.setattr(clock, "timed_rounds", fixed)
    cost = block_costs.selective_costs_on(block, (x, mask), {}, 0.0, torch.device("cpu"), replayed_share=0.5)
    assert cost.checkpoint_ms == pytest.approx(1.0, abs=0.01)
    assert cost.per_recorded_call_ms == pytest.approx(0.05, abs=0.001)
    whole = block_costs.selective_costs_on(block, (x, mask), {}, 0.0, torch.device("cpu"))
    assert whole.checkpoint_ms == pytest.approx(-4.0, abs=0.01) and whole.per_recorded_call_ms == 0.0


@pytest.mark.full_timing_rounds  # (an interval at the readings' level needs 9 values)
def test_a_blocks_policy_cost_per_call_pools_its_steps_and_its_forwards(monkeypatch):
    # Steps read 0.05 ms per call under the policy, forwards alone 0.03 ms: the figure is the
    # median of both rounds' readings, between the two; each alone would give its own.
    from planner.costs import block as block_costs
    from planner.measure import clock

    block = Block(32, 4, dropout=0.0).train()
    mask = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
    x = torch.randn(2, 16, 32, requires_grad=True)
    calls = len(forward_calls(block, x, mask))
    forwards = block_costs._FORWARDS * 10.0

    def fixed(step_ms, forward_ms):
        base = {"unchecked": 50.0, "bare": forwards, "counted": forwards, "plain": 56.0, "counted step": 60.0,
                "recorded step": 65.0, "selective": 56.0 + step_ms * 2 * calls,
                "policy forwards": forwards + forward_ms * block_costs._FORWARDS * calls}
        return lambda device, steps, rounds, kernels_only=False: {name: [base[name]] * rounds for name in steps}

    monkeypatch.setattr(clock, "timed_rounds", fixed(0.05, 0.03))
    pooled = block_costs.selective_costs_on(block, (x, mask), {}, 0.0, torch.device("cpu"))
    assert pooled.per_call_ms == pytest.approx(0.04)
    assert pooled.intervals["per_call_ms"] == pytest.approx((0.03, 0.05))
    monkeypatch.setattr(clock, "timed_rounds", fixed(0.05, 0.05))
    alone = block_costs.selective_costs_on(block, (x, mask), {}, 0.0, torch.device("cpu"))
    assert alone.per_call_ms == pytest.approx(0.05)
