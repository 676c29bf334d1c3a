"""Recompute a run of ATen calls inside one submodule call, and nothing else of it.

`checkpoint` on a submodule drops every tensor its forward saves for backward and replays the
forward up to its last saving call; a selective policy can keep calls' outputs, but then also
caches outputs that nothing saves (a linear's output feeding dropout). A region that is a run
of nodes inside a block (its norm and the next linear's input, an activation) is applied here
instead: a dispatch mode over the submodule's forward counts its ATen calls
(`planner.run_recording`); over the run's calls a `RunTape` records each call (op, arguments) and, once autograd has saved the call's tensors,
re-registers those that the run itself made with pack/unpack hooks that drop them
(`SavedTensor.register_hooks`). The first unpack in backward replays the recorded calls under
`no_grad`, from the run's inputs (kept, as checkpoint keeps a region's inputs) and the RNG
state saved before its first random call, and hands each dropped tensor back once. A dropped
tensor whose autograd node is gone by then (an in-place call whose result nothing reads: its
node is freed in forward and never runs) is not made again, as checkpoint's weak holders skip
it: kept, it would stay alive until the run's tape is freed, after backward.

Tensors the run saves that it did not make (its inputs, parameters) and tensors that later
calls save stay as they are, so memory is that of a region on exactly those nodes.

Example:
    >>> tape.record(func, args, kwargs, result)  # in forward, for each of the run's calls
    >>> tape.drop_saved(outputs)                  # once autograd saved the call's tensors
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from planner.sharded_units import UnitParameters, freed, gathered

_Ref = tuple[int, int]  # (call within the run, output of that call)
_SAVED_PREFIX = "_raw_saved_"
_saved_names: dict[type, tuple[str, ...]] = {}  # autograd node class -> its saved-tensor attributes


def counted_call(name: str) -> bool:
    """Whether a run's call indices count an ATen call: not torch.export's metadata asserts
    (the model's forward makes none) nor `detach`, which autograd itself dispatches when it
    saves some outputs without saved-tensor hooks (the planner's runs have hooks) and which
    replay needs no more than the tensor it aliases."""
    return not name.startswith("aten._assert") and name != "aten.detach.default"


def _tensor_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What identifies a tensor's value at one moment of the forward: its memory and layout.
    (autograd saves an output as a new tensor on the same memory, so identity would not do.)"""
    return (tensor.device, tensor.dtype, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))


@dataclass
class _Arg:
    """A recorded argument: a tensor the run made (`ref`), or any other value as it was."""

    ref: _Ref | None = None
    value: Any = None
    version: int | None = None  # of an input tensor when recorded: replay refuses a changed one
    # an input the call writes in place that the run did not make (BatchNorm's running
    # statistics): replay writes a copy, so the forward's update is not made twice
    scratch: bool = False
    owner: torch.nn.Module | None = None  # the FSDP2 unit that gathered it (a parameter it frees)


class _Holder:
    """What a dropped saved tensor's autograd node keeps in the tensor's place: its slot. The
    tape holds it weakly, so the holder dies with the node."""

    __slots__ = ("slot", "__weakref__")

    def __init__(self, slot: int):
        self.slot = slot


@dataclass
class RunTape:
    """One run's recorded calls in one forward, and the dropped saved tensors to hand back.

    Example:
        >>> tape.replay(); sorted(tape.replayed)[:2]
        [0, 1]
    """

    calls: list[tuple[Any, list[_Arg], Any]] = field(default_factory=list)  # (func, flat args, spec)
    made: dict[tuple[Any, ...], _Ref] = field(default_factory=dict)  # tensor key -> the call that made it
    slots: dict[int, _Ref] = field(default_factory=dict)  # dropped saved tensor -> its maker
    # slot -> what its node keeps, while the node lives (replay makes only these slots' tensors)
    holders: weakref.WeakValueDictionary[int, _Holder] = field(default_factory=weakref.WeakValueDictionary)
    rng: tuple[int, torch.Tensor, torch.device | None, torch.Tensor | None] | None = None
    replayed: dict[int, torch.Tensor] | None = None
    units: UnitParameters | None = None
    _slot_ids: Iterator[int] = field(default_factory=itertools.count)

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> list[Any]:
        """Note one call of the run; returns its outputs, flattened."""
        flat, spec = _flatten(args, kwargs)
        written = _written_inputs(func, args, kwargs) if _written_arguments(func) else ()
        recorded = []
        for value in flat:
            ref = self.made.get(_tensor_key(value)) if isinstance(value, torch.Tensor) else None
            if ref is not None:
                recorded.append(_Arg(ref=ref))
            elif isinstance(value, torch.Tensor) and id(value) in written and not value.requires_grad:
                recorded.append(_Arg(value=value, scratch=True))
            elif isinstance(value, torch.Tensor):
                owner = self.units.owner(value) if self.units is not None else None
                recorded.append(_Arg(value=value, version=value._version, owner=owner))
            else:
                recorded.append(_Arg(value=value))
        index = len(self.calls)
        self.calls.append((func, recorded, spec))
        results = [result] if isinstance(result, torch.Tensor) else tree_flatten(result)[0]
        # what the call returns of an input it wrote on a copy is no value of the run: later
        # calls read the input itself (as the forward left it)
        scratch = {_tensor_key(arg.value) for arg in recorded if arg.scratch} if written else ()
        for position, value in enumerate(results):
            if isinstance(value, torch.Tensor) and _tensor_key(value) not in scratch:
                self.made[_tensor_key(value)] = (index, position)
        return results

    def note_random(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Save the RNG state before the run's first random call (the one replay restores)."""
        if self.rng is not None:
            return
        device = next((t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)
        cuda = device if device is not None and device.type == "cuda" else None
        self.rng = (len(self.calls), torch.get_rng_state(), cuda,
                    torch.cuda.get_rng_state(cuda) if cuda is not None else None)

    def drop_saved(self, outputs: Sequence[Any]) -> int:
        """Re-register, with hooks that drop them, the tensors that the autograd nodes of the
        last recorded call saved and that this run made. Returns how many it dropped."""
        nodes = {t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        dropped = 0
        for node in nodes:
            names = _saved_names.get(type(node))
            if names is None:
                names = _saved_names[type(node)] = tuple(n for n in dir(node) if n.startswith(_SAVED_PREFIX))
            for name in names:
                raw = getattr(node, name)
                value = getattr(node, "_saved_" + name[len(_SAVED_PREFIX):])
                pairs = zip(raw, value) if isinstance(raw, (list, tuple)) else [(raw, value)]
                for saved, tensor in pairs:
                    ref = self.made.get(_tensor_key(tensor)) if isinstance(tensor, torch.Tensor) else None
                    if ref is None:
                        continue
                    slot = next(self._slot_ids)
                    self.slots[slot] = ref
                    try:
                        saved.register_hooks(functools.partial(self._pack, slot), self.unpack)
                    except RuntimeError as error:
                        raise RuntimeError("a run the plan recomputes cannot drop the tensors it saves: another "
                                           "saved_tensors_hooks context is active (activation offloading, an outer "
                                           "checkpoint?)") from error
                    dropped += 1
        return dropped

    def _pack(self, slot: int, _tensor: torch.Tensor) -> _Holder:
        holder = self.holders[slot] = _Holder(slot)
        return holder

    def unpack(self, holder: _Holder) -> torch.Tensor:
        """The dropped saved tensor that `holder` stands for, replaying the run first if
        needed; handed back once."""
        slot = holder.slot
        if self.replayed is None or slot not in self.replayed:  # (again: a backward with retain_graph)
            self.replay()
        assert self.replayed is not None
        return self.replayed.pop(slot)

    def replay(self) -> None:
        """Run the recorded calls again, up to the last one that made a dropped tensor, without
        autograd or autocast, keeping only what later calls read or backward asks for (of the
        dropped tensors, those whose autograd node is still alive)."""
        live = {slot: ref for slot, ref in self.slots.items() if slot in self.holders}
        wanted = set(live.values())
        last = max((ref[0] for ref in wanted), default=-1)
        last_read: dict[_Ref, int] = {}
        for index, (_, args, _) in enumerate(self.calls[:last + 1]):
            for arg in args:
                if arg.ref is not None:
                    last_read[arg.ref] = index
        values: dict[_Ref, torch.Tensor] = {}
        freed_units = {id(arg.owner): arg.owner for _, args, _ in self.calls[:last + 1] for arg in args
                       if arg.owner is not None and freed(arg.value)}
        devices = [self.rng[2]] if self.rng is not None and self.rng[2] is not None else []
        # (the generators are put back afterwards: backward's own draws must not see the replay)
        forked = torch.random.fork_rng(devices=devices) if self.rng is not None else contextlib.nullcontext()
        with gathered(freed_units.values()), torch.no_grad(), _no_autocast(), forked:
            for index, (func, args, spec) in enumerate(self.calls[:last + 1]):
                if self.rng is not None and self.rng[0] == index:
                    torch.set_rng_state(self.rng[1])
                    if self.rng[2] is not None:
                        torch.cuda.set_rng_state(self.rng[3], self.rng[2])
                # (one statement: no output that nothing reads, an in-place call's result on a
                # value read for the last time, outlives the call in a local)
                values.update({(index, position): value
                               for position, value in enumerate(_call(func, args, spec, values))
                               if (index, position) in wanted or last_read.get((index, position), -1) > index})
                for arg in args:
                    if arg.ref is not None and last_read.get(arg.ref) == index and arg.ref not in wanted:
                        values.pop(arg.ref, None)
        self.replayed = {slot: values[ref] for slot, ref in live.items()}


def _call(func: Any, args: list[_Arg], spec: Any, values: dict[_Ref, torch.Tensor]) -> list[Any]:
    """Make one recorded call again from `values` (the run's own tensors) and its other
    arguments; returns its outputs, flattened."""
    flat = [values[arg.ref] if arg.ref is not None else _checked_input(arg, func) for arg in args]
    call_args, call_kwargs = (flat, {}) if spec is None else tree_unflatten(flat, spec)
    result = func(*call_args, **call_kwargs)
    return [result] if isinstance(result, torch.Tensor) else tree_flatten(result)[0]


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """A call's arguments as a flat list, and what rebuilds them: None for positional ones with
    no tensor inside a list (most ATen calls: pytree's walk costs the recording more than the
    rest of its work), else pytree's spec of (args, kwargs)."""
    if not kwargs and not any(isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a)
                              for a in args):
        return list(args), None
    return tree_flatten((args, kwargs))


# Calls that write inputs their schema does not mark: BatchNorm's, in training, its running
# mean and variance (arguments 3 and 4).
_UNMARKED_WRITES = {"aten.native_batch_norm.default": (3, 4)}


@functools.lru_cache(maxsize=None)
def _written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments `func` writes in place, as its schema marks them
    (`Tensor(a!)`) or `_UNMARKED_WRITES` lists them; read once per func (recording is per call)."""
    arguments = func._schema.arguments
    unmarked = _UNMARKED_WRITES.get(str(func), ())
    return tuple((position, argument.name) for position, argument in enumerate(arguments)
                 if position in unmarked or (argument.alias_info is not None and argument.alias_info.is_write))


def _written_inputs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """ids of the tensors `func` writes in place (`_written_arguments`)."""
    values = (args[position] if position < len(args) else kwargs.get(name)
              for position, name in _written_arguments(func))
    return {id(value) for value in values if isinstance(value, torch.Tensor)}


def _checked_input(arg: _Arg, func: Any) -> Any:
    if arg.scratch:
        return arg.value.clone()
    if isinstance(arg.value, torch.Tensor) and freed(arg.value):
        raise RuntimeError(f"an input of {func} in a recomputed run was freed after the forward (a parameter "
                           "sharded by something other than FSDP2?), so the run cannot be recomputed")
    if arg.version is not None and arg.value._version != arg.version:
        raise RuntimeError(f"an input of {func} in a recomputed run was modified in place after the forward, so "
                           "it cannot be recomputed (the plan should not have put this run in a region)")
    return arg.value


@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    # The recorded calls are already cast (autocast sits above the dispatch mode that saw them).
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


__all__ = ["RunTape", "counted_call"]
