"""The random models' parts (tests/fuzz_models.py draws them): a program's ops over a list of
tensors (`run_program`), the `Block` and `FuzzModel` that run programs, and the `ProgramBuilder`
that draws programs while following which tensors autograd saves (`TensorState`), so that
in-place writes mostly go where the unplanned model allows them."""
from __future__ import annotations

import random

import torch
from torch import nn

# A program is a tuple of ops over a register list `r` (plain Python data, so fx unrolls it):
#   ("call", name, (i, ...), n_out)  r += outputs of getattr(self, name)(r[i], ...)
#   ("add", i, j)                    r.append(r[i] + r[j])
#   ("mul", i, j)                    r.append(r[i] * r[j])
#   ("cat", i, j, proj)              r.append(proj(torch.cat([r[i], r[j]], dim=1)))
#   ("iadd", i, j)                   r[i] += r[j]              (in place; no new register)
#   ("relu_", i, method)             torch.relu_(r[i]) or r[i].relu_()  (in place, result unused)
#   ("gate", i, j)                   r.append(r[i] * torch.sigmoid(r[j]))
#   ("scaled_iadd", i, j)            h = r[i] * 1.0; h += r[j]; r.append(h)
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
        elif kind == "gate":
            r.append(r[op[1]] * torch.sigmoid(r[op[2]]))
        elif kind == "scaled_iadd":
            h = r[op[1]] * 1.0
            h += r[op[2]]
            r.append(h)
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


class FlatModel(nn.Module):
    """stem -> one program in the model's own forward (no blocks: every op is the model's, its
    submodules leaves) -> the sum of its outputs -> head. The program's register list holds every
    tensor until forward returns, as a model's local variables would."""

    def __init__(self, stem: nn.Module, program: tuple, outputs: tuple[int, ...], modules: dict[str, nn.Module],
                 head: nn.Module, description: str):
        super().__init__()
        self.stem = stem
        self.program = program
        self.outputs = outputs
        for name, module in modules.items():
            self.add_module(name, module)
        self.head = head
        self.description = description

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = run_program(self, self.program, [self.stem(x)])
        total = r[self.outputs[0]]
        for index in self.outputs[1:]:
            total = total + r[index]
        return self.head(total)

    def extra_repr(self) -> str:
        return self.description


class TensorState:
    """What the builder knows of one tensor while it draws: whether autograd saved it for
    backward (then an in-place write to it would make the unplanned backward raise). Registers
    that alias one tensor (ReLU(inplace=True), `+=`, a block passing an input through) hold the
    same `TensorState`."""

    __slots__ = ("saved", "used")

    def __init__(self, saved: bool = False):
        self.saved = saved
        self.used = False  # read by an op that is not an in-place write to it


def _effect(module: nn.Module, x: TensorState) -> TensorState:
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
        return TensorState(saved=True)  # saves its output
    if isinstance(module, nn.Dropout):
        return TensorState()  # saves only its mask
    x.saved = True  # Linear, Conv, BatchNorm, GELU save their input
    return TensorState()


class ProgramBuilder:
    """Draws programs with a `random.Random`; knows the model's kind (mlp or conv) and width.

    It follows which tensors autograd saves, so that in-place writes mostly go to tensors that
    were consumed only by ops that do not save them (adds, cat, dropout, `+=`): legal for
    autograd, and exactly the writes a checkpointed region must not recompute from."""

    UNSAFE = 0.03  # how often an in-place write may hit a saved tensor anyway (then drawn again)

    def __init__(self, rng: random.Random, kind: str, width: int, flat: bool = False):
        self.rng = rng
        self.kind = kind
        self.width = width
        self.flat = flat  # leaf modules only (no Sequential, no nested block), LayerNorm, gates
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
        if self.flat and self.rng.random() < 0.5:
            return nn.LayerNorm(self.width)
        return nn.BatchNorm1d(self.width) if self.kind == "mlp" else nn.BatchNorm2d(self.width)

    def proj(self) -> nn.Module:
        w = self.width
        return nn.Linear(2 * w, w) if self.kind == "mlp" else nn.Conv2d(2 * w, w, 1)

    def unary(self, target_saved: bool) -> tuple[str, nn.Module]:
        rng = self.rng
        kinds = ["layer", "norm", "dropout", "gelu", "relu", "relu_inplace", "seq"]
        weights = [5, 2, 3, 1, 1, 2 if not target_saved or rng.random() < self.UNSAFE else 0, 0 if self.flat else 3]
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

    def in_place_target(self, registers: list[TensorState]) -> int | None:
        """A register to write in place: one autograd did not save, else (rarely) any."""
        free = [i for i, t in enumerate(registers) if not t.saved]
        if free and (self.rng.random() >= self.UNSAFE):
            return self.rng.choice(free)
        return self.rng.randrange(len(registers)) if self.rng.random() < self.UNSAFE else None

    # -- programs -------------------------------------------------------------------------------
    def block(self, inputs: list[TensorState], depth: int, n_out: int | None = None) -> tuple[Block, list[TensorState]]:
        """A block taking `inputs` (marked as autograd will treat them); returns it and its outputs."""
        rng = self.rng
        modules: dict[str, nn.Module] = {}
        program: list[tuple] = []
        r = list(inputs)
        steps = rng.randint(6, 16) if self.flat else rng.randint(3, 8) if depth == 0 else rng.randint(2, 4)
        if rng.random() < 0.5:  # start from the first input through a layer, as many blocks do
            name = self.name("fc" if self.kind == "mlp" else "conv")
            modules[name] = self.layer()
            program.append(("call", name, (0,), 1))
            r.append(_effect(modules[name], r[0]))
        for _ in range(steps):
            kind = rng.choices(["unary", "add", "mul", "cat", "iadd", "relu_", "inner", "gate", "scaled_iadd"],
                               weights=[6, 2, 1, 1, 2, 2, 1 if depth == 0 and not self.flat else 0,
                                        1 if self.flat else 0, 1 if self.flat else 0])[0]
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
                r.append(TensorState())
            elif kind == "mul":
                program.append(("mul", i, j))
                r[i].saved = r[j].saved = r[i].used = r[j].used = True
                r.append(TensorState())
            elif kind == "cat":
                name = self.name("proj")
                modules[name] = self.proj()
                program.append(("cat", i, j, name))
                r[i].used = r[j].used = True
                r.append(TensorState())  # proj saves the concatenation, not i or j
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
            elif kind == "gate":  # the product saves r[i] and the sigmoid's output, not r[j]
                program.append(("gate", i, j))
                r[i].saved = r[i].used = r[j].used = True
                r.append(TensorState())
            elif kind == "scaled_iadd":  # a product by a number saves nothing; += writes the new tensor
                program.append(("scaled_iadd", i, j))
                r[i].used = r[j].used = True
                r.append(TensorState())
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
                r.append(TensorState())
                returned.add(id(t))
                last = len(r) - 1
        outputs = (last, *extra)
        return Block(tuple(program), outputs, modules), [r[k] for k in outputs]

    def glue(self, history: list[TensorState], state_len: int) -> tuple[tuple, tuple[int, ...]]:
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
                history.append(TensorState())
            else:
                name = self.name("glue_proj")
                self.glue_modules[name] = self.proj()
                program.append(("cat", state[pos], earlier, name))
                history[state[pos]].used = history[earlier].used = True
                state[pos] = len(history)
                history.append(TensorState())
        if rng.random() < 0.3 and len(state) > 1:
            state = state[: rng.randint(1, len(state))]
        return tuple(program), tuple(state)


def describe(program: tuple, outputs: tuple[int, ...] | None = None) -> str:
    text = "; ".join(" ".join(str(part) for part in op) for op in program)
    return text + (f" -> {list(outputs)}" if outputs is not None else "")
