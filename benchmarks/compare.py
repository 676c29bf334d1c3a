"""Planner vs. today's options: measured peak memory and step time of one training step.

For each model, one run measures these configurations side by side:

- `none`: the model as it is, no checkpointing;
- `every block`: each block under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`, on a
  deep copy (Hugging Face models: `activation_checkpointing_enable()`, which is what transformers
  users get, or `gradient_checkpointing_enable()` on transformers older than its 5.x rename;
  the built-in models: each block's `forward` wrapped);
- `sqrt(N) segments`: what `checkpoint_sequential` does: the N blocks cut into segments of about
  sqrt(N) blocks, every segment but the last run under one checkpoint call (deep copy);
- `compile b=...`: `torch.compile` (Inductor) on a deep copy, with
  `torch._functorch.config.activation_memory_budget` set to each value while it compiles and
  first runs (one compiled copy per value; compile time is reported apart from step time);
- the planner: `plan(model, sample, budget_gb=80)` once, then `replan(budget_gb=..., solver=...)`
  at 40/60/80% of the measured unplanned peak, for every solver in `solvers.SOLVERS` (but
  `brute_force`), timing `p.module()`.

Every configuration is warmed up first (gradients allocated, compiled code built), its peak is
measured once, and then all configurations take one timed step per round, round after round,
so that machine noise hits them alike. Step time is the median over rounds.

Peaks count static storages (parameters, gradients, buffers, inputs) plus the peak of what the
step allocates, as `p.verify()` does: `planner.memory.PeakMemory`, which replays the
allocator's events from `torch.profiler` (kernel scratch included) and works for compiled code
too. Eager configurations are also measured with `planner.memory.LiveBytesTracker` (a
TorchDispatchMode: tensors only; Dynamo skips compiled code under it), and the allocator's view
without kernel scratch is checked against it.

    .venv/bin/python benchmarks/compare.py [--quick] [--models gpt,gpt2,cnn,vit] [--rounds 3]
                                           [--no-save] [--warm-cache]

Prints a table per model and, unless --no-save or --quick, appends them to
benchmarks/RESULTS.md and writes benchmarks/results/compare_<model>.png. `--quick` uses tiny
sizes, one round and one compile budget (a smoke run; its plots go to a temporary folder).
"""
from __future__ import annotations

import argparse
import copy
import functools
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Models


@dataclass
class Spec:
    """A benchmark model: how to build it, where its blocks are, how to checkpoint them."""

    key: str
    title: str
    build: Callable[[bool], tuple[Any, Any, str]]  # quick -> (model, sample, size description)
    blocks: Callable[[Any], Any]  # model -> ModuleList of blocks
    hugging_face: bool = False


def build_gpt(quick: bool):
    import torch
    from planner.examples import TinyGPT

    if quick:
        width, blocks, length, batch = 64, 4, 64, 2
    else:
        width, blocks, length, batch = 128, 8, 256, 6
    model = TinyGPT(width=width, heads=4, blocks=blocks, context=length)
    sample = torch.randint(0, 512, (batch, length))
    return model, sample, (f"TinyGPT: {blocks} blocks, width {width}, 4 heads, vocab 512, dropout 0.1; "
                           f"batch {batch} x {length} tokens")


def build_gpt2(quick: bool):
    import torch
    import transformers

    if quick:
        layers, hidden, heads, vocab, length, batch = 2, 64, 4, 512, 64, 2
    else:
        layers, hidden, heads, vocab, length, batch = 6, 256, 4, 8192, 512, 1
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                                     n_positions=length, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, vocab, (batch, length))
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}, (
        f"GPT2LMHeadModel: {layers} layers, hidden {hidden}, {heads} heads, vocab {vocab}, dropout 0.1; "
        f"batch {batch} x {length} tokens; loss computed by the model (labels)")


def build_cnn(quick: bool):
    import torch
    from planner.examples import SmallCNN

    if quick:
        channels, stages, size, batch = 8, 4, 16, 2
    else:
        channels, stages, size, batch = 32, 8, 64, 16
    model = SmallCNN(channels=channels, stages=stages)
    sample = torch.randn(batch, 3, size, size)
    return model, sample, (f"SmallCNN: {stages} residual stages of conv-BN-ReLU-conv-BN, {channels} channels; "
                           f"batch {batch} x 3 x {size} x {size}")


def build_vit(quick: bool):
    import torch
    import transformers

    if quick:
        layers, hidden, heads, image, patch, batch = 2, 64, 4, 32, 8, 2
    else:
        layers, hidden, heads, image, patch, batch = 6, 384, 6, 224, 16, 4
    config = transformers.ViTConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden,
                                    num_attention_heads=heads, image_size=image, patch_size=patch, num_labels=10)
    model = transformers.ViTForImageClassification(config)
    sample = {"pixel_values": torch.randn(batch, 3, image, image), "labels": torch.randint(0, 10, (batch,))}
    return model, sample, (f"ViTForImageClassification: {layers} layers, hidden {hidden}, {heads} heads, "
                           f"patch {patch}; batch {batch} x 3 x {image} x {image}; loss computed by the model (labels)")


def vit_layers(model):
    encoder = model.vit
    return encoder.layers if hasattr(encoder, "layers") else encoder.encoder.layer


SPECS = {
    "gpt": Spec("gpt", "Built-in transformer (TinyGPT)", build_gpt, lambda m: m.blocks),
    "gpt2": Spec("gpt2", "Hugging Face GPT-2 (small config)", build_gpt2, lambda m: m.transformer.h, True),
    "cnn": Spec("cnn", "CNN with BatchNorm (SmallCNN)", build_cnn, lambda m: m.stages),
    "vit": Spec("vit", "Hugging Face ViT (small config)", build_vit, vit_layers, True),
}


# --------------------------------------------------------------------------------------------
# Baselines: every block, sqrt(N) segments


def segments(count: int) -> list[list[int]]:
    """Consecutive segments of about sqrt(count) blocks (the last may be shorter)."""
    size = max(1, round(math.sqrt(count)))
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def _checkpointed(function):
    from torch.utils.checkpoint import checkpoint

    def run(*args, **kwargs):
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    return run


def every_block(spec: Spec, model):
    """A deep copy with each block checkpointed."""
    copied = copy.deepcopy(model)
    if spec.hugging_face:
        # transformers 5.x renamed it (the old name warns that it goes in v6); older ones lack it.
        if hasattr(copied, "activation_checkpointing_enable"):
            copied.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            how = "`activation_checkpointing_enable(use_reentrant=False)` on a deep copy"
        else:
            copied.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            how = "`gradient_checkpointing_enable(use_reentrant=False)` on a deep copy"
    else:
        blocks = spec.blocks(copied)
        for block in blocks:
            block.forward = _checkpointed(block.forward)
        how = f"each of the {len(blocks)} blocks' `forward` wrapped in `checkpoint(use_reentrant=False)` on a deep copy"
    copied.train()
    return copied, how


def _identity(hidden, *args, **kwargs):
    return hidden


def sqrt_segments(spec: Spec, model):
    """A deep copy whose blocks run in segments of about sqrt(N), all but the last under one
    checkpoint call each (what `checkpoint_sequential` does)."""
    copied = copy.deepcopy(model)
    blocks = spec.blocks(copied)
    parts = segments(len(blocks))
    sizes = "+".join(str(len(part)) for part in parts)
    if spec.key == "cnn":
        # The residual add and ReLU live in SmallCNN.forward, between stages: a segment must
        # include them, so the copy gets a forward that runs its stages segment by segment.
        def run_stages(indices):
            def run(x):
                for index in indices:
                    x = copied.relu(blocks[index](x) + x)
                return x
            return run

        runs = [_checkpointed(run_stages(part)) for part in parts[:-1]] + [run_stages(parts[-1])]

        def forward(images):
            x = copied.stem(images)
            for run in runs:
                x = run(x)
            return copied.head(x.mean(dim=(2, 3)))

        copied.forward = forward
        how = (f"a forward on a deep copy running stages (with their residual add and ReLU) in segments "
               f"{sizes}, all but the last under one checkpoint call")
    else:
        # Blocks map (hidden, *same arguments for every block) -> hidden: the first block of a
        # segment runs the whole segment under one checkpoint call, the others pass through.
        for part in parts[:-1]:
            forwards = [blocks[index].forward for index in part]

            def run(hidden, *args, _forwards=forwards, **kwargs):
                for forward in _forwards:
                    hidden = forward(hidden, *args, **kwargs)
                return hidden

            blocks[part[0]].forward = _checkpointed(run)
            for index in part[1:]:
                blocks[index].forward = _identity
        how = (f"blocks' `forward` patched on a deep copy: segments {sizes}, "
               f"all but the last under one checkpoint call")
    copied.train()
    return copied, how


# --------------------------------------------------------------------------------------------
# Configurations and measurement


@dataclass
class Config:
    name: str
    kind: str  # "baseline", "compile", "planner"
    module: Any = None
    budget_bytes: int | None = None
    solver: str = ""
    fraction: float | None = None
    infeasible: str = ""  # why there is no module
    note: str = ""
    compile_s: float | None = None
    predicted_peak_bytes: int | None = None
    peak: int | None = None  # the allocator's, kernel scratch included
    peak_without_scratch: int | None = None
    tensor_peak: int | None = None  # LiveBytesTracker's (eager configurations only)
    times_ms: list[float] = field(default_factory=list)
    backend: Any = None
    regions: tuple[tuple[str, ...], ...] | None = None  # planner: the recomputed node ranges

    @property
    def eager(self) -> bool:
        return self.kind != "compile"

    @property
    def step_ms(self) -> float | None:
        return statistics.median(self.times_ms) if self.times_ms else None

    @property
    def spread_ms(self) -> float:
        """max - min of the step times over rounds."""
        return max(self.times_ms) - min(self.times_ms) if self.times_ms else 0.0


def call(module, sample):
    from planner.trace import split_sample

    args, kwargs = split_sample(sample)
    return module(*args, **kwargs)


def step(module, sample) -> None:
    from planner.verify import training_loss

    training_loss(call(module, sample)).backward()


def static_bytes(module, sample) -> int:
    from planner.memory import storage_bytes

    parameters = list(module.parameters())
    return storage_bytes((parameters, [p.grad for p in parameters], list(module.buffers()), sample))


def measure_tensors(module, sample) -> int:
    from planner.memory import LiveBytesTracker

    gc.collect()
    with LiveBytesTracker() as tracker:
        step(module, sample)
    return static_bytes(module, sample) + tracker.peak_bytes


def measure_allocator(module, sample) -> tuple[int, int]:
    """The peak as p.verify() measures it (PeakMemory on the CPU), and without kernel scratch."""
    from planner.allocations import ProfiledPeakMemory

    gc.collect()
    with ProfiledPeakMemory() as memory:
        step(module, sample)
    static = static_bytes(module, sample)
    return static + memory.peak_bytes, static + memory.peak_bytes_without_scratch


def timed_step(module, sample) -> float:
    gc.collect()
    started = time.perf_counter()
    step(module, sample)
    return 1000 * (time.perf_counter() - started)


def inductor_with_budget(budget: float):
    """A distinct Inductor backend per budget: Dynamo guards on the backend, so each compiled
    copy gets its own graphs (copies of one class would otherwise share cache entries)."""
    import torch

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        backend.graphs += 1
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    backend.graphs = 0
    return backend


# --------------------------------------------------------------------------------------------
# One model


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f} MiB"


@dataclass
class ModelResult:
    spec: Spec
    description: str
    configs: list[Config]
    plan_s: float
    auto_solvers: dict[float, str]
    notes: list[str]


def run_model(spec: Spec, args) -> ModelResult:
    import torch
    from planner import InfeasibleBudget, plan
    from planner.api import GIB
    from solvers import SOLVERS

    torch.manual_seed(0)
    model, sample, description = spec.build(args.quick)
    model.train()
    log(f"{spec.key}: {description}")
    notes: list[str] = []

    none = Config("none", "baseline", model)
    step(model, sample)  # gradients allocated from here on
    none.peak, none.peak_without_scratch = measure_allocator(model, sample)
    unplanned = none.peak
    log(f"{spec.key}: unplanned peak {mib(unplanned)}")

    block_module, how = every_block(spec, model)
    every = Config("every block", "baseline", block_module)
    notes.append(f"every block: {how}")
    segment_module, how = sqrt_segments(spec, model)
    sqrt_config = Config(f"sqrt(N) segments ({'+'.join(str(len(p)) for p in segments(len(spec.blocks(model))))})",
                         "baseline", segment_module)
    notes.append(f"sqrt(N) segments: {how}")
    configs = [none, every, sqrt_config]

    log(f"{spec.key}: planning (plan(model, sample, budget_gb=80))")
    started = time.perf_counter()
    base = plan(model, sample, budget_gb=80, repeats=args.plan_repeats)
    plan_s = time.perf_counter() - started
    log(f"{spec.key}: measured and solved in {plan_s:.1f} s; {len(base.problem)} nodes via {base.frontend}")
    solver_names = [name for name in SOLVERS if name not in ("brute_force", "auto")]
    auto_solvers: dict[float, str] = {}
    for fraction in args.fractions:
        budget = int(fraction * unplanned)
        try:
            auto_solvers[fraction] = base.replan(budget_gb=budget / GIB, solver="auto").solver
        except InfeasibleBudget:
            auto_solvers[fraction] = "infeasible"
        except Exception as error:  # noqa: BLE001 - reported, not hidden
            auto_solvers[fraction] = f"error: {error}"
        for solver in solver_names:
            name = f"planner {solver} {fraction:.0%}"
            config = Config(name, "planner", budget_bytes=budget, solver=solver, fraction=fraction)
            started = time.perf_counter()
            try:
                planned = base.replan(budget_gb=budget / GIB, solver=solver)
            except InfeasibleBudget as infeasible:
                config.infeasible = f"infeasible: minimum {mib(infeasible.minimum_bytes)}"
            except Exception as error:  # noqa: BLE001 - a solver that fails is reported
                config.infeasible = f"error: {type(error).__name__}: {error}"
            else:
                config.module = planned.module()
                config.regions = tuple(checkpoint.nodes for checkpoint in planned.checkpoints)
                config.predicted_peak_bytes = planned.predicted_peak_bytes
                solution = planned.solution
                gap = f" (gap {100 * solution.gap:.1f}%)" if solution.gap else ""
                config.note = (f"{len(planned.checkpoints)} regions, recompute {planned.recompute_ms:.0f} ms "
                               f"predicted, {solution.status.value}{gap}, solved in {solution.solve_seconds:.2f} s")
            log(f"{spec.key}: {name} budget {mib(budget)}: "
                f"{config.infeasible or config.note} ({time.perf_counter() - started:.1f} s)")
            configs.append(config)

    for budget in args.compile_budgets:
        backend = inductor_with_budget(budget)
        compiled = torch.compile(copy.deepcopy(model), backend=backend)
        config = Config(f"compile b={budget:g}", "compile", compiled, backend=backend)
        log(f"{spec.key}: compiling with activation_memory_budget={budget:g}")
        started = time.perf_counter()
        try:
            with torch._functorch.config.patch(activation_memory_budget=budget):
                step(compiled, sample)
        except Exception as error:  # noqa: BLE001 - reported
            config.infeasible = f"error: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
            config.module = None
        else:
            config.compile_s = time.perf_counter() - started
            if backend.graphs == 0:
                raise RuntimeError(f"compiled copy for budget {budget} reused another copy's graphs")
            config.note = f"{backend.graphs} graph(s)"
        log(f"{spec.key}: compile b={budget:g}: {config.infeasible or f'{config.compile_s:.1f} s'}")
        configs.append(config)

    runnable = [c for c in configs if c.module is not None]
    for config in runnable:
        if config is not none and config.kind != "compile":
            step(config.module, sample)  # warm-up (the compiled ones were warmed by compiling)
    log(f"{spec.key}: measuring peaks of {len(runnable)} configurations")
    for config in runnable:
        if config.eager:
            config.tensor_peak = measure_tensors(config.module, sample)
        if config.peak is None:
            config.peak, config.peak_without_scratch = measure_allocator(config.module, sample)
    for round_index in range(args.rounds):
        shift = round_index % len(runnable)
        order = runnable[shift:] + runnable[:shift]
        for config in order:
            config.times_ms.append(timed_step(config.module, sample))
        log(f"{spec.key}: round {round_index + 1}/{args.rounds} done "
            f"(none {none.times_ms[-1]:.0f} ms, every block {every.times_ms[-1]:.0f} ms)")
    return ModelResult(spec, description, configs, plan_s, auto_solvers, notes)


# --------------------------------------------------------------------------------------------
# Reporting


def table(result: ModelResult) -> str:
    configs = {c.name: c for c in result.configs}
    none, every = configs["none"], configs["every block"]
    every_overhead = every.step_ms - none.step_ms if every.step_ms and none.step_ms else None
    rows = ["| configuration | peak | peak, tensors only | step: median [min-max] | vs none | recompute overhead "
            "| share of every-block overhead | budget | under budget | notes |",
            "|" + "---|" * 10]
    for c in result.configs:
        budget = mib(c.budget_bytes) if c.budget_bytes is not None else "-"
        if c.module is None:
            rows.append(f"| {c.name} | - | - | - | - | - | - | {budget} | {c.infeasible} | |")
            continue
        overhead = c.step_ms - none.step_ms
        share = (f"{overhead / every_overhead:.2f}" if every_overhead and every_overhead > 0 and c is not none
                 else "-")
        if c.budget_bytes is not None:
            under = "yes" if c.peak <= c.budget_bytes else "NO"
        else:
            under = "-"
        notes = c.note
        if c.kind == "planner":
            notes = f"predicted {mib(c.predicted_peak_bytes)}; {notes}"
            if result.auto_solvers.get(c.fraction) == c.solver:
                notes += "; = auto"
        if c.kind == "compile":
            notes = f"compile + first step {c.compile_s:.1f} s; {notes}"
        tensors = mib(c.tensor_peak) if c.tensor_peak is not None else "-"
        rows.append(f"| {c.name} | {mib(c.peak)} | {tensors} | {c.step_ms:.0f} ms "
                    f"[{min(c.times_ms):.0f}-{max(c.times_ms):.0f}] | {c.step_ms / none.step_ms:.2f}x "
                    f"| {overhead:+.0f} ms | {share} | {budget} | {under} | {notes} |")
    return "\n".join(rows)


def verdict(result: ModelResult) -> tuple[list[str], dict[str, bool | None]]:
    """Lines for the three targets and, per target, met (True), missed (False) or not
    applicable (None)."""
    configs = {c.name: c for c in result.configs}
    none, every = configs["none"], configs["every block"]
    planner = [c for c in result.configs if c.kind == "planner"]
    ran = [c for c in planner if c.module is not None]
    lines: list[str] = []
    flags: dict[str, bool] = {}
    noise_ms, noise_line = noise(result)

    over = [c for c in ran if c.peak > c.budget_bytes]
    flags["under budget"] = not over if ran else None
    infeasible = [c for c in planner if c.module is None]
    text = (f"every planner run measured under its budget ({len(ran)} runs)" if not over else
            "OVER budget: " + ", ".join(f"{c.name} {mib(c.peak)} > {mib(c.budget_bytes)}" for c in over))
    if infeasible:
        text += "; not run: " + ", ".join(f"{c.name} ({c.infeasible})" for c in infeasible)
    lines.append(f"- Under budget: {text}.")

    at_or_above = [c for c in ran if c.budget_bytes >= every.peak]
    faster = [c for c in at_or_above if c.step_ms < every.step_ms]
    flags["faster than every block"] = len(faster) == len(at_or_above) if at_or_above else None
    if not at_or_above:
        lines.append(f"- Faster than every block at budgets >= its peak ({mib(every.peak)}): "
                     "no planner budget was at or above it.")
    else:
        slower = [c for c in at_or_above if c.step_ms >= every.step_ms]
        lines.append(
            f"- Faster than every block at budgets >= its peak ({mib(every.peak)}, {every.step_ms:.0f} ms): "
            f"{len(faster)}/{len(at_or_above)}"
            + ("" if not slower else "; not faster: " + ", ".join(
                f"{c.name} {c.step_ms:.0f} ms ({'within' if c.step_ms - every.step_ms <= noise_ms else 'beyond'} noise)"
                for c in slower))
            + ".")
    every_overhead = every.step_ms - none.step_ms
    if every_overhead <= 0:
        lines.append(f"- Overhead share: every block's overhead measured {every_overhead:+.0f} ms (noise "
                     "exceeds it), so the share is undefined.")
        flags["overhead half or less"] = None
    elif not ran:
        lines.append("- Overhead share: no planner run to compare.")
        flags["overhead half or less"] = None
    else:
        shares = [(c, (c.step_ms - none.step_ms) / every_overhead) for c in (at_or_above or ran)]
        within = [c for c, share in shares if share <= 0.5]
        flags["overhead half or less"] = len(within) == len(shares)
        scope = "at budgets >= every block's peak" if at_or_above else "at all budgets run"
        beyond = [c for c, share in shares
                  if share > 0.5 and (c.step_ms - none.step_ms) - 0.5 * every_overhead > noise_ms]
        lines.append(f"- Planner overhead as a share of every block's ({every_overhead:+.0f} ms) {scope}: "
                     + ", ".join(f"{c.name} {share:.2f}" for c, share in shares)
                     + f"; {len(within)}/{len(shares)} at 0.5 or less"
                     + (f"; above 0.5 by more than the noise: {', '.join(c.name for c in beyond)}" if beyond else
                        "; every one above 0.5 is within the noise" if len(within) < len(shares) else "")
                     + f" (one noise spread = {noise_ms / every_overhead:.2f} of every block's overhead).")
    lines.append(noise_line)
    return lines, flags


def noise(result: ModelResult) -> tuple[float, str]:
    """The timing noise of a model's run: the median over configurations of their spread
    (max - min over rounds), and how far apart configurations running the same plan measured."""
    runnable = [c for c in result.configs if c.module is not None and len(c.times_ms) > 1]
    spread = statistics.median(c.spread_ms for c in runnable) if runnable else 0.0
    same = {}
    for c in result.configs:
        if c.regions is not None and c.module is not None:
            same.setdefault(c.regions, []).append(c)
    pairs = [group for group in same.values() if len(group) > 1]
    line = (f"- Timing noise: median spread (max - min over rounds) of a configuration's step time "
            f"{spread:.0f} ms")
    if pairs:
        worst = max(pairs, key=lambda group: max(c.step_ms for c in group) - min(c.step_ms for c in group))
        gap = max(c.step_ms for c in worst) - min(c.step_ms for c in worst)
        line += (f"; {len(pairs)} group(s) of planner runs with identical plans, whose medians differ by up to "
                 f"{gap:.0f} ms ({' vs '.join(c.name for c in worst)})")
    return spread, line + "."


def _place_labels(figure, axes, labels) -> None:
    """Annotate each point, trying offsets until the label overlaps no marker and no label
    placed before."""
    from matplotlib.transforms import Bbox

    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    placed = []
    for x, y, _, _ in labels:
        px, py = axes.transData.transform((x, y))
        placed.append(Bbox.from_extents(px - 4, py - 4, px + 4, py + 4))
    offsets = [(4, 3), (4, -9), (4, 10), (-4, 3), (-4, -9), (4, -16), (4, 17), (-4, 10), (-4, -16), (4, 24)]
    for x, y, text, color in labels:
        for dx, dy in offsets:
            annotation = axes.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=6.5,
                                       color=color, ha="left" if dx > 0 else "right")
            box = annotation.get_window_extent(renderer).expanded(1.02, 1.1)
            if not any(box.overlaps(other) for other in placed) or (dx, dy) == offsets[-1]:
                placed.append(box)
                break
            annotation.remove()


def plot(result: ModelResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(c.step_ms, c.peak / 2**20, c) for c in result.configs if c.module is not None]
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=90)
    colors = {"baseline": "#444444", "compile": "#1f77b4"}
    solver_colors = ["#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    solvers = sorted({c.solver for _, _, c in points if c.kind == "planner"})
    markers = {"baseline": "s", "compile": "^", "planner": "o"}
    labels = []
    for x, y, c in points:
        color = colors.get(c.kind) or solver_colors[solvers.index(c.solver) % len(solver_colors)]
        axes.scatter(x, y, color=color, marker=markers[c.kind], s=28, zorder=3)
        labels.append((x, y, c.name.replace("planner ", "").replace("sqrt(N) segments", "sqrt(N) seg"), color))
    front = []
    for x, y, c in sorted(points, key=lambda point: (point[0], point[1])):
        if not front or y < front[-1][1]:
            front.append((x, y, c))
    if front:
        xs = [x for x, _, _ in front]
        ys = [y for _, y, _ in front]
        axes.step(xs + [max(x for x, _, _ in points)], ys + [ys[-1]], where="post", color="#999999",
                  linewidth=1, linestyle="--", zorder=1, label="Pareto front")
    budgets = sorted({c.budget_bytes for c in result.configs if c.budget_bytes is not None})
    for budget in budgets:
        axes.axhline(budget / 2**20, color="#dddddd", linewidth=0.8, zorder=0)
    handles = [plt.Line2D([], [], color="#444444", marker="s", linestyle="", label="baselines")]
    if any(c.kind == "compile" for _, _, c in points):
        handles.append(plt.Line2D([], [], color="#1f77b4", marker="^", linestyle="", label="torch.compile,\nbudget b"))
    handles += [plt.Line2D([], [], color=solver_colors[i % len(solver_colors)], marker="o", linestyle="",
                           label=f"planner {name},\n% of unplanned peak") for i, name in enumerate(solvers)]
    handles.append(plt.Line2D([], [], color="#999999", linestyle="--", label="Pareto front"))
    handles.append(plt.Line2D([], [], color="#dddddd", label="planner budgets"))
    axes.margins(x=0.12, y=0.08)
    axes.set_xlabel("median step time, forward+backward (ms)", fontsize=9)
    axes.set_ylabel("measured peak (MiB)", fontsize=9)
    axes.set_title(f"{result.spec.title}: peak vs step time", fontsize=9)
    axes.tick_params(labelsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout(rect=(0, 0, 0.77, 1))
    _place_labels(figure, axes, labels)  # after the layout: placement works in display coordinates
    figure.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(0.77, 0.95), frameon=False)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def validation(results: list[ModelResult]) -> str:
    """How the allocator's view (kernel scratch left out) compares with the tensor tracker's."""
    lines = []
    for result in results:
        eager = [c for c in result.configs if c.module is not None and c.eager]
        exact = [c for c in eager if c.peak_without_scratch == c.tensor_peak]
        deviation = max(eager, key=lambda c: abs(c.peak_without_scratch - c.tensor_peak))
        difference = deviation.peak_without_scratch - deviation.tensor_peak
        scratch = [(c.peak - c.tensor_peak) / c.tensor_peak for c in eager]
        lines.append(
            f"- {result.spec.key}: {len(eager)} eager configurations, {len(exact)} identical to the byte; largest "
            f"difference {difference:+d} B ({100 * difference / deviation.tensor_peak:+.3f}%, {deviation.name}); "
            f"kernel scratch adds {100 * min(scratch):+.1f}% to {100 * max(scratch):+.1f}% to the peak")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round, one compile budget")
    parser.add_argument("--models", default=",".join(SPECS), help=f"comma-separated subset of {','.join(SPECS)}")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3, --quick 1)")
    parser.add_argument("--no-save", action="store_true", help="print only: no RESULTS.md, no plots")
    parser.add_argument("--warm-cache", action="store_true",
                        help="use Inductor's usual cache (default: a fresh one, so compile times are cold)")
    parser.add_argument("--plan-repeats", type=int, default=3, help="plan(repeats=...) timing repeats")
    parser.add_argument("--ilp-time-limit", type=float, default=10.0,
                        help="time_limit_s for the ilp solver when it is registered (default 10; its own default "
                             "is 60, which could add 12 minutes to the run)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (default 1: on a shared 2-core machine two OpenMP threads stall "
                             "whenever another process holds a core; steps measured 3-15x slower and erratic)")
    parser.add_argument("--compile-budgets", default=None,
                        help="comma-separated activation_memory_budget values (default 0.1,0.3,0.5,0.7,0.9; --quick 0.5)")
    args = parser.parse_args()
    keys = [key.strip() for key in args.models.split(",") if key.strip()]
    unknown = [key for key in keys if key not in SPECS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(SPECS)}")
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.fractions = (0.4, 0.6, 0.8)
    if args.compile_budgets is not None:
        args.compile_budgets = tuple(float(value) for value in args.compile_budgets.split(",") if value.strip())
    else:
        args.compile_budgets = (0.5,) if args.quick else (0.1, 0.3, 0.5, 0.7, 0.9)
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compare-inductor-")

    import torch
    import torch._dynamo

    from solvers import SOLVERS

    torch.set_num_threads(args.threads)
    if "ilp" in SOLVERS and args.ilp_time_limit > 0:
        # replan() passes no solver options: bound ilp in this process through the registry.
        SOLVERS["ilp"] = functools.partial(SOLVERS["ilp"], time_limit_s=args.ilp_time_limit)
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads; solvers {sorted(SOLVERS)}; "
        f"models {keys}; rounds {args.rounds}")

    results = [run_model(SPECS[key], args) for key in keys]

    save = not (args.no_save or args.quick)
    image_dir = HERE / "results" if save else Path(tempfile.mkdtemp(prefix="compare-plots-"))
    image_dir.mkdir(exist_ok=True)
    sections = []
    all_flags: dict[str, list[bool | None]] = {}
    for result in results:
        image = image_dir / f"compare_{result.spec.key}.png"
        plot(result, image)
        none = next(c for c in result.configs if c.name == "none")
        lines, flags = verdict(result)
        for key, value in flags.items():
            all_flags.setdefault(key, []).append(value)
        compile_times = ", ".join(f"b={c.name.split('=')[1]}: {c.compile_s:.0f} s" for c in result.configs
                                  if c.kind == "compile" and c.compile_s is not None)
        section = "\n".join([
            f"### {result.spec.title}",
            "",
            f"{result.description}. Unplanned step {none.step_ms:.0f} ms (median), measured peak {mib(none.peak)}.",
            "",
            "\n".join(f"- {note}" for note in result.notes),
            f"- planner: measure + solve (plan, budget 80 GiB) {result.plan_s:.1f} s, once; "
            "replans reuse the measurements",
            f"- torch.compile, compile + first step (not in step times): {compile_times or 'none'}",
            "",
            table(result),
            "",
            "\n".join(lines),
            "",
            f"![{result.spec.title}](results/{image.name})",
        ])
        sections.append(section)
        print(section.replace(f"results/{image.name}", str(image)), flush=True)
        print(flush=True)
    summary = "\n".join(
        f"- {key}: met on {sum(1 for value in values if value)} of {sum(1 for value in values if value is not None)} "
        f"models where it applies"
        + (f" (not applicable on {sum(1 for value in values if value is None)})" if None in values else "")
        for key, values in all_flags.items())
    wall = time.perf_counter() - STARTED
    body = "\n\n".join([
        "Peak: static storages (parameters, gradients, buffers, inputs) + the highest point of what one "
        "forward+backward step allocates, gradients already allocated, as `p.verify()` measures it: "
        "`planner.memory.PeakMemory`, the allocator's events from the profiler, kernel scratch included, for "
        "eager and compiled code alike; *under budget* uses it. *peak, tensors only* is the TorchDispatchMode "
        "tracker's (eager only: Dynamo skips compiled code under a dispatch mode). Step time: median over "
        f"{args.rounds} rounds, configurations alternating, {args.threads} intra-op thread(s). Recompute "
        "overhead = step time - none's; for compiled configurations it also holds the compiler's speed-up "
        "or slow-down. Batch sizes were picked for about one second per unplanned step on this machine with "
        "one thread; each model's *none* row gives what this run measured (the machine was shared).",
        *sections,
        "### Allocator vs tensor tracker on eager configurations",
        "Same configurations, separate steps. Differences left after removing kernel scratch are storages "
        "made outside the dispatcher: `checkpoint(preserve_rng_state=True)` keeps the CPU RNG state "
        "(`torch.get_rng_state()`, 5056 B) per checkpointed call, which the tracker cannot see.",
        validation(results),
        "### Targets",
        summary,
        f"Wall time of the run: {wall / 60:.1f} min; solvers in solvers.SOLVERS: {', '.join(sorted(SOLVERS))}"
        + (f" (ilp under a {args.ilp_time_limit:g} s time limit)" if "ilp" in SOLVERS else "") + ".",
    ])
    print("Allocator vs tensor tracker on eager configurations:\n" + validation(results))
    print("Targets:\n" + summary)
    print(f"Wall time {wall / 60:.1f} min; plots in {image_dir}")
    if save:
        command = "python benchmarks/compare.py" + (f" --models {args.models}" if args.models != ",".join(SPECS) else "") \
            + (f" --rounds {args.rounds}" if args.rounds != 3 else "")
        if args.compile_budgets != (0.1, 0.3, 0.5, 0.7, 0.9):
            command += " --compile-budgets " + ",".join(f"{budget:g}" for budget in args.compile_budgets)
        from results import append_results

        append_results("Planner vs. today's options", command, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
