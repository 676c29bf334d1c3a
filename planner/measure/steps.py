"""Real training steps of a model, planned or not, measured: `Verification` (`verify_modules`:
the original against its planned copy, peaks, times, outputs, gradients), a step's peak as
training holds it (`steady_peak`: gradients allocated, as from the second step on), and the
model's own unplanned step against the traced graph (`keep_free_beyond_graph`).

Plans are simulated on the traced graph, but the applied plan runs the model's own code, and the
two can allocate differently (on a GPU, an attention kernel the model's code picks otherwise
than the graph's; a kernel workspace). So where the whole step runs on the plan's device,
`plan()` measures the model's own unplanned step as `Plan.verify` does; where it peaks above the
graph's simulated peak by more than `MIN_GAP_BYTES`, the difference becomes a static term,
`BEYOND_GRAPH`, that every plan keeps free: measured, not modelled, and conservative.

Example:
    >>> record = verify_modules(model, p.module(), tokens, 3, p.predicted_peak_bytes,
    ...                         p.baseline_peak_bytes, p.budget_bytes)
    >>> record.within_budget, record.gradients_match
"""
from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from planner.core import (
    after_autocast,
    output_leaves,
    run_forward,
    split_sample,
    training_loss,
    training_step,
)
from planner.measure.clock import elapsed_ms, paired_difference
from planner.measure.device import release_freed_host_memory
from planner.measure.memory import PeakMemory, preserved_state, storage_bytes
from solvers import Problem, peak_bytes
from solvers.solution import format_bytes


@dataclass(frozen=True)
class Verification:
    """Measured figures of one model, unplanned and planned, on the same sample.

    Peaks count parameters, gradients, buffers and inputs plus the largest live activation
    memory of one forward+backward (steps after a warm-up, gradients already allocated).
    `overhead_ms` is what the plan adds to a step, the median over steps of the planned step's
    time less the original's just before it; `predicted_overhead_ms` the plan's `recompute_ms`
    (None where none was given). A few steps read the overhead only roughly where step times
    vary (a shared CPU): pass more steps to `Plan.verify` for a closer reading.
    """

    original_peak_bytes: int
    planned_peak_bytes: int
    predicted_peak_bytes: int
    predicted_original_peak_bytes: int
    budget_bytes: int
    original_step_ms: float
    planned_step_ms: float
    outputs_match: bool
    gradients_match: bool
    steps: int
    overhead_ms: float | None = None  # (None in records saved before it was measured)
    predicted_overhead_ms: float | None = None

    @property
    def overhead_percent(self) -> float:
        """Measured step-time increase of the planned module, in percent."""
        return 100 * (self.planned_step_ms / self.original_step_ms - 1)

    @property
    def peak_error(self) -> float:
        """(predicted - measured) / measured for the planned peak."""
        return (self.predicted_peak_bytes - self.planned_peak_bytes) / self.planned_peak_bytes

    @property
    def original_peak_error(self) -> float:
        return (self.predicted_original_peak_bytes - self.original_peak_bytes) / self.original_peak_bytes

    @property
    def within_budget(self) -> bool:
        return self.planned_peak_bytes <= self.budget_bytes

    def __str__(self) -> str:
        ok = lambda flag: "yes" if flag else "NO"  # noqa: E731
        return "\n".join([
            f"Verification over {self.steps} measured steps",
            f"  {'':<22}{'measured':>12}{'predicted':>12}{'error':>9}",
            f"  {'peak, original':<22}{format_bytes(self.original_peak_bytes):>12}"
            f"{format_bytes(self.predicted_original_peak_bytes):>12}{100 * self.original_peak_error:>+8.1f}%",
            f"  {'peak, planned':<22}{format_bytes(self.planned_peak_bytes):>12}"
            f"{format_bytes(self.predicted_peak_bytes):>12}{100 * self.peak_error:>+8.1f}%",
            f"  {'within budget':<22}{ok(self.within_budget):>12} (budget {format_bytes(self.budget_bytes)})",
            f"  {'step time':<22}{self.original_step_ms:>9.1f} ms -> {self.planned_step_ms:.1f} ms "
            f"({self.overhead_percent:+.0f}%)",
            *self._overhead_lines(),
            f"  {'outputs match':<22}{ok(self.outputs_match):>12}",
            f"  {'gradients match':<22}{ok(self.gradients_match):>12}",
        ])

    def _overhead_lines(self) -> list[str]:
        if self.overhead_ms is None:
            return []
        if self.predicted_overhead_ms is None:
            return [f"  {'step overhead':<22}{self.overhead_ms:>+9.1f} ms"]
        error = self.predicted_overhead_ms - self.overhead_ms
        return [f"  {'step overhead':<22}{self.overhead_ms:>+9.1f} ms{self.predicted_overhead_ms:>9.1f} ms"
                f"{error:>+6.1f} ms"]


def _outputs_and_grads(module: nn.Module, sample: Any, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    for parameter in module.parameters():
        parameter.grad = None
    torch.manual_seed(seed)
    output = run_forward(module, sample)
    loss = training_loss(output)
    with after_autocast():
        loss.backward()
    outputs = [t.detach() for t in output_leaves(output) if isinstance(t, torch.Tensor)]
    grads = [None if p.grad is None else p.grad.clone() for p in module.parameters()]
    return outputs, grads


def _all_close(left: list[Any], right: list[Any]) -> bool:
    if len(left) != len(right):
        return False
    for a, b in zip(left, right):
        if (a is None) != (b is None):
            return False
        if a is not None:
            try:
                torch.testing.assert_close(a, b)
            except AssertionError:
                return False
    return True


def measured_peak(module: nn.Module, sample: Any, device: torch.device) -> int:
    """One training step's peak on `device`, as `Plan.verify` measures it: the storages of the
    parameters, their gradients, the buffers and the sample, plus the highest point of what
    the step allocates (`planner.measure.memory.PeakMemory`, kernel scratch included).

    Example:
        >>> measured_peak(model, tokens, torch.device("cpu"))
    """
    static = static_bytes(module, sample)
    with PeakMemory(device) as memory:
        training_step(module, sample)
    return static + memory.peak_bytes


def static_bytes(module: nn.Module, sample: Any) -> int:
    """Bytes of the storages a step holds throughout: parameters, their gradients, buffers and
    the sample (what `measured_peak` adds to the step's own peak).

    Example:
        >>> static_bytes(model, tokens)
    """
    return storage_bytes((
        list(module.parameters()), [p.grad for p in module.parameters()], list(module.buffers()), sample,
    ))


def step_ms(module: nn.Module, sample: Any, device: torch.device) -> float:
    """One training step's time: CUDA events on CUDA, the wall clock on the CPU.

    Example:
        >>> step_ms(model, tokens, torch.device("cpu"))
    """
    return elapsed_ms(device, lambda: training_step(module, sample))


def verify_modules(original: nn.Module, planned: nn.Module, sample: Any, steps: int,
                   predicted_peak_bytes: int, predicted_original_peak_bytes: int,
                   budget_bytes: int, predicted_overhead_ms: float | None = None) -> Verification:
    """Compare `planned` with `original` on real steps; leaves `original` as it was.
    `predicted_overhead_ms`: what the plan is predicted to add to a step (its `recompute_ms`).

    Example:
        >>> print(verify_modules(model, p.module(), x, 3, p.predicted_peak_bytes,
        ...                      p.baseline_peak_bytes, p.budget_bytes))
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, not {steps}")
    args, kwargs = split_sample(sample)
    device = next(t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
    with preserved_state(original, [device]):
        expected = _outputs_and_grads(original, sample, seed=0)
        got = _outputs_and_grads(planned, sample, seed=0)
        outputs_match = _all_close(expected[0], got[0])
        gradients_match = _all_close(expected[1], got[1])
        del expected, got
        # Gradients stay allocated from here on, as in a training loop.
        peaks: dict[str, list[int]] = {"original": [], "planned": []}
        times: dict[str, list[float]] = {"original": [], "planned": []}
        for _ in range(steps):
            for name, module in (("original", original), ("planned", planned)):
                peaks[name].append(measured_peak(module, sample, device))
                times[name].append(step_ms(module, sample, device))
    return Verification(
        original_peak_bytes=max(peaks["original"]),
        planned_peak_bytes=max(peaks["planned"]),
        predicted_peak_bytes=predicted_peak_bytes,
        predicted_original_peak_bytes=predicted_original_peak_bytes,
        budget_bytes=budget_bytes,
        original_step_ms=statistics.median(times["original"]),
        planned_step_ms=statistics.median(times["planned"]),
        outputs_match=outputs_match,
        gradients_match=gradients_match,
        steps=steps,
        overhead_ms=paired_difference(times, "planned", "original"),
        predicted_overhead_ms=predicted_overhead_ms,
    )


BEYOND_GRAPH = "model's own step beyond the traced graph (measured)"


# Below it, the gap is measurement detail. Not a share of the peak: on an H100 a gap of 0.26%
# of GPT's 6.8 GiB (18 MiB) put two of its plans over budget.
MIN_GAP_BYTES = 1 << 20


def held_outside_step(breakdown: dict[str, int]) -> int:
    """The static terms a bare training step does not hold, though the budget keeps room for
    them: the optimizer state and the reserve.

    Example:
        >>> held_outside_step({"parameters": 4096, "optimizer state": 8192, "reserved": 1024})
        9216
    """
    return breakdown.get("optimizer state", 0) + breakdown.get("reserved", 0)


def steady_peak(module: nn.Module, sample: Any, device: torch.device, owner: nn.Module | None = None) -> int:
    """The peak of a training step of `module` on `device` as `Plan.verify` measures it, with
    gradients allocated, as from the second step of training on. The state of `owner` (default
    `module`; a planned copy shares the model's tensors) is left as it was.

    Example:
        >>> steady_peak(p.module(), tokens, torch.device("cpu"), owner=model)
    """
    with preserved_state(owner if owner is not None else module, [device]):
        release_freed_host_memory()  # (each step's host memory its own, not on top of what earlier work left)
        training_step(module, sample)
        release_freed_host_memory()
        return measured_peak(module, sample, device)


def eager_peak_gap(model: nn.Module, sample: Any, predicted_bytes: int, device: torch.device) -> tuple[int, int]:
    """(measured peak, gap): the model's own unplanned training step measured on `device`
    (gradients allocated, as in a training loop), and how far it peaks above `predicted_bytes`
    (0 where it does not, or by no more than `MIN_GAP_BYTES`). The model is left as it was.

    Example:
        >>> measured, gap = eager_peak_gap(model, tokens, p.baseline_peak_bytes, torch.device("cpu"))
        >>> gap
        0
    """
    measured = steady_peak(model, sample, device)
    gap = measured - predicted_bytes
    return measured, gap if gap > MIN_GAP_BYTES else 0


def keep_free_beyond_graph(model: nn.Module, sample: Any, problem: Problem, breakdown: dict[str, int],
                           device: torch.device, device_name: str) -> tuple[Problem, dict[str, int]]:
    """`problem` and the static `breakdown`, with `BEYOND_GRAPH` added to both where the
    model's own unplanned step peaks above the graph's simulated one (`eager_peak_gap`; the
    optimizer state and the reserve are left out of the comparison: a bare step holds neither).
    Warns with the figures where it adds it.

    Example:
        >>> problem, breakdown = keep_free_beyond_graph(model, tokens, problem, breakdown, cpu, "cpu")
    """
    predicted = peak_bytes(problem) - held_outside_step(breakdown)
    measured, gap = eager_peak_gap(model, sample, predicted, device)
    if not gap:
        return problem, breakdown
    warnings.warn(f"the model's own training step peaked at {format_bytes(measured)} on {device_name}, "
                  f"{format_bytes(gap)} above the traced graph's {format_bytes(predicted)}: memory the graph does "
                  "not show (a kernel workspace, or an attention kernel the model's code picks differently); "
                  f"every plan keeps it free (static term {BEYOND_GRAPH!r})", stacklevel=3)
    return replace(problem, static_bytes=problem.static_bytes + gap), {**breakdown, BEYOND_GRAPH: gap}
