"""Checkpoint's own cost per block, read within one training step (the blocks' figure that
`planner.step_costs` splits into a cost per call and per saved tensor).

Across steps, a plan against the unplanned model, the machine's load drifts between the two
steps: in planning's 9 paired rounds BERT's six checkpointed blocks read +205 ms beyond the
unplanned step with a 99.5% interval 121 ms wide, about a millisecond a block of which is
checkpoint's own cost. Within one step it barely drifts. So half of the model's blocks are
checkpointed (even blocks, then odd ones, as two configurations in each round) and each block's
forward, backward and recomputation are timed inside the step (`block_segments.BlockSegments`):
per step, the checkpointed blocks' mean forward+backward less their recomputation, less the
plain blocks' mean forward+backward; the two halves averaged per round, so a block's position
cancels. At 40 rounds its 95% interval was 0.7-1.0 ms wide per block on four transformers,
against 3.0-3.4 ms across steps from the same rounds, and read 0.6-1.3 ms a block more than
the figures priced (benchmarks/RESULTS.md, session notes of 2026-12-04 05:05-).

Example:
    >>> reading = within_step_block_ms(model, problem, large_calls(problem, wrapped), wrapped,
    ...                                lambda m: training_loss(m(x)).backward(), torch.device("cpu"))
    >>> reading.per_block_ms, reading.interval
    (1.71, (1.02, 2.48))
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from planner.apply import ModuleCheckpoint, apply_plan, shallow_clone
from planner.block_segments import BlockSegments, Segment
from planner.clock import READING_LEVEL, holds, median_interval, reading_or_price, until_decided
from planner.memory import preserved_state
from solvers import Problem

logger = logging.getLogger(__name__)

# Rounds (each: one step with the even blocks checkpointed, one with the odd ones), and half as
# many more at a time while the reading cannot be told from its price, up to 40: in the probe,
# 9 rounds decided no model's reading at 95% (widths 1.7-2.6 ms a block), 40 decided all four.
BLOCK_PRICE_ROUNDS = 20
MAX_BLOCK_PRICE_ROUNDS = 40
# The read's time at most, its next batch of rounds included (`clock.until_decided`).
MAX_READ_S = 45.0


@dataclass(frozen=True)
class BlockReading:
    """Checkpoint's own cost per block of `blocks`, read within the step: one value a round."""

    blocks: tuple[range, ...]
    values: tuple[float, ...]

    @property
    def per_block_ms(self) -> float:
        """The rounds' median."""
        return statistics.median(self.values)

    @property
    def interval(self) -> tuple[float, float] | None:
        """The median's interval at `clock.READING_LEVEL` (None: too few rounds for one)."""
        return median_interval(self.values, READING_LEVEL)

    def figure(self, problem: Problem) -> float:
        """The reading, or the blocks' mean price under `problem`'s figures
        (`Problem.checkpoint_ms`) where the reading's interval holds it (`clock.reading_or_price`).

        Example:
            >>> BlockReading((range(0, 40), range(40, 80)), (1.7,) * 20).figure(problem)
            1.7
        """
        price_ms = statistics.mean(map(problem.checkpoint_ms, self.blocks))
        return reading_or_price(self.per_block_ms, self.interval, price_ms,
                                f"checkpoint's own cost per block, {len(self.blocks)} blocks within one step")


def round_cost(halves: Sequence[dict[str, Segment]], checkpointed: Sequence[Sequence[str]]) -> float:
    """One round's reading: for each half (a step's segments, and the blocks it checkpointed),
    the checkpointed blocks' mean forward+backward less recomputation, less the plain blocks'
    mean forward+backward; averaged over the halves. Blocks without a backward segment (their
    input needs no gradient) are left out.

    Example:
        >>> round_cost([{"a": (1.0, 5.0, 1.5), "b": (1.0, 3.0, None)}, {"a": (1.0, 3.0, None), "b": (1.0, 4.0, 1.0)}],
        ...            [["a"], ["b"]])
        0.25
    """
    readings = []
    for segments, names in zip(halves, checkpointed):
        timed = {name: (forward + backward, recomputation) for name, (forward, backward, recomputation)
                 in segments.items() if backward is not None}
        beyond = [both - (recomputation or 0.0) for name, (both, recomputation) in timed.items() if name in names]
        plain = [both for name, (both, _) in timed.items() if name not in names]
        if not beyond or not plain:
            raise ValueError(f"a half checkpointing {list(names)} leaves no timed block checkpointed or plain")
        readings.append(statistics.mean(beyond) - statistics.mean(plain))
    return statistics.mean(readings)


def within_step_block_ms(model: nn.Module, problem: Problem, blocks: Sequence[range],
                         wrapped: dict[range, ModuleCheckpoint], train_step: Callable[[nn.Module], None],
                         device: torch.device) -> BlockReading | None:
    """Checkpoint's own cost per block of `blocks` (every call of the model's repeated block,
    `step_regions.large_calls`) read within the model's step, `train_step(module)` (forward,
    loss, backward), on two copies sharing the parameters, each checkpointing half of the
    blocks. `BLOCK_PRICE_ROUNDS` rounds, more while the reading's interval holds the blocks'
    price under `problem`'s figures (`Problem.checkpoint_ms`). None where there are fewer
    than two blocks, a block is called more than once, or fewer than two have a backward to
    time. The model, its gradients, buffers and the RNG are left as they were.

    Example:
        >>> within_step_block_ms(model, problem, large_calls(problem, wrapped), wrapped,
        ...                      lambda m: training_loss(m(x)).backward(), torch.device("cpu")).per_block_ms
        1.71
    """
    names = [wrapped[region].module for region in blocks]
    if len(names) < 2 or len(set(names)) < len(names):
        logger.info("checkpoint's cost per block not read within a step: %d blocks (%d distinct)", len(names),
                    len(set(names)))
        return None
    halves = [names[0::2], names[1::2]]
    copies = [apply_plan(shallow_clone(model), [wrapped[region] for region in blocks[start::2]]) for start in (0, 1)]
    segments = [BlockSegments(copy, names, device) for copy in copies]
    taken: list[list[dict[str, Segment]]] = [[], []]

    def run_rounds(count: int) -> None:
        for _ in range(count):
            turn = len(taken[0]) % 2  # (which half runs first alternates)
            for which in (turn, 1 - turn):
                train_step(copies[which])
                for parameter in model.parameters():
                    parameter.grad = None
                taken[which].append(segments[which].take())

    price_ms = statistics.mean(map(problem.checkpoint_ms, blocks))

    def values() -> list[float]:
        return [round_cost(pair, halves) for pair in zip(*taken)]

    try:
        with preserved_state(model, [device]):
            for which, copy in enumerate(copies):  # (untimed: the first step warms caches up)
                train_step(copy)
                segments[which].clear()
            for parameter in model.parameters():
                parameter.grad = None
            started = time.perf_counter()
            until_decided(run_rounds, BLOCK_PRICE_ROUNDS, BLOCK_PRICE_ROUNDS // 2,
                          lambda: holds(median_interval(values(), READING_LEVEL), price_ms),
                          MAX_BLOCK_PRICE_ROUNDS, MAX_READ_S)
            found = values()
    except ValueError as error:  # (too few blocks with a backward: a CNN's first takes the image)
        logger.info("checkpoint's cost per block not read within a step: %s", error)
        return None
    except RuntimeError as error:  # (a block that did not run, or ran twice, in a step)
        logger.warning("checkpoint's cost per block could not be read within a step (%s); the figures so far "
                       "price it", error)
        return None
    finally:
        for hooks in segments:
            hooks.remove()
    reading = BlockReading(tuple(blocks), tuple(found))
    bounds = "too few rounds" if reading.interval is None else "%+.2f to %+.2f" % reading.interval
    logger.info("checkpoint's cost per block within a step, %d blocks like %s, %d rounds in %.1f s: %+.3f ms "
                "(99.5%%: %s; rounds' quartiles %s), priced %.3f ms", len(blocks), names[0], len(found),
                time.perf_counter() - started, reading.per_block_ms, bounds,
                [round(q, 2) for q in statistics.quantiles(found)] if len(found) > 1 else found, price_ms)
    return reading


__all__ = ["BLOCK_PRICE_ROUNDS", "BlockReading", "MAX_BLOCK_PRICE_ROUNDS", "MAX_READ_S", "round_cost",
           "within_step_block_ms"]
