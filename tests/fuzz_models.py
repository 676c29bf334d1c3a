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
again (deterministically, from `10**6 + seed * 1000 + k`).

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
import random
import traceback
from dataclasses import replace
from typing import Any

import torch
import torch.fx
from torch import nn

from fuzz_programs import Block, FuzzModel, ProgramBuilder, TensorState, describe

GIB = 2**30
PEAK_TOLERANCE = 0.03
MAX_REDRAWS = 200


def _draw(seed: int) -> tuple[nn.Module, torch.Tensor]:
    rng = random.Random(seed)
    kind = rng.choices(["mlp", "conv"], weights=[2, 1])[0]
    if kind == "mlp":
        width = rng.choice([32, 48, 64, 96, 128])
        batch = rng.choice([32, 64, 128, 256])
        features = rng.choice([16, 32, 64])
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


def random_model(seed: int) -> tuple[nn.Module, torch.Tensor]:
    """A random traceable model and its sample, the same for the same seed.

    Draws again from `10**6 + seed * 1000 + k` (k = 1, 2, ...) until the unplanned model trains and
    every parameter gets a gradient.
    """
    for k in range(MAX_REDRAWS):
        model, sample = _draw(seed if k == 0 else 10**6 + seed * 1000 + k)
        if _trains(model, sample):
            return model, sample
    raise RuntimeError(f"no trainable model in {MAX_REDRAWS} draws for seed {seed}")


def features(model: nn.Module) -> dict[str, int]:
    """How many of each hazard a model holds: in-place writes, random and BatchNorm modules,
    products, concatenations, nested blocks, blocks returning several tensors."""
    ops = [op for module in model.modules() if isinstance(module, (Block, FuzzModel))
           for op in (module.program if isinstance(module, Block) else
                      [op for program, _ in module.glue for op in program])]
    count = lambda kind: sum(op[0] == kind for op in ops)  # noqa: E731
    return {
        "relu_": count("relu_"), "iadd": count("iadd"), "mul": count("mul"), "cat": count("cat"),
        "relu_inplace": sum(isinstance(m, nn.ReLU) and m.inplace for m in model.modules()),
        "dropout": sum(isinstance(m, nn.Dropout) for m in model.modules()),
        "batchnorm": sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()),
        "nested_blocks": sum(isinstance(m, Block) for m in model.modules()) - len(model.blocks),
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


def check_seed(seed: int, free_keeps: bool | None = None) -> dict[str, Any]:
    """Plan `random_model(seed)` at a random feasible budget and check the plan. See the module doc.
    `free_keeps`: plan with the selective policy's costs at 0 (default: on odd seeds).

    Returns: seed, model (a description), features, nodes, regions, modules (checkpointed),
    solver, status, budget, minimum, baseline, predicted, measured, error, baseline_measured,
    baseline_error (of the unplanned prediction), and the flags grads_ok, buffers_ok,
    outputs_ok, half_batch_ok (a second step on half the batch: outputs, gradients, buffers),
    within_budget, error_ok, verify_grads_ok, verify_outputs_ok, ok; `failure`
    names what failed (with a traceback where something raised).
    """
    from planner import plan
    from solvers import InfeasibleBudget, minimum_peak_bytes

    record: dict[str, Any] = {"seed": seed, "ok": False, "failure": None}
    stage = "build"
    try:
        model, sample = random_model(seed)
        record["model"] = model.description
        record["features"] = features(model)
        reference = copy.deepcopy(model)
        stage = "plan"
        unplanned = plan(model, sample, budget_gb=80, repeats=1)
        free = seed % 2 == 1 if free_keeps is None else free_keeps  # keeping free (see the module doc)
        if free:
            unplanned.problem = replace(unplanned.problem, keep_region_ms=0.0, keep_call_ms=0.0, kept_node_ms=0.0)
        minimum = minimum_peak_bytes(unplanned.problem)
        baseline = unplanned.baseline_peak_bytes
        low = min(int(minimum * 1.001) + 1, baseline)
        budget = random.Random(f"budget-{seed}").uniform(low, baseline)
        record.update(nodes=len(unplanned.problem), minimum=minimum, baseline=baseline, budget=int(budget))
        stage = "replan"
        try:
            p = unplanned.replan(budget_gb=budget / GIB)
        except InfeasibleBudget as error:
            record["failure"] = f"InfeasibleBudget at {int(budget)} B (minimum_peak_bytes {minimum}): {error}"
            return record
        record.update(regions=len(p.checkpoints), kept=len(p.solution.kept), predicted=p.predicted_peak_bytes,
                      solver=p.solution.solver,
                      status=str(getattr(p.solution.status, "value", p.solution.status)))
        stage = "verify"
        verification = p.verify(steps=1)  # on p.module(), a planned copy: before apply
        record.update(
            measured=verification.planned_peak_bytes,
            error=verification.peak_error,
            within_budget=verification.within_budget,
            error_ok=abs(verification.peak_error) <= PEAK_TOLERANCE,
            verify_grads_ok=verification.gradients_match,
            verify_outputs_ok=verification.outputs_match,
            baseline_measured=verification.original_peak_bytes,
            baseline_error=verification.original_peak_error,
            modules=[c.wrapped.module for c in p.checkpoints if c.wrapped is not None],
        )
        stage = "apply"
        p.apply(model)
        stage = "train"
        outputs_problem, grads_problem, buffers_problem = _step_mismatches(reference, model, sample)
        stage = "train on half the batch"  # (another shape: runs are recorded call by call)
        half_problem = next((text for text in _step_mismatches(reference, model, sample[:sample.shape[0] // 2])
                             if text), None)
        record.update(outputs_ok=outputs_problem is None, grads_ok=grads_problem is None,
                      buffers_ok=buffers_problem is None, half_batch_ok=half_problem is None)
        problems = [f"{what}: {text}" for what, text in (("output", outputs_problem), ("gradient", grads_problem),
                                                          ("buffer", buffers_problem),
                                                          ("half the batch", half_problem)) if text]
        if not record["within_budget"]:
            problems.append(f"measured peak {record['measured']} B over budget {record['budget']} B")
        if not record["error_ok"]:
            problems.append(f"peak error {100 * record['error']:+.2f}% (predicted {record['predicted']} B, "
                            f"measured {record['measured']} B)")
        if not record["verify_grads_ok"]:
            problems.append("verify: gradients differ")
        if not record["verify_outputs_ok"]:
            problems.append("verify: outputs differ")
        record["ok"] = not problems
        record["failure"] = "; ".join(problems) or None
    except Exception as error:  # noqa: BLE001 - a crash is a finding: keep the traceback
        record["failure"] = f"{stage}: {type(error).__name__}: {error}"
        record["traceback"] = traceback.format_exc()
    return record
