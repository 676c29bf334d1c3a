"""Throughput within a memory budget: samples per second of the planner's choice of batch and plan
(`planner.plan_throughput`) against what people use, each at its largest batch that fits.

For each compare model (`benchmarks/compare_models.py`), with candidate batches of 1, 2 and 4
times its compare batch, at a budget of half the unplanned step's peak at the largest (the
reference batch), AdamW's state included (two tensors per parameter, as `plan()` counts it):
- no checkpointing, every block and every n-th block (n = 2, 3, 4), each at the largest
  candidate batch whose measured peak fits the budget;
- the planner's choice among the same candidates (`plan_throughput(..., optimizer="adamw")`).
Every configuration is checked under the budget by allocator peak (plus the optimizer state) and
gives the unplanned model's gradients at its batch; then all take full training steps (forward,
backward, AdamW step), one each per round, in alternating rounds: samples per second is the
batch over the median step, with a 95% interval. Freed memory is kept in the process, as CUDA's
caching allocator keeps it (`benchmarks/cpu_memory.py`), for the planner's timings and the
rounds alike. Targets on this CPU: the planner's samples/s at
least the best baseline's (within the interval), its predicted samples/s within 10% of measured,
and `plan_throughput` at most 3x one `plan()` call (at the middle candidate batch, which
`plan_throughput` measures its node times at).

    .venv/bin/python -m benchmarks.throughput [--models gpt,gpt2,llama,bert,vit,cnn] [--rounds 10] [--results]

With `--results`, each model's `tp.plot` (samples/s against batch) goes to
`benchmarks/results/throughput_<model>.png`.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.compare_models import SPECS, every_block, every_nth_block
from benchmarks.cpu_memory import memory_kept, retain_freed_memory
from benchmarks.results import RAW, set_section, write_run
from planner import InfeasibleBudget, plan, plan_throughput
from planner.api import GIB
from planner.core import split_sample, training_loss
from planner.measure.clock import median_interval
from planner.measure.static import static_breakdown
from planner.measure.steps import steady_peak
from solvers.solution import format_bytes

SCALES = (1, 2, 4)  # candidate batches, times the model's compare batch
STRIDES = (2, 3, 4)
TOLERANCE = 0.10
CPU = torch.device("cpu")


def sampler(sample: Any) -> Callable[[int], Any]:
    """sample_for(batch): the reference sample's tensors with dimension 0 set to `batch` (token ids
    and labels drawn in the reference's range, floats from a normal distribution)."""
    args, kwargs = split_sample(sample)

    def like(tensor: Any, batch: int, seed: int) -> Any:
        if not isinstance(tensor, torch.Tensor) or not tensor.dim():
            return tensor
        generator = torch.Generator().manual_seed(1000 * batch + seed)
        shape = (batch, *tensor.shape[1:])
        if tensor.is_floating_point():
            return torch.randn(shape, generator=generator, dtype=tensor.dtype)
        return torch.randint(int(tensor.min()), int(tensor.max()) + 1, shape, generator=generator, dtype=tensor.dtype)

    def sample_for(batch: int) -> Any:
        if isinstance(sample, torch.Tensor):
            return like(sample, batch, 0)
        if isinstance(sample, dict):
            made = {key: like(value, batch, i) for i, (key, value) in enumerate(kwargs.items())}
            if "input_ids" in made and "labels" in made and torch.equal(kwargs["input_ids"], kwargs["labels"]):
                made["labels"] = made["input_ids"]  # (a causal LM's labels are its inputs)
            return made
        return tuple(like(value, batch, i) for i, value in enumerate(args))
    return sample_for


def adamw_bytes(model: nn.Module) -> int:
    """AdamW's state, as `plan(..., optimizer="adamw")` counts it (`planner.measure.static`)."""
    return static_breakdown(model, 0, 0, CPU, "adamw")["optimizer state"]


def largest_fitting(module: nn.Module, sample_for: Callable[[int], Any], batches: list[int], budget: int,
                    state: int) -> tuple[int | None, int | None]:
    """(largest batch whose measured peak, plus the optimizer state, fits; that peak)."""
    for batch in sorted(batches, reverse=True):
        peak = steady_peak(module, sample_for(batch), CPU) + state
        if peak <= budget:
            return batch, peak
    return None, None


def gradients(module: nn.Module, sample: Any) -> dict[str, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    args, kwargs = split_sample(sample)
    training_loss(module(*args, **kwargs)).backward()
    found = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return found


def same_gradients(module: nn.Module, reference: nn.Module, sample: Any) -> bool:
    expected, got = gradients(reference, sample), gradients(module, sample)
    try:
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value)
    except (AssertionError, KeyError):
        return False
    return expected.keys() == got.keys()


def timed_rounds(configs: dict[str, tuple[nn.Module, Any]], rounds: int) -> dict[str, list[float]]:
    """Full training steps (forward, backward, AdamW step), one per configuration per round."""
    optimizers = {name: torch.optim.AdamW(module.parameters(), lr=1e-5) for name, (module, _) in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    for round_index in range(rounds + 1):  # (the first, untimed, allocates state and gradients)
        for name, (module, sample) in configs.items():
            args, kwargs = split_sample(sample)
            started = time.perf_counter()
            optimizers[name].zero_grad(set_to_none=True)
            training_loss(module(*args, **kwargs)).backward()
            optimizers[name].step()
            if round_index:
                times[name].append((time.perf_counter() - started) * 1000)
    return times


def run_model(key: str, rounds: int, quick: bool = False, share: float = 0.5,
              plot_to: Path | None = None) -> dict[str, Any]:
    spec = SPECS[key]
    torch.manual_seed(0)
    model, sample, description = spec.build(quick)
    model.train()
    sample_for = sampler(sample)
    compare_batch = next(t for t in (*split_sample(sample)[0], *split_sample(sample)[1].values())
                         if isinstance(t, torch.Tensor)).shape[0]
    batches = sorted({max(1, int(scale * compare_batch)) for scale in SCALES})
    state = adamw_bytes(model)
    budget = int(share * (steady_peak(model, sample_for(batches[-1]), CPU) + state))
    print(f"{key}: {description}; budget {format_bytes(budget)}; batches {batches}", flush=True)

    started = time.perf_counter()
    try:
        plan(model, sample_for(batches[len(batches) // 2]), budget_gb=budget / GIB, optimizer="adamw")
    except InfeasibleBudget:  # (a planning all the same: what one call takes)
        pass
    plan_s = time.perf_counter() - started
    started = time.perf_counter()
    try:
        tp = plan_throughput(model, sample_for, budget / GIB, batches, optimizer="adamw")
    except InfeasibleBudget as error:  # (then no baseline fits either: they are plans too)
        print(f"{key}: {error}", flush=True)
        return {"model": key, "description": description, "budget": budget, "batches": batches, "rows": {},
                "infeasible": str(error), "plan_s": plan_s, "throughput_s": time.perf_counter() - started}
    throughput_s = time.perf_counter() - started
    print(tp, flush=True)
    if plot_to is not None:
        tp.plot(plot_to / f"throughput_{key}.png")

    baselines: dict[str, nn.Module] = {"none": copy.deepcopy(model), "every block": every_block(spec, model)[0]}
    for n in STRIDES:
        if n < len(spec.blocks(model)):
            baselines[f"every {n}{ {2: 'nd', 3: 'rd'}.get(n, 'th')} block"] = every_nth_block(spec, model, n)[0]
    rows: dict[str, dict[str, Any]] = {}
    configs: dict[str, tuple[nn.Module, Any]] = {}
    for name, module in baselines.items():
        batch, peak = largest_fitting(module, sample_for, batches, budget, state)
        rows[name] = {"batch": batch, "peak": peak}
        if batch is not None:
            configs[name] = (module, sample_for(batch))
    planned = tp.apply(copy.deepcopy(model))
    planner_peak = steady_peak(planned, sample_for(tp.batch_size), CPU) + state
    rows["planner"] = {"batch": tp.batch_size, "peak": planner_peak,
                       "predicted": next(r.samples_per_s for r in tp.table if r.batch == tp.batch_size)}
    configs["planner"] = (planned, sample_for(tp.batch_size))
    for name, (module, batch_sample) in configs.items():
        rows[name]["grads_ok"] = same_gradients(module, model, batch_sample)
    times = timed_rounds(configs, rounds)
    for name, values in times.items():
        batch = rows[name]["batch"]
        rates = [1000 * batch / t for t in values]
        interval = median_interval(rates, 0.95)
        rows[name].update(samples_per_s=statistics.median(rates), interval=interval, step_ms=statistics.median(values))
    best = max((name for name in configs if name != "planner"), key=lambda n: rows[n]["samples_per_s"], default=None)
    return {"model": key, "description": description, "budget": budget, "batches": batches, "rows": rows,
            "best_baseline": best, "plan_s": plan_s, "throughput_s": throughput_s, "table": str(tp)}


def verdict(found: dict[str, Any]) -> list[str]:
    if "infeasible" in found:
        return [f"no candidate batch fits: {found['infeasible']} (AdamW's state alone takes two fp32 copies of "
                "the parameters)"]
    rows, best = found["rows"], found["best_baseline"]
    planner = rows["planner"]
    lines = []
    if best is not None:
        low, high = planner["interval"] or (planner["samples_per_s"],) * 2
        ratio = planner["samples_per_s"] / rows[best]["samples_per_s"]
        ok = ratio >= 1 or high >= rows[best]["samples_per_s"]
        lines.append(f"planner {planner['samples_per_s']:.1f} samples/s at batch {planner['batch']} against the best "
                     f"baseline, {best}, {rows[best]['samples_per_s']:.1f} at batch {rows[best]['batch']}: "
                     f"{ratio:.2f}x ({'met' if ok else 'MISSED'})")
    error = planner["predicted"] / planner["samples_per_s"] - 1
    lines.append(f"predicted {planner['predicted']:.1f} samples/s against {planner['samples_per_s']:.1f} measured: "
                 f"{100 * error:+.0f}% ({'met' if abs(error) <= TOLERANCE else 'MISSED'})")
    ratio = found["throughput_s"] / found["plan_s"]
    lines.append(f"plan_throughput {found['throughput_s']:.0f} s against one plan() {found['plan_s']:.0f} s: "
                 f"{ratio:.1f}x ({'met' if ratio <= 3 else 'MISSED'})")
    over = [name for name, row in rows.items() if row.get("peak") is not None and row["peak"] > found["budget"]]
    wrong = [name for name, row in rows.items() if row.get("grads_ok") is False]
    lines.append("every configuration measured under the budget" if not over else f"OVER budget: {over}")
    lines.append("every configuration gave the unplanned model's gradients" if not wrong else f"gradients differ: {wrong}")
    return lines


def summary(records: list[dict[str, Any]], share: float, retained: bool | None = None) -> str:
    """RESULTS.md's section: one row per model (each configuration at its largest fitting batch:
    batch, samples/s with its 95% interval) and the targets' ratios, then each miss's reason."""
    header = ["model", "budget", "no checkpointing", "every block", "best every n-th block", "planner",
              "planner / best baseline", "predicted / measured", "plan_throughput / plan()"]
    lines = [f"Budget: {share:g} of the unplanned step's peak at the largest candidate batch, AdamW's state "
             "included. Cells: batch, samples/s (95% interval) of full training steps (AdamW's step included), "
             "alternating rounds, medians. Every configuration is checked under the budget by allocator peak and "
             "against the unplanned model's gradients." + ("" if retained is None else " " + memory_kept(retained)), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes = []

    def cell(row: dict[str, Any] | None) -> str:
        if not row or row.get("batch") is None:
            return "fits at no batch"
        low_high = f" ({row['interval'][0]:.1f}-{row['interval'][1]:.1f})" if row.get("interval") else ""
        return f"{row['batch']}: {row['samples_per_s']:.1f}{low_high}"

    for found in records:
        rows, key = found["rows"], found["model"]
        if "infeasible" in found:
            lines.append(f"| {key} | {format_bytes(found['budget'])} | " + " | ".join(["fits at no batch"] * 4)
                         + " | - | - | - |")
            notes.append(f"{key}: {verdict(found)[0]}")
            continue
        strided = [name for name in rows if name.startswith("every ") and name != "every block"
                   and rows[name].get("samples_per_s") is not None]
        best_strided = max(strided, key=lambda name: rows[name]["samples_per_s"], default=None)
        planner, best = rows["planner"], found["best_baseline"]
        ratio = f"{planner['samples_per_s'] / rows[best]['samples_per_s']:.2f} ({best})" if best else "-"
        lines.append(f"| {key} | {format_bytes(found['budget'])} | {cell(rows.get('none'))} "
                     f"| {cell(rows.get('every block'))} | "
                     + (f"{best_strided}, {cell(rows[best_strided])}" if best_strided else "fits at no batch")
                     + f" | {cell(planner)} | {ratio} | {planner['predicted'] / planner['samples_per_s']:.2f} "
                     f"| {found['throughput_s'] / found['plan_s']:.1f} |")
        notes += [f"{key}: {line}" for line in verdict(found) if "MISSED" in line or "OVER" in line or "differ" in line]
    return "\n".join(lines + ([""] + [f"- {note}" for note in notes] if notes else ["", "Every target met."]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt,gpt2,llama,bert,vit,cnn")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--results", action="store_true", help="write the table to benchmarks/RESULTS.md")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--share", type=float, default=0.5,
                        help="the budget, as a share of the unplanned peak at the largest batch (default 0.5)")
    parser.add_argument("--render", metavar="JSON", help="write RESULTS.md's section from a run's raw figures")
    args = parser.parse_args()
    command = "python -m benchmarks.throughput" + (f" --models {args.models}" if args.models != "gpt,gpt2,llama,bert,vit,cnn"
                                                   else "")
    if args.render:
        import json

        raw = json.loads(Path(args.render).read_text())
        set_section("throughput", "Throughput within the budget (CPU)", raw.get("command", command),
                    summary(raw["records"], raw.get("share", args.share), raw.get("retained")))
        return 0
    import transformers

    transformers.logging.set_verbosity_error()
    retained = retain_freed_memory()  # (as compare.py: a CPU step then pays no page faults a GPU would not)
    records = []
    for key in args.models.split(","):
        found = run_model(key.strip(), args.rounds, args.quick, args.share,
                          RAW if args.results and not args.quick else None)
        records.append(found)
        rows = ["| configuration | batch | measured peak | samples/s (95%) | gradients |", "|---|---|---|---|---|"]
        for name, row in found["rows"].items():
            if row["batch"] is None:
                rows.append(f"| {name} | fits at no candidate batch | | | |")
                continue
            interval = row.get("interval")
            spread = f" ({interval[0]:.1f}-{interval[1]:.1f})" if interval else ""
            rows.append(f"| {name} | {row['batch']} | {format_bytes(row['peak'])} | {row['samples_per_s']:.1f}{spread} "
                        f"| {'equal' if row['grads_ok'] else 'DIFFER'} |")
        print(f"#### {found['description']}\n\nBudget {format_bytes(found['budget'])}; candidate batches "
              f"{found['batches']}.\n\n" + ("\n".join(rows) + "\n\n" if found["rows"] else "")
              + "\n".join(f"- {line}" for line in verdict(found))
              + "\n\nThe planner's table:\n\n" + found.get("table", "none"), flush=True)
    print(summary(records, args.share))
    if args.quick:  # (a smoke run's figures replace no run's)
        return 0
    write_run("throughput", {"command": command, "share": args.share, "retained": retained, "records": records})
    if args.results:
        set_section("throughput", "Throughput within the budget (CPU)", command,
                    summary(records, args.share, retained))
    return 0


if __name__ == "__main__":
    sys.exit(main())
