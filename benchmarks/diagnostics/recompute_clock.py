"""Does predicted recompute time meet the clock? Per model, every block checkpointed by the
planner (`Plan.with_submodules`): each region's forward and its recomputation timed inside
real training steps (the region's own forward call, wrapped), against the sums of its nodes'
forward times that the planner measured and predicts with; and the step's overhead over the
unplanned model (7 alternating rounds, medians) against `recompute_ms`.

It tells where a predicted overhead (benchmarks/compare.py) goes wrong: in the node times
(region forward and recompute off their sums), or in the rest of the step (regions on time,
step overhead not). The blocks' own forward and backward are also timed one by one inside the
same steps (`planner.costs.block_price`), which reads checkpoint's cost per block without the rest of the
step's noise.

With `--keep`, each model also runs with every block keeping all its keepable nodes (a
selective policy: `Problem.keepable_in`), whose recomputation skips them.

    .venv/bin/python -m benchmarks.diagnostics.recompute_clock [--models gpt,gpt2,llama,bert,cnn,vit]
                                                   [--rounds 7] [--keep]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks.compare_models import SPECS, block_names
from benchmarks.compare_steps import step, timed_step
from benchmarks.cpu_memory import memory_kept, retain_freed_memory
from benchmarks.retime import NodeRetimer

HERE = Path(__file__).resolve().parent


def timed_regions(module) -> dict[str, list[float]]:
    """Wrap each checkpointed submodule's own forward (inside checkpoint) with a clock: its
    calls alternate forward, recomputation (as long as each step recomputes every region)."""
    from planner.apply.checkpoints import CheckpointedForward

    times: dict[str, list[float]] = {}
    for name, submodule in module.named_modules():
        forward = submodule.__dict__.get("forward")
        if not isinstance(forward, CheckpointedForward):
            continue

        def timed(*args, _original=forward.original, _name=name, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:  # recomputation ends by raising at its last saving node
                times.setdefault(_name, []).append(1000 * (time.perf_counter() - started))

        forward.original = timed
    return times


def run(key: str, rounds: int, keep: bool = False) -> str:
    import torch

    from planner import plan
    from planner.costs.block_price import BlockSegments
    from planner.measure.clock import median_interval

    spec = SPECS[key]
    torch.manual_seed(0)
    model, sample, _ = spec.build(False)
    model.train()
    step(model, sample)
    base = plan(model, sample, budget_gb=80, repeats=3)
    planned_plan = base.with_submodules(block_names(spec, model))
    if keep:
        problem = planned_plan.problem
        candidates = [problem.nodes[i].name for region in planned_plan.solution.regions
                      for i in problem.keepable_in(region)]
        planned_plan = base.with_submodules(block_names(spec, model), kept=candidates)
    planned = planned_plan.module()
    times = timed_regions(planned)
    names = [checkpoint.module for checkpoint in planned_plan.module_checkpoints]
    segments = {id(module): BlockSegments(module, names, torch.device("cpu")) for module in (model, planned)}
    step(planned, sample)
    step(model, sample)
    times.clear()
    retimer = NodeRetimer(base)
    plain: list[float] = []
    checked: list[float] = []
    plain_segments: list[dict] = []
    checked_segments: list[dict] = []
    for index in range(rounds):
        pairs = [(model, plain, plain_segments), (planned, checked, checked_segments)]
        for module, record, segment_record in pairs if index % 2 == 0 else reversed(pairs):
            segments[id(module)].clear()  # (what untimed steps marked)
            record.append(timed_step(module, sample))
            segment_record.append(segments[id(module)].take())
        retimer.measure()
    for found in segments.values():
        found.remove()
    # (node times as planning measured them, and as means over the rounds' own passes: the
    # machine's drift between planning and these rounds out of the comparison)
    means = retimer.problem()
    kept = planned_plan.solution.kept
    forward = recompute = 0.0
    predicted_forward = [0.0, 0.0]
    predicted_recompute = [0.0, 0.0]
    for region, checkpoint in zip(planned_plan.solution.regions, planned_plan.checkpoints):
        calls = times[checkpoint.wrapped.module]
        forward += statistics.median(calls[0::2])
        recompute += statistics.median(calls[1::2])
        for index, priced in enumerate((planned_plan.problem, means)):
            predicted_forward[index] += sum(priced.nodes[i].compute_ms for i in region)
            predicted_recompute[index] += priced.region_recompute_ms(region, kept)
    differences = [b - a for a, b in zip(plain, checked)]
    overhead = statistics.median(differences)
    # (what the step pays beyond its regions' recomputations, round by round: checkpoint's own
    # work, which `Problem.checkpoint_ms` prices, and anything else the cost model misses)
    recomputed = [sum(times[checkpoint.wrapped.module][2 * index + 1] for checkpoint in planned_plan.checkpoints)
                  for index in range(rounds)]
    beyond = [difference - ms for difference, ms in zip(differences, recomputed)]
    by_block = _beyond_block_by_block(plain_segments, checked_segments, times)
    problem = planned_plan.problem
    calls_ms = sum(problem.checkpoint_ms(region) for region in planned_plan.solution.regions)
    policies_ms = sum(problem.selective_ms(region) for region in planned_plan.solution.regions
                      if any(i in region for i in kept)) + problem.kept_node_ms * len(kept)
    label = f"{key} keeping {len(planned_plan.solution.kept)}" if keep else key
    per_call = f"{calls_ms:.1f} ms checkpoint calls" + (f", {policies_ms:.1f} ms policies" if policies_ms else "")
    return (f"| {label} | {len(planned_plan.solution.regions)} | {forward:.1f} ms "
            f"| {predicted_forward[0]:.1f} / {predicted_forward[1]:.1f} ms | {recompute:.1f} ms "
            f"| {predicted_recompute[0]:.1f} / {predicted_recompute[1]:.1f} ms | {statistics.median(plain):.0f} ms "
            f"| {overhead:+.1f} ms{_interval(median_interval(differences))} "
            f"| {statistics.median(beyond):+.1f} ms{_interval(median_interval(beyond))} "
            f"| {by_block} "
            f"| {planned_plan.recompute_ms:.1f} / {retimer.predict(planned_plan):.1f} ms ({per_call}) |")


def _beyond_block_by_block(plain: list[dict], checked: list[dict], times: dict[str, list[float]]) -> str:
    """What the checkpointed blocks' own segments took beyond the unplanned blocks' and their
    recomputations, round by round (forward, backward, both; medians and 95% intervals), and per
    block. Blocks whose input needs no gradient have no backward segment and count in neither."""
    from planner.measure.clock import median_interval

    forward, backward = [], []
    for index, (none, planned) in enumerate(zip(plain, checked)):
        forward.append(sum(planned[name][0] - none[name][0] for name in none))
        backward.append(sum(planned[name][1] - none[name][1] - times[name][2 * index + 1]
                            for name in none if none[name][1] is not None and planned[name][1] is not None))
    both = [f + b for f, b in zip(forward, backward)]
    per_block = statistics.median(both) / len(plain[0])
    return (f"{statistics.median(forward):+.1f} / {statistics.median(backward):+.1f} / "
            f"{statistics.median(both):+.1f} ms{_interval(median_interval(both))}; {per_block:+.2f} ms a block")


def _interval(bounds: tuple[float, float] | None) -> str:
    """A 95% interval in brackets, or nothing where too few rounds give one."""
    return f" ({bounds[0]:+.1f} to {bounds[1]:+.1f})" if bounds else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(SPECS), help=f"comma-separated subset of {','.join(SPECS)}")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--keep", action="store_true", help="also every block keeping all its keep candidates")
    parser.add_argument("--return-freed-memory", action="store_true",
                        help="leave glibc's malloc as it is (default: keep freed memory, as CUDA's caching "
                             "allocator does; see benchmarks/cpu_memory.py)")
    args = parser.parse_args()
    retained = False if args.return_freed_memory else retain_freed_memory()
    import torch

    torch.set_num_threads(1)
    rows = ["| model | regions | region forwards, measured | sum of node times (planning / rounds' means) "
            "| recomputations, measured | predicted (nodes to the last save; planning / rounds' means) "
            "| unplanned step | step overhead, measured (95%) | step less recomputations, measured (95%) "
            "| blocks less recomputations, block by block: forward / backward / both (95%) "
            "| predicted overhead (planning / rounds' means) |",
            "|" + "---|" * 11]
    for key in [key.strip() for key in args.models.split(",") if key.strip()]:
        for keep in (False, True) if args.keep else (False,):
            rows.append(run(key, args.rounds, keep))
            print(rows[-1], flush=True)
    body = "\n".join(rows) + (
        "\n\nEvery block checkpointed by the planner, one intra-op thread. Region times are medians over the "
        f"{args.rounds} rounds of each region's own forward call, timed inside the step (first call: forward; "
        "second: recomputation, up to its last saving node), summed over regions. Node times: as planning measured them, and "
        "as means over one pass of the graph's nodes per round, between the steps (`retime.NodeRetimer`). Step "
        "overhead: median over rounds of the paired difference; less recomputations: the same, less each "
        "round's recomputations, which checkpoint's own work (*checkpoint calls*) should account for. Block by block: "
        "each block's own forward and backward timed inside the same steps (`planner.costs.block_price.BlockSegments`: "
        "forward hooks, and gradient hooks on its output and input), checkpointed less unplanned, less the "
        "block's recomputation, summed over blocks round by round: that figure without the noise of the rest "
        "of the step. Rows *keeping N*: every "
        "block keeps all its keepable nodes (`Problem.keepable_in`); its recomputation skips them (predicted: the nodes it still runs), "
        "and the policies' cost (a dispatch mode over every ATen call of forward and recomputation, and a cost per "
        "kept node) is in the "
        "predicted overhead and in the measured region times. *Checkpoint calls*: checkpoint's own cost, per "
        "call and per tensor saved in it (`Problem.checkpoint_ms`). "
        + memory_kept(retained))
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
