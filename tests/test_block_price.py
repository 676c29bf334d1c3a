"""Checkpoint's own cost per block, read within one training step (`planner.costs.block_price`, with
`planner.costs.block_price` timing each block inside the step), and how it prices a call and a
saved tensor (`step_costs.call_and_tensor_ms`, `step_costs.tensor_ms_within`)."""
from __future__ import annotations

import pytest
import torch
from conftest import norms_and_blocks, small_gpt, train_step

from planner.apply.checkpoints import CheckpointedForward, apply_plan, shallow_clone
from planner.core import ModuleCheckpoint
from planner.costs.block_price import (
    BlockReading,
    BlockSegments,
    round_cost,
    within_step_block_ms,
)
from planner.measure.clock import until_decided


def test_a_round_reads_checkpointed_blocks_beyond_their_recomputation_against_the_plain_ones_of_the_same_step():
    # Half 1: block a checkpointed, 1 + 6 ms less 2 ms recomputed = 5, against b's 1 + 3 = 4: +1.
    # Half 2: b checkpointed, 1 + 7 - 3 = 5, against a's 1 + 2 = 3: +2. The round: +1.5. A block
    # whose input needs no gradient (c: no backward) is left out of both.
    halves = [{"a": (1.0, 6.0, 2.0), "b": (1.0, 3.0, None), "c": (9.0, None, None)},
              {"a": (1.0, 2.0, None), "b": (1.0, 7.0, 3.0), "c": (9.0, None, None)}]
    assert round_cost(halves, [["a", "c"], ["b"]]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="no timed block"):  # (only c plain in the first half, untimed)
        round_cost([{"a": (1.0, 6.0, 2.0), "c": (9.0, None, None)}] * 2, [["a"], ["a"]])


def _half_checkpointed(model: torch.nn.Module, names: list[str]) -> torch.nn.Module:
    return apply_plan(shallow_clone(model), [ModuleCheckpoint(name, "Block") for name in names])


def test_block_segments_time_each_block_and_the_recomputation_of_the_checkpointed_ones_only():
    model, tokens = small_gpt()
    names = [f"blocks.{i}" for i in range(len(model.blocks))]
    planned = _half_checkpointed(model, names[0::2])
    _, expected = train_step(model, tokens)
    segments = BlockSegments(planned, names, torch.device("cpu"))
    _, found = train_step(planned, tokens)
    times = segments.take()
    assert set(times) == set(names)
    for index, name in enumerate(names):
        forward, backward, recomputation = times[name]
        assert forward > 0 and backward is not None and backward > 0
        assert (recomputation is not None) == (index % 2 == 0)
        if recomputation is not None:  # (inside the block's backward, which also runs its kernels)
            assert 0 < recomputation < backward
    assert segments.marks == {} and segments.recomputed == {}  # (taken: the next step starts over)
    assert all(torch.equal(found[name], expected[name]) for name in expected)  # the hooks change no gradient
    segments.remove()
    assert all(not model.get_submodule(name)._forward_hooks and not planned.get_submodule(name)._forward_pre_hooks
               for name in names)
    forwards = [planned.get_submodule(name).__dict__["forward"] for name in names[0::2]]
    assert all(isinstance(f, CheckpointedForward) and "original" not in f.__dict__ for f in forwards)


def test_a_checkpointed_block_that_did_not_recompute_once_is_an_error_not_a_reading():
    model, tokens = small_gpt()
    planned = _half_checkpointed(model, ["blocks.0"])
    segments = BlockSegments(planned, ["blocks.0", "blocks.1"], torch.device("cpu"))
    with torch.no_grad():  # (a forward without backward: no recomputation)
        planned(tokens)
    with pytest.raises(RuntimeError, match="blocks.0 ran its forward 1 times"):
        segments.take()
    segments.remove()


def test_the_within_step_reading_runs_its_rounds_and_leaves_the_model_as_it_was():
    from planner import plan
    from planner.core import training_loss
    from planner.costs.step import large_calls

    model, tokens = small_gpt()
    p = plan(model, tokens, budget_gb=80, repeats=1)
    blocks = large_calls(p.problem, p.wrapped)
    assert [p.wrapped[region].module for region in blocks] == [f"blocks.{i}" for i in range(len(model.blocks))]
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 0.5)
    rng = torch.get_rng_state()
    reading = within_step_block_ms(model, p.problem, blocks, p.wrapped,
                                   lambda module: training_loss(module(tokens)).backward(), torch.device("cpu"))
    assert reading is not None and reading.blocks == tuple(blocks)
    assert len(reading.values) == 3 and reading.interval is None  # (conftest: 3 rounds, too few for one)
    assert reading.per_block_ms == sorted(reading.values)[1]
    assert all(torch.equal(parameter.grad, torch.full_like(parameter, 0.5)) for parameter in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all("forward" not in model.get_submodule(f"blocks.{i}").__dict__ for i in range(len(model.blocks)))
    one = within_step_block_ms(model, p.problem, blocks[:1], p.wrapped,
                               lambda module: training_loss(module(tokens)).backward(), torch.device("cpu"))
    assert one is None  # (one block: nothing plain to read it against)


@pytest.mark.parametrize("per_call, per_tensor", [(0.8, 0.02), (0.4, 0.08), (0.1, 0.15)])
def test_the_within_step_block_cost_and_the_norms_fix_a_call_and_a_tensor_either_side_of_the_old_figure(
        per_call, per_tensor):
    # Norms save one tensor per call and were read across steps, beyond their recomputation;
    # blocks save twelve and were read within one step, beyond their timed recomputation. Both
    # figures fit exactly, above the old tensor figure (0.05 ms) as well as below: the blocks'
    # reading holds no recomputation, which was why an across-step fit was taken only below it.
    from planner.costs.step import call_and_tensor_ms

    problem, norms, blocks = norms_and_blocks()
    norms_ms = sum(problem.region_recompute_ms(r) + per_call + per_tensor for r in norms)
    block_ms = per_call + 12 * per_tensor
    found = call_and_tensor_ms(problem, norms, norms_ms, blocks, 1e6, (blocks, block_ms))  # (across steps: unused)
    assert found == (pytest.approx(per_call), pytest.approx(per_tensor))


def test_without_calls_to_split_with_a_blocks_cost_beyond_the_call_is_its_tensors():
    from planner.costs.step import tensor_ms_within

    problem, _, blocks = norms_and_blocks()
    assert tensor_ms_within(problem, blocks, 0.3 + 12 * 0.07) == pytest.approx(0.07)
    assert tensor_ms_within(problem, blocks, 0.1) == 0.0  # (less than a call: no tensor costs less than nothing)


def test_a_within_step_reading_replaces_the_blocks_price_only_clear_of_it():
    problem, _, blocks = norms_and_blocks()
    price = problem.checkpoint_ms(blocks[0])  # 0.3 + 12 x 0.05
    clear = BlockReading(tuple(blocks), (1.1,) * 5 + (1.4,) * 10 + (1.9,) * 5)
    assert clear.interval == (1.1, 1.9) and clear.figure(problem) == 1.4
    holding = BlockReading(tuple(blocks), (0.5,) * 5 + (1.4,) * 10 + (1.9,) * 5)
    assert holding.interval == (0.5, 1.9) and holding.figure(problem) == pytest.approx(price)
    alone = BlockReading(tuple(blocks), (1.4,) * 3)
    assert alone.interval is None and alone.figure(problem) == 1.4  # (no interval: taken)


def test_rounds_run_in_batches_while_undecided_up_to_the_most_allowed():
    ran: list[int] = []
    assert until_decided(ran.append, 20, 10, lambda: True, 40) == 40 and ran == [20, 10, 10]
    ran.clear()
    assert until_decided(ran.append, 20, 10, lambda: len(ran) < 2, 40) == 30 and ran == [20, 10]
