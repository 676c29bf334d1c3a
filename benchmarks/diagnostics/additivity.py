"""Does a plan cost its training step the sum of what its parts cost? The cost model adds up
its regions' prices, so a plan whose whole measures more than its parts would be priced low
however well each region is.

One planning of a model of `benchmarks/compare.py`; its plan at `--fraction` of the unplanned
peak is split in two (module calls / runs recomputed alone where it has both, else alternate
regions), and the whole, each part and the unplanned step are timed in sandwiched rounds
(`planner.measure.clock.sandwiched_rounds`), every node retimed after each round
(`benchmarks/retime.py`). Per round, the interaction is the whole's overhead less the parts':
about 0 where the overheads add up. Prints medians with distribution-free 95% intervals.

With `--whole-only`, the plan alone is timed against the unplanned step (no split): a check of
one plan's prediction, away from the other configurations of a compare run.

Usage:
    .venv/bin/python -m benchmarks.diagnostics.additivity --model llama --fraction 0.8 --rounds 120
    .venv/bin/python -m benchmarks.diagnostics.additivity --model vit --fraction 0.8 --rounds 60 --whole-only
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks.compare_models import SPECS
from benchmarks.compare_steps import step, timed_step
from benchmarks.cpu_memory import retain_freed_memory
from benchmarks.retime import NodeRetimer

ROOT = Path(__file__).resolve().parents[1]


def split(planned):
    """The plan's regions in two parts, each as (first, last) node-name pairs with the names of
    the nodes it keeps, and how they were split."""
    problem, regions = planned.problem, planned.solution.regions
    is_run = [problem.run_windows(region) is not None for region in regions]
    if any(is_run) and not all(is_run):
        parts = ([r for r, run in zip(regions, is_run) if not run], [r for r, run in zip(regions, is_run) if run])
        how = "module calls / runs"
    else:
        parts, how = (regions[0::2], regions[1::2]), "alternate regions"
    kept = planned.solution.kept or ()
    named = [([(problem.nodes[r.start].name, problem.nodes[r.stop - 1].name) for r in part],
              [problem.nodes[i].name for i in kept if any(i in r for r in part)]) for part in parts]
    return named, how


def interval_text(values: list[float]) -> str:
    from planner.measure.clock import median_interval

    low_high = median_interval(values)
    spread = f" (95% {low_high[0]:+.1f} to {low_high[1]:+.1f})" if low_high else ""
    return f"{statistics.median(values):+.1f}{spread}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=sorted(SPECS))
    parser.add_argument("--fraction", type=float, default=0.8, help="budget as a fraction of the unplanned peak")
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--whole-only", action="store_true", help="time the plan alone, not its two parts")
    args = parser.parse_args()

    import torch

    from planner import plan
    from planner.api import GIB
    from planner.measure.clock import sandwiched_rounds

    torch.set_num_threads(1)
    retain_freed_memory()
    torch.manual_seed(0)
    model, sample, _ = SPECS[args.model].build(False)
    model.train()
    step(model, sample)
    base = plan(model, sample, budget_gb=80)
    whole = base.replan(budget_gb=args.fraction * base.baseline_peak_bytes / GIB)
    plans = {"whole": whole}
    if args.whole_only:
        print(f"{args.model} at {args.fraction:.0%}: {len(whole.solution.regions)} regions, "
              f"{len(whole.solution.kept)} nodes kept, timed alone")
    else:
        ((first, first_kept), (second, second_kept)), how = split(whole)
        if not first or not second:
            sys.exit(f"the plan at {args.fraction:.0%} has {len(whole.solution.regions)} region(s): nothing to split")
        plans.update({"part A": base.with_regions(first, kept=first_kept),
                      "part B": base.with_regions(second, kept=second_kept)})
        parts = [*plans["part A"].solution.regions, *plans["part B"].solution.regions]
        if sorted(parts, key=lambda r: r.start) != sorted(whole.solution.regions, key=lambda r: r.start):
            sys.exit("the two parts' regions, named again, are not the plan's: the interaction would mean nothing")
        print(f"{args.model} at {args.fraction:.0%}: {len(whole.solution.regions)} regions, split as {how} "
              f"({len(first)} / {len(second)})")
    for name, planned in plans.items():
        print(f"  {name}: predicted {planned.recompute_ms:.1f} ms")
    retimer = NodeRetimer(base)
    modules = {name: planned.module() for name, planned in plans.items()}
    calls = {"none": lambda: timed_step(model, sample)}
    calls.update({name: (lambda m=m: timed_step(m, sample)) for name, m in modules.items()})

    def after_round(index: int) -> None:
        retimer.measure()
        if (index + 1) % 20 == 0:
            print(f"  round {index + 1}/{args.rounds} done", flush=True)

    overheads = sandwiched_rounds(calls, "none", args.rounds, after_round)
    print(f"after {args.rounds} rounds, overhead over the unplanned step (ms):")
    for name, planned in plans.items():
        print(f"  {name}: measured {interval_text(overheads[name])}; predicted {planned.recompute_ms:.1f}, "
              f"from the rounds' node means {retimer.predict(planned):.1f}")
    if not args.whole_only:
        interaction = [w - a - b for w, a, b in zip(overheads["whole"], overheads["part A"], overheads["part B"])]
        print(f"  interaction (whole less its parts): {interval_text(interaction)}; "
              f"mean {statistics.fmean(interaction):+.1f}")


if __name__ == "__main__":
    main()
