"""Where a plan's overhead goes, op by op: the unplanned step and a plan's, profiled in
alternating blocks of steps, and each ATen op's (and autograd node's) own CPU time per step,
plan less unplanned, largest first, beside the plan's prediction and the wall clock's paired
difference.

A step's wall clock on this shared CPU moves by 20-30% within seconds, so a plan's overhead
read off whole steps has a 95% interval tens of ms wide. Per op, the same ops in both steps
cancel and what the plan adds stands out: the recomputed ops, and the Python that runs inside
the unpacking backward node (checkpoint's and the recomputed modules' calls, booked as the
backward node's own time).

    .venv/bin/python -m benchmarks.diagnostics.step_ops --model cnn --budget 0.8 [--rounds 16] [--steps 2]

`--budget` is a fraction of the unplanned peak (as compare.py's 40/60/80%).
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

from benchmarks.compare_models import SPECS
from benchmarks.compare_steps import step
from benchmarks.cpu_memory import retain_freed_memory

HERE = Path(__file__).resolve().parent


def op_times(module, sample, steps: int) -> tuple[collections.Counter, float]:
    """Each op's own CPU time (ms per step) over `steps` profiled steps, and the wall clock's
    ms per step."""
    from torch.profiler import ProfilerActivity, profile

    own: collections.Counter = collections.Counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step(module, sample)
        wall_ms = (time.perf_counter() - started) * 1000 / steps
    for event in prof.key_averages():
        own[event.key] += event.self_cpu_time_total / 1000 / steps
    return own, wall_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cnn", choices=sorted(SPECS))
    parser.add_argument("--budget", type=float, default=0.8, help="fraction of the unplanned peak (default 0.8)")
    parser.add_argument("--rounds", type=int, default=16, help="alternating rounds (default 16)")
    parser.add_argument("--steps", type=int, default=2, help="profiled steps per configuration and round")
    parser.add_argument("--top", type=int, default=20, help="ops to list (default 20)")
    parser.add_argument("--quick", action="store_true", help="the model's tiny sizes")
    args = parser.parse_args()
    if not 0 < args.budget <= 1 or args.rounds < 1 or args.steps < 1:
        parser.error("--budget must lie in (0, 1], --rounds and --steps must be at least 1")

    import torch

    from planner import plan
    from planner.api import GIB

    torch.set_num_threads(1)
    retain_freed_memory()
    torch.manual_seed(0)
    model, sample, size = SPECS[args.model].build(args.quick)
    model.train()
    step(model, sample)
    base = plan(model, sample, budget_gb=80)
    planned = base.replan(budget_gb=args.budget * base.baseline_peak_bytes / GIB)
    print(f"{SPECS[args.model].title}, {size}; budget {args.budget:.0%} of the unplanned peak: "
          f"{len(planned.solution.regions)} regions, predicted {planned.recompute_ms:.1f} ms")
    configs = {"none": model, "plan": planned.module()}
    for module in configs.values():
        step(module, sample)
    own = {name: collections.Counter() for name in configs}
    walls: dict[str, list[float]] = {name: [] for name in configs}
    for index in range(args.rounds):
        for name in (list(configs) if index % 2 == 0 else list(configs)[::-1]):
            times, wall_ms = op_times(configs[name], sample, args.steps)
            own[name].update({key: ms / args.rounds for key, ms in times.items()})
            walls[name].append(wall_ms)
    paired = statistics.median(a - b for a, b in zip(walls["plan"], walls["none"]))
    print(f"wall clock per step (profiled): none {statistics.median(walls['none']):.1f} ms, plan "
          f"{statistics.median(walls['plan']):.1f} ms; paired difference {paired:+.1f} ms; own CPU time in all ops "
          f"{sum(own['plan'].values()) - sum(own['none'].values()):+.1f} ms")
    names = sorted(set(own["none"]) | set(own["plan"]), key=lambda key: -abs(own["plan"][key] - own["none"][key]))
    print("| op | none, ms per step | plan | plan - none |\n|---|---|---|---|")
    for key in names[:args.top]:
        print(f"| `{key}` | {own['none'][key]:.2f} | {own['plan'][key]:.2f} | {own['plan'][key] - own['none'][key]:+.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
