"""Command line: plan a model under a memory budget, show a saved plan, or run the demo.

    ckpt-plan plan MODEL --budget-gb 4 [--sample 8x128] [--json plan.json] [--plot memory.png]
    ckpt-plan show plan.json [--plot memory.png]
    ckpt-plan demo

(`python -m planner ...` is the same.) Exit status: 0 done; 1 planning failed (the model could
not be traced or measured, or an output could not be written); 2 usage error (bad arguments,
a MODEL that cannot be loaded); 3 the budget cannot be met.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Any, Callable

import torch

from planner.api import GIB, load_plan, plan
from planner.throughput.search import plan_throughput
from planner.cli.models import (
    FactoryError,
    UsageError,
    first_line,
    load_hf_model,
    load_model,
    parse_shapes,
    resize_sample,
    to_device,
)
from planner.core import split_sample
from planner.examples import EXAMPLES
from planner.measure.device import MEASURE_MODES
from planner.measure.targets import targets
from planner.trace.tracing import FRONTENDS, TraceError
from solvers import SOLVERS, InfeasibleBudget
from solvers.solution import format_bytes

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INFEASIBLE = 3

MODEL_HELP = (
    "a built-in example ({examples}); package.module:factory, a callable that takes no "
    "arguments and returns (model, sample) (path/to/file.py:factory works too, and the current "
    "directory is importable); or hf:TYPE, a Hugging Face architecture (hf:llama, hf:gpt2, "
    "hf:bert, ...) built from its config on the meta device, nothing downloaded or allocated"
)
SAMPLE_HELP = (
    "resize the model's sample: one shape per tensor of the factory's sample, in order, dims "
    "joined by x, shapes by commas (e.g. 8x128: 8 sequences of 128 tokens for gpt). The new "
    "tensors keep each tensor's dtype and device; floating-point ones are drawn from a normal "
    "distribution, integer ones from the range of the factory's values (token ids stay valid). "
    "Default: the factory's own sample"
)


Say = Callable[[str], None]


def _describe_sample(sample: Any) -> str:
    args, kwargs = split_sample(sample)
    parts = [
        f"{'x'.join(map(str, value.shape))} {str(value.dtype).removeprefix('torch.')}"
        for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)
    ]
    return ", ".join(parts)


def _round_up_gb(size_bytes: int) -> str:
    """A budget in GiB, rounded up to 3 significant digits (so it still fits)."""
    gb = size_bytes / GIB
    digits = max(3, 3 - math.floor(math.log10(gb))) if gb > 0 else 3
    return f"{math.ceil(gb * 10**digits) / 10**digits:.{digits}f}".rstrip("0").rstrip(".")


def _error(message: str) -> None:
    print(f"ckpt-plan: error: {message}", file=sys.stderr)


def _infeasible(error: InfeasibleBudget) -> int:
    _error(str(error))
    smallest = "the smallest budget that fits" if error.proven else f"the smallest budget {error.solver} fits"
    print(f"hint: {smallest} is about --budget-gb {_round_up_gb(error.minimum_bytes)}", file=sys.stderr)
    return EXIT_INFEASIBLE


def _progress(quiet: bool) -> Say:
    return (lambda message: None) if quiet else (lambda message: print(f"... {message}", file=sys.stderr))


def _plan(args: argparse.Namespace) -> int:
    say = _progress(args.quiet)
    torch.manual_seed(0)
    if args.budget_gb is None and args.target is None:
        raise UsageError("give --budget-gb, or --target (its memory is then the budget)")
    model, sample = _load(args)
    say(f"model {args.model}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} "
        f"parameters; sample {_describe_sample(sample)}")
    try:
        p = plan(model, sample, budget_gb=args.budget_gb, solver=args.solver, reserved_gb=args.reserved_gb,
                 frontend=args.frontend, repeats=args.repeats, progress=say, target=args.target,
                 world_size=args.world_size, optimizer=_optimizer(args.optimizer), measure=args.measure,
                 effort=args.effort, selective=args.selective, autocast=args.autocast,
                 param_dtype=args.param_dtype)
    except InfeasibleBudget as error:
        return _infeasible(error)
    except (TraceError, RuntimeError, TypeError, ValueError) as error:
        resized = " (its sample was resized by --sample: does the model take that shape?)" if args.sample else ""
        _error(f"planning {args.model} failed{resized}: {first_line(error)}")
        return EXIT_FAILED
    if p.profile.times_estimated:
        say(f"times are estimates (roofline on {p.setup.where.name}), not measurements")
    if args.verify:
        say(f"verifying: {args.verify_steps} training steps of the original and the planned module")
        try:
            p.verify(steps=args.verify_steps)
        except ValueError as error:  # (a model on meta, a plan for another device)
            _error(f"--verify: {first_line(error)}")
            return EXIT_FAILED
    print(p.report(verbose=args.verbose))
    return _write_outputs(p, args.json, args.plot, say)


def _write_outputs(p: Any, json_path: str | None, plot_path: str | None, say: Say) -> int:
    status = EXIT_OK
    if json_path:
        try:
            say(f"saved the plan to {p.save(json_path)}")
        except OSError as error:
            _error(f"cannot write {json_path}: {error}")
            status = EXIT_FAILED
    if plot_path:
        try:
            say(f"wrote the memory plot to {p.plot(plot_path)}")
        except (ImportError, OSError) as error:
            _error(f"cannot write {plot_path}: {error}")
            status = EXIT_FAILED
    return status


def _show(args: argparse.Namespace) -> int:
    try:
        saved = load_plan(args.plan)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read plan {args.plan!r}: {error}") from None
    print(saved.report(verbose=args.verbose))
    return _write_outputs(saved, None, args.plot, _progress(args.quiet))


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model and sample MODEL names, moved and resized as the options say. An `hf:` model is
    built on `meta`, or where the command runs steps (`--verify`, `throughput`; `--device`, else
    the CPU), with random weights."""
    if args.model.startswith("hf:"):
        runs = args.run is _throughput or args.verify
        model, sample = load_hf_model(args.model, args, args.device or ("cpu" if runs else "meta"))
    else:
        if args.config or args.seq or args.batch != 1 or args.dtype:
            raise UsageError("--config, --seq, --batch and --dtype are for hf: models; use --sample to resize")
        model, sample = load_model(args.model)
        if args.device:
            model, sample = to_device(model, sample, args.device)
    if args.sample:
        sample = resize_sample(sample, parse_shapes(args.sample))
    return model, sample


def _throughput(args: argparse.Namespace) -> int:
    say = _progress(args.quiet)
    torch.manual_seed(0)
    model, sample = _load(args)
    tensors = [v for v in (*split_sample(sample)[0], *split_sample(sample)[1].values()) if isinstance(v, torch.Tensor)]
    batches = parse_batches(args.batches)

    def sample_for(batch: int) -> Any:  # the sample with every tensor's first dimension set to the batch
        return resize_sample(sample, [(batch, *t.shape[1:]) for t in tensors])

    say(f"model {args.model}: {type(model).__name__}; batches {', '.join(map(str, batches))}")
    try:
        tp = plan_throughput(model, sample_for, args.budget_gb, batches, global_batch=args.global_batch, progress=say,
                             optimizer=_optimizer(args.optimizer), solver=args.solver)
    except InfeasibleBudget as error:
        return _infeasible(error)
    except (TraceError, RuntimeError, TypeError, ValueError) as error:
        _error(f"planning {args.model} for throughput failed: {first_line(error)}")
        return EXIT_FAILED
    print(tp)
    status = _write_outputs(tp.plan, args.json, None, say)
    return (_write_plot(tp, args.plot, say) or status) if args.plot else status


def _write_plot(tp: Any, path: str, say: Say) -> int:
    try:
        say(f"wrote the throughput plot to {tp.plot(path)}")
    except (ImportError, OSError) as error:
        _error(f"cannot write {path}: {error}")
        return EXIT_FAILED
    return EXIT_OK


def parse_batches(text: str) -> list[int]:
    """--batches 2,4,8: whole numbers of samples, at least 1."""
    try:
        batches = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--batches {text!r}: give whole numbers joined by commas, e.g. 2,4,8,16") from None
    if not batches or min(batches) < 1:
        raise UsageError(f"--batches {text!r}: give whole numbers of samples, at least 1")
    return batches


def _demo(args: argparse.Namespace) -> int:
    say = _progress(args.quiet)
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
        return _infeasible(error)
    print(planned.report(verbose=args.verbose))
    module = planned.module()
    loss = module(sample).float().pow(2).mean()
    loss.backward()
    print(f"\nOne training step of the planned module ran: loss {loss.item():.4f}.")
    return EXIT_OK


def _gib(allow_zero: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'zero or more' if allow_zero else 'more than zero'}")
        return value
    return parse


def _optimizer(text: str | None) -> str | float | None:
    """--optimizer: a name, or bytes of state per parameter."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `ckpt-plan` (subcommands plan, show, demo).

    Example:
        >>> build_parser().parse_args(["plan", "gpt", "--budget-gb", "4"]).budget_gb
        4.0
    """
    parser = argparse.ArgumentParser(
        prog="ckpt-plan", description="Choose which parts of a PyTorch model to recompute so that one "
        "training step fits a memory budget.", epilog="Exit status: 0 done, 1 planning failed, "
        "2 usage error, 3 the budget cannot be met.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{plan,throughput,show,demo}")
    solvers = [*sorted(SOLVERS), "auto"]

    planning = commands.add_parser(
        "plan", help="plan a model under a budget and print the report",
        description="Trace and measure MODEL on its sample, choose the regions to recompute so one "
        "training step fits the budget, and print the report.",
        epilog="Examples: ckpt-plan plan gpt --budget-gb 0.05 --sample 4x128 --plot memory.png; "
        "ckpt-plan plan mypackage.models:build --budget-gb 40 --device cuda --json plan.json; "
        "ckpt-plan plan hf:llama --config hidden_size=4096,num_hidden_layers=32 --seq 4096 --target h100 "
        "--world-size 8 --optimizer adamw --json plan.json. "
        "Exit status: 0 done, 1 planning failed, 2 usage error, 3 the budget cannot be met.",
    )
    planning.add_argument("model", metavar="MODEL", help=MODEL_HELP.format(examples=", ".join(sorted(EXAMPLES))))
    planning.add_argument("--budget-gb", type=_gib(False), default=None, metavar="GIB",
                          help="memory budget of one training step per rank in GiB (2**30 bytes); "
                          "default: the --target's memory")
    planning.add_argument("--target", metavar="GPU", help="the GPU the plan is for: "
                          f"{', '.join(t.name for t in targets())}; times there are roofline estimates "
                          "unless it is this machine's GPU (default: the model's own device)")
    planning.add_argument("--world-size", type=_positive_int, default=1, metavar="N",
                          help="plan for FSDP2 over N ranks: parameters, gradients and optimizer state "
                          "sharded, blocks all-gathered in flight (default 1)")
    planning.add_argument("--optimizer", metavar="NAME|BYTES",
                          help="count optimizer state: sgd, sgd-momentum, adam, adamw, or bytes per parameter")
    planning.add_argument("--measure", choices=MEASURE_MODES, default="auto",
                          help="run: measure the whole step at once; no-run: sizes on fake tensors, then one "
                          "node at a time; auto (default): the whole step wherever this device has the memory for it")
    planning.add_argument("--effort", choices=("normal", "thorough"), default="normal",
                          help="thorough: also read what regions cost off the model's own training steps (slower)")
    planning.add_argument("--selective", action="store_true",
                          help="let regions keep some nodes' outputs under a selective-checkpoint policy")
    planning.add_argument("--autocast", choices=("bfloat16", "float16"),
                          help="plan the step trained under torch.autocast to this dtype (the Trainer's --bf16)")
    planning.add_argument("--param-dtype", choices=("bfloat16", "float16"),
                          help="plan the step FSDP2 runs under MixedPrecisionPolicy(param_dtype=this dtype)")
    planning.add_argument("--config", metavar="K=V,...", help="hf: models: config overrides, e.g. "
                          "hidden_size=4096,num_hidden_layers=32")
    planning.add_argument("--seq", type=_positive_int, default=None, metavar="N",
                          help="hf: models: sequence length of the sample (default 512)")
    planning.add_argument("--batch", type=_positive_int, default=1, metavar="N",
                          help="hf: models: batch size of the sample per rank (default 1)")
    planning.add_argument("--dtype", help="hf: models: parameter dtype, e.g. bfloat16 (default: the config's, "
                          "else float32)")
    planning.add_argument("--sample", metavar="SHAPE[,SHAPE...]", help=SAMPLE_HELP)
    planning.add_argument("--solver", choices=solvers, default="auto", help="default: auto")
    planning.add_argument("--reserved-gb", type=_gib(True), default=0.0, metavar="GIB",
                          help="GiB of the budget set aside for other things, e.g. optimizer state (default 0)")
    planning.add_argument("--frontend", choices=FRONTENDS, default="auto",
                          help="tracer: fx, export, or auto (fx, then export where fx fails; default)")
    planning.add_argument("--device", help="move the model and sample there first (e.g. cuda); "
                          "default: where the factory put them")
    planning.add_argument("--repeats", type=_positive_int, default=5,
                          help="timed forward passes per node, median taken (default 5)")
    planning.add_argument("--json", metavar="PLAN.json", help="save the plan (load it with planner.load_plan)")
    planning.add_argument("--plot", metavar="MEMORY.png", help="write the predicted memory plot (needs matplotlib)")
    planning.add_argument("--verify", action="store_true",
                          help="run real training steps of the original and the planned module and "
                          "report measured peaks, step times, the step overhead beside the predicted one and whether "
                          "gradients match")
    planning.add_argument("--verify-steps", type=_positive_int, default=3, help="steps for --verify (default 3)")
    planning.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    planning.add_argument("--verbose", action="store_true", help="also the solver, the graph and the cost model's figures in the report")
    planning.set_defaults(run=_plan)

    through = commands.add_parser(
        "throughput", help="choose the batch size and the plan together, by samples per second",
        description="Plan MODEL at each candidate batch (its sample's first dimension resized) under the budget, "
        "predict samples per second, time the best two, and print the table beside no checkpointing and every block.",
        epilog="Example: ckpt-plan throughput gpt --budget-gb 0.2 --batches 2,4,8,16 --optimizer adamw --plot tp.png")
    through.add_argument("model", metavar="MODEL", help=MODEL_HELP.format(examples=", ".join(sorted(EXAMPLES))))
    through.add_argument("--budget-gb", type=_gib(False), required=True, metavar="GIB", help="memory budget in GiB")
    through.add_argument("--batches", required=True, metavar="B,B,...", help="candidate batch sizes, e.g. 2,4,8,16")
    through.add_argument("--global-batch", type=_positive_int, default=None, metavar="N",
                         help="samples per optimizer step, through gradient accumulation (candidates must divide it)")
    through.add_argument("--optimizer", default="adamw", metavar="NAME|BYTES",
                         help="optimizer whose state and step count: adamw (default), adam, sgd, sgd-momentum")
    through.add_argument("--solver", choices=solvers, default="auto")
    through.add_argument("--sample", metavar="SHAPE[,SHAPE...]", help=SAMPLE_HELP)
    through.add_argument("--device", default=None, help="move the model and sample there first (e.g. cuda)")
    through.add_argument("--config", metavar="K=V,...", help="hf: models: config overrides")
    through.add_argument("--seq", type=_positive_int, default=None, help="hf: models: sequence length")
    through.add_argument("--batch", type=_positive_int, default=1, help="hf: models: batch of the base sample")
    through.add_argument("--dtype", default=None, help="hf: models: dtype")
    through.add_argument("--json", metavar="PLAN.json", help="save the chosen batch's plan")
    through.add_argument("--plot", metavar="THROUGHPUT.png", help="write samples/s against batch size (matplotlib)")
    through.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    through.set_defaults(run=_throughput)

    show = commands.add_parser("show", help="print the report of a saved plan",
                               description="Print the report of a plan saved with --json or Plan.save.")
    show.add_argument("plan", metavar="PLAN.json")
    show.add_argument("--plot", metavar="MEMORY.png", help="write the predicted memory plot (needs matplotlib)")
    show.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    show.add_argument("--verbose", action="store_true", help="also the solver, the graph and the cost model's figures in the report")
    show.set_defaults(run=_show)

    demo = commands.add_parser("demo", help="plan a built-in example model under a tight budget")
    demo.add_argument("--model", choices=sorted(EXAMPLES), default="gpt")
    demo.add_argument("--budget-gb", type=_gib(False), default=None, metavar="GIB",
                      help="budget in GiB (default: half of the model's unplanned peak)")
    demo.add_argument("--solver", choices=solvers, default="auto")
    demo.add_argument("--quiet", action="store_true", help="no progress messages")
    demo.add_argument("--verbose", action="store_true", help="also the solver, the graph and the cost model's figures in the report")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `ckpt-plan` with `argv` (default: the process's arguments); returns the exit status.

    Example:
        >>> main(["plan", "mlp", "--budget-gb", "1", "--quiet"])
        0
    """
    logging.basicConfig(level=logging.WARNING)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # argparse has printed usage and its error (or the help)
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    try:
        return args.run(args)
    except UsageError as error:
        _error(str(error))
        return EXIT_USAGE
    except FactoryError as error:
        _error(str(error))
        return EXIT_FAILED


__all__ = ["EXIT_FAILED", "EXIT_INFEASIBLE", "EXIT_OK", "EXIT_USAGE", "MODEL_HELP", "SAMPLE_HELP", "Say",
           "build_parser", "main"]
