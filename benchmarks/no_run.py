"""Planning without running the unplanned step.

Four parts, each printing its table and full reports; with --results, each part's table and
verdict become its section of RESULTS.md:

* `small`: GPT-2, Llama, BERT (small configs) and the built-in GPT, each planned at 40/60/80%
  of its measured unplanned peak twice: with the measured path (`measure="run"`, real model)
  and with the no-run path (the same architecture built on the `meta` device, planned for this
  CPU, the plan saved, loaded and applied to the real model). The no-run plan is measured
  (`verify_modules`): under budget, its prediction within 3% of the measurement, its
  recompute cost within 10% of the measured path's plan, gradients equal to the unplanned
  model's. Recompute cost two ways: both plans costed with the measured path's node times (a
  model), and on the clock (step time over the unplanned model's, alternating rounds, medians),
  which is what is judged: more than 10% and more than NOISE_MS over the run path's plan misses
  (where both paths chose the very same submodules, the difference is the clock's noise).
* `flat`: flat random models (every op in the model's own forward, in-place writes on values
  other ops consumed; `benchmarks.fuzz_models`) planned on `meta` at 40/60/80% of the real
  model's measured peak, saved, loaded and applied to it: under budget, within 0.1%.
* `memory`: a GPT-2 whose unplanned step needs at least 2 GiB, planned at 40% of that with the
  real model: the peak resident memory `plan()` adds, in a fresh process after a warm-up plan
  of a small model, against the budget plus the stated margin (`MEASURE_MARGIN`), against
  one unplanned step's and against two training steps with the plan `plan()` returned (what
  training with it adds: glibc's heap keeps freed memory, so on a CPU a step's resident memory
  exceeds the bytes it allocates).
* `llama`: Llama 7B (32 layers, hidden 4096) for an H100 with FSDP2 over 8 ranks and AdamW, and
  70B (80 layers, hidden 8192, 64 heads, 8 KV heads) over 32 ranks, built on `meta`: wall time,
  peak resident memory, both reports, and the static breakdown checked against arithmetic.
* `autocast`: the `small` models' step under CUDA autocast's casts applied on this CPU
  (`planner.measure.autocast.cuda_autocast_on_cpu`, what a plan for a GPU made without CUDA
  predicts from), planned at 40/60/80% with the default call and with `measure="no-run"` on
  `meta`, each plan's step measured under the same casts: under budget, within 3%. Beside them,
  each model's unplanned peak in float32, under CPU autocast and under CUDA's casts.

    .venv/bin/python -m benchmarks.no_run [--parts small,flat,memory,llama,autocast] [--results]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.results import set_section, write_run
from planner import InfeasibleBudget, load_plan, plan
from planner.api import GIB
from planner.measure.autocast import cuda_autocast_on_cpu
from planner.measure.device import MEASURE_MARGIN
from planner.measure.steps import step_ms, steady_peak, verify_modules
from solvers.solution import format_bytes

HERE = Path(__file__).resolve().parent

FRACTIONS = (0.4, 0.6, 0.8)
NOISE_MS = 2.0  # step-time differences below this are within this machine's noise


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def small_models() -> dict:
    """name -> build(device) -> (model, sample); the same weights' shapes on any device."""
    t = _transformers()
    from planner.examples import TinyGPT

    def hf(config_class, model_class, labels=True, **config):
        def build(device):
            with torch.device(device):
                model = model_class(config_class(**config))
            ids = torch.randint(0, 1000, (4, 256), device=device) if device != "meta" else \
                torch.zeros(4, 256, dtype=torch.long, device="meta")
            return model.train(), {"input_ids": ids, "labels": ids}
        return build

    def gpt(device):
        with torch.device(device):
            model = TinyGPT(width=128, heads=4, blocks=6, context=256)
        tokens = torch.randint(0, 512, (8, 256)) if device != "meta" else torch.zeros(8, 256, dtype=torch.long,
                                                                                        device="meta")
        return model.train(), tokens

    return {
        "GPT-2 (4 layers, 256 wide)": hf(t.GPT2Config, t.GPT2LMHeadModel, n_layer=4, n_embd=256, n_head=4,
                                         vocab_size=1000, n_positions=256, bos_token_id=0, eos_token_id=0, use_cache=False),
        "Llama (4 layers, 256 wide)": hf(t.LlamaConfig, t.LlamaForCausalLM, num_hidden_layers=4, hidden_size=256,
                                         intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                         vocab_size=1000, bos_token_id=0, eos_token_id=0, use_cache=False),
        "BERT (4 layers, 256 wide)": hf(t.BertConfig, t.BertForMaskedLM, num_hidden_layers=4, hidden_size=256,
                                        intermediate_size=512, num_attention_heads=4, vocab_size=1000),
        "built-in GPT (6 blocks)": gpt,
    }


def measured_overheads(model, planned: list, sample, rounds: int) -> list[float]:
    """Median step time of each planned module minus the unplanned model's, in ms, from
    alternating rounds (one warm-up step each first)."""
    modules = [model, *planned]
    device = torch.device("cpu")
    times: list[list[float]] = [[] for _ in modules]
    for module in modules:
        step_ms(module, sample, device)
    for _ in range(rounds):
        for module, found in zip(modules, times):
            found.append(step_ms(module, sample, device))
    for module in modules:
        module.zero_grad(set_to_none=True)
    medians = [statistics.median(found) for found in times]
    return [median - medians[0] for median in medians[1:]]


def part_flat(steps: int, seeds: int = 30) -> tuple[str, str]:
    """Flat random models (`benchmarks.fuzz_models`, every op in the model's own forward: in-place
    writes on consumed values, `h * 1.0; h += old`, gates, concatenations) built on `meta` and
    planned at 40/60/80% of the real model's measured peak (where refused, at the minimum the
    refusal names); each plan saved, loaded, applied to the real model and measured: under
    budget, its prediction within 0.1%."""
    import copy

    from benchmarks.fuzz_models import random_model
    from planner.measure.steps import steady_peak

    rows = ["| seed | nodes | budget | regions | predicted peak | measured peak | error | under budget |",
            "|" + "---|" * 8]
    errors, misses = [], []
    for seed in range(seeds):
        model, sample = random_model(seed, "flat")
        unplanned = steady_peak(model, sample, torch.device("cpu"))
        on_meta = copy.deepcopy(model).to("meta")
        minimums: set[int] = set()
        for fraction in FRACTIONS:
            budget, asked = int(fraction * unplanned), ""
            try:
                p = plan(on_meta, sample.to("meta"), budget_gb=budget / GIB)
            except InfeasibleBudget as error:  # planned at the minimum it names, which must then fit
                if error.minimum_bytes in minimums:
                    continue  # (planned already, refused at a larger fraction's budget too)
                minimums.add(error.minimum_bytes)
                budget, asked = error.minimum_bytes, f" (asked {fraction:.0%}: infeasible)"
                p = plan(on_meta, sample.to("meta"), budget_gb=budget / GIB)
            with tempfile.TemporaryDirectory() as folder:
                applied = load_plan(p.save(Path(folder) / "plan.json")).apply(copy.deepcopy(model))
            measured = steady_peak(applied, sample, torch.device("cpu"))
            error = (p.predicted_peak_bytes - measured) / measured
            errors.append(error)
            rows.append(f"| {seed} | {len(p.problem)} | {format_bytes(budget)}{asked} | {len(p.checkpoints)} "
                        f"| {format_bytes(p.predicted_peak_bytes)} | {format_bytes(measured)} | {100 * error:+.3f}% "
                        f"| {'yes' if measured <= budget else 'NO'} |")
            if measured > budget or abs(error) > 0.001:
                misses.append(f"seed {seed} at {fraction:.0%}: {100 * error:+.3f}%"
                              + ("" if measured <= budget else ", over budget"))
    worst = max(errors, key=abs, default=0.0)
    verdict = (f"{len(errors)} plans made on meta; worst error {100 * worst:+.3f}%. "
               + ("Every plan under its budget and within 0.1%." if not misses else
                  "Misses:\n" + "\n".join(f"- {m}" for m in misses)))
    refused = sum("infeasible" in row for row in rows)
    summary = (f"{seeds} flat models planned on meta at {', '.join(f'{f:.0%}' for f in FRACTIONS)} of their "
               f"measured peak; {refused} refused as infeasible and planned at the minimum named (once a seed). ")
    return "\n".join(rows) + "\n\n" + verdict, summary + verdict


def part_small(steps: int, rounds: int = 11) -> tuple[str, str]:
    rows = ["| model | budget | path | regions | predicted peak | measured peak | error | under budget "
            "| recompute (measured costs) | vs run path | measured overhead | vs run path | gradients match |",
            "|" + "---|" * 13]
    misses = []
    for name, build in small_models().items():
        torch.manual_seed(0)
        model, sample = build("cpu")
        unplanned = plan(model, sample, budget_gb=80, measure="run")
        measured_peak = unplanned.verify(steps=steps).original_peak_bytes
        meta_model, meta_sample = build("meta")
        for fraction in FRACTIONS:
            budget = fraction * measured_peak
            label = f"{fraction:.0%} = {format_bytes(budget)}"
            try:
                run = unplanned.replan(budget_gb=budget / GIB)
                no_run = plan(meta_model, meta_sample, budget_gb=budget / GIB, measure="no-run")
            except InfeasibleBudget as error:
                rows.append(f"| {name} | {label} | both | infeasible: minimum {format_bytes(error.minimum_bytes)} "
                            "| | | | | | | | | |")
                continue
            with tempfile.TemporaryDirectory() as folder:
                saved = load_plan(no_run.save(Path(folder) / "plan.json"))
            applied = saved.apply(build("cpu")[0].train())
            applied.load_state_dict(model.state_dict())
            record = verify_modules(model, applied, sample, steps, no_run.predicted_peak_bytes,
                                    no_run.baseline_peak_bytes, no_run.budget_bytes)
            index = {node.name: i for i, node in enumerate(run.problem.nodes)}
            regions = tuple(range(index[c.nodes[0]], index[c.nodes[-1]] + 1) for c in no_run.checkpoints)
            cost = run.problem.recompute_ms(regions)
            ratio = cost / run.recompute_ms if run.recompute_ms else (1.0 if cost == 0 else math.inf)
            # What recomputation costs on the clock: step times, alternating rounds, medians.
            overheads = measured_overheads(model, [run.module(), applied], sample, rounds)
            measured_ratio = (overheads[1] / overheads[0] if overheads[0] > 0 else
                              (1.0 if overheads[1] <= 0 else math.inf))
            ratio_cell = f"{measured_ratio:.2f}" if measured_ratio < math.inf else "(run path: none)"
            rows.append(f"| {name} | {label} | run | {len(run.checkpoints)} | {format_bytes(run.predicted_peak_bytes)} "
                        f"| | | | {run.recompute_ms:.1f} ms | | {overheads[0]:.1f} ms | | |")
            rows.append(
                f"| {name} | {label} | no-run | {len(no_run.checkpoints)} | {format_bytes(record.predicted_peak_bytes)} "
                f"| {format_bytes(record.planned_peak_bytes)} | {100 * record.peak_error:+.1f}% "
                f"| {'yes' if record.within_budget else 'NO'} | {cost:.1f} ms | {ratio:.2f} "
                f"| {overheads[1]:.1f} ms | {ratio_cell} | {'yes' if record.gradients_match else 'NO'} |")
            print(rows[-2], rows[-1], sep="\n", flush=True)
            where = f"{name} at {fraction:.0%}"
            if not record.within_budget:
                misses.append(f"{where}: measured over budget")
            if abs(record.peak_error) > 0.03:
                misses.append(f"{where}: prediction off by {100 * record.peak_error:+.1f}%")
            same_plan = [c.wrapped for c in run.checkpoints] == [c.wrapped for c in no_run.checkpoints]
            if same_plan:
                rows[-1] = rows[-1].replace(f"| {ratio_cell} |", f"| {ratio_cell} (same plan) |")
            elif measured_ratio > 1.10 and overheads[1] - overheads[0] > NOISE_MS:
                on_clock = (f"{measured_ratio:.2f}x the run path's plan" if overheads[0] > 0 else
                            f"{overheads[1]:.1f} ms where the run path's plan measured none")
                misses.append(f"{where}: recompute {on_clock} on the clock ({ratio:.2f}x by the node times)")
            if not record.gradients_match:
                misses.append(f"{where}: gradients differ")
    verdict = "All targets met." if not misses else "Misses:\n" + "\n".join(f"- {m}" for m in misses)
    # RESULTS.md: the no-run plans, each beside the run path's plan by its ratios (the run path's rows: output)
    brief = [row for row in rows if "| run |" not in row]
    return "\n".join(rows) + "\n\n" + verdict, "\n".join(brief) + "\n\n" + verdict


# ---------------------------------------------------------------------------------------------
# Peak resident memory in fresh processes

_CHILD = r'''
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {root!r})
import torch, transformers
transformers.logging.set_verbosity_error()
from planner import load_plan, plan
from planner.core import training_loss, training_step

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

torch.manual_seed(0)
small = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=100,
                                                             n_positions=32))
ids = torch.randint(0, 100, (1, 32))
plan(small, {{"input_ids": ids, "labels": ids, "use_cache": False}}, budget_gb=80, measure={warm!r})
training_loss(small(input_ids=ids, labels=ids, use_cache=False)).backward()  # warm up backward too
config = transformers.GPT2Config(**{config!r})
model = transformers.GPT2LMHeadModel(config).train()
ids = torch.randint(0, config.vocab_size, {shape!r})
sample = {{"input_ids": ids, "labels": ids, "use_cache": False}}
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark restarts from here
before = rss("VmRSS")
started = time.perf_counter()
report = ""
if {mode!r} == "step":
    training_loss(model(**sample)).backward()
elif {mode!r} == "plan":
    p = plan(model, sample, budget_gb={budget_gb!r})
    p.save({path!r})
    report = str(p)
else:  # "train": two steps of the saved plan, gradients allocated in the second as in training
    load_plan({path!r}).apply(model)
    for _ in range(2):
        training_step(model, sample)
print(json.dumps({{"added": rss("VmHWM") - before, "seconds": time.perf_counter() - started, "report": report}}))
'''


def _child(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report_lines(report: str, *starts: str) -> list[str]:
    """The lines of a plan's report that start with one of `starts`, their spacing collapsed: what
    RESULTS.md quotes of reports the output prints whole.

    Example:
        >>> report_lines("Checkpoint plan for M: 2 regions\\n  planning took   3.1 s", "planning took")
        ['planning took 3.1 s']
    """
    return [" ".join(line.split()) for line in report.splitlines() if line.strip().startswith(starts)]


def part_memory() -> tuple[str, str]:
    config = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, bos_token_id=0,
                  eos_token_id=0)
    shape = (4, 1024)
    root = str(HERE.parent)
    step = _child(_CHILD.format(root=root, warm="run", config=config, shape=shape, mode="step", budget_gb=None,
                                path=None))
    torch.manual_seed(0)
    t = _transformers()
    model = t.GPT2LMHeadModel(t.GPT2Config(**config)).train()
    ids = torch.randint(0, config["vocab_size"], shape)
    unplanned = plan(model, {"input_ids": ids, "labels": ids, "use_cache": False}, budget_gb=80, measure="no-run",
                     repeats=1)
    peak = unplanned.baseline_peak_bytes  # the step's peak, static included (params and gradients)
    del model, unplanned
    budget_gb = 0.4 * peak / GIB
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "plan.json")
        planned = _child(_CHILD.format(root=root, warm="no-run", config=config, shape=shape, mode="plan",
                                       budget_gb=budget_gb, path=path))
        trained = _child(_CHILD.format(root=root, warm="no-run", config=config, shape=shape, mode="train",
                                       budget_gb=budget_gb, path=path))
    rows = [
        "| what | bytes |", "|---|---|",
        f"| GPT-2 124M, batch {shape[0]} x {shape[1]}: unplanned step's peak (predicted, static included) "
        f"| {format_bytes(peak)} |",
        f"| one unplanned training step: resident memory it adds (fresh process) | {format_bytes(step['added'])} |",
        f"| budget (40% of the peak) | {format_bytes(budget_gb * GIB)} |",
        f"| `plan()` with the real model: resident memory it adds (fresh process) | {format_bytes(planned['added'])} "
        f"({planned['added'] / (budget_gb * GIB):.2f} of the budget) |",
        f"| `plan()` wall time | {planned['seconds']:.1f} s |",
        f"| two training steps with that plan: resident memory they add (fresh process) "
        f"| {format_bytes(trained['added'])} ({trained['added'] / (budget_gb * GIB):.2f} of the budget) |",
    ]
    allowed = (1 + MEASURE_MARGIN) * budget_gb * GIB  # measuring may use the budget plus the stated margin
    verdict = (f"plan() added at most the budget plus the stated margin ({MEASURE_MARGIN:.0%}, "
               "`planner.measure.device.MEASURE_MARGIN`)." if planned["added"] <= allowed
               else f"MISS: plan() added more than the budget plus the stated margin ({MEASURE_MARGIN:.0%}).")
    took = "; ".join(report_lines(planned["report"], "planning took"))
    table = "\n".join(rows) + "\n\n" + verdict
    return table + "\n\n```\n" + planned["report"] + "\n```", table + (f" The report: {took}." if took else "")


_LLAMA = r'''
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {root!r})
started = time.perf_counter()
import torch, transformers
from planner import plan
config = transformers.LlamaConfig(**{config!r}, use_cache=False)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
tokens = torch.zeros(1, 4096, dtype=torch.long, device="meta")
p = plan(model, {{"input_ids": tokens, "labels": tokens}}, budget_gb=80, target="h100",
         world_size={world_size}, optimizer="adamw")
shapes = [list(t.shape) for t in model.parameters()]
print(json.dumps({{"seconds": time.perf_counter() - started,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "report": str(p), "breakdown": p.static_breakdown, "shapes": shapes,
                  "blocks": {layers}}}))
'''


def _expected_breakdown(shapes: list[list[int]], world_size: int, layers: int) -> dict[str, int]:
    """The arithmetic: bf16 parameters (2 bytes) split on dim 0 across ranks, as many gradients,
    AdamW's two states; the root (embeddings, output layer, final norm) unsharded; two blocks'
    parameters in flight. (The unsharded gradients are placed in backward, not static.)"""
    total = sum(math.prod(s) for s in shapes)
    per_block = sum(math.prod(s) for s in shapes[1:-2]) // layers  # shapes: embed, blocks..., norm, head
    root = total - per_block * layers
    return {"parameters": total * 2 // world_size, "gradients": total * 2 // world_size,
            "optimizer state": 2 * total * 2 // world_size,
            "root parameters, unsharded (FSDP)": root * 2,
            "block parameters in flight (FSDP, 2 blocks)": 2 * per_block * 2}


def part_llama() -> tuple[str, str]:
    sizes = {
        "Llama 7B, 8 ranks": (dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=32000), 8, 32, 60),
        "Llama 70B, 32 ranks": (dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                     num_attention_heads=64, num_key_value_heads=8, vocab_size=32000), 32, 80, 180),
    }
    rows = ["| model | wall time | limit | peak resident memory | static terms equal to the arithmetic |",
            "|---|---|---|---|---|"]
    reports, brief = [], []
    for name, (config, world_size, layers, limit) in sizes.items():
        result = _child(_LLAMA.format(root=str(HERE.parent), config=config, world_size=world_size, layers=layers))
        expected = _expected_breakdown(result["shapes"], world_size, layers)
        got = result["breakdown"]
        wrong = [f"{term}: {got.get(term)} != {value}" for term, value in expected.items() if got.get(term) != value]
        rows.append(f"| {name} | {result['seconds']:.1f} s | {limit} s | {format_bytes(result['rss'])} "
                    f"| {'yes, all ' + str(len(expected)) if not wrong else 'NO: ' + '; '.join(wrong)} |")
        print(rows[-1], flush=True)
        terms = "\n".join(f"  {term}: {got[term]:,} bytes (arithmetic: {expected.get(term, got[term]):,})"
                          for term in got)
        reports.append(f"### {name}\n\n```\n{result['report']}\n```\n\nStatic terms per rank:\n```\n{terms}\n```")
        brief.append(f"- {name}: " + "; ".join(report_lines(result["report"], "Checkpoint plan for", "planning took")))
    table = "\n".join(rows)
    return table + "\n\n" + "\n\n".join(reports), table + "\n\n" + "\n".join(brief)


def part_autocast() -> tuple[str, str]:
    cpu = torch.device("cpu")
    rows = ["| model | budget | path | regions | predicted peak | measured peak | error | under budget |",
            "|---|---|---|---|---|---|---|---|"]
    unplanned_rows = ["| model | unplanned peak: float32 | CPU autocast (bfloat16) | CUDA's casts (bfloat16) |",
                      "|---|---|---|---|"]
    misses = []
    for name, build in small_models().items():
        torch.manual_seed(0)
        model, sample = build("cpu")
        meta_model, meta_sample = build("meta")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cpu_casts = steady_peak(model, sample, cpu)
        with cuda_autocast_on_cpu(torch.bfloat16):
            unplanned = steady_peak(model, sample, cpu)
        unplanned_rows.append(f"| {name} | {format_bytes(steady_peak(model, sample, cpu))} | {format_bytes(cpu_casts)} "
                              f"| {format_bytes(unplanned)} |")
        print(unplanned_rows[-1], flush=True)
        for fraction in FRACTIONS:
            budget = fraction * unplanned
            label = f"{fraction:.0%} = {format_bytes(budget)}"
            for path, planned_model, planned_sample, measure in (("default", model, sample, "auto"),
                                                                  ("no-run, meta", meta_model, meta_sample, "no-run")):
                try:
                    with cuda_autocast_on_cpu(torch.bfloat16):
                        p = plan(planned_model, planned_sample, budget_gb=budget / GIB, measure=measure)
                except InfeasibleBudget as error:
                    minimum = format_bytes(error.minimum_bytes)
                    rows.append(f"| {name} | {label} | {path} | infeasible: minimum {minimum} | | | | |")
                    continue
                applied = p.apply(build("cpu")[0].train()) if measure == "no-run" else p.module()
                applied.load_state_dict(model.state_dict())
                with cuda_autocast_on_cpu(torch.bfloat16):
                    measured = steady_peak(applied, sample, cpu)
                error = (p.predicted_peak_bytes - measured) / measured
                within = measured <= p.budget_bytes
                rows.append(f"| {name} | {label} | {path} | {len(p.checkpoints)} "
                            f"| {format_bytes(p.predicted_peak_bytes)} | {format_bytes(measured)} "
                            f"| {100 * error:+.2f}% | {'yes' if within else 'NO'} |")
                print(rows[-1], flush=True)
                if not within or abs(error) > 0.03:
                    misses.append(f"{name} at {fraction:.0%}, {path}: {100 * error:+.2f}%, "
                                  f"{'under' if within else 'OVER'} budget")
    verdict = "All targets met." if not misses else "Misses:\n" + "\n".join(f"- {m}" for m in misses)
    body = "\n".join(unplanned_rows) + "\n\n" + "\n".join(rows) + "\n\n" + verdict
    return body, body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="small,flat,memory,llama,autocast")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--results", action="store_true", help="write each part's table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    parts = {"small": ("Planning without running: measured vs no-run path",
                       lambda: part_small(args.steps)),
             "flat": ("Planning without running: flat models with in-place writes, on meta", lambda: part_flat(args.steps)),
             "memory": ("Planning without running: memory plan() adds", part_memory),
             "llama": ("Planning without running: Llama 7B and 70B on meta for H100s", part_llama),
             "autocast": ("Planning for a GPU's mixed precision on a CPU: CUDA autocast's casts", part_autocast)}
    for key in args.parts.split(","):
        title, run = parts[key]
        started = time.perf_counter()
        body, brief = run()  # (the output gets the whole body, RESULTS.md the brief one)
        print(f"\n## {title} ({time.perf_counter() - started:.0f} s)\n{body}\n", flush=True)
        write_run(f"no_run_{key}", {"command": f"python -m benchmarks.no_run --parts {key}", "table": body})
        if args.results:
            set_section(f"no_run_{key}", title, f"python -m benchmarks.no_run --parts {key}", brief)
    return 0


if __name__ == "__main__":
    sys.exit(main())
