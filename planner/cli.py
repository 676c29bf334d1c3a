"""Command line: `ckpt-plan demo` (also `python -m planner demo`)."""
from __future__ import annotations

import argparse
import logging
import sys

import torch

from planner.api import GIB, plan
from planner.examples import EXAMPLES
from solvers import SOLVERS, InfeasibleBudget, format_bytes


def _demo(args: argparse.Namespace) -> int:
    say = (lambda message: None) if args.quiet else (lambda message: print(f"... {message}", file=sys.stderr))
    torch.manual_seed(0)
    model, sample = EXAMPLES[args.model]()
    say(f"built example model {args.model!r} ({sum(p.numel() for p in model.parameters()):,} parameters)")
    unplanned = plan(model, sample, budget_gb=80.0, solver=args.solver, progress=say)
    budget_gb = args.budget_gb or 0.5 * unplanned.baseline_peak_bytes / GIB
    say(f"budget: {format_bytes(budget_gb * GIB)} "
        f"({'given' if args.budget_gb else 'half of the unplanned peak'})")
    try:
        planned = unplanned.replan(budget_gb=budget_gb)
    except InfeasibleBudget as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(planned)
    module = planned.module()
    loss = module(sample).float().pow(2).mean()
    loss.backward()
    print(f"\nOne training step of the planned module ran: loss {loss.item():.4f}.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckpt-plan", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="plan a built-in example model under a tight budget")
    demo.add_argument("--model", choices=sorted(EXAMPLES), default="gpt")
    demo.add_argument("--budget-gb", type=float, default=None,
                      help="budget in GiB (default: half of the model's unplanned peak)")
    demo.add_argument("--solver", choices=[*sorted(SOLVERS), "auto"], default="auto")
    demo.add_argument("--quiet", action="store_true", help="no progress messages")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = build_parser().parse_args(argv)
    return args.run(args)
