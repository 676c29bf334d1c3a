"""Planner vs. today's options: measured peak memory and step time of one training step.

For each model (`benchmarks/compare_models.py`), one run measures side by side:

- `none`: the model as it is, no checkpointing;
- `every block`: each block under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`, on a
  deep copy (Hugging Face models: `activation_checkpointing_enable()`, which is what transformers
  users get; the built-in models: each block's `forward` wrapped);
- `sqrt(N) segments`: what `checkpoint_sequential` does: the N blocks cut into segments of about
  sqrt(N) blocks, every segment but the last run under one checkpoint call (deep copy);
- the planner: the call users make, `plan(model, sample, budget_gb=X)` with every other argument
  at its default, at every block's own measured peak and at 40/60/80% of the measured unplanned
  peak, its planning time in the notes (`--replan`: `plan(model, sample, budget_gb=80)` once and
  `replan(budget_gb=..., solver=...)` at each budget, the faster route; the plan at 80 GB gives
  the cost figures, the every-block plan and the bounds either way) (solver
  `auto` unless `--solvers` names others), timing `p.module()`;
- with `--save-plans DIR`, each plan is also saved there (`Plan.save`), so that a probe can
  time exactly that plan again (`planner.load_plan(path).apply(model)`);
- optionally `compile b=...`: `torch.compile` (Inductor) on a deep copy, with
  `torch._functorch.config.activation_memory_budget` set to each `--compile-budgets` value.

Every configuration is warmed up first (gradients allocated), its peak is measured once, and
then all configurations take one timed step per round, round after round, so that machine
noise hits them alike. Step time is the median over rounds (7 by default). Each plan's
overhead is measured (its step time minus none's), predicted (`p.recompute_ms`: the nodes it
recomputes plus checkpoint's cost per call) and compared with every block's; the report
(`benchmarks/compare_report.py`) checks the targets of issue 14: share of every block's
overhead at most 0.6 at every block's peak, 0.4 at 60%, 0.2 at 80%, and every prediction within
10% (or 2 ms) of the measured overhead, saying why where one is missed. Each plan's notes give,
at its budget and on the same measurements, the lower bound for every plan of whole graph nodes
(`solvers.bound.recompute`), the cheapest plan with every subset of the keepable nodes of each
submodule call of up to 10 as a keep choice (`dp` on `decision_space.every_keep_subset`: what
wrapping submodule calls reaches at all) and, with `--any-run`, the cheapest plan of whole
regions on any run of graph nodes (`dp`; the planner can only apply submodule calls), as shares
of every block's predicted overhead (`benchmarks/keep_gain.py` tabulates them).

Peaks count static storages (parameters, gradients, buffers, inputs) plus the peak of what the
step allocates, as `p.verify()` does (the allocator's events from `torch.profiler`, kernel
scratch included). Eager configurations are also measured with
`planner.measure.memory.LiveBytesTracker` (tensors only), and the allocator's view without kernel
scratch is checked against it.

    .venv/bin/python benchmarks/compare.py [--quick] [--models gpt,gpt2,llama,bert,cnn,vit]
                                           [--rounds 7] [--solvers auto] [--compile-budgets 0.5]
                                           [--no-save]

Each model's notes also keep the planner's cost figures and the readings its planning took off
the model's steps (`compare_results.PlanningReadings`), so that runs can be read together.

Prints a table per model and, unless --no-save or --quick, writes the run's one section of
benchmarks/RESULTS.md, each model's raw figures to benchmarks/results/ and its plot to
benchmarks/results/compare_<model>.png. `--quick` uses tiny
sizes and one round (a smoke run; its plots go to a temporary folder).
"""
from __future__ import annotations

import argparse
import copy
import functools
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from benchmarks.compare_models import (
    SPECS,
    Spec,
    every_block,
    every_block_plan,
    every_nth_block,
    on_device,
    segments,
    sqrt_segments,
)
from benchmarks.compare_plot import plot
from benchmarks.compare_report import (
    method_text,
    overview,
    summary_lines,
    table,
    validation,
    verdict,
)
from benchmarks.compare_results import Config, ModelResult, PlanningReadings, mib
from benchmarks.compare_steps import (
    inductor_with_budget,
    measure_allocator,
    measure_tensors,
    step,
    timed_step,
)
from benchmarks.cpu_memory import retain_freed_memory
from benchmarks.decision_space import beyond_the_planner
from benchmarks.results import set_section, write_run
from benchmarks.retime import NodeRetimer

HERE = Path(__file__).resolve().parent

STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# One model


def run_model(spec: Spec, args) -> ModelResult:
    import torch

    from planner import InfeasibleBudget, plan
    from planner.api import GIB
    from planner.measure.clock import sandwiched_rounds
    from planner.measure.steps import BEYOND_GRAPH
    from solvers import Status

    torch.manual_seed(0)
    model, sample, description = spec.build(args.quick)
    model, sample = on_device(model.train(), sample, args.device, args.batch_scale)
    if args.batch_scale > 1:
        description += f", batch repeated {args.batch_scale} times"
    log(f"{spec.key}: {description}")
    notes: list[str] = []

    none = Config("none", "baseline", model)
    step(model, sample)  # gradients allocated from here on
    none.peak, none.peak_without_scratch = measure_allocator(model, sample)
    unplanned = none.peak
    log(f"{spec.key}: unplanned peak {mib(unplanned)}")

    block_module, how = every_block(spec, model)
    every = Config("every block", "baseline", block_module)
    step(block_module, sample)
    every.peak, every.peak_without_scratch = measure_allocator(block_module, sample)
    log(f"{spec.key}: every block's peak {mib(every.peak)}")
    notes.append(f"every block: {how}")
    segment_module, how = sqrt_segments(spec, model)
    sqrt_config = Config(f"sqrt(N) segments ({'+'.join(str(len(p)) for p in segments(len(spec.blocks(model))))})",
                         "baseline", segment_module)
    notes.append(f"sqrt(N) segments: {how}")
    configs = [none, every, sqrt_config]
    for n in args.strides:  # every n-th block: what people set by hand (every_n_layers, a stride)
        if n < len(spec.blocks(model)):
            strided, how = every_nth_block(spec, model, n)
            name = f"every {n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n, 'th')} block"
            configs.append(Config(name, "baseline", strided))
            notes.append(f"{name}: {how}")

    log(f"{spec.key}: planning (plan(model, sample, budget_gb=80))")
    started = time.perf_counter()
    with PlanningReadings().watching() as readings:
        base = plan(model, sample, budget_gb=80, repeats=args.plan_repeats)
    plan_s = time.perf_counter() - started
    log(f"{spec.key}: measured and solved in {plan_s:.1f} s; {len(base.problem)} nodes via {base.frontend}")
    none.note = f"the planner's prediction {mib(base.baseline_peak_bytes)}"
    figures = base.problem
    notes.append(f"planner's cost figures: forward {sum(n.compute_ms for n in figures.nodes):.2f} ms (sum of node "
                 f"times: {base.profile.timing}); per checkpoint call {figures.region_overhead_ms:.3f} ms, "
                 f"per saved tensor "
                 f"{1000 * figures.saved_tensor_ms:.1f} us, per run {figures.run_region_ms:.3f} ms, per counted call "
                 f"{1000 * figures.run_call_ms:.1f} us, per recorded call {1000 * figures.recorded_call_ms:.1f} us, "
                 f"per keeping region {figures.keep_region_ms:.3f} ms, per policy call "
                 f"{1000 * figures.keep_call_ms:.1f} us")
    log(f"{spec.key}: {notes[-1]}")
    if readings.lines:  # (kept, so that runs can be read together: see compare_results.PlanningReadings)
        notes.append("planner's readings (medians of paired rounds): " + "; ".join(readings.lines))
    if BEYOND_GRAPH in base.static_breakdown:
        notes.append(f"planner: the {BEYOND_GRAPH}, {mib(base.static_breakdown[BEYOND_GRAPH])}, kept free in every plan")
    every_plan = every_block_plan(spec, model, base)
    retimer = NodeRetimer(base)
    budgets = [("every block's peak", every.peak)] + [(f"{f:.0%}", int(f * unplanned)) for f in args.fractions]
    for label, budget in budgets:
        bound_ms, any_run_ms, every_keep_ms = beyond_the_planner(base.problem, budget, args.any_run,
                                                                 args.bound_time_limit)
        efforts = ["normal", "thorough"] if label in args.thorough else ["normal"]
        for solver, effort in [(solver, effort) for solver in args.solvers for effort in efforts]:
            name = f"planner {solver} @ {label}" + (" (thorough)" if effort == "thorough" else "")
            config = Config(name, "planner", budget_bytes=budget, solver=solver, budget_label=label,
                            bound_ms=bound_ms, any_run_ms=any_run_ms, every_keep_ms=every_keep_ms)
            started = time.perf_counter()
            try:
                if args.replan:  # (the faster route: the measurements of the plan at 80 GB, solved again)
                    planned = base.replan(budget_gb=budget / GIB, solver=solver)
                else:  # the call users make
                    planned = plan(model, sample, budget_gb=budget / GIB,
                                   **({} if solver == "auto" else {"solver": solver}),
                                   **({} if effort == "normal" else {"effort": effort}))
                config.plan_s = time.perf_counter() - started
            except InfeasibleBudget as infeasible:
                config.infeasible = f"infeasible: minimum {mib(infeasible.minimum_bytes)}"
            except Exception as error:  # noqa: BLE001 - a solver that fails is reported
                config.infeasible = f"error: {type(error).__name__}: {error}"
            else:
                config.module = planned.module()
                config.plan = planned
                if args.save_plans:  # (so that a later probe can time exactly this plan: `load_plan`)
                    Path(args.save_plans).mkdir(parents=True, exist_ok=True)
                    label_name = label.replace("'", "").replace(" ", "_").replace("%", "pct")
                    saved = planned.save(Path(args.save_plans) / f"{spec.key}_{solver}_{label_name}.json")
                    log(f"{spec.key}: saved {name} as {saved}")
                config.regions = tuple(checkpoint.nodes for checkpoint in planned.checkpoints)
                config.predicted_peak_bytes = planned.predicted_peak_bytes
                config.predicted_overhead_ms = planned.recompute_ms
                solution = planned.solution
                config.optimal = solution.status == Status.OPTIMAL
                gap = f" (gap {100 * solution.gap:.1f}%)" if solution.gap else ""
                runs = sum(planned.problem.run_span_of(region) is not None for region in solution.regions)
                slices = sum(region in planned.problem.segment_regions for region in solution.regions)
                config.note = (f"planned in {config.plan_s:.1f} s; "
                               f"{len(planned.checkpoints)} regions ({runs} runs inside a call"
                               + (f", {slices} slices of a Sequential" if slices else "") + ") keeping "
                               f"{len(solution.kept)} nodes, "
                               f"{solution.solver} {solution.status.value}{gap}, solved in {solution.solve_seconds:.2f} s")
            nodes_only = ""
            if config.plan is not None:  # the cost model's parts, for diagnosis on a new device
                solution = config.plan.solution
                nodes_only = (f"; predicted {config.predicted_overhead_ms:.2f} ms, its nodes alone "
                              f"{sum(config.plan.problem.region_recompute_ms(r) for r in solution.regions):.2f} ms")
            log(f"{spec.key}: {name} budget {mib(budget)}: "
                f"{config.infeasible or config.note}{nodes_only} ({time.perf_counter() - started:.1f} s)")
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
        if config.kind == "planner" or config is sqrt_config:
            step(config.module, sample)  # warm-up (the compiled ones were warmed by compiling)
    log(f"{spec.key}: measuring peaks of {len(runnable)} configurations")
    for config in runnable:
        if config.eager:
            config.tensor_peak = measure_tensors(config.module, sample)
        if config.peak is None:
            config.peak, config.peak_without_scratch = measure_allocator(config.module, sample)
    def timed(config: Config) -> Callable[[], float]:
        def run() -> float:
            config.times_ms.append(timed_step(config.module, sample))
            return config.times_ms[-1]
        return run

    def round_done(round_index: int) -> None:
        retimer.measure()  # node times of this round, for predictions free of the machine's drift
        log(f"{spec.key}: round {round_index + 1}/{args.rounds} done "
            f"(none {none.times_ms[-1]:.0f} ms, every block {every.times_ms[-1]:.0f} ms)")

    # Each configuration between two unplanned steps (`planner.measure.clock.sandwiched_rounds`): its
    # overhead in a round is its step less their mean, which the machine's speed changes spare.
    by_name = {config.name: config for config in runnable}
    overheads = sandwiched_rounds({name: timed(config) for name, config in by_name.items()}, none.name,
                                  args.rounds, round_done)
    for name, values in overheads.items():
        by_name[name].overheads_ms = values
    for config in runnable:
        del config.times_ms[0]  # (the untimed warm-up run)
    for config in configs:
        if config.plan is not None:
            config.retimed_ms = retimer.predict(config.plan)
    every.retimed_ms = retimer.predict(every_plan) if every_plan is not None else None
    return ModelResult(spec, description, configs, plan_s, notes,
                       every_plan.recompute_ms if every_plan is not None else None)


def device_name(device: str) -> str | None:
    """The GPU's name for RESULTS.md's heading, None on the CPU."""
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None


def device_text(args) -> str:
    if args.device == "cpu":
        return ""
    return (f" Device: {device_name(args.device)}, torch {__import__('torch').__version__}: peaks from "
            "`torch.cuda.max_memory_allocated` (the allocator cannot tell kernel scratch apart there), step times "
            "between CUDA events around a step, as plans are measured on the GPU"
            + (f"; each sample's batch repeated {args.batch_scale} times" if args.batch_scale > 1 else "")
            + ". The sentence on batch sizes above is about the CPU.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round, one compile budget")
    parser.add_argument("--models", default=",".join(SPECS), help=f"comma-separated subset of {','.join(SPECS)}")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7, --quick 1)")
    parser.add_argument("--solvers", default="auto", help="comma-separated planner solvers (default auto)")
    parser.add_argument("--thorough", default="",
                        help="budgets also planned with effort='thorough', e.g. \"every block's peak,60%%\"")
    parser.add_argument("--strides", default="2,3,4",
                        help="every n-th block baselines to measure (default 2,3,4; every block is n = 1)")
    parser.add_argument("--replan", action="store_true",
                        help="plan at 80 GB once and replan at each budget (faster; not the call users make)")
    parser.add_argument("--no-save", action="store_true", help="print only: no RESULTS.md, no plots")
    parser.add_argument("--warm-cache", action="store_true",
                        help="use Inductor's usual cache (default: a fresh one, so compile times are cold)")
    parser.add_argument("--any-run", action="store_true",
                        help="also solve each budget with whole regions on any run of nodes (dp; seconds per budget)")
    parser.add_argument("--save-plans", default=None, metavar="DIR",
                        help="save each plan the planner makes here (Plan.save), to time it again later")
    parser.add_argument("--plan-repeats", type=int, default=3, help="plan(repeats=...) timing repeats")
    parser.add_argument("--bound-time-limit", type=float, default=20.0,
                        help="seconds for the lower bound's program at each budget (it keeps the bound proven by then)")
    parser.add_argument("--ilp-time-limit", type=float, default=10.0,
                        help="time_limit_s for the ilp solver when it is registered (default 10; its own default "
                             "is 60, which could add 12 minutes to the run)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (default 1: on a shared 2-core machine two OpenMP threads stall "
                             "whenever another process holds a core; steps measured 3-15x slower and erratic)")
    parser.add_argument("--compile-budgets", default="",
                        help="comma-separated activation_memory_budget values to compare torch.compile at (default: none)")
    parser.add_argument("--return-freed-memory", action="store_true",
                        help="leave glibc's malloc as it is (default: keep freed memory, as CUDA's caching "
                             "allocator does; see benchmarks/cpu_memory.py)")
    parser.add_argument("--device", default="cpu",
                        help="where the models run (default cpu; cuda: peaks from torch.cuda.max_memory_allocated, "
                             "steps timed between CUDA events)")
    parser.add_argument("--batch-scale", type=int, default=1,
                        help="repeat each sample's batch this many times (default 1; the sizes are the CPU's)")
    args = parser.parse_args()
    if args.batch_scale < 1:
        parser.error("--batch-scale must be at least 1")
    args.retained = False if args.return_freed_memory else retain_freed_memory()
    keys = [key.strip() for key in args.models.split(",") if key.strip()]
    unknown = [key for key in keys if key not in SPECS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(SPECS)}")
    # The checkpoint figures read off the model's step and block (`planner.costs.step`,
    # `planner.costs.block`, `planner.costs.block_price`: its rounds and their time), and readings
    # their rounds could not tell from the price (`planner.measure.clock.reading_or_price`): they say
    # why a figure was kept.
    logging.basicConfig(format="%(name)s: %(message)s")
    for name in ("planner.costs.step", "planner.costs.block", "planner.costs.block_price", "planner.measure.clock"):
        logging.getLogger(name).setLevel(logging.INFO)
    args.rounds = args.rounds or (1 if args.quick else 7)
    args.solvers = [name.strip() for name in args.solvers.split(",") if name.strip()]
    args.fractions = (0.4, 0.6, 0.8)
    args.thorough = [label.strip() for label in args.thorough.split(",") if label.strip()]
    args.strides = [int(n) for n in args.strides.split(",") if n.strip()]
    args.compile_budgets = tuple(float(value) for value in args.compile_budgets.split(",") if value.strip())
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
    sections, plots = [], []
    all_flags: dict[str, list[bool | None]] = {}
    for result in results:
        suffix = "" if args.device == "cpu" else f"_{args.device.split(':')[0]}"
        image = image_dir / f"compare_{result.spec.key}{suffix}.png"
        plot(result, image)
        none = next(c for c in result.configs if c.name == "none")
        lines, flags = verdict(result)
        for key, value in flags.items():
            all_flags.setdefault(key, []).append(value)
        compile_times = ", ".join(f"b={c.name.split('=')[1]}: {c.compile_s:.0f} s" for c in result.configs
                                  if c.kind == "compile" and c.compile_s is not None)
        opening = f"{result.description}. Unplanned step {none.step_ms:.0f} ms (median), measured peak {mib(none.peak)}."
        section = "\n".join([
            f"### {result.spec.title}",
            "",
            opening,
            "",
            "\n".join(f"- {note}" for note in result.notes),
            f"- planner: measure + solve at 80 GiB (for the cost figures, the bounds and every block's prediction) "
            f"{result.plan_s:.1f} s; " + ("each budget replans those measurements" if args.replan else
                                          "each budget is planned with the default call, its time in the notes"),
            f"- torch.compile, compile + first step (not in step times): {compile_times or 'none'}",
            "",
            table(result),
            "",
            "\n".join(lines),
            "",
            f"![{result.spec.title}](results/{image.name})",
        ])
        # RESULTS.md gets the table and the verdict; the cost figures, the readings and the
        # predictions from the rounds' node times stay in this output and the run's raw figures.
        # (every run under budget is said once, in the targets)
        brief = [line for line in verdict(result, brief=True)[0]
                 if not line.startswith("- Under budget: every planner run")]
        sections.append("\n".join([f"### {result.spec.title}", "", opening, "", table(result, brief=True), "",
                                    "\n".join(brief)]))  # (in the model's raw figures; RESULTS.md has the overview)
        plots.append(f"[{result.spec.title}](results/{image.name})")
        print(section.replace(f"results/{image.name}", str(image)), flush=True)
        print(flush=True)
    summary = summary_lines(all_flags)
    wall = time.perf_counter() - STARTED
    print("Allocator vs tensor tracker on eager configurations:\n" + validation(results))
    print("Targets:\n" + summary)
    print(f"Wall time {wall / 60:.1f} min; plots in {image_dir}")
    if save:
        command = "python -m benchmarks.compare" + (f" --models {args.models}" if args.models != ",".join(SPECS) else "") \
            + (f" --rounds {args.rounds}" if args.rounds != 7 else "") \
            + (f" --solvers {','.join(args.solvers)}" if args.solvers != ["auto"] else "") \
            + (" --any-run" if args.any_run else "") \
            + (f" --device {args.device}" if args.device != "cpu" else "") \
            + (f" --batch-scale {args.batch_scale}" if args.batch_scale != 1 else "") \
            + (" --replan" if args.replan else "") \
            + (f" --thorough \"{','.join(args.thorough)}\"" if args.thorough else "")
        if args.compile_budgets:
            command += " --compile-budgets " + ",".join(f"{budget:g}" for budget in args.compile_budgets)
        device = "cpu" if args.device == "cpu" else args.device.split(":")[0]
        for result, model_section in zip(results, sections):
            write_run(f"compare_{result.spec.key}", {
                "command": command, "section": model_section, "configs": [
                {"name": c.name, "budget": c.budget_bytes, "peak": c.peak, "predicted_peak": c.predicted_peak_bytes,
                 "times_ms": c.times_ms, "overheads_ms": c.overheads_ms, "predicted_overhead_ms": c.predicted_overhead_ms,
                 "plan_s": c.plan_s, "note": c.note or c.infeasible} for c in result.configs]}, device)
        # One section for the run: how it measured, one row per model, the targets; each model's
        # table and verdict go to its raw figures.
        raw = f"`benchmarks/results/compare_<model>_{device}_<date>.json` (`section`)"
        set_section(f"compare_{device}", f"Planner vs. today's options ({device})", command,
                    "\n\n".join([method_text(args.rounds, args.threads, args.retained, device_text(args)),
                                 overview(results), f"Each model's table and verdicts: {raw}.",
                                 "Targets:", "\n".join(line for line in summary.splitlines()
                                                       if "the rounds' node times" not in line),
                                 f"Plots: {', '.join(plots)}. Wall time of the run: {wall / 60:.1f} min."]),
                    device_name(args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
