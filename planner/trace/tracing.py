"""Trace a model into an fx graph bound to the sample's argument structure (`trace`).

torch.fx first, at module level: torch.nn modules without children are leaves, as is each call
of a custom `torch.autograd.Function` (one autograd node, saving what its forward saves), and a
submodule fx cannot follow is kept whole and tracing retried; where fx needed such leaves, or
cannot trace the model's own forward, `torch.export(strict=False)` is taken where it traces (an
ATen-level graph whose nodes keep their submodule in `nn_module_stack`). `Traced` binds later calls to the
graph's inputs and rebuilds the model's output structure.

Example:
    >>> traced = trace(model, {"input_ids": ids, "labels": ids})
    >>> traced.frontend, len(traced.gm.graph.nodes)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import operator
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.graph import _PyTreeCodeGen
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from planner.core import sample_tensors, split_sample
from planner.trace.fake import fake_like, fake_model_state

logger = logging.getLogger(__name__)


class TraceError(RuntimeError):
    """The model could not be traced, not even with its failing submodules kept as leaves."""


@dataclass
class Traced:
    """A traced graph and how to feed it.

    `tensor_names` are the forward arguments that became graph inputs (in order); every other
    argument was fixed to `fixed_args` at trace time.
    """

    gm: fx.GraphModule
    tensor_names: tuple[str, ...]
    fixed_args: dict[str, Any]
    leaves: tuple[str, ...] = field(default_factory=tuple)
    frontend: str = "torch.fx.symbolic_trace"
    output_spec: TreeSpec | None = None  # export graphs return flat outputs; this rebuilds them
    extras: dict[str, Any] = field(default_factory=dict)  # export's subgraphs and constants, by name
    signature: inspect.Signature | None = None  # of the model's forward, to bind later calls

    def structure_output(self, flat: Any) -> Any:
        """A flat graph return value (the planned graph's) in the model's output structure."""
        return flat if self.output_spec is None else tree_unflatten(list(flat), self.output_spec)

    def model_output(self, result: Any) -> Any:
        """What `gm` itself returned, in the model's output structure: fx graphs traced with
        fixed arguments rebuild it themselves (pytree codegen), export graphs return it flat."""
        if isinstance(self.gm.graph._codegen, _PyTreeCodeGen):
            return result
        return self.structure_output(result)

    def graph_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """Bind a call's arguments to the model's forward and return the graph's inputs."""
        assert self.signature is not None, "trace() sets the signature"
        bound = bind_arguments(self.signature, args, kwargs)
        for name, planned in self.fixed_args.items():
            given = bound.get(name, planned)
            if not _same_fixed_value(given, planned):
                raise ValueError(
                    f"argument {name!r} was {planned!r} when the plan was made and is "
                    f"{given!r} now; make a new plan for this call"
                )
        return [bound[name] for name in self.tensor_names]


def _same_fixed_value(given: Any, planned: Any) -> bool:
    if isinstance(given, torch.Tensor) or isinstance(planned, torch.Tensor):
        return given is planned
    try:
        return bool(given == planned)
    except Exception:  # objects whose == is not a plain bool (arrays, proxies)
        return given is planned


def bind_arguments(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Map positional and keyword arguments to forward's parameter names, defaults included;
    those its `**kwargs` receives (a PEFT model's forward passes them on) by their own names."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"the sample does not match forward{signature}: {error}") from None
    bound.apply_defaults()
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL and value:
            raise TypeError(f"forward's *{name} receives {len(value)} arguments; pass them by name in a dict "
                            "sample, the tracer cannot follow variadic positional arguments")
        if kind == inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind != inspect.Parameter.VAR_POSITIONAL:
            named[name] = value
    return named


# Augmented assignments fx's Proxy lacks: Python then falls back to `h = h + x`, a new tensor,
# where the eager run writes `h` in place (a hazard the plan must see).
_IN_PLACE_OPERATORS = {
    "__iadd__": operator.iadd, "__isub__": operator.isub, "__imul__": operator.imul,
    "__itruediv__": operator.itruediv, "__ifloordiv__": operator.ifloordiv, "__ipow__": operator.ipow,
    "__iand__": operator.iand, "__ior__": operator.ior, "__ixor__": operator.ixor,
}


class _InPlaceProxy(fx.Proxy):
    """A Proxy that records `x += y` (and the other augmented assignments) as the in-place
    operator it is, not as `x = x + y`."""


def _augmented(name: str, function: Any) -> Any:
    def method(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", function, (self, other), {})

    method.__name__ = name
    return method


for _name, _function in _IN_PLACE_OPERATORS.items():
    setattr(_InPlaceProxy, _name, _augmented(_name, _function))


@functools.cache
def function_call(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """The graph's target for calls of a custom autograd Function: `function.apply`. (fx names
    a target from torch by its qualified name, which a subclass's `apply` does not have.)

    Example:
        >>> function_call(Swish)(x) is not None  # Swish.apply(x)
        True
    """
    def apply(*args: Any, **kwargs: Any) -> Any:
        return function.apply(*args, **kwargs)

    apply.__name__ = apply.__qualname__ = f"{function.__name__}_apply"
    return apply


class _LeafTracer(fx.Tracer):
    """A tracer that keeps named submodules and custom autograd Functions whole and remembers
    where tracing failed."""

    def __init__(self, leaves: set[str] | None = None):  # no argument when fx unpickles a graph
        super().__init__()
        self.leaves = leaves or set()
        self.failed_module: str | None = None

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        # fx would follow a custom Function's forward op by op: a graph whose autograd saves
        # what those ops save, not what the Function's forward saves for its own backward.
        def whole(apply: Callable[..., Any], function: type[torch.autograd.Function], *args: Any,
                  **kwargs: Any) -> Any:
            if any(isinstance(value, fx.Proxy) for value in tree_flatten((args, kwargs))[0]):
                return self.create_proxy("call_function", function_call(function), args, kwargs)
            return apply(function, *args, **kwargs)

        with _function_apply_replaced(whole):
            return super().trace(root, concrete_args)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _InPlaceProxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # fx keeps every torch.nn module whole; one with children (nn.TransformerEncoder and its
        # layers) is followed instead, so that its parts can be planned.
        if module_qualified_name in self.leaves:
            return True
        return super().is_leaf_module(m, module_qualified_name) and next(m.children(), None) is None

    def create_arg(self, a: Any) -> Any:
        # A dataclass instance (a returned record of tensors) becomes a call of its class.
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            fields = {f.name: self.create_arg(getattr(a, f.name)) for f in dataclasses.fields(a) if f.init}
            return self.create_node("call_function", type(a), (), fields)
        return super().create_arg(a)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_module is None:  # the innermost module fails first
                self.failed_module = self.path_of_module(m)
            raise


FRONTENDS = ("auto", "fx", "export")


def trace(model: nn.Module, sample: Any, leaves: tuple[str, ...] = (), frontend: str = "auto",
          fake_device: torch.device | None = None) -> Traced:
    """Trace `model` into an fx graph for calls shaped like `sample`.

    Tensor arguments become graph inputs; every other argument (flags, ints, None defaults) is
    fixed to its sample value. Two frontends:
    - "fx": `torch.fx` symbolic tracing at module level. A submodule whose forward cannot be
      traced becomes a leaf and tracing is retried; the leaves are listed in `Traced.leaves`.
    - "export": `torch.export.export(strict=False)`, an ATen-level graph (linear, attention,
      layer norm, dropout, ...) that follows models fx cannot, such as Hugging Face models
      with decorated forwards and mask code with data-dependent control flow.
    "auto" tries fx, and export where fx cannot trace the model's own forward or could only by
    keeping some submodules whole (their insides, an encoder's layers, could not be planned);
    where export fails too, fx's graph with those leaves stands.
    With `fake_device`, export runs on fake copies of the model's state and sample on that
    device (for a model on `meta`: its graph is then the one the real model gives there).

    Example:
        >>> traced = trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4))
        >>> [n.op for n in traced.gm.graph.nodes]
        ['placeholder', 'call_module', 'call_module', 'output']
    """
    if frontend not in FRONTENDS:
        raise ValueError(f"frontend must be one of {FRONTENDS}, not {frontend!r}")
    signature = inspect.signature(model.forward)
    sample_tensors(sample)  # (refuses tensors inside a list or dict argument)
    args, kwargs = split_sample(sample)
    bound = bind_arguments(signature, args, kwargs)
    tensor_names = tuple(name for name, value in bound.items() if isinstance(value, torch.Tensor))
    if not tensor_names:
        raise TypeError("the sample holds no tensor: pass the model's input tensors as the sample")
    fixed_args = {name: value for name, value in bound.items() if name not in tensor_names}
    if frontend == "export":
        traced = _trace_export(model, bound, tensor_names, fixed_args, fake_device)
    else:
        try:
            traced = _trace_fx(model, tensor_names, fixed_args, leaves)
            if traced.leaves and frontend == "auto" and not leaves:
                try:
                    traced = _trace_export(model, bound, tensor_names, fixed_args, fake_device)
                except TraceError as export_error:
                    logger.info("keeping %s whole: torch.export cannot trace %s either (%s)",
                                ", ".join(traced.leaves), type(model).__name__, export_error)
        except TraceError as fx_error:
            if frontend == "fx":
                raise
            logger.info("fx cannot trace %s (%s); trying torch.export", type(model).__name__, fx_error)
            try:
                traced = _trace_export(model, bound, tensor_names, fixed_args, fake_device)
            except TraceError as export_error:
                raise TraceError(
                    f"{fx_error}\n{export_error}\nMake the failing code traceable, or pass "
                    "leaves=('submodule.name', ...) to keep the failing submodules whole."
                ) from export_error
    traced.signature = signature
    return traced


def _trace_export(
    model: nn.Module, bound: dict[str, Any], tensor_names: tuple[str, ...], fixed_args: dict[str, Any],
    fake_device: torch.device | None = None,
) -> Traced:
    """The torch.export frontend: an ATen-level graph whose inputs are the tensor arguments."""
    try:
        with _custom_functions_called() as functions:
            if fake_device is None:
                with eager_attention_masks(bound):
                    exported = torch.export.export(model, (), dict(bound), strict=False)
            else:
                mode = FakeTensorMode(allow_non_fake_inputs=False)
                fake_bound = {name: fake_like(value, mode, fake_device) if isinstance(value, torch.Tensor) else value
                              for name, value in bound.items()}
                with fake_model_state(model, mode, fake_device), eager_attention_masks(bound):
                    exported = torch.export.export(model, (), fake_bound, strict=False)
    except Exception as error:
        raise TraceError(f"torch.export cannot trace {type(model).__name__}: {_export_error(error)}") from error
    if functions:
        warnings.warn(f"torch.export follows the custom autograd Function(s) {', '.join(sorted(functions))} op by op: "
                      "the plan counts what their operations would save for backward, not what their forward saves "
                      "(a plan whose own step runs in planning is fitted to what it measured; one made without "
                      "running may be off: p.verify() on the device it is for tells)", stacklevel=4)
    unlifted = exported.module()
    graph = fx.Graph()
    outputs = graph.graph_copy(unlifted.graph, {})
    graph.output(outputs)  # default codegen: a flat list; Traced.structure_output rebuilds it
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)  # shape guards of the export call: the planner checks inputs
    extras: dict[str, Any] = {}
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.target not in tensor_names:
            if node.users:
                raise TraceError(f"the exported graph reads fixed argument {node.target!r}")
            graph.erase_node(node)
        elif node.op in ("get_attr", "call_module") and not _has_path(model, node.target):
            # A subgraph or a lifted constant; one made inside a submodule's forward is named by
            # its path (`encoder.lifted_tensor_0`), which the model does not have: named flat.
            extra = _attribute(unlifted, str(node.target))
            if isinstance(extra, FakeTensor):  # traced on fake tensors: keep its shape only
                extra = torch.empty_strided(extra.shape, extra.stride(), dtype=extra.dtype, device="meta")
            node.target = str(node.target).replace(".", "_")
            extras[node.target] = extra
    graph.lint()
    gm = graph_module(model, graph, extras, f"Exported{type(model).__name__}")
    return Traced(gm, tensor_names, fixed_args, (), "torch.export", exported.call_spec.out_spec, extras)


@contextlib.contextmanager
def _function_apply_replaced(replacement: Callable[..., Any]) -> Iterator[None]:
    """Inside the block, `SomeFunction.apply(*args)` of every autograd Function calls
    `replacement(apply, SomeFunction, *args)` (`apply` the original, unbound)."""
    apply = torch.autograd.Function.__dict__["apply"]
    torch.autograd.Function.apply = classmethod(  # type: ignore[method-assign, assignment]
        functools.partial(replacement, apply.__func__))
    try:
        yield
    finally:
        torch.autograd.Function.apply = apply  # type: ignore[method-assign]


@contextlib.contextmanager
def _custom_functions_called() -> Iterator[set[str]]:
    """The names of the custom autograd Functions called inside the block (not torch's own: a
    `torch.library` custom op calls one, and stays one node of the exported graph)."""
    called: set[str] = set()

    def noted(apply: Callable[..., Any], function: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
        if not function.__module__.startswith("torch."):
            called.add(function.__qualname__)
        return apply(function, *args, **kwargs)

    with _function_apply_replaced(noted):
        yield called


@contextlib.contextmanager
def eager_attention_masks(bound: dict[str, Any], check_packing: bool = False) -> Iterator[None]:
    """Build attention masks as the eager run on real tensors builds them. While torch.export
    traces, or a forward runs on fake tensors, Hugging Face models cannot read tensor values, so
    they build an explicit causal mask (and a packed-sequence mask from the position ids) where
    an eager call without padding passes none and lets SDPA apply causality, a kernel that saves
    less (on Llama, 8% of the step's peak). The plan runs in the model's own eager forward, so
    the graph, and the forward followed on fake tensors, take eager's branch: no mask where
    the call (`bound`: forward's arguments by name) has no attention mask and no position ids
    (then none are packed). With `check_packing`, the check for packed sequences still makes
    its calls, as the real call does (on fake tensors, for a forward matched call by call with
    the real one), and its answer is ignored.

    Example:
        >>> with eager_attention_masks({"input_ids": ids, "attention_mask": None}):
        ...     exported = torch.export.export(model, (), {"input_ids": ids}, strict=False)
    """
    masking = sys.modules.get("transformers.masking_utils")
    eager_skips = bound.get("attention_mask") is None and bound.get("position_ids") is None
    if masking is None or not eager_skips or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    check = masking.find_packed_sequence_indices

    def not_packed(*args: Any, **kwargs: Any) -> None:
        if check_packing:
            check(*args, **kwargs)

    patched = {"is_torchdynamo_exporting": lambda: False, "find_packed_sequence_indices": not_packed}
    originals = {name: getattr(masking, name) for name in patched if hasattr(masking, name)}
    for name in originals:
        setattr(masking, name, patched[name])
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(masking, name, value)


def _export_error(error: Exception) -> str:
    """torch.export's error in a line: its kind and first line, and the model's code that raised
    it where torch.export names it (a branch on a tensor's value, say)."""
    lines = str(error).splitlines()
    text = f"{type(error).__name__}: {next((line for line in lines if line.strip()), '')}"
    marker = "The following call raised this error:"
    if marker in lines:
        at = lines[lines.index(marker) + 1:lines.index(marker) + 3]
        text += f" (raised at {' '.join(line.strip() for line in at)})"
    return text


def _attribute(module: nn.Module, target: str) -> Any:
    """The attribute a graph node's dotted `target` names in `module`."""
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _has_path(module: nn.Module, target: str) -> bool:
    try:
        for part in target.split("."):
            module = getattr(module, part)
    except AttributeError:
        return False
    return True


def graph_module(root: nn.Module, graph: fx.Graph, extras: dict[str, Any], name: str) -> fx.GraphModule:
    """A GraphModule whose attribute paths resolve through `root`'s own module tree.

    fx copies only the attributes a graph names and makes placeholder containers for the levels
    in between; replacing the top level with `root`'s own children and its parameter and buffer
    dicts makes every path reach the live objects (so `.to()` and buffer swaps are seen).
    `extras` are top-level attributes the graph names that `root` does not have.
    """
    holder = nn.Module()
    link_to_root(holder, root, extras)
    gm = fx.GraphModule(holder, graph, class_name=name)
    link_to_root(gm, root, extras)
    return gm


def link_to_root(module: nn.Module, root: nn.Module, extras: dict[str, Any]) -> None:
    """Make `module`'s top level be `root`'s: its children and the very same parameter and
    buffer dicts, so later changes to `root` (`.to()`, buffer swaps) are seen. `extras` are
    added as child modules, or as plain attributes when they are not modules (constants)."""
    module._modules = {**root._modules, **{k: v for k, v in extras.items() if isinstance(v, nn.Module)}}
    module._parameters = root._parameters
    module._buffers = root._buffers
    for name, value in extras.items():
        if not isinstance(value, nn.Module):
            module.__dict__[name] = value


def _trace_fx(
    model: nn.Module, tensor_names: tuple[str, ...], fixed_args: dict[str, Any], leaves: tuple[str, ...]
) -> Traced:
    """The torch.fx frontend, with automatic leaves for submodules it cannot follow."""
    auto_leaves: list[str] = []
    while True:
        tracer = _LeafTracer(set(leaves) | set(auto_leaves))
        try:
            graph = tracer.trace(model, concrete_args=dict(fixed_args))
            break
        except Exception as error:
            failed = tracer.failed_module
            if not failed or failed in auto_leaves:
                where = f"submodule {failed!r}" if failed else f"{type(model).__name__}.forward"
                raise TraceError(
                    f"cannot trace {where} of {type(model).__name__}: "
                    f"{type(error).__name__}: {error}"
                ) from error
            logger.info("keeping %s whole: tracing it failed with %s", failed, error)
            auto_leaves.append(failed)

    _drop_fixed_inputs(graph, tensor_names)
    for node in graph.nodes:
        if isinstance(node.type, str):
            # Postponed annotations ("torch.Tensor" as a string) end up as string globals of
            # the generated code, which GraphModule's pickling cannot name.
            node.type = None
    # With fixed (concrete) arguments fx generates pytree code: the output node holds the flat
    # outputs and the codegen rebuilds the structure. The planned graph has plain codegen, so
    # keep the spec and let Traced.structure_output rebuild it.
    codegen = graph._codegen
    output_spec = codegen.pytree_info.out_spec if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info else None
    gm = fx.GraphModule(model, graph, class_name=f"Traced{type(model).__name__}")
    return Traced(gm, tensor_names, fixed_args, tuple(auto_leaves), output_spec=output_spec)


def _drop_fixed_inputs(graph: fx.Graph, tensor_names: tuple[str, ...]) -> None:
    """Remove placeholders of fixed arguments and the specialisation asserts fx adds for them:
    the planner checks those values itself when the planned module is called."""
    fixed = [n for n in graph.nodes if n.op == "placeholder" and n.target not in tensor_names]
    doomed: list[fx.Node] = []
    frontier = list(fixed)
    while frontier:
        node = frontier.pop()
        if node in doomed:
            continue
        if node.op == "output":
            raise TraceError(f"the graph returns fixed argument {node.name!r} directly")
        doomed.append(node)
        frontier.extend(node.users)
    for node in reversed(list(graph.nodes)):
        if node in doomed:
            graph.erase_node(node)
    graph.lint()
