"""Run real training steps of the original and the planned module and compare them."""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from planner.clock import elapsed_ms, paired_difference
from planner.memory import PeakMemory, preserved_state, storage_bytes
from planner.trace import split_sample
from solvers import format_bytes


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


def training_loss(output: Any) -> torch.Tensor:
    """A scalar to call backward on: the model's own `loss` if it returns one, else the sum of
    its floating-point outputs, whose backward hands each output a gradient of ones as a loss
    function would: materialised (`t.sum()` passes an expanded scalar, which kernels such as
    matmul's backward then copy into scratch of their own, memory no real loss causes).

    Example:
        >>> training_loss(torch.ones(3, requires_grad=True))
        tensor(3., grad_fn=<AddBackward0>)
    """
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in _leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        raise ValueError("the model's output holds no tensor that requires grad: nothing to train")
    return sum(_SumOfOnes.apply(t) for t in tensors)  # type: ignore[return-value]


class _SumOfOnes(torch.autograd.Function):
    """`x.sum()` whose backward returns a contiguous gradient, as a loss function's does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        return x.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.expand(ctx.shape).clone(memory_format=torch.contiguous_format)


def _leaves(output: Any) -> list[Any]:
    """Pytree leaves, looking inside dataclass records too (pytree treats them as leaves)."""
    found = []
    for leaf in tree_flatten(output)[0]:
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += _leaves([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
        else:
            found.append(leaf)
    return found


def _call(module: nn.Module, sample: Any) -> Any:
    args, kwargs = split_sample(sample)
    return module(*args, **kwargs)


def training_step(module: nn.Module, sample: Any) -> None:
    training_loss(_call(module, sample)).backward()


def _outputs_and_grads(module: nn.Module, sample: Any, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    for parameter in module.parameters():
        parameter.grad = None
    torch.manual_seed(seed)
    output = _call(module, sample)
    training_loss(output).backward()
    outputs = [t.detach() for t in _leaves(output) if isinstance(t, torch.Tensor)]
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
    the step allocates (`planner.memory.PeakMemory`, kernel scratch included).

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
