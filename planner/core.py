"""The records every stage shares, at the bottom of the data flow: one `NodeProfile` per compute
node (in `node.meta["planner.profile"]`, written by `planner.measure.profile` and
`planner.measure.sizes`) and one `GraphProfile` for the graph, which
`planner.problem.graph.build_problem` turns into the solvers' `NodeCost`s; a region's
`ModuleCheckpoint` (what `planner.apply` applies); how a sample is read (`split_sample`,
`sample_tensors`) and run in training (`training_sample`: a Hugging Face cache off); the training loss and step that measuring and verifying both run
(`training_loss`, `training_step`); which ATen calls a run counts (`counted_call`); and which
submodules checkpoint themselves (`self_checkpointing`).

Example:
    >>> record = gm.graph.find_nodes(op="call_module", target="fc1")[0].meta["planner.profile"]
    >>> record.saved_bytes, record.transient_bytes
    >>> training_step(model, {"input_ids": ids, "labels": ids})
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten


@dataclass
class NodeProfile:
    """What one fx node costs. Node references are fx node names of the owning nodes."""

    forward_ms: float = 0.0
    output_bytes: int = 0
    grad_bytes: int = 0
    saved_bytes: int = 0
    transient_bytes: int = 0
    param_grad_bytes: int = 0
    late_grad_bytes: int = 0  # of those, summed from a broadcast after its backward returns (NodeCost's)
    parameters: tuple[str, ...] = ()  # trainable parameters it reads (first qualified name of each)
    uses: tuple[str, ...] = ()
    saves: tuple[str, ...] = ()
    mutates: tuple[str, ...] = ()
    grad_aliases: tuple[str, ...] = ()  # owners whose gradient its backward hands on uncopied
    # (owner, view node, bytes) per view of an owner's output it reads, where it is the view's
    # last reader: its gradient for the view is a storage of its own until that view node's
    # backward (planner.measure.view_gradients)
    view_grads: tuple[tuple[str, str, int], ...] = ()
    mutated_buffers: tuple[str, ...] = ()  # qualified names of buffers written (BatchNorm statistics)
    backward_transient_bytes: int = 0  # temporaries of this node's backward (freed when it ends)
    holds: tuple[str, ...] = ()  # outputs the model's own code still references while it runs (planner.measure.holds)
    arguments: tuple[str, ...] = ()  # outputs passed to a submodule call starting here (planner.measure.holds)
    random: bool = True  # draws random numbers (dropout): a region holding it must replay the RNG
    # False where backward never reaches its autograd nodes (nothing returned depends on its
    # output): what it saved is freed with its output, not by its backward
    backward_runs: bool = True
    # its last saved tensor is packed before its outputs are made (an input or an intermediate,
    # saved before the last kernel runs): recomputation that stops here never makes them
    stops_before_output: bool = False
    # forward time up to its last saved tensor (what recomputation stopping here costs); None
    # where not measured (then all of forward_ms counts)
    stop_ms: float | None = None
    stop_transient_bytes: int | None = None  # stops_before_output: temporaries up to its last save
    # graph inputs (placeholder names, not parameters or buffers) it reads, and writes in place:
    # a region must not recompute from an input written in place (planner.problem.graph.build_problem)
    input_reads: tuple[str, ...] = ()
    input_writes: tuple[str, ...] = ()
    # its ATen calls in the model's own forward, in order (planner.measure.holds; empty where the whole
    # step was not run, or the model's calls differ from the graph's)
    aten_calls: tuple[str, ...] = ()
    # where a region may keep its output (planner.measure.holds.NodeCalls.keepable), the positions in
    # `aten_calls` of the calls that make its storages: what a selective policy caches
    keep_calls: tuple[int, ...] = ()
    # (start, stop) compute-node indices: kept only by regions within them (NodeCost.keep_span)
    keep_span: tuple[int, int] | None = None
    # (start, stop) compute-node indices of the largest submodule call holding it whose ATen
    # calls the model's forward makes exactly as the graph does, from a submodule call at or
    # before it on (planner.measure.holds.NodeCalls.run_span): a run of nodes inside it may be
    # recomputed alone (planner.apply.runs)
    call_span: tuple[int, int] | None = None
    # tensors autograd saved for its backward, counted as packed (parameters included): in a
    # region, checkpoint's hooks pack and unpack each one
    saved_tensors: int = 0
    # what autograd saved for its backward past the saved-tensor hooks (Python numbers taken as
    # tensors): held from its forward to its backward whatever the plan (NodeCost's)
    unhooked_saved_bytes: int = 0
    # parameters it cast under autocast, saved or not: autocast's cache holds them to the end of
    # forward outside a region (regions run uncached: `uncached_autocast`), and `cast_saved_bytes`
    # of them it saved (counted in `saved_bytes`; the rest are NodeCost.forward_held_bytes)
    cast_bytes: int = 0
    cast_saved_bytes: int = 0
    # parameters whose autocast copies it used, cast here or found in autocast's cache
    cast_parameters: tuple[str, ...] = ()


@dataclass(frozen=True)
class GraphProfile:
    """Whole-graph figures next to the per-node records in `node.meta`."""

    parameter_bytes: int
    gradient_bytes: int
    buffer_bytes: int
    input_bytes: int
    device: torch.device  # the device the plan is for
    timing: str  # how forward times were obtained
    # Checkpoint keeps a copy of the RNG state for each region that draws random numbers, from
    # its forward to its backward: this many bytes each (the simulator counts them per region).
    rng_state_bytes: int = 0
    measurement: str = "whole step"  # or "node by node": sizes on fake tensors, see profile_fake
    times_estimated: bool = False  # times are roofline estimates for a target GPU, not measured
    scratch_measured: bool = True  # kernel scratch (workspace the allocator sees) was measured
    loss_bytes: int = 0  # held through backward by the loss outside the graph (see training_loss_bytes)
    loss_scratch_bytes: int = 0  # that loss's kernel scratch, when forward is done (Problem.loss_scratch_bytes)
    # Gradients in flight, measured: (node whose backward made the storage, node whose backward
    # freed it, bytes), where the whole step ran (None: derived from the graph by the solvers)
    gradients: tuple[tuple[str, str, int], ...] | None = None


# a slice: (start, stop, random), `ModuleCheckpoint.segments`
Segment = tuple[int, int, bool]


@dataclass(frozen=True)
class ModuleCheckpoint:
    """One region of a plan: one call of a submodule, recomputed in backward, keeping the
    outputs of the ATen calls in `saved_calls` (a selective-checkpoint policy).

    Example:
        >>> ModuleCheckpoint("transformer.h.3", "GPT2Block", random=True,
        ...                  saved_calls=(("aten.addmm.default", 0), ("aten.addmm.default", 2)))
    """

    module: str  # the submodule's path in the model ("transformer.h.3")
    module_class: str  # its class name when planned (checked when applied)
    random: bool = True  # draws random numbers: recomputation replays the RNG state
    written_buffers: tuple[str, ...] = ()  # buffers its forward writes (relative names)
    # ATen calls whose outputs its forward keeps for backward, so recomputation skips them:
    # (func name, occurrence of that func within the forward, from 0); () keeps nothing
    saved_calls: tuple[tuple[str, int], ...] = ()
    # Where given, the forward is not checkpointed: only these runs of its ATen calls ((start,
    # stop) call indices, `planner.apply.runs`) are recomputed, checked against `calls`,
    # the names of all its calls as planned.
    runs: tuple[tuple[int, int], ...] = ()
    calls: tuple[str, ...] = ()
    # per run: the submodules (paths relative to this one, "" for itself) whose forward pre-hook
    # starts recording and whose forward hook stops it, with the calls where they start and stop
    run_windows: tuple[tuple[str, int, str, int], ...] = ()
    # Where given (an `nn.Sequential`), the forward is not checkpointed: each (start, stop,
    # random) slice of its children runs under one checkpoint call (`planner.apply.sequential`),
    # replaying the RNG state where random (a slice that draws random numbers).
    segments: tuple[Segment, ...] = ()
    # runs with autocast's cache off (`uncached_autocast`): set where no parameter's autocast copy
    # is used by two calls of the model (else a region's own copies of a shared parameter's casts
    # would differ from the one cached copy the plan was measured with)
    uncached: bool = False


def split_sample(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sample is a Tensor, a tuple/list of positional args, or a dict of keyword args.

    Example:
        >>> split_sample(torch.ones(2))
        ((tensor([1., 1.]),), {})
    """
    if isinstance(sample, torch.Tensor):
        return (sample,), {}
    if isinstance(sample, (tuple, list)):
        return tuple(sample), {}
    if isinstance(sample, dict):
        return (), dict(sample)
    raise TypeError(
        f"sample must be a Tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments for the model's forward, not {type(sample).__name__}"
    )


CACHE_ARGUMENT = "use_cache"  # Hugging Face's switch for the key-value cache a forward returns


def cache_signature(model: nn.Module) -> inspect.Signature | None:
    """The signature of `model.forward` where it takes Hugging Face's `use_cache`: by name, or in
    its `**kwargs` where the model has a Hugging Face config with `use_cache` (a PEFT model
    passes them on to the model it wraps); else None.

    Example:
        >>> cache_signature(gpt2) is not None, cache_signature(nn.Linear(2, 2))
        (True, None)
    """
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    if CACHE_ARGUMENT in signature.parameters:
        return signature
    passes_on = any(parameter.kind == parameter.VAR_KEYWORD for parameter in signature.parameters.values())
    return signature if passes_on and hasattr(getattr(model, "config", None), CACHE_ARGUMENT) else None


def cache_off(signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
    """The arguments with `use_cache` (Hugging Face) set to False, for a forward of `signature`
    (`cache_signature`; None: the arguments as they are), as Hugging Face's own gradient
    checkpointing sets it in training: a cache would hold every layer's keys and values to the
    end of the step, and a checkpointed layer's recomputation would append them to it a second
    time. Also whether the call asked for the cache (`use_cache=True`).

    Example:
        >>> cache_off(cache_signature(gpt2), (ids,), {"labels": ids})[1]["use_cache"]
        False
    """
    if signature is None:
        return args, kwargs, False
    positional = [name for name, parameter in signature.parameters.items()
                  if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)]
    if CACHE_ARGUMENT in positional and positional.index(CACHE_ARGUMENT) < len(args):
        at = positional.index(CACHE_ARGUMENT)
        return (*args[:at], False, *args[at + 1:]), kwargs, args[at] is True
    return args, {**kwargs, CACHE_ARGUMENT: False}, kwargs.get(CACHE_ARGUMENT) is True


def training_sample(model: nn.Module, sample: Any) -> Any:
    """`sample` as a planned model trains on it (`cache_off`): where the model's forward takes
    `use_cache`, with `use_cache=False` (a tuple sample becomes a dict of its arguments by name,
    where it does not give `use_cache` itself); else `sample` itself.

    Example:
        >>> training_sample(gpt2, {"input_ids": ids, "labels": ids})["use_cache"]
        False
    """
    signature = cache_signature(model)
    if signature is None:
        return sample
    args, kwargs = split_sample(sample)
    args, kwargs, asked = cache_off(signature, args, kwargs)
    if asked:
        warnings.warn("the sample asks for use_cache=True: planned with use_cache=False, as a planned model "
                      "trains (a checkpointed layer's recomputation would append to the cache)", stacklevel=3)
    if CACHE_ARGUMENT not in kwargs:  # (given by position, now False)
        return tuple(args)
    try:
        bound = signature.bind_partial(*args)
    except TypeError:
        return sample  # (the model's forward reports the bad call)
    if any(signature.parameters[name].kind == inspect.Parameter.VAR_POSITIONAL for name in bound.arguments):
        return sample
    return {**bound.arguments, **kwargs}


def sample_tensors(sample: Any) -> list[torch.Tensor]:
    """The tensors a sample passes to forward directly (positional and keyword arguments).
    Raises TypeError for tensors inside a list, tuple or dict argument, which tracing cannot bind.

    Example:
        >>> sample_tensors({"input_ids": torch.ones(2), "use_cache": False})
        [tensor([1., 1.])]
    """
    args, kwargs = split_sample(sample)
    for where, value in (*((f"positional argument {i}", a) for i, a in enumerate(args)),
                         *((f"argument {name!r}", v) for name, v in kwargs.items())):
        if not isinstance(value, torch.Tensor) and any(isinstance(leaf, torch.Tensor)
                                                       for leaf in tree_flatten(value)[0]):
            raise TypeError(f"the sample's {where} holds tensors inside a {type(value).__name__}: the planner "
                            "traces tensors passed as arguments of their own (positional or by name); wrap the "
                            "model in a module whose forward takes them one by one and passes them on")
    return [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]


def training_loss(output: Any) -> torch.Tensor:
    """A scalar to call backward on: the model's own `loss` if it returns one, else the sum of
    its floating-point outputs, whose backward hands each output a gradient of ones as a loss
    function would: materialised (`t.sum()` passes an expanded scalar, which kernels such as
    matmul's backward then copy into scratch of their own, memory no real loss causes).

    Example:
        >>> training_loss(torch.ones(3, requires_grad=True))
        tensor(3., grad_fn=<AddBackward0>)
    """
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in output_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        raise ValueError("the model's output holds no tensor that requires grad: nothing to train")
    return sum(_SumOfOnes.apply(t) for t in tensors)  # type: ignore[return-value]


class _SumOfOnes(torch.autograd.Function):
    """`x.sum()` whose backward returns a contiguous gradient, as a loss function's does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        return x.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.expand(ctx.shape).clone(memory_format=torch.contiguous_format)


def output_leaves(output: Any) -> list[Any]:
    """Pytree leaves, looking inside dataclass records too (pytree treats them as leaves)."""
    found = []
    for leaf in tree_flatten(output)[0]:
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += output_leaves([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
        else:
            found.append(leaf)
    return found


def run_forward(module: nn.Module, sample: Any) -> Any:
    args, kwargs = split_sample(sample)
    cold_autocast_cache()
    return module(*args, **kwargs)


def training_step(module: nn.Module, sample: Any) -> None:
    loss = training_loss(run_forward(module, sample))
    with after_autocast():
        loss.backward()


AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def autocast_devices() -> list[str]:
    """The device types autocast is on for here (inside an op it reads as off: ask before).

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_devices()
        ['cpu']
    """
    return [device for device in AUTOCAST_DEVICES if torch.is_autocast_enabled(device)]


def cold_autocast_cache() -> None:
    """Where autocast is on, empty its cache of cast parameters, as a training step's forward
    finds it (the previous forward's `with torch.autocast` emptied it on exit): the first use of
    each parameter casts it again, an ATen call and an allocation, as in training.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     cold_autocast_cache(); model(x)
    """
    if autocast_devices():
        torch.clear_autocast_cache()


@contextmanager
def uncached_autocast() -> Iterator[None]:
    """Where autocast is on, its cache of cast parameters off: what a checkpointed region runs
    under, forward and recomputation (checkpoint restores the state it was called in). A cached
    copy would be held to the end of forward though the region drops what it saves; uncached,
    a region's casts live as its other tensors do, and the planner counts them so.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), uncached_autocast():
        ...     y = checkpoint(block, x, use_reentrant=False)
    """
    if not autocast_devices() or not torch.is_autocast_cache_enabled():
        yield
        return
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(True)


@contextmanager
def after_autocast() -> Iterator[None]:
    """Where autocast is on, the state a mixed-precision loop runs backward in, its `with
    torch.autocast(...)` around the forward exited: autocast off, its cache of cast parameters
    cleared, and no autocast context open, so that a checkpoint's recomputation (which turns
    autocast on again) clears the casts it makes when it ends. Restored after. Where autocast is
    off, nothing changes. Every step the planner runs goes backward in it.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     loss = training_loss(model(x))
        ...     with after_autocast():
        ...         loss.backward()
    """
    enabled = autocast_devices()
    if not enabled:
        yield
        return
    depth = 1
    while torch.autocast_decrement_nesting() > 0:
        depth += 1
    for device in enabled:
        torch.set_autocast_enabled(device, False)
    torch.clear_autocast_cache()
    try:
        yield
    finally:
        for device in enabled:
            torch.set_autocast_enabled(device, True)
        for _ in range(depth):
            torch.autocast_increment_nesting()


def counted_call(name: str) -> bool:
    """Whether a run's call indices count an ATen call: not torch.export's metadata asserts
    (the model's forward makes none) nor `detach`, which autograd itself dispatches when it
    saves some outputs without saved-tensor hooks (the planner's runs have hooks) and which
    replay needs no more than the tensor it aliases."""
    return not name.startswith("aten._assert") and name != "aten.detach.default"


def self_checkpointing(model: nn.Module) -> list[str]:
    """The submodules of `model` that checkpoint their own calls: Hugging Face's gradient
    checkpointing (`gradient_checkpointing_enable()`, `activation_checkpointing_enable()` in
    transformers 5, or the Trainer where its arguments ask for it) sets `gradient_checkpointing`
    on them.

    Example:
        >>> hf_model.gradient_checkpointing_enable()
        >>> self_checkpointing(hf_model)[:2]
        ['model', 'model.layers.0']
    """
    return [name for name, module in model.named_modules() if getattr(module, "gradient_checkpointing", False) is True]


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """Validate a keyword that takes one of a few names (`measure=`, `effort=`).

    Example:
        >>> check_choice("effort", "thorough", ("normal", "thorough"))
        'thorough'
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; not {value!r}")
    return value


__all__ = ["AUTOCAST_DEVICES", "GraphProfile", "ModuleCheckpoint", "NodeProfile", "after_autocast", "autocast_devices",
           "check_choice", "cold_autocast_cache", "counted_call", "output_leaves", "run_forward", "sample_tensors",
           "self_checkpointing", "split_sample", "training_loss", "training_step", "uncached_autocast"]
