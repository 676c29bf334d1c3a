"""The traced graph against the model's own code, where the whole step runs on the plan's device.

Plans are simulated on the traced graph, but the applied plan runs the model's own code. The
two can allocate differently: on an H100, a Hugging Face Llama with grouped-query attention ran
`scaled_dot_product_attention` on the math kernel in its own code (attention probabilities
saved) and peaked 14% above the graph's prediction, and at larger batches every model's plans
measured 18-480 MiB above theirs (benchmarks/RESULTS.md, 2026-11-26 21:53-22:02). So `plan()`
measures the model's own unplanned step there, as `Plan.verify` does, and where it peaks above
the graph's simulated peak by more than `MIN_GAP_BYTES`, the difference
becomes a static term, `BEYOND_GRAPH`: every plan then keeps it free. Measured, not modelled,
and conservative (the part of it that checkpointing would free is kept free anyway).
"""
from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from planner.memory import preserved_state
from planner.verify import measured_peak, training_step
from solvers import Problem, format_bytes, peak_bytes

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
        training_step(module, sample)
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
