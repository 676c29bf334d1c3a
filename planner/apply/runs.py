"""Recompute a run of ATen calls inside one submodule call, and nothing else of it.

`checkpoint` on a submodule drops every tensor its forward saves for backward and replays the
forward up to its last saving call; a selective policy can keep calls' outputs, but then also
caches outputs that nothing saves (a linear's output feeding dropout). A region that is a run
of nodes inside a block (its norm and the next linear's input, an activation) is applied here
instead, and memory is that of a region on exactly those nodes:

- `RunTape`: one run's calls in one forward. It records each call (op, arguments) and, once
  autograd has saved the call's tensors, re-registers those that the run itself made with
  pack/unpack hooks that drop them (`SavedTensor.register_hooks`). The first unpack in backward
  replays the recorded calls under `no_grad`, from the run's inputs (kept, as checkpoint keeps
  a region's inputs) and the RNG state saved before its first random call, and hands each
  dropped tensor back once. A dropped tensor whose autograd node is gone by then (an in-place
  call whose result nothing reads: its node is freed in forward and never runs) is not made
  again, as checkpoint's weak holders skip it: kept, it would stay alive until the run's tape
  is freed, after backward. Tensors the run saves that it did not make (its inputs,
  parameters) and tensors that later calls save stay as they are;
- `RunRecorder`: counts a submodule's ATen calls from a window's first submodule hook and hands
  the run's calls to a `RunTape`. Windows of different submodules' recordings may overlap
  without nesting (a run across two blocks starts inside the first block's forward, where a
  run of that block may be recording, and ends after it): one shared dispatch mode passes each
  call to every recorder that is on, in the order they started, so each starts and stops at
  its own hooks;
- `RunRecording`: a submodule's planned runs in each of its forwards: which ATen calls are the
  runs', and where recording starts and stops;
- `sharded_units`, `UnitParameters`, `gathered`, `freed`: parameters FSDP2 frees between
  forward and backward, gathered back for a run's replay. `fully_shard` frees a unit's
  gathered parameters after its forward and gathers them again just before its backward. A run
  recorded across units (from one sharded stage's last BatchNorm into the next stage's
  convolution) replays in the later unit's backward, while the earlier unit's parameters are
  freed: the replay gathers them itself and frees them after, as FSDP2's pre-forward hook does
  for a checkpointed module's recomputation;
- `calls_outside`: what a selective policy keeps to recompute only the runs (how torch.compile
  applies them).

Example:
    >>> recording = RunRecording(block, calls, ((52, 58),), (("norm2", 51, "mlp.1", 58),))
    >>> out = recording.run(block_forward, x, mask)  # records the runs; backward replays them
    >>> recording.remove()
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten, tree_unflatten

from planner.core import counted_call
from planner.measure.memory import draws_random_numbers


def sharded_units(module: nn.Module) -> tuple[nn.Module, ...]:
    """The FSDP2 units (modules `fully_shard` was applied to) in `module`'s tree, parents first."""
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FSDPModule

    return tuple(m for m in module.modules() if isinstance(m, FSDPModule))


class UnitParameters:
    """Which unit gathered a parameter (the gathered tensor a forward's calls receive)."""

    def __init__(self, units: tuple[nn.Module, ...]):
        self.units = units
        self._owners: dict[int, nn.Module | None] = {}

    def owner(self, tensor: torch.Tensor) -> nn.Module | None:
        """The innermost unit whose parameters include `tensor` now, or None."""
        if not self.units or not isinstance(tensor, nn.Parameter):
            return None
        if id(tensor) not in self._owners:  # (a unit gathered since the last look)
            for unit in self.units:  # parents first: a nested unit's own parameters are its
                self._owners.update(dict.fromkeys(map(id, unit.parameters()), unit))
            self._owners.setdefault(id(tensor), None)
        return self._owners[id(tensor)]


def freed(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s memory was released (FSDP2 resizes a freed parameter's storage to 0)."""
    return tensor.numel() > 0 and tensor.untyped_storage().size() == 0


@contextlib.contextmanager
def gathered(units: Iterable[nn.Module]) -> Iterator[None]:
    """Gather the units' parameters (`FSDPModule.unshard`) for the block, free them after."""
    units = list(units)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


_Ref = tuple[int, int]  # (call within the run, output of that call)
_SAVED_PREFIX = "_raw_saved_"
_saved_names: dict[type, tuple[str, ...]] = {}  # autograd node class -> its saved-tensor attributes


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
                raw, suffix = getattr(node, name), name[len(_SAVED_PREFIX):]
                # (a custom autograd.Function's node unpacks its saved tensors as `saved_tensors`)
                unpacked = "_saved_" + suffix if hasattr(node, "_saved_" + suffix) else "saved_" + suffix
                value = getattr(node, unpacked)
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
        # (with gradients on, as the calls were recorded, on detached arguments: see `_call`)
        with gathered(freed_units.values()), torch.enable_grad(), _no_autocast(), forked:
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
    # Detached, no call records a graph; gradients stay on, as in the forward the call was recorded
    # in: some kernels make what their backward saves only then (mkldnn's LSTM layer, its workspace).
    flat = [value.detach() if isinstance(value, torch.Tensor) else value for value in flat]
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


_SCOPE_ENTER = "profiler._record_function_enter_new.default"  # torch.profiler.record_function
_SCOPE_EXIT = "profiler._record_function_exit._RecordFunction"


class _SharedDispatch(TorchDispatchMode):
    """The one dispatch mode under which every recorder that is on sees each ATen call once:
    on while any is (entered by the first to start, left by the last to stop)."""

    active: list[RunRecorder] = []
    mode: _SharedDispatch | None = None

    @classmethod
    def add(cls, recorder: RunRecorder) -> None:
        cls.active.append(recorder)
        if cls.mode is None:
            cls.mode = cls()
            cls.mode.__enter__()

    @classmethod
    def remove(cls, recorder: RunRecorder) -> None:
        cls.active.remove(recorder)
        if not cls.active and cls.mode is not None:
            mode, cls.mode = cls.mode, None
            if _get_current_dispatch_mode() is not mode:
                # Modes leave by popping the top of one stack: another mode entered or left
                # inside the window popped this one (and stopped the recording), or is popped here.
                warnings.warn("a recomputed run's recording crossed the scope of another dispatch mode (entered "
                              "or left inside the run's window: a selective-checkpoint policy, a profiler, your "
                              "own TorchDispatchMode), so the run may hold more memory than planned", stacklevel=2)
            mode.__exit__(None, None, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        tapes = [(recorder, recorder.before(func, name, args, kwargs)) for recorder in list(self.active)]
        result = func(*args, **kwargs)
        for recorder, tape in tapes:
            if tape is not None:
                recorder.after(tape, func, args, kwargs, result)
        return result


class RunRecorder:
    """What records the runs of one window of a submodule call: counts its ATen calls
    (`planner.core.counted_call`, as `planner.problem.graph.run_checkpoints` does; not those
    inside a profiler scope that the plan does not open, such as FSDP2's hooks on submodules
    called inside it) and records each run in `runs` ((start, stop) call indices, counted from
    `start`) as a `RunTape`, checking each call's name against `calls`, the planned ones. A
    call that differs stops recording (`mismatch` says where); what was recorded up to it still
    replays.

    Example:
        >>> with RunRecorder(calls=("aten.native_layer_norm.default", "aten.t.default"), runs=((0, 1),)):
        ...     y = block(x)
    """

    def __init__(self, calls: Sequence[str], runs: Sequence[tuple[int, int]], start: int = 0,
                 units: UnitParameters | None = None):
        self.units = units
        self.calls = tuple(calls)
        self.runs = tuple(runs)
        self.count = start  # the index of the first call it sees (started by a submodule's hook)
        self.tapes: list[RunTape] = []
        self.mismatch: str | None = None
        self.dropped = 0
        self._pending: tuple[RunTape, list[Any]] | None = None  # the last recorded call's outputs
        self._run = 0  # index into `runs` of the current or next run
        self._foreign_scopes = 0  # profiler scopes open that are not the plan's calls

    def before(self, func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> RunTape | None:
        """Count a call about to run (named `name`); the tape that records it, or None."""
        if not counted_call(name) or self.mismatch is not None:  # (autograd's detach: while it saves)
            return None
        if name in (_SCOPE_ENTER, _SCOPE_EXIT) and self._planned(self.count) != name:
            # a profiler scope the model's graph does not open: FSDP2's hooks on the submodules
            # called inside a window (all-gather before a block, reshard after); not counted,
            # nor is the work inside it
            self._foreign_scopes = max(0, self._foreign_scopes + (1 if name == _SCOPE_ENTER else -1))
            return None
        if self._foreign_scopes:
            return None
        self.finish()
        index = self.count
        self.count += 1
        while self._run < len(self.runs) and self.runs[self._run][1] <= index:
            self._run += 1
        if self._run == len(self.runs) or index < self.runs[self._run][0]:
            return None
        if self._planned(index) != name:
            self.mismatch = f"call {index} is {name} here and {self._planned(index)} in the plan"
            return None
        if index == self.runs[self._run][0]:
            self.tapes.append(RunTape(units=self.units))
        tape = self.tapes[-1]
        if draws_random_numbers(func, args, kwargs):
            tape.note_random(args, kwargs)
        return tape

    def after(self, tape: RunTape, func: Any, args: Any, kwargs: dict[str, Any], result: Any) -> None:
        """Record a call `before` gave `tape` for, now that it returned `result`."""
        self._pending = (tape, tape.record(func, args, kwargs, result))

    def _planned(self, index: int) -> str:
        return self.calls[index] if index < len(self.calls) else "none"

    def finish(self) -> None:
        """Drop the saved tensors of the last recorded call (autograd saves them after the
        call returns, so this runs at the next call and when the forward ends)."""
        if self._pending is not None:
            tape, outputs = self._pending
            self._pending = None
            self.dropped += tape.drop_saved(outputs)

    def __enter__(self) -> "RunRecorder":
        _SharedDispatch.add(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _SharedDispatch.remove(self)
        self.finish()
        for tape in self.tapes:
            tape.made = {}  # keys of tensors that may be freed now: never looked up again


class RunRecording:
    """Records a submodule's planned runs (`ModuleCheckpoint.runs`) in each of its forwards: a
    `RunRecorder` per window of calls, started by the forward pre-hook of the window's first
    submodule (or as the forward starts) and stopped by the forward hook of its last (or as the
    forward ends), so the dispatch mode sees few calls besides the run's; runs whose windows
    overlap share one recorder.

    Example:
        >>> recording = RunRecording(block, calls, ((52, 58),), (("norm2", 51, "mlp.1", 58),))
        >>> out = recording.run(block_forward, x, mask)
        >>> recording.remove()  # its hooks
    """

    def __init__(self, module: torch.nn.Module, calls: Sequence[str], runs: Sequence[tuple[int, int]],
                 windows: Sequence[tuple[str, int, str, int]] = ()):
        windows = tuple(windows) or tuple(("", 0, "", len(calls)) for _ in runs)  # (plans saved without them)
        merged: list[list[Any]] = []  # [entry, its first call, exit, its stop call, runs]
        for run, (entry, first, leave, stop) in sorted(zip(runs, windows), key=lambda pair: pair[1][1]):
            if merged and first < merged[-1][3]:  # overlaps the previous window
                if stop > merged[-1][3]:
                    merged[-1][2:4] = [leave, stop]
                merged[-1][4].append(run)
            else:
                merged.append([entry, first, leave, stop, [run]])
        self.module = module
        self.calls = tuple(calls)
        self.windows = [(entry, first, leave, tuple(sorted(found))) for entry, first, leave, _, found in merged]
        self.recorders: list[RunRecorder] | None = None
        self.state: list[int] = []  # per window: 0 not started, 1 recording, 2 stopped
        self.mismatch: str | None = None
        self.dropped = 0
        self.handles = []
        for index, (entry, _, leave, _) in enumerate(self.windows):
            if entry:
                start = functools.partial(self._start, index)
                self.handles.append(module.get_submodule(entry).register_forward_pre_hook(lambda *_, f=start: f()))
            if leave:
                stop = functools.partial(self._stop, index)
                self.handles.append(module.get_submodule(leave).register_forward_hook(
                    lambda *_, f=stop: f(), always_call=True))

    def _start(self, index: int) -> None:
        if self.recorders is not None and self.state[index] == 0:
            self.state[index] = 1
            self.recorders[index].__enter__()

    def _stop(self, index: int) -> None:
        if self.recorders is not None and self.state[index] == 1:
            self.state[index] = 2
            self.recorders[index].__exit__(None, None, None)

    def run(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        """`forward(*args, **kwargs)`, recording the runs; `mismatch` and `dropped` say how it went."""
        units = UnitParameters(sharded_units(self.module))
        self.recorders = [RunRecorder(self.calls, runs, first, units) for _, first, _, runs in self.windows]
        self.state = [0] * len(self.windows)
        try:
            for index, (entry, _, _, _) in enumerate(self.windows):
                if not entry:
                    self._start(index)
            return forward(*args, **kwargs)
        finally:
            for index in reversed(range(len(self.windows))):
                self._stop(index)
            recorders, self.recorders = self.recorders, None
            self.mismatch = next((r.mismatch for r in recorders if r.mismatch is not None), None)
            self.dropped = sum(r.dropped for r in recorders)

    def remove(self) -> None:
        """Remove its hooks from the submodules."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


def calls_outside(calls: Sequence[str], runs: Sequence[tuple[int, int]]) -> tuple[tuple[str, int], ...]:
    """(name, occurrence) of each of `calls` outside `runs`: what a selective policy keeps to
    recompute only the runs (how torch.compile applies them).

    Example:
        >>> calls_outside(("aten.mm.default", "aten.gelu.default", "aten.mm.default"), ((1, 2),))
        (('aten.mm.default', 0), ('aten.mm.default', 1))
    """
    seen: dict[str, int] = {}
    found = []
    for index, name in enumerate(calls):
        if not any(start <= index < stop for start, stop in runs):
            found.append((name, seen.get(name, 0)))
        seen[name] = seen.get(name, 0) + 1
    return tuple(found)


__all__ = ["RunRecorder", "RunRecording", "RunTape", "UnitParameters", "calls_outside", "freed", "gathered",
           "sharded_units"]
