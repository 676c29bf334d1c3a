"""Random models for fuzzing the planner, and the check each one must pass.

`random_model(seed)` builds a small model that `torch.fx` can trace: a stem, 2-6 blocks in an
`nn.ModuleList` and a head. Each block runs a short random program over a list of tensors (its
"registers"): submodule calls (Linear/Conv, BatchNorm in training mode, Dropout with p > 0,
GELU/ReLU modules, ReLU(inplace=True), a nested Sequential, a nested block of its own), residual
adds, `h += old`, `torch.relu_` / `.relu_()` on an earlier tensor that other ops already consumed,
products and `torch.cat` of earlier tensors. Blocks take and return several tensors, and glue
code between blocks mutates, multiplies and concatenates tensors of earlier blocks (their
inputs included). The builder follows which tensors autograd saves, so in-place writes go
(mostly) to tensors only non-saving ops consumed (adds, cat, dropout), which is legal for the
unplanned model and exactly what a recomputed region must not read; every tensor, mutated ones
included, is read again later (no dead code). Everything is chosen by the seed; a draw whose unplanned training step
raises an autograd error, or leaves a parameter without gradient (a dead branch), is drawn
again (deterministically, from `10**6 + seed * 1000 + k`). `random_model(seed, "flat")` puts one
such program in the model's own forward; `random_model(seed, "sequential")` makes the model an
`nn.Sequential` of single layers.

`check_seed(seed)` plans the model at a random budget between the smallest feasible one and
the unplanned peak (on odd seeds with the selective policy's costs set to 0, so that plans keep
nodes inside regions: on models this small the measured costs outweigh what keeping saves, and
no plan would), applies the plan in place and compares one training step with an
unplanned deep copy (gradients, BatchNorm statistics), then one on half the batch, and
verifies the predicted peak against the measured one (`Plan.verify`). It returns a plain record.

    >>> model, sample = random_model(3)
    >>> record = check_seed(3)
    >>> record["ok"], record["failure"]
    (True, None)
"""
from __future__ import annotations

import copy
import json
import random
import traceback
from dataclasses import replace
from typing import Any

import torch
import torch.fx
from torch import nn

from benchmarks.fuzz_programs import (
    Block,
    FlatModel,
    FuzzModel,
    ProgramBuilder,
    TensorState,
    describe,
)

GIB = 2**30
PEAK_TOLERANCE = 0.03
OVER_TOLERANCE = 0.01  # a plan that has not run its own step may exceed its budget by this share at most
MAX_REDRAWS = 200


def _mlp_sizes(rng: random.Random) -> tuple[int, int, int]:
    """An MLP's width, batch and input features, drawn in that order."""
    return rng.choice([32, 48, 64, 96, 128]), rng.choice([32, 64, 128, 256]), rng.choice([16, 32, 64])


def _draw(seed: int) -> tuple[nn.Module, torch.Tensor]:
    rng = random.Random(seed)
    kind = rng.choices(["mlp", "conv"], weights=[2, 1])[0]
    if kind == "mlp":
        width, batch, features = _mlp_sizes(rng)
        sample_shape: tuple[int, ...] = (batch, features)
    else:
        width = rng.choice([8, 12, 16, 24])
        batch = rng.choice([8, 16, 32])
        size = rng.choice([8, 12, 16])
        features = 3
        sample_shape = (batch, 3, size, size)
    torch.manual_seed(seed)
    builder = ProgramBuilder(rng, kind, width)
    if kind == "mlp":
        stem_parts: list[nn.Module] = [nn.Linear(features, width)]
    else:
        stem_parts = [nn.Conv2d(features, width, 3, padding=1)]
    if rng.random() < 0.5:
        stem_parts.append(builder.norm())
    if rng.random() < 0.5:
        stem_parts.append(nn.GELU())
    stem = nn.Sequential(*stem_parts)
    history = [TensorState()]  # the stem's output
    state = [history[0]]
    blocks, glue = [], []
    n_blocks = rng.randint(2, 6)
    for _ in range(n_blocks):
        block, outputs = builder.block(state, 0)
        blocks.append(block)
        history.extend(outputs)
        program, indices = builder.glue(history, len(outputs))
        glue.append((program, indices))
        state = [history[i] for i in indices]
    finals = {id(t) for t in state}
    tail, seen = [], set()
    for index, t in enumerate(history):
        if not t.used and id(t) not in finals and id(t) not in seen:
            tail.append(index)
            seen.add(id(t))
    if kind == "mlp":
        head: nn.Module = nn.Sequential(nn.Linear(width, 10))
    else:
        head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))
    lines = [f"seed={seed}, {kind}, width={width}, sample={sample_shape}, blocks={n_blocks}"]
    for k, (block, (program, indices)) in enumerate(zip(blocks, glue)):
        lines.append(f"blocks.{k}: {describe(block.program, block.outputs)}")
        for name, module in block.named_modules():
            if isinstance(module, Block) and name:
                lines.append(f"blocks.{k}.{name}: {describe(module.program, module.outputs)}")
        if program:
            lines.append(f"glue after blocks.{k}: {describe(program)} -> next takes {list(indices)}")
    if tail:
        lines.append(f"head input: sum of the last state and {tail}")
    model = FuzzModel(stem, blocks, glue, builder.glue_modules, tuple(tail), head, "\n".join(lines))
    model.train()
    sample = torch.randn(*sample_shape, generator=torch.Generator().manual_seed(seed))
    return model, sample


def _draw_flat(seed: int) -> tuple[nn.Module, torch.Tensor]:
    """A flat model (`FlatModel`): one program of 6-16 ops in the model's own forward."""
    rng = random.Random(seed)
    width, batch, features = _mlp_sizes(rng)
    torch.manual_seed(seed)
    builder = ProgramBuilder(rng, "mlp", width, flat=True)
    stem = nn.Linear(features, width)
    block, _ = builder.block([TensorState()], 0, 1)
    modules = dict(block.named_children())
    description = (f"seed={seed}, flat, width={width}, sample={(batch, features)}: "
                   f"{describe(block.program, block.outputs)}")
    model = FlatModel(stem, block.program, block.outputs, modules, nn.Linear(width, 10), description).train()
    return model, torch.randn(batch, features, generator=torch.Generator().manual_seed(seed))


def _draw_sequential(seed: int) -> tuple[nn.Module, torch.Tensor]:
    """A model that is itself an `nn.Sequential` of 7-25 layers, each one graph node (linears,
    LayerNorm, BatchNorm1d, GELU, ReLU, in place too, Tanh, dropout): the planner's regions are
    slices of its children, in its own loop."""
    rng = random.Random(seed)
    width, batch, features = _mlp_sizes(rng)
    torch.manual_seed(seed)
    makers = {"linear": lambda: nn.Linear(width, width), "layernorm": lambda: nn.LayerNorm(width),
              "batchnorm": lambda: nn.BatchNorm1d(width), "gelu": nn.GELU, "relu": nn.ReLU,
              "relu_inplace": lambda: nn.ReLU(inplace=True), "tanh": nn.Tanh, "dropout": lambda: nn.Dropout(0.1)}
    names = [rng.choice([*makers, "linear", "linear"]) for _ in range(rng.randint(5, 23))]
    model = nn.Sequential(nn.Linear(features, width), *(makers[name]() for name in names), nn.Linear(width, 10)).train()
    model.description = f"seed={seed}, sequential, width={width}, sample={(batch, features)}: {', '.join(names)}"
    return model, torch.randn(batch, features, generator=torch.Generator().manual_seed(seed))


def training_step(model: nn.Module, sample: torch.Tensor,
                  seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward+backward with a fixed RNG seed: the output and each parameter's gradient."""
    for parameter in model.parameters():
        parameter.grad = None
    torch.manual_seed(seed)
    output = model(sample)
    output.float().pow(2).mean().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    for parameter in model.parameters():
        parameter.grad = None
    return output.detach(), grads


def _trains(model: nn.Module, sample: torch.Tensor) -> bool:
    """fx traces it, its unplanned step raises no autograd error, the output and every
    gradient are finite (products of products can overflow in backward: seed 236 drew one),
    and every parameter gets a gradient (no dead branches)."""
    try:
        torch.fx.symbolic_trace(copy.deepcopy(model))
        output, grads = training_step(copy.deepcopy(model), sample)
    except RuntimeError:
        return False
    finite = bool(torch.isfinite(output).all()) and all(bool(torch.isfinite(g).all()) for g in grads.values())
    return finite and len(grads) == len(list(model.parameters()))


KINDS = ("blocked", "flat", "sequential")


def model_kind(seed: int) -> str:
    """Which kind of model the fuzz run draws for `seed`: every third seed flat, one in twelve
    a Sequential, the others blocked."""
    return "flat" if seed % 3 == 2 else "sequential" if seed % 12 == 1 else "blocked"


def random_model(seed: int, kind: str = "blocked") -> tuple[nn.Module, torch.Tensor]:
    """A random traceable model and its sample, the same for the same seed and kind (`KINDS`):
    "blocked", blocks in an `nn.ModuleList`; "flat", one program in the model's own forward
    (`FlatModel`); "sequential", the model an `nn.Sequential` of single layers.

    Draws again from `10**6 + seed * 1000 + k` (k = 1, 2, ...) until the unplanned model trains and
    every parameter gets a gradient.
    """
    draw = {"blocked": _draw, "flat": _draw_flat, "sequential": _draw_sequential}[kind]
    for k in range(MAX_REDRAWS):
        model, sample = draw(seed if k == 0 else 10**6 + seed * 1000 + k)
        if _trains(model, sample):
            return model, sample
    raise RuntimeError(f"no trainable model in {MAX_REDRAWS} draws for seed {seed}")


def features(model: nn.Module) -> dict[str, int]:
    """How many of each hazard a model holds: in-place writes, random and BatchNorm modules,
    products, concatenations, nested blocks, blocks returning several tensors."""
    ops = [op for module in model.modules() if isinstance(module, (Block, FuzzModel, FlatModel))
           for op in (module.program if isinstance(module, (Block, FlatModel)) else
                      [op for program, _ in module.glue for op in program])]
    count = lambda kind: sum(op[0] == kind for op in ops)  # noqa: E731
    return {
        "relu_": count("relu_"), "iadd": count("iadd") + count("scaled_iadd"), "mul": count("mul"),
        "cat": count("cat"), "gate": count("gate"),
        "relu_inplace": sum(isinstance(m, nn.ReLU) and m.inplace for m in model.modules()),
        "dropout": sum(isinstance(m, nn.Dropout) for m in model.modules()),
        "batchnorm": sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()),
        "nested_blocks": sum(isinstance(m, Block) for m in model.modules()) - len(getattr(model, "blocks", ())),
        "multi_output_blocks": sum(len(b.outputs) > 1 for b in model.modules() if isinstance(b, Block)),
    }


# -- the check -----------------------------------------------------------------------------------

def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _mismatch(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> str | None:
    if expected.keys() != got.keys():
        return f"keys differ: {sorted(expected.keys() ^ got.keys())}"
    for key in expected:
        try:
            torch.testing.assert_close(got[key], expected[key])
        except AssertionError as error:
            return f"{key}: {str(error).splitlines()[0]} ({str(error).splitlines()[-1].strip()})"
    return None


def _step_mismatches(reference: nn.Module, model: nn.Module,
                      sample: torch.Tensor) -> tuple[str | None, str | None, str | None]:
    """One training step of each: where outputs, gradients and buffers differ (None: equal)."""
    expected_output, expected_grads = training_step(reference, sample)
    output, grads = training_step(model, sample)
    return (_mismatch({"output": expected_output}, {"output": output}), _mismatch(expected_grads, grads),
            _mismatch(_buffers(reference), _buffers(model)))


def _plan_checked(make_plan: Any, reference: nn.Module, model: nn.Module, sample: torch.Tensor,
                  record: dict[str, Any]) -> Any:
    """Plan with `make_plan(budget_bytes)` at `record["budget"]`, or, where that budget is refused
    as infeasible, at the smallest budget the refusal names (which must then be met: a plan at
    the minimum fits). Verify the plan (`Plan.verify`, one step), apply it in place to `model`
    and train it against `reference` on the sample and on half of it. Fills `record`."""
    from solvers import InfeasibleBudget

    try:
        p = make_plan(record["budget"])
    except InfeasibleBudget as error:
        record.update(infeasible=True, minimum=error.minimum_bytes, asked=record["budget"], budget=error.minimum_bytes)
        p = make_plan(error.minimum_bytes)
    record.update(nodes=len(p.problem), regions=len(p.checkpoints), kept=len(p.solution.kept),
                  predicted=p.predicted_peak_bytes, solver=p.solution.solver,
                  status=str(getattr(p.solution.status, "value", p.solution.status)), verified=p.verified,
                  modules=[c.wrapped.module for c in p.checkpoints if c.wrapped is not None])
    verification = p.verify(steps=1)  # on p.module(), a planned copy: before apply
    record.update(
        measured=verification.planned_peak_bytes, error=verification.peak_error,
        within_budget=verification.within_budget, error_ok=abs(verification.peak_error) <= PEAK_TOLERANCE,
        verify_grads_ok=verification.gradients_match, verify_outputs_ok=verification.outputs_match,
        baseline=p.baseline_peak_bytes, baseline_error=verification.original_peak_error,
    )
    p.apply(model)
    outputs_problem, grads_problem, buffers_problem = _step_mismatches(reference, model, sample)
    # (another shape: runs are recorded call by call)
    half_problem = next((text for text in _step_mismatches(reference, model, sample[:sample.shape[0] // 2]) if text),
                        None)
    record.update(outputs_ok=outputs_problem is None, grads_ok=grads_problem is None,
                  buffers_ok=buffers_problem is None, half_batch_ok=half_problem is None)
    problems = [f"{what}: {text}" for what, text in (("output", outputs_problem), ("gradient", grads_problem),
                                                      ("buffer", buffers_problem), ("half the batch", half_problem))
                if text]
    if not record["within_budget"]:
        problems.append(f"measured peak {record['measured']} B over budget {record['budget']} B")
    if not record["error_ok"]:
        problems.append(f"peak error {100 * record['error']:+.2f}% (predicted {record['predicted']} B, "
                        f"measured {record['measured']} B)")
    if not verification.gradients_match or not verification.outputs_match:
        problems.append("verify: outputs or gradients differ")
    record["problems"] = problems
    return p


def _plan_predicted(make_plan: Any, reference: nn.Module, sample: torch.Tensor, budget: int,
                    meta: bool) -> dict[str, Any]:
    """A plan that does not run its own step (`measure="no-run"`, or the model on `meta`), at
    `budget`: saved, loaded and applied to a copy of `reference`, whose steady peak and
    gradients are then measured. Its record: predicted, measured, over (the measured peak's
    excess over the budget, a share of it), grads_ok, and where its step peaks above its
    prediction (within OVER_TOLERANCE or not) or its gradients differ, the saved plan (`plan`,
    for `replay_plan`: which plan the node times chose differs between runs); or infeasible and
    minimum."""
    import tempfile

    from planner import load_plan
    from planner.measure.steps import steady_peak
    from solvers import InfeasibleBudget

    try:
        p = make_plan(budget)
    except InfeasibleBudget as error:
        return {"infeasible": True, "minimum": error.minimum_bytes}
    model = copy.deepcopy(reference)
    with tempfile.TemporaryDirectory() as folder:
        document = p.save(f"{folder}/plan.json").read_text()
        if meta:  # (applied to the real model through its saved plan, as a user of a meta plan would)
            load_plan(f"{folder}/plan.json").apply(model)
        else:
            p.apply(model)
    measured = steady_peak(model, sample, torch.device("cpu"))
    grads_problem = _step_mismatches(reference, model, sample)[1]
    found = {"predicted": p.predicted_peak_bytes, "measured": measured, "over": measured / budget - 1,
             "regions": len(p.checkpoints), "verified": p.verified, "grads_ok": grads_problem is None}
    if measured > p.predicted_peak_bytes or grads_problem is not None:
        found["plan"] = json.loads(document)  # to replay it: `replay_plan`
    return found


def replay_plan(seed: int, kind: str, document: dict[str, Any]) -> int:
    """The measured steady peak of the seed's model under a plan a fuzz record kept (`plan` in
    its no-run or meta record, where that plan failed), without planning again.

    Example:
        >>> record = json.load(open("benchmarks/results/fuzz_cpu_....json"))["records"][291]
        >>> peak = replay_plan(291, record["kind"], record["no_run"]["plan"])
    """
    import tempfile
    from pathlib import Path

    from planner import load_plan
    from planner.measure.steps import steady_peak

    model, sample = random_model(seed, kind)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        path.write_text(json.dumps(document))
        load_plan(path).apply(model)
    return steady_peak(model, sample, torch.device("cpu"))


def check_seed(seed: int, kind: str = "blocked", replan: bool = False) -> dict[str, Any]:
    """Plan `random_model(seed, kind)` at a random budget (30-100% of its measured unplanned
    peak) with the call users make, `plan(model, sample, budget_gb=X)`, and check the plan. See
    the module doc. `replan`: the faster route
    instead, `plan(..., budget_gb=80)` then `replan(budget_gb=X)`.

    Where the budget is refused as infeasible, the smallest budget the refusal names is planned
    for and must be met. On odd seeds the model is also planned with `selective=True` and solved
    again with the selective policy's costs at 0 (on models this small the measured costs
    outweigh what keeping saves, and no plan would keep a node), and that plan verified too
    (`keep`). Then the same budget is planned
    with `measure="no-run"` (`no_run`) and for a copy of the model on `meta` (`meta`), each
    applied and measured: their peaks may not exceed the budget by more than 1%.

    Returns: seed, kind, model (a description), features, budget, unplanned (measured), nodes,
    regions, kept, modules, solver, status, verified, predicted, measured, error, baseline,
    baseline_error, infeasible/minimum/asked (where the budget was refused), the flags
    grads_ok, buffers_ok, outputs_ok, half_batch_ok (a second step on half the batch),
    within_budget, error_ok, the keep, no-run and meta records, and ok; `failure` names what
    failed (with a traceback where something raised).
    """
    from planner import plan
    from planner.measure.steps import steady_peak

    record: dict[str, Any] = {"seed": seed, "kind": kind, "ok": False, "failure": None}
    stage = "build"
    try:
        model, sample = random_model(seed, kind)
        record["model"] = model.description
        record["features"] = features(model)
        reference = copy.deepcopy(model)
        stage = "measure the unplanned step"
        unplanned = steady_peak(model, sample, torch.device("cpu"))
        budget = int(random.Random(f"budget-{seed}").uniform(0.3, 1.0) * unplanned)
        record.update(unplanned=unplanned, budget=budget)
        stage = "plan"
        if replan:
            base = plan(model, sample, budget_gb=80, repeats=1)
            make_plan = lambda size: base.replan(budget_gb=size / GIB)  # noqa: E731
        else:
            make_plan = lambda size: plan(model, sample, budget_gb=size / GIB)  # noqa: E731
        _plan_checked(make_plan, reference, model, sample, record)
        problems = record.pop("problems")
        budget = record["budget"]
        if seed % 2 == 1:
            stage = "plan keeping free"
            keeping = plan(copy.deepcopy(reference), sample, budget_gb=80, repeats=1, selective=True)
            keeping.problem = replace(keeping.problem, keep_region_ms=0.0, keep_call_ms=0.0, kept_node_ms=0.0)
            model_k = copy.deepcopy(reference)
            keep: dict[str, Any] = {"budget": budget}
            _plan_checked(lambda size: keeping.replan(budget_gb=size / GIB), reference, model_k, sample, keep)
            problems += [f"keeping: {text}" for text in keep.pop("problems")]
            record["keep"] = keep
        stage = "plan node by node"
        record["no_run"] = _plan_predicted(
            lambda size: plan(copy.deepcopy(reference), sample, budget_gb=size / GIB, measure="no-run", repeats=1),
            reference, sample, budget, meta=False)
        stage = "plan on meta"
        on_meta = copy.deepcopy(reference).to("meta")
        record["meta"] = _plan_predicted(
            lambda size: plan(on_meta, sample.to("meta"), budget_gb=size / GIB, repeats=1),
            reference, sample, budget, meta=True)
        for name in ("no_run", "meta"):
            found = record[name]
            if found.get("over", 0) > OVER_TOLERANCE:
                problems.append(f"{name}: measured {found['measured']} B, {100 * found['over']:+.2f}% over the budget")
            if not found.get("grads_ok", True):
                problems.append(f"{name}: gradients differ")
        record["ok"] = not problems
        record["failure"] = "; ".join(problems) or None
    except Exception as error:  # noqa: BLE001 - a crash is a finding: keep the traceback
        record["failure"] = f"{stage}: {type(error).__name__}: {error}"
        record["traceback"] = traceback.format_exc()
    return record
