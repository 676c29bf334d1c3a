"""Checkpoint's own cost per block, read within one training step: the blocks' figure that
`planner.costs.step` splits into a cost per call and per saved tensor.

Across steps (a plan against the unplanned model), the machine's load drifts between the two
steps, and their difference carries the noise of the whole step: its interval can be many
times wider than what checkpoint itself costs a block. Within one step the load barely drifts,
and a block's own segments carry only their noise. So half of the model's blocks are
checkpointed (even blocks, then odd ones, as two configurations in each round) and each block's
forward, backward and recomputation are timed inside the step: per step, the checkpointed
blocks' mean forward+backward less their recomputation, less the plain blocks' mean
forward+backward; the two halves averaged per round, so a block's position cancels.

- `BlockSegments`: hooks that time each block's segments. Forward: from the block's forward
  pre-hook to its forward hook. Backward: from the gradient of its output (a tensor hook) to
  the gradient of its input, which for blocks in sequence is complete once the block's own
  backward nodes have run (and, for a checkpointed block, its recomputation). Recomputation: a
  clock around a checkpointed block's own forward inside checkpoint
  (`planner.apply.checkpoints.CheckpointedForward.original`), whose second call in a step is
  the recomputation; it runs the forward without `__call__`, so it fires no forward hook. On
  CUDA each mark is an event on the stream, so the times are the GPU's, not the host's
  launches;
- `round_cost`: one round's reading off the two halves' segments;
- `within_step_block_ms`: the rounds, until the reading can be told from its price, as a
  `BlockReading`.

Example:
    >>> segments = BlockSegments(model, ["h.0", "h.1"], torch.device("cpu"))
    >>> training_step(model, sample)
    >>> segments.take()
    {'h.0': (28.7, 30.5, None), 'h.1': (28.4, 58.6, 27.9)}
    >>> segments.remove()
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
from typing import Any, Callable, Sequence

import torch
from torch import nn

from planner.apply.checkpoints import CheckpointedForward, apply_plan, shallow_clone
from planner.core import ModuleCheckpoint
from planner.measure.clock import (
    READING_LEVEL,
    holds,
    median_interval,
    reading_or_price,
    until_decided,
)
from planner.measure.memory import preserved_state
from solvers import Problem

Mark = Any  # a perf_counter reading (CPU) or a recorded torch.cuda.Event (CUDA)
Segment = tuple[float, float | None, float | None]  # forward, backward, recomputation (ms)


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a (nested) tuple, list or dict, or None.

    Example:
        >>> first_tensor(((), {"x": torch.ones(1)}))
        tensor([1.])
    """
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        if (found := first_tensor(item)) is not None:
            return found
    return None


class BlockSegments:
    """Hooks on `module`'s submodules `names` (each called once per forward) that time each
    one's forward, backward and, where `module` checkpoints it, recomputation (ms) in the steps
    that follow; `take()` returns the last step's and starts over; `remove()` takes the hooks
    off."""

    def __init__(self, module: nn.Module, names: list[str], device: torch.device):
        if len(set(names)) != len(names):
            raise ValueError(f"each block must be named once: {names}")
        self.names = list(names)
        self.cuda = device.type == "cuda"
        self.marks: dict[tuple[str, str], Mark] = {}
        self.recomputed: dict[str, list[tuple[Mark, Mark]]] = {}
        self.handles: list[Any] = []
        self.clocked: dict[str, CheckpointedForward] = {}  # checkpointed blocks, by name
        for name in self.names:
            block = module.get_submodule(name)
            self.handles.append(block.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._post(name), with_kwargs=True))
            forward = block.__dict__.get("forward")
            if isinstance(forward, CheckpointedForward):
                forward.original = self._clocked(name, forward.original)  # (an instance attribute: `remove` drops it)
                self.clocked[name] = forward

    def _now(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _ms(self, start: Mark, end: Mark) -> float:
        return start.elapsed_time(end) if self.cuda else 1000 * (end - start)

    def _mark(self, name: str, event: str) -> None:
        self.marks[name, event] = self._now()

    def _on_grad(self, name: str, event: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._mark(name, event)
        return hook

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(block: nn.Module, args: Any, kwargs: Any) -> None:
            self._mark(name, "forward starts")
            tensor = first_tensor((args, kwargs))
            if tensor is not None and tensor.requires_grad:
                tensor.register_hook(self._on_grad(name, "backward ends"))
        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(block: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            self._mark(name, "forward ends")
            tensor = first_tensor(output)
            if tensor is not None and tensor.requires_grad:
                tensor.register_hook(self._on_grad(name, "backward starts"))
        return hook

    def _clocked(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = self._now()
            try:
                return original(*args, **kwargs)
            finally:  # (recomputation may end by raising at its last saving node)
                self.recomputed.setdefault(name, []).append((started, self._now()))
        return timed

    def take(self) -> dict[str, Segment]:
        """Per block, the last step's (forward, backward, recomputation) in ms: backward None
        where the block's input needs no gradient (nothing marks its end), recomputation None
        where the block is not checkpointed. Raises RuntimeError where a block did not run, or
        a checkpointed one ran other than once and recomputed once.

        Example:
            >>> segments.take()["h.1"]
            (28.4, 58.6, 27.9)
        """
        if self.cuda:
            torch.cuda.synchronize()

        def between(name: str, start: str, end: str) -> float | None:
            if (name, start) not in self.marks or (name, end) not in self.marks:
                return None
            return self._ms(self.marks[name, start], self.marks[name, end])

        found = {}
        for name in self.names:
            forward = between(name, "forward starts", "forward ends")
            if forward is None:
                raise RuntimeError(f"{name} did not run in the step")
            recomputation = None
            if name in self.clocked:
                calls = self.recomputed.get(name, [])
                if len(calls) != 2:
                    raise RuntimeError(f"checkpointed {name} ran its forward {len(calls)} times in the step, "
                                       "not once and once more to recompute")
                recomputation = self._ms(*calls[1])
            found[name] = (forward, between(name, "backward starts", "backward ends"), recomputation)
        self.clear()
        return found

    def clear(self) -> None:
        """Forget what was marked so far (steps not to be read)."""
        self.marks.clear()
        self.recomputed.clear()

    def remove(self) -> None:
        """Take the hooks and clocks off."""
        for handle in self.handles:
            handle.remove()
        for forward in self.clocked.values():
            forward.__dict__.pop("original", None)
        self.handles.clear()
        self.clocked.clear()


logger = logging.getLogger(__name__)

# Rounds (each: one step with the even blocks checkpointed, one with the odd ones), and half as
# many more at a time while the reading cannot be told from its price, up to 40: a block's
# reading needs tens of rounds before its interval is narrow enough to tell it from its price.
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
    `planner.costs.step.large_calls`) read within the model's step, `train_step(module)` (forward,
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


__all__ = ["BLOCK_PRICE_ROUNDS", "BlockReading", "BlockSegments", "MAX_BLOCK_PRICE_ROUNDS", "MAX_READ_S", "Mark",
           "Segment", "first_tensor", "round_cost", "within_step_block_ms"]
