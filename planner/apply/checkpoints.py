"""Apply a plan inside the model's own forward: each planned submodule's `forward` runs under
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`, the way `gradient_checkpointing_enable()`
and `apply_activation_checkpointing` do, instead of replacing the model's forward.

The model's Python code still runs, so any batch and length it accepts works, module hooks fire
(FSDP2's `fully_shard`, DDP, PEFT adapters), the model keeps its class (`save_pretrained`,
`generate`) and `state_dict()` keys, and `torch.compile` sees ordinary checkpoint calls.
`remove_plan(model)` restores every `forward` exactly.

Example:
    >>> apply_plan(model, [ModuleCheckpoint("blocks.0", "Block")], planned_shapes={"x": (4, 256)})
    >>> remove_plan(model)
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.apply.policy import KeepPolicy, keep_contexts
from planner.apply.runs import RunRecording, calls_outside
from planner.apply.sequential import buffers_of_children, run_segments
from planner.core import ModuleCheckpoint, Segment, cache_off, cache_signature, split_sample, uncached_autocast
from planner.trace.tracing import bind_arguments

PLAN_ATTRIBUTE = "_checkpoint_plan"  # on the planned model: what apply_plan changed


@contextlib.contextmanager
def _entered(*contexts: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def shallow_clone(module: nn.Module, memo: dict[int, nn.Module] | None = None) -> nn.Module:
    """A new module tree with the same classes, attributes, Parameters and buffers.

    Example:
        >>> clone = shallow_clone(model)
        >>> clone.fc.weight is model.fc.weight, clone.fc is model.fc
        (True, False)
    """
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    clone = module.__class__.__new__(module.__class__)
    clone.__dict__.update(module.__dict__)
    # A plan applied to the original does not carry over: its forwards run the original's modules.
    clone.__dict__.pop(PLAN_ATTRIBUTE, None)
    forward = clone.__dict__.get("forward")
    if isinstance(forward, CheckpointedForward):
        if forward.previous is None:
            del clone.__dict__["forward"]
        else:
            clone.__dict__["forward"] = forward.previous
    memo[id(module)] = clone
    for name, value in module.__dict__.items():
        if "hook" in name and isinstance(value, dict):
            clone.__dict__[name] = value.copy()
    clone._parameters = module._parameters.copy()
    clone._buffers = module._buffers.copy()
    clone._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    clone._modules = {
        name: None if child is None else shallow_clone(child, memo)
        for name, child in module._modules.items()
    }
    return clone


@contextlib.contextmanager
def restored_buffers(module: nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """Put the named buffers back as they were afterwards: recomputation must not update
    BatchNorm statistics (or any other buffer the module writes) a second time."""
    saved = {name: module.get_buffer(name).clone() for name in names}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                module.get_buffer(name).copy_(value)


class CheckpointedForward:
    """Stands in for one submodule's `forward`: the original forward under non-reentrant
    checkpoint while gradients are on, unchanged otherwise (eval, `generate`, `no_grad`).

    The RNG state is saved for recomputation only where the module draws random numbers (a
    copy of the generator's state per call costs time); buffers the forward writes are put
    back after recomputation (not under torch.compile, which applies buffer writes once); the
    calls in `spec.saved_calls` are kept by a selective-checkpoint policy (`KeepPolicy`)."""

    def __init__(self, module: nn.Module, spec: ModuleCheckpoint, previous: Any):
        self.module = module
        self.spec = spec
        self.previous = previous  # an instance-level forward that was there before, or None
        try:  # what inspect sees of the forward (the Trainer drops dataset columns it does not name)
            self.__signature__ = inspect.signature(previous or type(module).forward.__get__(module))
        except (TypeError, ValueError):
            pass
        self.calls = 0  # calls since the model's last forward began (see AppliedPlan)
        # runs recomputed alone: hooks on its submodules start and stop their recording
        self.recording = RunRecording(module, spec.calls, spec.runs, spec.run_windows) if spec.runs else None
        self.warned = False
        # per slice of a Sequential's children: the buffers its recomputation puts back
        self.slice_buffers = {start: buffers_of_children(module, spec.written_buffers, start, stop)
                              for start, stop, _ in spec.segments}
        # torch.compile takes a context_fn that is a function or a functools.partial of one;
        # cache_hash lets AOTAutograd's cache tell policies apart.
        # Under torch.compile, runs are a policy on the whole forward that keeps every other call.
        compiled_calls = spec.saved_calls if not spec.runs else calls_outside(spec.calls, spec.runs)
        self.compiled_context_fn: Any = functools.partial(keep_contexts, compiled_calls)
        self.compiled_context_fn.cache_hash = f"planner.apply.policy.keep_contexts{compiled_calls!r}"

    def original(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def _contexts(self, policy: KeepPolicy | None = None) -> tuple[Any, Any]:
        forward, recompute = (contextlib.nullcontext(), contextlib.nullcontext()) if policy is None else (
            keep_contexts(self.spec.saved_calls, policy))
        if self.spec.written_buffers:  # outside the policy's mode: its copies are no calls of the forward
            recompute = _entered(restored_buffers(self.module, self.spec.written_buffers), recompute)
        return forward, recompute

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        self.calls += 1
        if torch.compiler.is_compiling() or not self.spec.uncached:  # (compiled code has no autocast cache)
            return self._checkpointed(*args, **kwargs)
        with uncached_autocast():  # (see ModuleCheckpoint.uncached)
            return self._checkpointed(*args, **kwargs)

    def _checkpointed(self, *args: Any, **kwargs: Any) -> Any:
        if self.spec.segments:
            (value,) = (*args, *kwargs.values())  # nn.Sequential's forward takes one input
            return run_segments(self.module, value, self.spec.segments, self._checkpoint_slice)
        if self.spec.runs and not torch.compiler.is_compiling():
            return self._recompute_runs(*args, **kwargs)
        options: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": self.spec.random}
        if torch.compiler.is_compiling():
            if self.spec.saved_calls or self.spec.runs:
                options["context_fn"] = self.compiled_context_fn
            return checkpoint(self.original, *args, **options, **kwargs)
        policy = KeepPolicy(self.spec.saved_calls) if self.spec.saved_calls else None
        if policy is not None or self.spec.written_buffers:
            options["context_fn"] = functools.partial(self._contexts, policy)
        result = checkpoint(self.original, *args, **options, **kwargs)
        missed = policy.missed() if policy is not None else []
        if missed and not self.warned:
            self.warned = True
            warnings.warn(f"{self.spec.module!r} made no call {missed[0][0]} number {missed[0][1] + 1} to keep: its "
                          "ATen calls differ from the planned ones (another input layout?), so it keeps less than "
                          "planned and recomputes the rest", stacklevel=2)
        return result

    def _checkpoint_slice(self, run: Any, segment: Segment, value: Any) -> Any:
        start, _, random = segment
        options: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": random}
        written = self.slice_buffers[start]
        if written and not torch.compiler.is_compiling():  # (compiled: buffer writes apply once)
            options["context_fn"] = functools.partial(_restoring, self.module, written)
        return checkpoint(run, value, **options)

    def _recompute_runs(self, *args: Any, **kwargs: Any) -> Any:
        assert self.recording is not None
        result = self.recording.run(self.original, *args, **kwargs)
        if self.recording.mismatch is not None and not self.warned:
            self.warned = True
            warnings.warn(f"{self.spec.module!r} makes other ATen calls than planned ({self.recording.mismatch}; "
                          "another input layout?), so it recomputes less than planned and holds more memory",
                          stacklevel=3)
        return result


def _restoring(module: nn.Module, names: tuple[str, ...]) -> tuple[Any, Any]:
    return contextlib.nullcontext(), restored_buffers(module, names)


@dataclass
class AppliedPlan:
    """What `apply_plan` changed on a model, kept on it so that `remove_plan` can undo it.

    A forward pre-hook on the model warns once when an input is larger than the planned one
    (the memory promise holds up to the planned shape), once when a planned submodule ran
    more than once in one forward (each call is checkpointed; the plan counted one), and once
    when the model's own (Hugging Face) gradient checkpointing is on too; with gradients on, it
    turns a Hugging Face forward's `use_cache` off (`planner.core.cache_off`), as planned."""

    forwards: dict[str, CheckpointedForward]
    planned_shapes: dict[str, tuple[int, ...]]
    signature: inspect.Signature | None
    handle: Any = None
    warned: set[str] = field(default_factory=set)
    # the submodules that have Hugging Face's flag (`planner.core.self_checkpointing`), found at apply
    flaggable: tuple[nn.Module, ...] = ()
    cache: inspect.Signature | None = None  # the model's forward's, where it takes use_cache (cache_off)

    def before_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                       ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if module.training and "checkpointing" not in self.warned and any(
                flagged.gradient_checkpointing is True for flagged in self.flaggable):
            self.warned.add("checkpointing")
            warnings.warn("Hugging Face gradient checkpointing is on as well as the plan "
                          "(gradient_checkpointing_enable() or activation_checkpointing_enable(), which "
                          "TrainingArguments can call): its layers are recomputed on top of the plan's regions, "
                          "at a cost the plan does not count; turn it off", stacklevel=3)
        repeated = [path for path, forward in self.forwards.items() if forward.calls > 1]
        if repeated and "repeated" not in self.warned:
            self.warned.add("repeated")
            warnings.warn(f"planned submodule {repeated[0]!r} ran more than once in one forward; every call is "
                          "checkpointed, but the plan's memory figures count one call", stacklevel=3)
        for forward in self.forwards.values():
            forward.calls = 0
        self._check_shapes(args, kwargs)
        if self.cache is None or not torch.is_grad_enabled():  # (generate() keeps its cache)
            return None
        args, kwargs, asked = cache_off(self.cache, args, kwargs)
        if asked and "cache" not in self.warned:
            self.warned.add("cache")
            warnings.warn("use_cache=True turned off while the plan's regions are checkpointed (a layer's "
                          "recomputation would append to the cache), as Hugging Face's gradient checkpointing "
                          "does", stacklevel=3)
        return args, kwargs

    def _check_shapes(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if "shape" in self.warned or self.signature is None or torch.compiler.is_compiling():
            return
        try:
            bound = bind_arguments(self.signature, args, kwargs)
        except TypeError:
            return  # the model's own forward reports a bad call
        for name, planned in self.planned_shapes.items():
            value = bound.get(name)
            if isinstance(value, torch.Tensor) and _larger(tuple(value.shape), planned):
                self.warned.add("shape")
                warnings.warn(f"input {name!r} has shape {tuple(value.shape)}, larger than the planned {planned}: "
                              "the plan's memory promise holds up to the planned shape; plan again with the "
                              "largest batch and length you train on", stacklevel=4)
                return


def _larger(shape: tuple[int, ...], planned: tuple[int, ...]) -> bool:
    if len(shape) != len(planned):
        return _numel(shape) > _numel(planned)
    return any(size > limit for size, limit in zip(shape, planned))


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def sample_shapes(model: nn.Module, sample: Any) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor argument of `sample`, by forward's parameter name.

    Example:
        >>> sample_shapes(model, {"input_ids": torch.zeros(4, 256, dtype=torch.long)})
        {'input_ids': (4, 256)}
    """
    args, kwargs = split_sample(sample)
    bound = bind_arguments(inspect.signature(model.forward), args, kwargs)
    return {name: tuple(value.shape) for name, value in bound.items() if isinstance(value, torch.Tensor)}


def applied_plan(model: nn.Module) -> tuple[str, AppliedPlan] | None:
    """The plan applied to `model` or to one of its submodules (under a DDP or other wrapper),
    with that submodule's path; None if there is none."""
    for path, module in model.named_modules():
        state = module.__dict__.get(PLAN_ATTRIBUTE)
        if state is not None:
            return path, state
    return None


def _class_names(module: nn.Module) -> set[str]:
    # FSDP2 swaps a module's class for a subclass ("FSDPGPT2Block"): its bases still match
    return {cls.__name__ for cls in type(module).__mro__}


def check_modules(model: nn.Module, checkpoints: Sequence[ModuleCheckpoint], planned_for: str) -> None:
    """Raise ValueError naming the first planned submodule that `model` lacks or that has
    another class, or a written buffer it does not have, or whose children a plan cuts in
    slices while something else replaced its forward.

    Example:
        >>> check_modules(model, plan_checkpoints, "GPT2LMHeadModel")
    """
    name = type(model).__name__
    for spec in checkpoints:
        try:
            module = model.get_submodule(spec.module)
        except AttributeError:
            raise ValueError(f"{name} does not match the plan (made for {planned_for}): it has no submodule "
                             f"{spec.module!r}") from None
        if spec.module_class not in _class_names(module):
            raise ValueError(f"{name} does not match the plan (made for {planned_for}): {spec.module!r} is a "
                             f"{type(module).__name__} here and was a {spec.module_class}")
        forward = module.__dict__.get("forward")
        if spec.segments and forward is not None and not isinstance(forward, CheckpointedForward):
            raise ValueError(f"{spec.module!r} has a forward of its own instance, not nn.Sequential's: its children "
                             "cannot be checkpointed in slices")
        for buffer in spec.written_buffers:
            try:
                module.get_buffer(buffer)
            except AttributeError:
                raise ValueError(f"{name} does not match the plan (made for {planned_for}): "
                                 f"{spec.module!r} has no buffer {buffer!r}") from None


def apply_plan(model: nn.Module, checkpoints: Sequence[ModuleCheckpoint],
               planned_shapes: dict[str, tuple[int, ...]] | None = None, planned_for: str = "") -> nn.Module:
    """Run each planned submodule of `model` under checkpoint, in place; return `model`.

    A plan already applied is removed first. Raises ValueError (before changing anything)
    where `model` lacks a planned submodule.

    Example:
        >>> apply_plan(model, [ModuleCheckpoint("blocks.0", "Block")]) is model
        True
    """
    check_modules(model, checkpoints, planned_for or type(model).__name__)
    if PLAN_ATTRIBUTE in model.__dict__:
        remove_plan(model)
    forwards: dict[str, CheckpointedForward] = {}
    for spec in checkpoints:
        module = model.get_submodule(spec.module)
        forward = CheckpointedForward(module, spec, module.__dict__.get("forward"))
        module.__dict__["forward"] = forward  # an instance attribute: the class stays the same
        forwards[spec.module] = forward
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        signature = None
    flaggable = tuple(module for module in model.modules() if hasattr(module, "gradient_checkpointing"))
    state = AppliedPlan(forwards, dict(planned_shapes or {}), signature, flaggable=flaggable,
                        cache=cache_signature(model))
    state.handle = model.register_forward_pre_hook(state.before_forward, with_kwargs=True)
    model.__dict__[PLAN_ATTRIBUTE] = state
    return model


def remove_plan(model: nn.Module) -> nn.Module:
    """Undo `apply_plan` (or `Plan.apply`): every submodule's forward is the original again.
    Works on the planned model or on a wrapper around it (DDP). Returns `model`.

    Example:
        >>> p.apply(model)
        >>> remove_plan(model) is model
        True
    """
    found = applied_plan(model)
    if found is None:
        raise ValueError(f"no checkpoint plan is applied to this {type(model).__name__}")
    path, state = found
    root = model.get_submodule(path)
    for module_path, forward in state.forwards.items():
        module = root.get_submodule(module_path)
        if module.__dict__.get("forward") is not forward:
            raise ValueError(f"the forward of {module_path!r} was replaced after the plan was applied; "
                             "not removing the plan")
    for module_path, forward in state.forwards.items():
        module = root.get_submodule(module_path)
        if forward.recording is not None:
            forward.recording.remove()
        if forward.previous is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = forward.previous
    state.handle.remove()
    del root.__dict__[PLAN_ATTRIBUTE]
    return model


__all__ = ["AppliedPlan", "CheckpointedForward", "PLAN_ATTRIBUTE", "applied_plan", "apply_plan", "check_modules",
           "remove_plan", "restored_buffers", "sample_shapes", "shallow_clone"]
