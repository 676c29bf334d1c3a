"""Choose the batch size and the plan together, by samples per second within the budget
(`plan_throughput`).

A larger micro-batch spreads each step's fixed costs (the optimizer step, kernel launches,
Python) over more samples; recomputing frees the memory that buys it, at the price of its
recomputation. For each candidate batch:
- memory comes from sizes on fake tensors at that batch (no memory used; at the reference batch,
  from its measured step), and the cheapest plan that fits is solved for it, priced with the
  node times measured at the reference batch scaled by the batch (node times grow with the
  activations they compute);
- the unplanned step's time (forward and backward) is measured at two or three batches the
  device can run, taken as measured there, on straight lines between them, and beyond them at
  the slope of the line fitted to all (`StepTimes`); the optimizer step is timed once on copies
  of the parameters;
- its predicted time per optimizer step is the fitted step plus its plan's recompute, times the
  micro-batches per optimizer step, plus the optimizer step.
The best two candidates are then planned for real (`plan_measured`: their own steps run where
they can) and their planned steps timed; the one measured faster is chosen. Beside them stand
the baselines people use: no checkpointing, and every block, each at its largest batch that fits.

Example:
    >>> tp = plan_throughput(model, lambda batch: torch.randint(0, 512, (batch, 256)), budget_gb=8,
    ...                      batch_sizes=[4, 8, 16, 32], optimizer="adamw")
    >>> print(tp)
    >>> tp.apply(model)
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from planner.api import GIB, Plan, plan, plan_measured
from planner.core import sample_tensors, training_sample
from planner.measure.autocast import step_autocast
from planner.measure.clock import elapsed_ms
from planner.measure.device import measurable_bytes, plan_device
from planner.measure.static import check_optimizer, fsdp_blocks
from planner.measure.steps import step_ms
from planner.measure.targets import target as find_target
from planner.planning import MeasuredProblem, check_gb, measure_problem
from planner.trace.structure import compute_nodes
from solvers import InfeasibleBudget, Problem, peak_bytes, solve
from solvers.solution import format_bytes

logger = logging.getLogger(__name__)

TIMED_STEPS = 5  # steps timed (after one untimed) per batch the unplanned step is measured at
COST_FIELDS = ("region_overhead_ms", "saved_tensor_ms", "keep_region_ms", "keep_call_ms", "kept_node_ms",
               "run_call_ms", "recorded_call_ms", "run_region_ms")


@dataclass(frozen=True)
class BatchRow:
    """One candidate batch: `batch` samples per micro-batch, `accumulation` micro-batches per
    optimizer step; the cheapest plan that fits (`peak_bytes`, `recompute_ms` per micro-batch;
    None where none fits, and `why`), its predicted time per optimizer step (`step_ms`) and
    samples per second, and, where it was timed, the measured ones; whether no checkpointing
    and every block fit (`none_fits`, `every_block_fits`; None: no blocks), with their predicted
    samples per second."""

    batch: int
    accumulation: int = 1
    peak_bytes: int | None = None
    recompute_ms: float | None = None
    step_ms: float | None = None
    samples_per_s: float | None = None
    measured_step_ms: float | None = None
    measured_samples_per_s: float | None = None
    none_fits: bool = False
    none_samples_per_s: float | None = None
    every_block_fits: bool | None = None
    every_block_samples_per_s: float | None = None
    why: str = ""


@dataclass(frozen=True)
class StepTimes:
    """The unplanned step's time (forward and backward) at the batches it was timed at
    (`measured`, (batch, ms) pairs), the line `intercept_ms + per_sample_ms * batch` fitted to
    them, and the optimizer step's time.

    Example:
        >>> StepTimes(2.0, 4.0, 1.0, ((2, 9.0), (4, 19.0))).step_ms(3)
        14.0
    """

    intercept_ms: float
    per_sample_ms: float
    optimizer_ms: float
    measured: tuple[tuple[int, float], ...]

    def step_ms(self, batch: int) -> float:
        """The step's time at `batch`: as measured where it was timed, on the straight line
        between the two timed batches around it, and beyond them from the nearest one at the
        fitted slope (step times need not be one line: caches, a kernel's tiling)."""
        points = sorted(self.measured)
        if not points:
            return self.intercept_ms + self.per_sample_ms * batch
        for (low, low_ms), (high, high_ms) in zip(points, points[1:]):
            if low <= batch <= high:
                return low_ms + (high_ms - low_ms) * (batch - low) / (high - low)
        nearest, nearest_ms = points[0] if batch < points[0][0] else points[-1]
        return max(0.0, nearest_ms + self.per_sample_ms * (batch - nearest))


@dataclass
class ThroughputPlan:
    """What `plan_throughput` chose: `batch_size` and its `plan`, the table of every candidate
    (`table`), the step-time fit (`times`), the budget, and the global batch where one was given.

    Example:
        >>> tp.batch_size, tp.plan.predicted_peak_bytes
        >>> print(tp)
        >>> tp.plot("throughput.png")
    """

    batch_size: int
    plan: Plan
    table: tuple[BatchRow, ...]
    times: StepTimes
    budget_bytes: int
    global_batch: int | None = None
    reference_batch: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def apply(self, model: nn.Module) -> nn.Module:
        """`self.plan.apply(model)`: the chosen batch's plan, in place.

        Example:
            >>> tp.apply(model)
        """
        return self.plan.apply(model)

    def baseline(self, kind: str) -> BatchRow | None:
        """The row of a baseline's largest fitting batch: `kind` "none" or "every block"."""
        fits = [row for row in self.table if (row.none_fits if kind == "none" else row.every_block_fits)]
        return max(fits, key=lambda row: row.batch) if fits else None

    def plot(self, path: Any) -> Any:
        """Samples per second against batch size: no checkpointing, every block and the planner,
        with the memory wall marked (needs matplotlib). See `planner.throughput.plot`.

        Example:
            >>> tp.plot("throughput.png")
        """
        from planner.throughput.plot import plot_throughput

        return plot_throughput(self, path)

    def __str__(self) -> str:
        per = f"global batch {self.global_batch}" if self.global_batch else "optimizer step per micro-batch"
        lines = [f"Throughput plan: batch {self.batch_size} ({per}), budget {format_bytes(self.budget_bytes)}; "
                 f"planned in {self.seconds:.0f} s",
                 "  step time (forward + backward, unplanned): measured "
                 + ", ".join(f"{ms:.1f} ms at batch {b}" for b, ms in self.times.measured)
                 + f"; between them on straight lines, beyond at {self.times.per_sample_ms:.3f} ms per sample; "
                 f"optimizer step {self.times.optimizer_ms:.1f} ms",
                 "",
                 f"  {'batch':>6} {'accum':>5} {'peak':>11} {'recompute':>10} {'step':>10} {'samples/s':>10} "
                 f"{'measured':>9}  {'none':>8} {'every block':>11}"]
        for row in self.table:
            chosen = " <- chosen" if row.batch == self.batch_size else ""
            if row.peak_bytes is None:
                lines.append(f"  {row.batch:>6} {row.accumulation:>5} cannot fit: {row.why}")
                continue
            measured = f"{row.measured_samples_per_s:>9.1f}" if row.measured_samples_per_s is not None else f"{'-':>9}"
            none = f"{row.none_samples_per_s:>8.1f}" if row.none_samples_per_s is not None else f"{'-':>8}"
            every = (f"{row.every_block_samples_per_s:>11.1f}" if row.every_block_samples_per_s is not None
                     else f"{'-':>11}")
            lines.append(f"  {row.batch:>6} {row.accumulation:>5} {format_bytes(row.peak_bytes):>11} "
                         f"{row.recompute_ms:>7.1f} ms {row.step_ms:>7.1f} ms {row.samples_per_s:>10.1f} {measured}  "
                         f"{none} {every}{chosen}")
        lines.append("  (samples/s predicted; 'measured' where the planned step was timed; 'none' and 'every block'"
                     " where they fit)")
        for kind in ("none", "every block"):
            row = self.baseline(kind)
            if row is not None:
                rate = row.none_samples_per_s if kind == "none" else row.every_block_samples_per_s
                lines.append(f"  {kind + ':':<13} largest fitting batch {row.batch}, {rate:.1f} samples/s (predicted)")
            else:
                lines.append(f"  {kind + ':':<13} fits at no candidate batch")
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])


def check_sample_for(sample_for: Callable[[int], Any], batch: int) -> Any:
    """`sample_for(batch)`, refused (ValueError) where a tensor in it has another first
    dimension than `batch`: the batch must be dimension 0 of every input.

    Example:
        >>> check_sample_for(lambda b: torch.zeros(b, 16), 4).shape
        torch.Size([4, 16])
    """
    sample = sample_for(batch)
    tensors = sample_tensors(sample)
    if not tensors:
        raise TypeError(f"sample_for({batch}) holds no tensor: return the model's inputs for that batch size")
    for tensor in tensors:
        if tensor.dim() and tensor.shape[0] != batch:
            raise ValueError(f"sample_for({batch}) returned a tensor of shape {tuple(tensor.shape)}: its first "
                             f"dimension must be the batch ({batch}); sample_for must scale the batch dimension")
    return sample


def _scaled_times(problem: Problem, scale: float) -> Callable[[Any], str]:
    """Sets each compute node's forward time to the reference's, by name, times `scale`."""
    by_name = {node.name: node for node in problem.nodes}

    def set_times(gm: Any) -> str:
        from planner.core import NodeProfile  # (the record each node carries)

        for node in compute_nodes(gm):
            record: NodeProfile = node.meta["planner.profile"]
            reference = by_name.get(node.name)
            record.forward_ms = 0.0 if reference is None else reference.compute_ms * scale
            record.stop_ms = None if reference is None or reference.stop_ms is None else reference.stop_ms * scale
        return f"node times measured at the reference batch, scaled by {scale:.2f}"
    return set_times


def _timed_step(model: nn.Module, sample: Any, device: torch.device) -> float:
    """Median forward+backward step time of `model` (unplanned or planned) on `sample`, one
    untimed step first; its gradients are dropped after."""
    step_ms(model, sample, device)
    times = [step_ms(model, sample, device) for _ in range(TIMED_STEPS)]
    for parameter in model.parameters():
        parameter.grad = None
    return statistics.median(times)


def optimizer_step_ms(model: nn.Module, optimizer: str | float | None, device: torch.device) -> float:
    """The optimizer's step time on copies of the model's trainable parameters (with gradients):
    AdamW for "adamw" and "adam", SGD with momentum for "sgd-momentum", SGD for "sgd"; 0 where
    no optimizer is named (a number of bytes names none to time).

    Example:
        >>> optimizer_step_ms(model, "adamw", torch.device("cpu"))
    """
    kinds = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd-momentum": torch.optim.SGD,
             "sgd": torch.optim.SGD}
    if not isinstance(optimizer, str) or optimizer not in kinds:
        return 0.0
    copies = [torch.zeros_like(p, device=device).requires_grad_() for p in model.parameters() if p.requires_grad]
    for tensor in copies:
        tensor.grad = torch.ones_like(tensor)
    options = {"momentum": 0.9} if optimizer == "sgd-momentum" else {}
    stepper = kinds[optimizer](copies, lr=1e-3, **options)
    stepper.step()  # (allocates its state)
    return statistics.median(elapsed_ms(device, stepper.step) for _ in range(TIMED_STEPS))


def fit_line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through (batch, ms) points; one point: through the origin.

    Example:
        >>> fit_line([(2, 10.0), (4, 18.0)])
        (2.0, 4.0)
    """
    if len(points) == 1:
        batch, ms = points[0]
        return 0.0, ms / batch
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points))
    slope = max(slope, 0.0)
    return max(0.0, mean_y - slope * mean_x), slope


def plan_throughput(model: nn.Module, sample_for: Callable[[int], Any], budget_gb: float,
                    batch_sizes: Sequence[int], global_batch: int | None = None,
                    progress: Callable[[str], None] | None = None, **plan_options: Any) -> ThroughputPlan:
    """Choose the batch size and the plan together by samples per second within `budget_gb`
    (see the module docstring). `sample_for(batch)` returns the sample for that batch (the batch
    is dimension 0 of every tensor); `batch_sizes` are the candidates; `global_batch` keeps the
    samples per optimizer step fixed through gradient accumulation (candidates must divide it);
    the other keywords are `plan()`'s (`optimizer`, `target`, `world_size`, `measure`, ...).
    A candidate no plan fits is reported as such, never chosen; InfeasibleBudget where none fits.

    Example:
        >>> tp = plan_throughput(model, lambda b: torch.randint(0, 512, (b, 256)), budget_gb=8,
        ...                      batch_sizes=[4, 8, 16], optimizer="adamw")
        >>> tp.batch_size, tp.plan.recompute_ms
    """
    started = time.perf_counter()
    say = progress or (lambda message: logger.info(message))
    if plan_options.get("param_dtype") is not None:  # (its steps would run in the parameters' own dtype)
        raise ValueError("plan_throughput does not search under FSDP2's mixed precision (param_dtype): "
                         "plan each batch size with plan(..., param_dtype=...)")
    budget_bytes = int(check_gb("budget_gb", budget_gb) * GIB)
    reserved_bytes = int(check_gb("reserved_gb", plan_options.get("reserved_gb", 0.0), allow_zero=True) * GIB)
    candidates = sorted({int(b) for b in batch_sizes})
    if not candidates or any(b < 1 or b != float(b) for b in batch_sizes):
        raise ValueError(f"batch_sizes must be whole numbers of samples, at least 1; not {list(batch_sizes)!r}")
    if global_batch is not None and (not isinstance(global_batch, int) or global_batch < 1):
        raise ValueError(f"global_batch must be a whole number of samples, at least 1; not {global_batch!r}")
    samples = {b: training_sample(model, check_sample_for(sample_for, b)) for b in candidates}
    optimizer = check_optimizer(plan_options.get("optimizer"))
    gpu = find_target(plan_options["target"]) if plan_options.get("target") else None
    where = plan_device([*model.parameters(), *model.buffers(), *sample_tensors(samples[candidates[0]])], gpu)
    usable = [b for b in candidates if global_batch is None or global_batch % b == 0]
    if not usable:
        raise ValueError(f"no candidate batch divides the global batch {global_batch}: {candidates}")

    # One planning at a reference batch measures the node times and the cost figures.
    reference_batch = usable[len(usable) // 2]
    say(f"measuring the model at batch {reference_batch} (the reference)")
    reference = plan(model, samples[reference_batch], budget_gb=80, **plan_options)
    setup = replace(reference.setup, static_breakdown=None)
    with step_autocast(where, setup.autocast):  # (every step the search runs, as the reference's)
        costs = {name: getattr(reference.problem, name) for name in COST_FIELDS}
        blocks = fsdp_blocks(model)

        measured: dict[int, MeasuredProblem] = {}
        rows: dict[int, BatchRow] = {}
        for b in candidates:
            accumulation = 1 if global_batch is None else global_batch // b
            if b not in usable:
                rows[b] = BatchRow(b, why=f"{b} does not divide the global batch {global_batch}")
                continue
            if b == reference_batch:  # measured already, on real tensors
                measured[b] = MeasuredProblem(reference.traced, reference.profile, reference.problem,
                                              reference.static_breakdown, reference.wrapped)
                rows[b] = BatchRow(b, accumulation)
                continue
            say(f"sizes at batch {b} on fake tensors")
            found = measure_problem(model, samples[b], where, reserved_bytes, optimizer, setup.world_size,
                                    plan_options.get("leaves", ()), plan_options.get("frontend", "auto"), 1, "no-run",
                                    lambda message: None, selective=plan_options.get("selective", False),
                                    node_times=_scaled_times(reference.problem, b / reference_batch))
            found = replace(found, problem=replace(found.problem, **costs))
            measured[b] = found
            rows[b] = BatchRow(b, accumulation)

        # The unplanned step's time, at two or three batches this device can run.
        room = measurable_bytes(where.device) if where.local else 0
        runnable = [b for b in measured if peak_bytes(measured[b].problem) <= room] if where.local else []
        chosen_for_times = sorted({runnable[0], runnable[len(runnable) // 2], runnable[-1]}) if runnable else []
        points = []
        for b in chosen_for_times:
            say(f"timing the unplanned step at batch {b}")
            points.append((b, _timed_step(model, samples[b], where.device)))
        if not points:
            raise ValueError(f"no candidate batch's unplanned step can run on {where.name} to be timed "
                             "(a model on meta, or another target): plan_throughput measures step times here")
        intercept, slope = fit_line(points)
        times = StepTimes(intercept, slope, optimizer_step_ms(model, optimizer, where.device), tuple(points))

        def per_step(b: int, recompute_ms: float) -> tuple[float, float]:
            accumulation = rows[b].accumulation
            total = accumulation * (times.step_ms(b) + recompute_ms) + times.optimizer_ms
            return total, accumulation * b * 1000 / total

        refusals: dict[int, InfeasibleBudget] = {}
        for b, found in measured.items():
            problem = found.problem
            block_regions = _block_regions(found, blocks)
            none_fits = peak_bytes(problem) <= budget_bytes
            every_fits = None if not block_regions else peak_bytes(problem, block_regions) <= budget_bytes
            extra = {"none_fits": none_fits, "none_samples_per_s": per_step(b, 0.0)[1] if none_fits else None,
                     "every_block_fits": every_fits,
                     "every_block_samples_per_s": per_step(b, problem.recompute_ms(block_regions))[1] if every_fits
                     else None}
            try:
                solution = solve(problem, budget_bytes, method=plan_options.get("solver", "auto"))
            except InfeasibleBudget as error:
                refusals[b] = error
                smallest = format_bytes(error.minimum_bytes)
                rows[b] = replace(rows[b], why=f"the smallest budget a plan fits is {smallest}",
                                  **extra)
                continue
            step, rate = per_step(b, solution.recompute_ms)
            rows[b] = replace(rows[b], peak_bytes=solution.peak_bytes, recompute_ms=solution.recompute_ms, step_ms=step,
                              samples_per_s=rate, **extra)
        ranked = sorted((row for row in rows.values() if row.samples_per_s is not None),
                        key=lambda row: (-row.samples_per_s, row.batch))
        if not ranked:  # the smallest candidate's refusal, with the least budget a plan for it fits
            raise (refusals[min(refusals)] if refusals
                   else ValueError(f"no candidate batch can be planned: {candidates}"))

        # The best two are planned for real and their planned steps timed, and the largest batch that
        # needs no checkpointing (on a CPU, where larger batches buy less, it may win): measured beats
        # predicted.
        plans: dict[int, Plan] = {}
        notes: list[str] = []
        plain = max((row for row in ranked if row.none_fits), key=lambda row: row.batch, default=None)
        for row in [*ranked[:2], *([plain] if plain is not None and plain not in ranked[:2] else [])]:
            b = row.batch
            say(f"planning batch {b} and timing its planned step")
            try:
                plans[b] = plan_measured(model, samples[b], measured[b],
                                         replace(setup, static_breakdown=measured[b].breakdown), budget_bytes,
                                         reserved_bytes,
                                         solver=plan_options.get("solver", "auto"))
            except InfeasibleBudget as error:  # (its own step held more than predicted)
                refusals[b] = error
                rows[b] = replace(rows[b], peak_bytes=None, samples_per_s=None, why=f"its measured step: {error}")
                notes.append(f"batch {b}: {error}")
                continue
            if where.local and plans[b].model is not None:
                planned_ms = _timed_step(plans[b].module(), samples[b], where.device)
                total = rows[b].accumulation * planned_ms + times.optimizer_ms
                rows[b] = replace(rows[b], measured_step_ms=total,
                                  measured_samples_per_s=rows[b].accumulation * b * 1000 / total)
        if not plans:  # every candidate's own step held more than predicted: the smallest one's refusal
            raise refusals[min(refusals)]
        best = max((rows[b] for b in plans),
                   key=lambda row: (row.measured_samples_per_s or row.samples_per_s, -row.batch))
        if not plans[best.batch].solution.regions:
            notes.append(f"batch {best.batch} needs no checkpointing and measures fastest: the plan recomputes nothing")
        return ThroughputPlan(best.batch, plans[best.batch], tuple(rows[b] for b in candidates), times, budget_bytes,
                              global_batch, reference_batch, time.perf_counter() - started, notes)


def _block_regions(found: MeasuredProblem, blocks: list[str]) -> tuple[range, ...]:
    """The node ranges of the model's blocks (each a submodule call the plan may checkpoint)."""
    by_module = {spec.module: region for region, spec in found.wrapped.items() if not spec.segments}
    regions = tuple(by_module[name] for name in blocks if name in by_module)
    return regions if len(regions) == len(blocks) else ()


__all__ = ["BatchRow", "StepTimes", "ThroughputPlan", "check_sample_for", "fit_line", "optimizer_step_ms",
           "plan_throughput"]
