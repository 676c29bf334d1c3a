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
the unplanned peak, applies the plan in place and compares one training step with an
unplanned deep copy (gradients, BatchNorm statistics), and verifies the predicted peak
against the measured one (`Plan.verify`). It returns a plain record.

    >>> model, sample = random_model(3)
    >>> record = check_seed(3)
    >>> record["ok"], record["failure"]
    (True, None)
"""
from __future__ import annotations

import copy
import random
import traceback
from typing import Any

import torch
import torch.fx
from torch import nn

GIB = 2**30
PEAK_TOLERANCE = 0.03
MAX_REDRAWS = 200

# A program is a tuple of ops over a register list `r` (plain Python data, so fx unrolls it):
#   ("call", name, (i, ...), n_out)  r += outputs of getattr(self, name)(r[i], ...)
#   ("add", i, j)                    r.append(r[i] + r[j])
#   ("mul", i, j)                    r.append(r[i] * r[j])
#   ("cat", i, j, proj)              r.append(proj(torch.cat([r[i], r[j]], dim=1)))
#   ("iadd", i, j)                   r[i] += r[j]              (in place; no new register)
#   ("relu_", i, method)             torch.relu_(r[i]) or r[i].relu_()  (in place, result unused)
# followed by the indices of the registers the block returns.


def run_program(module: nn.Module, program: tuple, registers: list[torch.Tensor]) -> list[torch.Tensor]:
    r = registers
    for op in program:
        kind = op[0]
        if kind == "call":
            _, name, inputs, n_out = op
            result = getattr(module, name)(*[r[i] for i in inputs])
            if n_out == 1:
                r.append(result)
            else:
                for k in range(n_out):
                    r.append(result[k])
        elif kind == "add":
            r.append(r[op[1]] + r[op[2]])
        elif kind == "mul":
            r.append(r[op[1]] * r[op[2]])
        elif kind == "cat":
            r.append(getattr(module, op[3])(torch.cat([r[op[1]], r[op[2]]], dim=1)))
        elif kind == "iadd":
            target = r[op[1]]
            target += r[op[2]]
            r[op[1]] = target
        elif kind == "relu_":
            if op[2]:
                r[op[1]].relu_()
            else:
                torch.relu_(r[op[1]])
        else:
            raise ValueError(f"unknown op {op!r}")
    return r


class Block(nn.Module):
    """Runs `program` over its inputs; returns the registers named in `outputs`."""

    def __init__(self, program: tuple, outputs: tuple[int, ...], modules: dict[str, nn.Module]):
        super().__init__()
        self.program = program
        self.outputs = outputs
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(self, *inputs: torch.Tensor):
        r = run_program(self, self.program, list(inputs))
        if len(self.outputs) == 1:
            return r[self.outputs[0]]
        return tuple(r[i] for i in self.outputs)


class FuzzModel(nn.Module):
    """stem -> blocks (with glue programs over all earlier tensors between them) -> head."""

    def __init__(self, stem: nn.Module, blocks: list[Block], glue: list[tuple], glue_modules: dict[str, nn.Module],
                 tail: tuple[int, ...], head: nn.Module, description: str):
        super().__init__()
        self.stem = stem
        self.blocks = nn.ModuleList(blocks)
        self.glue = glue  # per block: (program over the history, state indices after it)
        for name, module in glue_modules.items():
            self.add_module(name, module)
        self.tail = tail  # earlier tensors nothing else reads: added to the head's input
        self.head = head
        self.description = description

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        history = [h]
        state = [h]
        for block, (program, next_state) in zip(self.blocks, self.glue):
            out = block(*state)
            out = list(out) if isinstance(out, tuple) else [out]
            history = history + out
            history = run_program(self, program, history)
            state = [history[i] for i in next_state]
        total = state[0]
        for extra in state[1:]:
            total = total + extra
        for index in self.tail:
            total = total + history[index]
        return self.head(total)

    def extra_repr(self) -> str:
        return self.description


class _Tensor:
    """What the builder knows of one tensor while it draws: whether autograd saved it for
    backward (then an in-place write to it would make the unplanned backward raise). Registers
    that alias one tensor (ReLU(inplace=True), `+=`, a block passing an input through) hold the
    same `_Tensor`."""

    __slots__ = ("saved", "used")

    def __init__(self, saved: bool = False):
        self.saved = saved
        self.used = False  # read by an op that is not an in-place write to it


def _effect(module: nn.Module, x: _Tensor) -> _Tensor:
    """The tensor `module(x)` returns, marking what autograd saves (leaf modules and Sequential)."""
    x.used = True
    if isinstance(module, nn.Sequential):
        for part in module:
            x = _effect(part, x)
        return x
    if isinstance(module, nn.ReLU) and module.inplace:
        x.saved = True  # relu_ saves its result, which is x itself
        return x
    if isinstance(module, (nn.ReLU, nn.Tanh)):
        return _Tensor(saved=True)  # saves its output
    if isinstance(module, nn.Dropout):
        return _Tensor()  # saves only its mask
    x.saved = True  # Linear, Conv, BatchNorm, GELU save their input
    return _Tensor()


class _Builder:
    """Draws programs with a `random.Random`; knows the model's kind (mlp or conv) and width.

    It follows which tensors autograd saves, so that in-place writes mostly go to tensors that
    were consumed only by ops that do not save them (adds, cat, dropout, `+=`): legal for
    autograd, and exactly the writes a checkpointed region must not recompute from."""

    UNSAFE = 0.03  # how often an in-place write may hit a saved tensor anyway (then drawn again)

    def __init__(self, rng: random.Random, kind: str, width: int):
        self.rng = rng
        self.kind = kind
        self.width = width
        self.count = 0
        self.glue_modules: dict[str, nn.Module] = {}  # what glue() adds to the model itself

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    # -- submodules, all width -> width ----------------------------------------------------------
    def layer(self) -> nn.Module:
        w = self.width
        return nn.Linear(w, w) if self.kind == "mlp" else nn.Conv2d(w, w, 3, padding=1)

    def norm(self) -> nn.Module:
        return nn.BatchNorm1d(self.width) if self.kind == "mlp" else nn.BatchNorm2d(self.width)

    def proj(self) -> nn.Module:
        w = self.width
        return nn.Linear(2 * w, w) if self.kind == "mlp" else nn.Conv2d(2 * w, w, 1)

    def unary(self, target_saved: bool) -> tuple[str, nn.Module]:
        rng = self.rng
        kinds = ["layer", "norm", "dropout", "gelu", "relu", "relu_inplace", "seq"]
        weights = [5, 2, 3, 1, 1, 2 if not target_saved or rng.random() < self.UNSAFE else 0, 3]
        choice = rng.choices(kinds, weights=weights)[0]
        if choice == "layer":
            return self.name("fc" if self.kind == "mlp" else "conv"), self.layer()
        if choice == "norm":
            return self.name("bn"), self.norm()
        if choice == "dropout":
            return self.name("drop"), nn.Dropout(rng.choice([0.1, 0.25, 0.5]))
        if choice == "gelu":
            return self.name("gelu"), nn.GELU()
        if choice == "relu":
            return self.name("relu"), nn.ReLU()
        if choice == "relu_inplace":
            return self.name("relu_ip"), nn.ReLU(inplace=True)
        parts: list[nn.Module] = []
        if rng.random() < 0.3:
            parts.append(nn.Dropout(0.1))  # consumes its input without saving it
        parts.append(self.layer())
        if rng.random() < 0.5:
            parts.append(self.norm())
        parts.append(rng.choice([nn.GELU(), nn.ReLU(), nn.ReLU(inplace=True), nn.Tanh()]))
        if rng.random() < 0.3:
            parts.append(nn.Dropout(0.1))
        if rng.random() < 0.5:
            parts.append(self.layer())
        if rng.random() < 0.3:  # a Sequential inside the Sequential
            parts.append(nn.Sequential(self.layer(), nn.GELU()))
        return self.name("seq"), nn.Sequential(*parts)

    def in_place_target(self, registers: list[_Tensor]) -> int | None:
        """A register to write in place: one autograd did not save, else (rarely) any."""
        free = [i for i, t in enumerate(registers) if not t.saved]
        if free and (self.rng.random() >= self.UNSAFE):
            return self.rng.choice(free)
        return self.rng.randrange(len(registers)) if self.rng.random() < self.UNSAFE else None

    # -- programs -------------------------------------------------------------------------------
    def block(self, inputs: list[_Tensor], depth: int, n_out: int | None = None) -> tuple[Block, list[_Tensor]]:
        """A block taking `inputs` (marked as autograd will treat them); returns it and its outputs."""
        rng = self.rng
        modules: dict[str, nn.Module] = {}
        program: list[tuple] = []
        r = list(inputs)
        steps = rng.randint(3, 8) if depth == 0 else rng.randint(2, 4)
        if rng.random() < 0.5:  # start from the first input through a layer, as many blocks do
            name = self.name("fc" if self.kind == "mlp" else "conv")
            modules[name] = self.layer()
            program.append(("call", name, (0,), 1))
            r.append(_effect(modules[name], r[0]))
        for _ in range(steps):
            kind = rng.choices(["unary", "add", "mul", "cat", "iadd", "relu_", "inner"],
                               weights=[6, 2, 1, 1, 2, 2, 1 if depth == 0 else 0])[0]
            n = len(r)
            i = rng.randrange(max(0, n - 3), n) if rng.random() < 0.7 else rng.randrange(n)
            j = rng.randrange(n)
            if kind == "unary":
                name, module = self.unary(r[i].saved)
                modules[name] = module
                program.append(("call", name, (i,), 1))
                r.append(_effect(module, r[i]))
            elif kind == "add":
                program.append(("add", i, j))
                r[i].used = r[j].used = True
                r.append(_Tensor())
            elif kind == "mul":
                program.append(("mul", i, j))
                r[i].saved = r[j].saved = r[i].used = r[j].used = True
                r.append(_Tensor())
            elif kind == "cat":
                name = self.name("proj")
                modules[name] = self.proj()
                program.append(("cat", i, j, name))
                r[i].used = r[j].used = True
                r.append(_Tensor())  # proj saves the concatenation, not i or j
            elif kind == "iadd":
                target = self.in_place_target(r)
                if target is not None:
                    program.append(("iadd", target, j))
                    r[j].used = r[j].used or r[j] is not r[target]
                    r[target].used = False  # its new value must be read later (not dead code)
            elif kind == "relu_":
                target = self.in_place_target(r)
                if target is not None:
                    program.append(("relu_", target, rng.random() < 0.5))
                    r[target].saved = True
                    r[target].used = False  # its new value must be read later (not dead code)
            else:
                inner_in = rng.randint(1, 2)
                inner_out = rng.randint(1, 2)
                picked = [i] + [rng.randrange(n) for _ in range(inner_in - 1)]
                name = self.name("inner")
                modules[name], outputs = self.block([r[k] for k in picked], depth + 1, inner_out)
                program.append(("call", name, tuple(picked), inner_out))
                r.extend(outputs)
        if n_out is None:
            n_out = rng.choices([1, 2, 3], weights=[3, 2, 1])[0] if depth == 0 else 1
        # The last register first; the others may be inputs passed through (e.g. (h, old)).
        extra = [rng.randrange(len(r)) for _ in range(n_out - 1)]
        # Every tensor the block made flows into its outputs: no dead branches (autograd would
        # free them at once, and their parameters would get no gradient, unlike in real models).
        returned = {id(r[k]) for k in extra} | {id(r[-1])} | {id(t) for t in inputs}
        last = len(r) - 1
        for k, t in enumerate(list(r)):
            if not t.used and id(t) not in returned:
                program.append(("add", last, k))
                r[last].used = t.used = True
                r.append(_Tensor())
                returned.add(id(t))
                last = len(r) - 1
        outputs = (last, *extra)
        return Block(tuple(program), outputs, modules), [r[k] for k in outputs]

    def glue(self, history: list[_Tensor], state_len: int) -> tuple[tuple, tuple[int, ...]]:
        """Ops between blocks over every tensor so far (`history`, extended in place); then
        which of them the next block takes."""
        rng = self.rng
        program: list[tuple] = []
        state = list(range(len(history) - state_len, len(history)))
        for _ in range(rng.choices([0, 1, 2, 3], weights=[3, 3, 2, 1])[0]):
            kind = rng.choices(["relu_", "iadd", "mul", "cat", "add"], weights=[3, 2, 1, 1, 1])[0]
            earlier = rng.randrange(len(history))
            pos = rng.randrange(len(state))
            if kind == "relu_":
                target = self.in_place_target(history)
                if target is not None:
                    program.append(("relu_", target, rng.random() < 0.5))
                    history[target].saved = True
                    history[target].used = False
            elif kind == "iadd":
                if not history[state[pos]].saved or rng.random() < self.UNSAFE:
                    program.append(("iadd", state[pos], earlier))
                    history[earlier].used = history[earlier].used or history[earlier] is not history[state[pos]]
                    history[state[pos]].used = False
            elif kind in ("mul", "add"):
                program.append((kind, state[pos], earlier))
                history[state[pos]].used = history[earlier].used = True
                if kind == "mul":
                    history[state[pos]].saved = history[earlier].saved = True
                state[pos] = len(history)
                history.append(_Tensor())
            else:
                name = self.name("glue_proj")
                self.glue_modules[name] = self.proj()
                program.append(("cat", state[pos], earlier, name))
                history[state[pos]].used = history[earlier].used = True
                state[pos] = len(history)
                history.append(_Tensor())
        if rng.random() < 0.3 and len(state) > 1:
            state = state[: rng.randint(1, len(state))]
        return tuple(program), tuple(state)


def _describe(program: tuple, outputs: tuple[int, ...] | None = None) -> str:
    text = "; ".join(" ".join(str(part) for part in op) for op in program)
    return text + (f" -> {list(outputs)}" if outputs is not None else "")


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
    builder = _Builder(rng, kind, width)
    if kind == "mlp":
        stem_parts: list[nn.Module] = [nn.Linear(features, width)]
    else:
        stem_parts = [nn.Conv2d(features, width, 3, padding=1)]
    if rng.random() < 0.5:
        stem_parts.append(builder.norm())
    if rng.random() < 0.5:
        stem_parts.append(nn.GELU())
    stem = nn.Sequential(*stem_parts)
    history = [_Tensor()]  # the stem's output
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
        lines.append(f"blocks.{k}: {_describe(block.program, block.outputs)}")
        for name, module in block.named_modules():
            if isinstance(module, Block) and name:
                lines.append(f"blocks.{k}.{name}: {_describe(module.program, module.outputs)}")
        if program:
            lines.append(f"glue after blocks.{k}: {_describe(program)} -> next takes {list(indices)}")
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


def check_seed(seed: int) -> dict[str, Any]:
    """Plan `random_model(seed)` at a random feasible budget and check the plan. See the module doc.

    Returns: seed, model (a description), features, nodes, regions, modules (checkpointed),
    solver, status, budget, minimum, baseline, predicted, measured, error, baseline_measured,
    baseline_error (of the unplanned prediction), and the flags grads_ok, buffers_ok,
    outputs_ok, within_budget, error_ok, verify_grads_ok, verify_outputs_ok, ok; `failure`
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
        expected_output, expected_grads = training_step(reference, sample)
        output, grads = training_step(model, sample)
        outputs_problem = _mismatch({"output": expected_output}, {"output": output})
        grads_problem = _mismatch(expected_grads, grads)
        buffers_problem = _mismatch(_buffers(reference), _buffers(model))
        record.update(outputs_ok=outputs_problem is None, grads_ok=grads_problem is None,
                      buffers_ok=buffers_problem is None)
        problems = [f"{what}: {text}" for what, text in (("output", outputs_problem), ("gradient", grads_problem),
                                                          ("buffer", buffers_problem)) if text]
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
