"""Real models through the planner, with the call users make: graph size, frontend, leaves, and
`plan(model, sample, budget_gb=X)` at 50% of the measured unplanned peak and at the peak that
checkpointing every block measures (each layer under `torch.utils.checkpoint`), each verified
by measurement: under budget, within 1% of its prediction, the original's gradients. The
planner reaches every block's peak where a plan at it is not refused as infeasible.

    .venv/bin/python -m benchmarks.real_models [--replan] [--results]

`--replan` takes the faster route: `plan(..., budget_gb=80)` once, then `replan(budget_gb=X)`.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks.results import set_section, write_run
from planner import InfeasibleBudget, plan
from planner.api import GIB
from planner.examples import SkipTransformer
from planner.measure.steps import steady_peak
from solvers.solution import format_bytes

TOLERANCE = 0.01


def _ids(batch: int = 8, length: int = 256) -> torch.Tensor:
    return torch.randint(0, 1000, (batch, length))


def _models() -> dict:
    """Small configs whose activations, not parameters, dominate a training step."""
    import transformers

    transformers.logging.set_verbosity_error()
    t = transformers
    ids = _ids()
    images = torch.randn(16, 3, 64, 64)
    labels = torch.arange(16) % 10
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=512, batch_first=True)
    return {
        "GPT2LMHeadModel": lambda: (t.GPT2LMHeadModel(t.GPT2Config(
            n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=256, bos_token_id=0, eos_token_id=0)),
            {"input_ids": ids, "labels": ids, "use_cache": False}),
        "LlamaForCausalLM": lambda: (t.LlamaForCausalLM(t.LlamaConfig(
            num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, bos_token_id=0, eos_token_id=0)),
            {"input_ids": ids, "labels": ids, "use_cache": False}),
        "BertForMaskedLM": lambda: (t.BertForMaskedLM(t.BertConfig(
            num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4, vocab_size=1000)),
            {"input_ids": ids, "labels": ids}),
        "ViTForImageClassification": lambda: (t.ViTForImageClassification(t.ViTConfig(
            num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
            image_size=64, patch_size=8, num_labels=10)), {"pixel_values": images, "labels": labels}),
        "ResNetForImageClassification": lambda: (t.ResNetForImageClassification(t.ResNetConfig(
            embedding_size=32, hidden_sizes=[32, 64, 128], depths=[1, 1, 1], num_labels=10)),
            {"pixel_values": images, "labels": labels}),
        "TransformerEncoder (4 layers) in an nn.Sequential": lambda: (
            nn.Sequential(nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)),
            torch.randn(8, 256, 256)),
        "U-Net-shaped transformer": lambda: (SkipTransformer(vocab=1000, width=128, depth=3, context=256), _ids()),
    }


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the layers of its largest ModuleList."""
    lists = [module for module in model.modules() if isinstance(module, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def every_block_peak(model: nn.Module, sample: Any) -> int | None:
    """The measured peak with every block's forward under `checkpoint(use_reentrant=False)`
    (None where the model has no blocks); the model is left as it was."""
    blocks = _blocks(model)
    if not blocks:
        return None
    for block in blocks:
        block.forward = (lambda forward: lambda *a, **k: checkpoint(forward, *a, use_reentrant=False, **k))(block.forward)
    try:
        return steady_peak(model, sample, torch.device("cpu"))
    finally:
        for block in blocks:
            del block.forward


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replan", action="store_true", help="plan at 80 GB once, then replan (the faster route)")
    parser.add_argument("--results", action="store_true", help="write the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows = ["| model | graph nodes | frontend | leaves kept whole | unplanned peak | budget | planning | regions "
            "| predicted peak | measured peak | error | under budget | gradients match |", "|" + "---|" * 13]
    records, failures = [], []
    for name, factory in _models().items():
        torch.manual_seed(0)
        model, sample = factory()
        model.train()
        unplanned = steady_peak(model, sample, torch.device("cpu"))
        every = every_block_peak(model, sample)
        base = plan(model, sample, budget_gb=80) if args.replan else None
        make: Callable[[int], Any] = ((lambda size: base.replan(budget_gb=size / GIB)) if base is not None
                                      else (lambda size: plan(model, sample, budget_gb=size / GIB)))
        budgets = [("50%", int(0.5 * unplanned))] + ([("every block's peak", every)] if every else [])
        for label, budget in budgets:
            started = time.perf_counter()
            try:
                q = make(budget)
            except InfeasibleBudget as error:
                rows.append(f"| {name} | | | | {format_bytes(unplanned)} | {label} {format_bytes(budget)} | | "
                            f"infeasible: minimum {format_bytes(error.minimum_bytes)} | | | | | |")
                failures.append(f"{name} at {label}: infeasible")
                records.append({"model": name, "label": label, "budget": budget, "minimum": error.minimum_bytes})
                print(rows[-1], flush=True)
                continue
            seconds = time.perf_counter() - started
            record = q.verify(steps=2)
            rows.append(f"| {name} | {len(q.problem)} | {q.frontend} | {', '.join(q.leaves) or 'none'} "
                        f"| {format_bytes(unplanned)} | {label} {format_bytes(budget)} | {seconds:.1f} s "
                        f"| {len(q.checkpoints)} | {format_bytes(q.predicted_peak_bytes)} "
                        f"| {format_bytes(record.planned_peak_bytes)} | {100 * record.peak_error:+.2f}% "
                        f"| {'yes' if record.within_budget else 'NO'} | {'yes' if record.gradients_match else 'NO'} |")
            records.append({"model": name, "label": label, "budget": budget, "unplanned": unplanned,
                            "nodes": len(q.problem), "frontend": q.frontend, "seconds": seconds,
                            "predicted": q.predicted_peak_bytes, "measured": record.planned_peak_bytes,
                            "within_budget": record.within_budget, "gradients_match": record.gradients_match})
            if not record.within_budget or abs(record.peak_error) > TOLERANCE or not record.gradients_match:
                failures.append(f"{name} at {label}")
            print(rows[-1], flush=True)
    rows.append("")
    rows.append("Every plan measured under its budget, within 1% of its prediction, with the original's gradients; "
                "every model with blocks reaches every block's peak." if not failures
                else f"Misses: {'; '.join(failures)}")
    table = "\n".join(rows)
    print(table)
    command = "python -m benchmarks.real_models" + (" --replan" if args.replan else "")
    print(f"records: {write_run('real_models', {'command': command, 'records': records})}")
    if args.results:
        set_section("real_models", "Real models at 50% of the unplanned peak and at every block's peak", command,
                    table)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
