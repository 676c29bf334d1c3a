"""Real models through the planner: graph size, frontend, leaves, and the plan at 50% of the
unplanned peak, verified by measurement. Prints a table and appends it to RESULTS.md.

    .venv/bin/python benchmarks/real_models.py [--no-save]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# This folder holds solvers.py (the solver benchmark): put the project first so that
# `import solvers` finds the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import warnings

import torch
from torch import nn  # noqa: E402

from benchmarks.results import append_results  # noqa: E402
from planner import InfeasibleBudget, plan
from planner.api import GIB
from planner.examples import SkipTransformer
from solvers.solution import format_bytes


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
        "TransformerEncoder (4 layers)": lambda: (
            nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False), torch.randn(8, 256, 256)),
        "U-Net-shaped transformer": lambda: (SkipTransformer(vocab=1000, width=128, depth=3, context=256), _ids()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows = ["| model | graph nodes | frontend | leaves kept whole | unplanned peak | budget (50%) "
            "| solver | regions | predicted peak | measured peak | error | under budget | gradients match |",
            "|" + "---|" * 13]
    failures = []
    for name, factory in _models().items():
        torch.manual_seed(0)
        model, sample = factory()
        model.train()
        p = plan(model, sample, budget_gb=80, solver=args.solver)
        budget = 0.5 * p.baseline_peak_bytes
        head = (f"| {name} | {len(p.problem)} | {p.frontend} | {', '.join(p.leaves) or 'none'} "
                f"| {format_bytes(p.baseline_peak_bytes)} | {format_bytes(budget)} ")
        try:
            q = p.replan(budget_gb=budget / GIB)
        except InfeasibleBudget as error:
            rows.append(head + f"| {args.solver} | infeasible: minimum {format_bytes(error.minimum_bytes)} | | | | | |")
        else:
            record = q.verify(steps=2)
            rows.append(head + f"| {q.solver} | {len(q.checkpoints)} | {format_bytes(q.predicted_peak_bytes)} "
                        f"| {format_bytes(record.planned_peak_bytes)} | {100 * record.peak_error:+.1f}% "
                        f"| {'yes' if record.within_budget else 'NO'} | {'yes' if record.gradients_match else 'NO'} |")
            if not record.within_budget or abs(record.peak_error) > 0.03 or not record.gradients_match:
                failures.append(name)
                print(f"{name}: regions {[c.wrapped.module for c in q.checkpoints]}", file=sys.stderr, flush=True)
        print(rows[-1], flush=True)
    rows.append("")
    rows.append("Every planned model measured under its budget, within 3% of its prediction, with the original's "
                "gradients." if not failures else f"FAILED (over budget, off by > 3% or other gradients): {failures}")
    table = "\n".join(rows)
    print(table)
    if not args.no_save:
        append_results("Real models at 50% of the unplanned peak",
                       f"python benchmarks/real_models.py --solver {args.solver}", table)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
