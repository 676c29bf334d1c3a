"""CUDA truth: plan the models of `benchmarks/real_models.py` on a CUDA GPU twice, with the
whole step measured (`measure="run"`) and without running it (the model built on `meta`, sizes
on fake tensors, each node run alone on the GPU, the plan saved, loaded and applied to the real
model), and verify every plan on the GPU: peaks from `torch.cuda.max_memory_allocated`, step
times from CUDA events (`Plan.verify` / `verify_modules`), gradients against the unplanned model.

    .venv/bin/python benchmarks/cuda_check.py [--fraction 0.5] [--steps 3] [--no-save]

Without a CUDA device it says so and exits 0 (nothing to check).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from benchmarks.real_models import _models
from benchmarks.results import set_section, write_run
from planner import InfeasibleBudget, load_plan, plan
from planner.api import GIB
from planner.cli.models import to_device
from planner.measure.steps import verify_modules
from solvers.solution import format_bytes

HERE = Path(__file__).resolve().parent


def gpu_check_arguments(description: str | None) -> argparse.ArgumentParser:
    """The arguments every GPU check takes: --fraction, --steps, --results, --device."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fraction", type=float, default=0.5, help="budget as a share of the measured unplanned peak")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--results", action="store_true", help="write the table to benchmarks/RESULTS.md")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run of this script")
    return parser


def no_gpu_here(device: torch.device) -> bool:
    """Says so where a CUDA check has no CUDA device to run on."""
    if device.type == "cuda" and not torch.cuda.is_available():
        print("No CUDA device here: nothing to check. Run this on a machine with a GPU.")
        return True
    return False


def report(key: str, title: str, command: str, rows: list[str], misses: list[str], device: torch.device,
           results: bool) -> int:
    """Print the table and its verdict; on a GPU, keep the run and (`results`) write its section."""
    verdict = "All plans under budget, predictions within 3%, gradients equal." if not misses else \
        "Misses:\n" + "\n".join(f"- {miss}" for miss in misses)
    table = "\n".join(rows)
    print(table, verdict, sep="\n\n")
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        write_run(key, {"command": command, "table": table, "verdict": verdict}, "cuda")
        if results:
            set_section(key, title.format(gpu=gpu), command, f"{table}\n\n{verdict}", gpu)
    return 0 if not misses else 1


def main() -> int:
    args = gpu_check_arguments(__doc__).parse_args()
    device = torch.device(args.device)
    if no_gpu_here(device):
        return 0
    warnings.filterwarnings("ignore")
    rows = ["| model | path | budget | regions | predicted peak | measured peak | error | under budget "
            "| step ms unplanned -> planned | overhead ms: predicted / measured | gradients match |", "|" + "---|" * 11]
    misses = []
    for name, factory in _models().items():
        torch.manual_seed(0)
        model, sample = factory()
        model, sample = to_device(model.train(), sample, args.device)
        unplanned = plan(model, sample, budget_gb=80, measure="run")
        measured_peak = unplanned.verify(steps=args.steps).original_peak_bytes
        budget = args.fraction * measured_peak
        with torch.device("meta"):
            torch.manual_seed(0)
            meta_model, meta_sample = factory()
        try:
            run = plan(model, sample, budget_gb=budget / GIB)  # the call users make
            no_run = plan(meta_model.train(), meta_sample, budget_gb=budget / GIB, measure="no-run")
        except InfeasibleBudget as error:
            rows.append(f"| {name} | both | {format_bytes(budget)} | infeasible: minimum "
                        f"{format_bytes(error.minimum_bytes)} | | | | | | | |")
            continue
        run_record = run.verify(steps=args.steps)
        with tempfile.TemporaryDirectory() as folder:
            saved = load_plan(no_run.save(Path(folder) / "plan.json"))
        applied = saved.apply(model)
        no_run_record = verify_modules(model, applied, sample, args.steps, no_run.predicted_peak_bytes,
                                       no_run.baseline_peak_bytes, no_run.budget_bytes, no_run.recompute_ms)
        for path, p, record in (("run", run, run_record), ("no-run", no_run, no_run_record)):
            rows.append(
                f"| {name} | {path} | {format_bytes(budget)} | {len(p.checkpoints)} "
                f"| {format_bytes(record.predicted_peak_bytes)} | {format_bytes(record.planned_peak_bytes)} "
                f"| {100 * record.peak_error:+.1f}% | {'yes' if record.within_budget else 'NO'} "
                f"| {record.original_step_ms:.1f} -> {record.planned_step_ms:.1f} "
                f"| {p.recompute_ms:.1f} / {record.overhead_ms:+.1f} | {'yes' if record.gradients_match else 'NO'} |")
            print(rows[-1], flush=True)
            if not record.within_budget or abs(record.peak_error) > 0.03 or not record.gradients_match:
                misses.append(f"{name} ({path}): {record.peak_error:+.1%}, "
                              f"under budget {record.within_budget}, gradients {record.gradients_match}")
    return report("cuda_check", "CUDA check on {gpu} (the default call, and without running)",
                  f"python -m benchmarks.cuda_check --fraction {args.fraction}", rows, misses, device, args.results)


if __name__ == "__main__":
    sys.exit(main())
