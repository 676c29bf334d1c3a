"""Record a submodule's planned runs in its forward: which ATen calls are the runs', where
recording starts and stops, and one dispatch mode that serves every recording at once.

A run's calls are counted from a window's first submodule hook (`RunRecording`), by a
`RunRecorder` that hands the run's calls to a `planner.run_checkpoint.RunTape`. Windows of
different submodules' recordings may overlap without nesting (a run across two blocks starts
inside the first block's forward, where a run of that block may be recording, and ends after
it): one shared dispatch mode passes each call to every recorder that is on, in the order they
started, so each starts and stops at its own hooks.

Example:
    >>> recording = RunRecording(block, calls, ((52, 58),), (("norm2", 51, "mlp.1", 58),))
    >>> out = recording.run(block_forward, x, mask)
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from planner.memory import draws_random_numbers
from planner.run_checkpoint import RunTape, counted_call
from planner.sharded_units import UnitParameters, sharded_units

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
    """What records the runs of one window of a submodule call: counts its ATen calls (`counted_call`, as
    `planner.graph.run_checkpoints` does; not those inside a profiler scope that the plan does
    not open, such as FSDP2's hooks on submodules called inside it) and records each run in
    `runs` ((start, stop) call indices, counted from `start`) as a `RunTape`, checking each call's name against
    `calls`, the planned ones. A call that differs stops recording (`mismatch` says where);
    what was recorded up to it still replays.

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


__all__ = ["RunRecorder", "RunRecording", "calls_outside"]
