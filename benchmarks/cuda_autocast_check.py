"""CUDA truth for mixed precision: plans for a step under `torch.autocast("cuda", torch.bfloat16)`,
made two ways, verified on the GPU under that autocast.

- on the GPU: `plan(model, sample, budget_gb=X, autocast=torch.bfloat16)`, the call users make;
- as on a laptop: in a child process that sees no CUDA (`CUDA_VISIBLE_DEVICES=""`), the same
  architecture built on `meta` and planned for this GPU (`target=`, CUDA autocast's casts applied
  on the CPU's fake tensors: `planner.measure.autocast.cuda_autocast_on_cpu`), saved, then loaded
  here, applied to the real model and verified.

Budgets: `--fraction` of each model's unplanned peak under autocast, measured here. Misses: a plan
over its budget, a prediction more than 3% off, gradients unlike the unplanned model's.

    python -m benchmarks.cuda_autocast_check [--fraction 0.5] [--models GPT2LMHeadModel,...] [--results]

Without a CUDA device it says so and exits 0. `--device cpu` is a dry run of the script itself
(CPU autocast, the child planning for this CPU).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from benchmarks.cuda_check import gpu_check_arguments, no_gpu_here, report
from benchmarks.real_models import _models
from planner import InfeasibleBudget, load_plan, plan
from planner.api import GIB
from planner.cli.models import to_device
from planner.measure.steps import steady_peak
from planner.measure.targets import local_target
from solvers.solution import format_bytes

HERE = Path(__file__).resolve().parent
DEFAULT_MODELS = ("GPT2LMHeadModel", "LlamaForCausalLM", "BertForMaskedLM", "ViTForImageClassification")

_WITHOUT_CUDA = r'''
import sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {root!r})
import torch
from benchmarks.real_models import _models
from planner import plan
assert not torch.cuda.is_available()
with torch.device("meta"):
    torch.manual_seed(0)
    model, sample = _models()[{name!r}]()
p = plan(model.train(), sample, budget_gb={budget_gb!r}, target={target!r}, autocast=torch.bfloat16)
p.save({path!r})
'''


def planned_without_cuda(name: str, budget_gb: float, target: str | None, path: Path) -> None:
    """Plan model `name` on `meta` for `target` in a process that sees no CUDA; save it to `path`."""
    code = _WITHOUT_CUDA.format(root=str(HERE.parent), name=name, budget_gb=budget_gb, target=target, path=str(path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"planning {name} without CUDA failed: {last}")


def main() -> int:
    parser = gpu_check_arguments(__doc__)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="comma-separated names of benchmarks/real_models.py's models")
    args = parser.parse_args()
    device = torch.device(args.device)
    if no_gpu_here(device):
        return 0
    warnings.filterwarnings("ignore")
    target = local_target() if device.type == "cuda" else None
    if device.type == "cuda" and target is None:
        print(f"{torch.cuda.get_device_name(device)} is not in planner.targets(): no plan can name it as a target.")
        return 1
    rows = ["| model | planned | budget | regions | predicted peak | measured peak | error | under budget "
            "| gradients match |", "|" + "---|" * 9]
    misses = []
    models = _models()
    for name in args.models.split(","):
        torch.manual_seed(0)
        model, sample = models[name]()
        model, sample = to_device(model.train(), sample, args.device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            unplanned = steady_peak(model, sample, device)
        budget = args.fraction * unplanned
        try:
            on_device = plan(model, sample, budget_gb=budget / GIB, autocast=torch.bfloat16)
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "plan.json"
                planned_without_cuda(name, budget / GIB, target.name if target else None, path)
                laptop = load_plan(path)
        except InfeasibleBudget as error:
            rows.append(f"| {name} | | {format_bytes(budget)} | infeasible: minimum "
                        f"{format_bytes(error.minimum_bytes)} | | | | | |")
            continue
        except RuntimeError as error:  # (the child's planning: a miss of its own, the other models still run)
            rows.append(f"| {name} | | {format_bytes(budget)} | failed: {error} | | | | | |")
            misses.append(str(error))
            continue
        for how, p in (("here (the default call)", on_device), ("without CUDA, on meta for this GPU", laptop)):
            record = p.verify(sample, steps=args.steps, model=model)  # under the plan's autocast
            rows.append(f"| {name} | {how} | {format_bytes(budget)} | {len(p.checkpoints)} "
                        f"| {format_bytes(record.predicted_peak_bytes)} | {format_bytes(record.planned_peak_bytes)} "
                        f"| {100 * record.peak_error:+.1f}% | {'yes' if record.within_budget else 'NO'} "
                        f"| {'yes' if record.gradients_match else 'NO'} |")
            print(rows[-1], flush=True)
            if not record.within_budget or abs(record.peak_error) > 0.03 or not record.gradients_match:
                misses.append(f"{name} ({how}): {record.peak_error:+.1%}, under budget {record.within_budget}, "
                              f"gradients {record.gradients_match}")
    return report("cuda_autocast_check", "CUDA check under bfloat16 autocast on {gpu}",
                  f"python -m benchmarks.cuda_autocast_check --fraction {args.fraction}", rows, misses, device,
                  args.results)


if __name__ == "__main__":
    sys.exit(main())
