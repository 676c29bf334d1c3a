"""Checkpoint's own cost per block, read within one step, against its price in planning.

Across steps (a plan against the unplanned model) the machine's load drifts between the two
steps; within one step it barely does. So: two plans each checkpoint half the blocks (even,
then odd; `Plan.with_submodules`), and in each step the checkpointed blocks' mean forward plus
backward, less their recomputation, is set against the plain blocks' mean in the same step
(`planner.costs.block_price.BlockSegments`, `planner.costs.block_price.round_cost`, as planning reads it
with 20-40 rounds). The two halves are averaged per round, so a block's position cancels. The
across-step reading of the same rounds (each checkpointed block against the same block of the
unplanned model, a third configuration in the rotation) is printed beside it. Price:
`Problem.checkpoint_ms` per block.

    .venv/bin/python -m benchmarks.diagnostics.block_price [--models gpt,gpt2,llama,bert] [--rounds 40]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks.compare_models import SPECS, block_names
from benchmarks.compare_steps import step, timed_step
from benchmarks.cpu_memory import memory_kept, retain_freed_memory

HERE = Path(__file__).resolve().parent


def _reading(values: list[float]) -> str:
    """Median (95% interval; its width), ms."""
    from planner.measure.clock import median_interval

    bounds = median_interval(values)
    if bounds is None:
        return f"{statistics.median(values):+.2f} (too few rounds for an interval)"
    low, high = bounds
    return f"{statistics.median(values):+.2f} ({low:+.2f} to {high:+.2f}; {high - low:.2f})"


def run(key: str, rounds: int) -> str:
    """One table row: a block's price, and its cost within and across steps at 9 and all rounds."""
    import torch

    from planner import plan
    from planner.costs.block_price import BlockSegments, round_cost

    spec = SPECS[key]
    torch.manual_seed(0)
    model, sample, _ = spec.build(False)
    model.train()
    step(model, sample)
    names = block_names(spec, model)
    if len(names) < 2:
        raise ValueError(f"{key}: {len(names)} block(s); a within-step reading needs a plain and a checkpointed one")
    base = plan(model, sample, budget_gb=80, repeats=3)
    halves = [names[0::2], names[1::2]]
    plans = [base.with_submodules(half) for half in halves]
    modules = [p.module() for p in plans] + [model]
    segments = [BlockSegments(module, names, torch.device("cpu")) for module in modules]
    for module in modules:
        step(module, sample)
    found: list[list[dict]] = [[], [], []]
    for index in range(rounds):
        order = [(index + k) % 3 for k in range(3)]
        for which in order if index % 2 == 0 else reversed(order):
            segments[which].clear()  # (what untimed steps marked)
            timed_step(modules[which], sample)
            found[which].append(segments[which].take())
    for hooks in segments:
        hooks.remove()
    within = [round_cost(pair, halves) for pair in zip(found[0], found[1])]
    across: list[float] = []
    for index in range(rounds):
        crossed: list[float] = []
        for which, half in enumerate(halves):
            blocks = found[which][index]
            # (a block whose input needs no gradient has no backward segment: left out)
            crossed += [blocks[n][0] + blocks[n][1] - blocks[n][2] - sum(found[2][index][n][:2])
                        for n in half if blocks[n][1] is not None]
        across.append(statistics.mean(crossed))
    priced = sum(p.problem.checkpoint_ms(region) for p in plans for region in p.solution.regions) / len(names)
    first = min(9, rounds)
    return (f"| {key} | {len(names)} | {priced:.2f} ms | {_reading(within[:first])} | {_reading(within)} "
            f"| {_reading(across[:first])} | {_reading(across)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt,gpt2,llama,bert", help=f"comma-separated subset of {','.join(SPECS)}")
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds (default 40)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (an interval needs two readings)")
    retained = retain_freed_memory()
    import torch

    torch.set_num_threads(1)
    rows = ["| model | blocks | priced a block | within the step, 9 rounds | within, all rounds "
            "| across steps, 9 rounds | across, all rounds |", "|" + "---|" * 7]
    for key in [key.strip() for key in args.models.split(",") if key.strip()]:
        rows.append(run(key, args.rounds))
        print(rows[-1], flush=True)
    body = "\n".join(rows) + (
        f"\n\nPer block, ms: median over {args.rounds} rounds (95% interval; its width). Within the step: the "
        "checkpointed half's forward+backward less recomputation against the plain half's, same step, both "
        "halves averaged. Across steps: each checkpointed block against the unplanned model's. One intra-op "
        "thread. " + memory_kept(retained))
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
