"""Where a measured peak and the planner's predicted one part: for each model, plan it with the
whole step measured (`measure="run"`), verify the unplanned step and the plan at `--fraction`
of the measured unplanned peak, and for each step show the allocator's peak and what was live
there (the largest allocations and the operators that made them), beside the planner's
predicted peak and the node the simulation puts it at.

    .venv/bin/python -m benchmarks.diagnostics.peak_gap [--device cuda] [--models llama,llama-mha,gpt2]
    .venv/bin/python -m benchmarks.diagnostics.peak_gap --device cuda --compare gpt2,cnn --batch-scale 32

`--compare` takes `benchmarks/compare.py`'s models (`compare_models.SPECS`) at its sizes, the
batch repeated `--batch-scale` times, as `compare.py --device cuda` ran them.

It prints only (a diagnostic; RESULTS.md cites what it found).
"""
from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter

import torch
from torch._C._profiler import _EventType

from planner import plan
from planner.api import GIB
from planner.cli.models import to_device
from planner.core import split_sample, training_loss
from planner.measure.allocations import memory_profile
from solvers.simulate import simulate
from solvers.solution import format_bytes


def _models() -> dict:
    import transformers as t

    transformers_logging = t.logging
    transformers_logging.set_verbosity_error()
    ids = torch.randint(0, 1000, (8, 256))

    def llama(kv_heads: int):
        return lambda: (t.LlamaForCausalLM(t.LlamaConfig(
            num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=kv_heads, vocab_size=1000, bos_token_id=0, eos_token_id=0)),
            {"input_ids": ids, "labels": ids, "use_cache": False})

    return {
        "llama": llama(2),
        "llama-mha": llama(4),
        "gpt2": lambda: (t.GPT2LMHeadModel(t.GPT2Config(
            n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=256, bos_token_id=0, eos_token_id=0)),
            {"input_ids": ids, "labels": ids, "use_cache": False}),
    }


def _allocations(profile, device_type: str) -> list[tuple[int, int, int, str]]:
    """(time, size, pointer, innermost aten:: operator path) of each allocation event."""
    events = []
    stack = [(root, ()) for root in profile.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, path = stack.pop()
        kind, fields = node.typed
        if kind == _EventType.Allocation:
            if fields.device.type == device_type and fields.alloc_size != 0:
                events.append((node.start_time_ns, fields.alloc_size, fields.ptr, " > ".join(path[-3:])))
            continue
        if kind == _EventType.TorchOp:
            path = path + (node.name,)
        stack.extend((child, path) for child in node.children)
    events.sort(key=lambda event: (event[0], event[1] > 0))
    return events


def _allocator_rounding(device: torch.device) -> str:
    """The CUDA allocator's peaks since the last reset: what it counts as allocated (whole
    blocks: sizes rounded up, and a cached block up to 1 MiB larger than asked is handed out
    unsplit) against what the code asked for. Their gap is memory no tensor size shows."""
    stats = torch.cuda.memory_stats(device)
    allocated, requested = stats["allocated_bytes.all.peak"], stats["requested_bytes.all.peak"]
    return (f" (allocator peaks: allocated {format_bytes(allocated)}, requested {format_bytes(requested)}, "
            f"gap {format_bytes(allocated - requested)}; reserved {format_bytes(stats['reserved_bytes.all.peak'])})")


def _peak_report(module, sample, device: torch.device) -> str:
    args, kwargs = split_sample(sample)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with memory_profile() as profile:
        training_loss(module(*args, **kwargs)).backward()
    rounding = ""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        rounding = _allocator_rounding(device)
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    peak_op = ""
    for _, size, pointer, op in _allocations(profile, device.type):
        if size > 0:
            live[pointer] = (size, op)
            total += size
            if total > peak:
                peak, at_peak, peak_op = total, dict(live), op
        elif pointer in live:
            total -= live.pop(pointer)[0]
    by_op = Counter()
    for size, op in at_peak.values():
        by_op[op] += size
    lines = [f"    peak of the step's allocations {format_bytes(peak)} at an allocation in {peak_op!r}{rounding}; live there:"]
    lines += [f"      {format_bytes(size):>12}  {op}" for op, size in by_op.most_common(12)]
    return "\n".join(lines)


def _regions(planned) -> str:
    return ", ".join(c.nodes[0] + (f"..{c.nodes[-1]}" if len(c.nodes) > 1 else "") for c in planned.checkpoints)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="llama,llama-mha,gpt2")
    parser.add_argument("--compare", default="", help="compare.py's models instead (comma-separated keys)")
    parser.add_argument("--batch-scale", type=int, default=1, help="with --compare: repeat each batch this many times")
    parser.add_argument("--fraction", type=float, default=0.5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    if args.compare:
        from benchmarks.compare_models import SPECS, on_device

        names = args.compare.split(",")
        build = lambda name: on_device(*SPECS[name].build(False)[:2], args.device, args.batch_scale)  # noqa: E731
    else:
        models = _models()
        names = args.models.split(",")
        build = lambda name: to_device(*models[name](), args.device)  # noqa: E731
    for name in names:
        torch.manual_seed(0)
        model, sample = build(name)
        model.train()
        unplanned = plan(model, sample, budget_gb=80, measure="run")
        record = unplanned.verify(steps=2)
        print(f"{name} on {device}: unplanned predicted {format_bytes(unplanned.baseline_peak_bytes)}, "
              f"measured {format_bytes(record.original_peak_bytes)} ({100 * record.original_peak_error:+.1f}%)")
        timeline = simulate(unplanned.problem)
        print(f"  simulated unplanned peak at {timeline.labels[timeline.peak_step]}")
        print(_peak_report(model, sample, device))
        planned = unplanned.replan(budget_gb=args.fraction * record.original_peak_bytes / GIB)
        planned_record = planned.verify(steps=2)
        timeline = simulate(planned.problem, planned.solution.regions, planned.solution.kept)
        print(f"  plan at {args.fraction:.0%}: {_regions(planned)}; predicted "
              f"{format_bytes(planned.predicted_peak_bytes)}, measured {format_bytes(planned_record.planned_peak_bytes)} "
              f"({100 * planned_record.peak_error:+.1f}%), simulated peak at {timeline.labels[timeline.peak_step]}")
        print(_peak_report(planned.module(), sample, device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
