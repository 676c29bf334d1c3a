"""How long the model's own code keeps each node's output alive in forward, what it passes to
each submodule call, and which of each node's ATen calls the model's forward makes as the
traced graph does.

A traced graph frees a value right after its last use. The model's Python code may hold it
longer: a local variable kept until the function returns, a list of tensors, a `residual`. A
plan runs in the model's own forward, so memory follows the eager lifetimes, not the graph's.
Checkpoint also keeps every tensor a checkpointed call is passed, read or not, until its
backward: the graph only shows the ones it reads.

- `eager_holds` (`fake_eager_holds` on fake copies, nothing run) runs the graph and the model's
  forward once each, on the same inputs, with autograd on but saving nothing (so only Python
  references keep a tensor alive), and matches their ATen calls one to one. For each node whose
  output the model's code frees later than the graph does, it names the last node during whose
  forward the output was still alive, and for each submodule call, the outputs it was passed
  (by the first node of the call): `EagerLifetimes`. Where the two runs make different ATen
  calls (a frontend that rewrites ops, a data-dependent branch), it reports no lifetimes and
  logs why: the graph's own lifetimes stand.
- `NodeCalls`: each node's ATen calls, which say whether a region may keep the node's output.
  A selective-checkpoint policy caches ATen calls by name and occurrence within a submodule's
  forward, counted in the model's own forward. Those need not match the graph's call for call
  (torch.export adds metadata asserts, drops no-op slices, decomposes dropout its own way),
  only in the calls a policy may cache (`KEEPABLE_OPS`): a node's calls are found in the
  model's forward where, for every submodule call (region) that holds it, the region's
  `KEEPABLE_OPS` calls are the same in order in both runs, so any such call's occurrence
  counted from the region's start is too.
- `unmatched_regions`, `matched_from`, `matched_span`: which submodule calls the model's
  forward makes as the graph does, ATen call for ATen call. A selective policy finds a node's
  calls only where the calls it may cache match, and a run counts calls only where all of them
  do, from its window's first hook on.

Example:
    >>> lifetimes = eager_holds(gm, inputs, lambda: model(x))
    >>> lifetimes.holds.get("relu")   # the model's code still holds relu's output during "fc2"
    'fc2'
    >>> unmatched, differing, starts = unmatched_regions(gm, calls_of, eager_calls, by_path, False)
    >>> matched_span(40, module_calls(gm), differing, starts)
    (8, 43)
"""
from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Collection, Iterator, Sequence

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from planner.core import cold_autocast_cache
from planner.measure.memory import (
    LiveBytesTracker,
    draws_random_numbers,
    written_arguments,
)
from planner.measure.profile import tensors_in
from planner.measure.targets import ATTENTION_TARGETS
from planner.trace.fake import fake_like, fake_model_state
from planner.trace.structure import COMPUTE_OPS, ModuleCall, compute_nodes, module_calls
from planner.trace.tracing import bind_arguments, eager_attention_masks

logger = logging.getLogger(__name__)

# The compute-intensive ATen ops whose outputs a region may keep (a selective-checkpoint policy
# caches them): matrix products, convolution and fused attention, as this PyTorch dispatches
# nn.Linear (addmm; mm on inputs it must copy or without bias), matmul in attention (bmm),
# F.scaled_dot_product_attention and nn.Conv2d. Everything else is cheaper to recompute.
KEEPABLE_OPS = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten.convolution.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
})


def keepable_calls(names: Sequence[str]) -> list[str]:
    return [name for name in names if name in KEEPABLE_OPS]


def checked_calls(names: Sequence[str]) -> list[str]:
    """The calls a policy's occurrences depend on: all but torch.export's metadata asserts
    (`aten._assert_tensor_metadata`), which the model's forward does not make; a policy counts
    each func's calls on its own, so leaving out other funcs changes no occurrence."""
    return [name for name in names if not name.startswith("aten._assert")]


def first_difference(what: str, model: list[str], graph: list[str]) -> str:
    """Where two call lists first differ: "call 3 is aten.mul.Tensor in the model, none in the graph"."""
    at = next((i for i, (a, b) in enumerate(zip(model, graph)) if a != b), min(len(model), len(graph)))
    return (f"{what} {at} is {model[at] if at < len(model) else 'none'} in the model, "
            f"{graph[at] if at < len(graph) else 'none'} in the graph")


def unmatched_regions(gm: fx.GraphModule, calls_of: dict[str, Sequence[str]], eager_calls: list[str],
                      calls_by_path: Callable[[list[str]], dict[str, list[range]]], broken: bool
                      ) -> tuple[list[range], list[range], dict[range, int]]:
    """The node ranges of the regions (submodule calls, `planner.trace.structure.module_calls`)
    whose `KEEPABLE_OPS` calls, and those whose calls of any op, are not the same, in order, in the
    graph run and in the module's one call in the model's forward; logs the first kind and why.
    And for those of the second kind called once, where their calls match from a submodule call
    inside them to their end (`matched_from`): that call's first node."""
    nodes = compute_nodes(gm)
    regions = module_calls(gm)
    by_path = calls_by_path([call.path for call in regions])
    unmatched: list[range] = []
    differing: list[range] = []
    starts: dict[range, int] = {}
    why: list[str] = []
    differ: list[str] = []
    for call in regions:
        graph_calls = checked_calls([name for i in call.nodes for name in calls_of[nodes[i].name]])
        graph = keepable_calls(graph_calls)
        found = by_path.get(call.path, [])
        if len(found) != 1:
            unmatched.append(call.nodes)
            differing.append(call.nodes)
            why.append(f"{call.path} (called {len(found)} times in the model's forward, once in the graph)")
            continue
        eager = checked_calls(eager_calls[found[0].start:found[0].stop])
        if eager != graph_calls:
            differing.append(call.nodes)
            differ.append(f"{call.path} ({first_difference('call', eager, graph_calls)})")
            start = matched_from(call, regions, [len(checked_calls(calls_of[nodes[i].name])) for i in call.nodes],
                                 eager, graph_calls)
            if start is not None:
                starts[call.nodes] = start
        model = keepable_calls(eager)  # (the asserts left out are no keepable calls)
        if model != graph:
            unmatched.append(call.nodes)
            why.append(f"{call.path} ({first_difference('keepable call', model, graph)})")
    if broken:
        logger.info("the model's submodule calls were not recorded: its module hooks did not nest")
    if why:
        logger.info("no region may keep a node of %d submodule calls: the model's forward does not make their "
                    "matrix product, convolution and attention calls as the graph does, so a selective policy "
                    "would not find them: %s", len(why), "; ".join(why))
    if differ:
        logger.info("%d of %d submodule calls make other ATen calls in the model's forward than in the graph: "
                    "they keep only matrix products, convolutions and attention: %s", len(differ), len(regions),
                    "; ".join(differ[:4]) + ("; ..." if len(differ) > 4 else ""))
    return unmatched, differing, starts


def matched_from(call: ModuleCall, regions: list[ModuleCall], node_calls: list[int], eager: list[str],
                  graph: list[str]) -> int | None:
    """The first node of the first submodule call inside `call` from which the model's forward
    makes the same calls as the graph to the end of `call` (the two lists' common tail: a
    stack's blocks, after a prefix that differs, such as an attention mask made another way);
    None where no call inside starts there. A run recorded from such a call's hooks counts
    the calls it sees as the graph has them."""
    tail = next((n for n, (a, b) in enumerate(zip(reversed(eager), reversed(graph))) if a != b),
                min(len(eager), len(graph)))
    first_call = len(graph) - tail
    position = 0
    for offset, count in enumerate(node_calls):
        if position >= first_call:
            starts = sorted(inner.nodes.start for inner in regions if inner.nodes != call.nodes
                            and call.nodes.start + offset <= inner.nodes.start and inner.nodes.stop <= call.nodes.stop)
            return starts[0] if starts else None
        position += count
    return None


def matched_span(index: int, calls: list[ModuleCall], differing: list[range],
                  starts: dict[range, int]) -> tuple[int, int] | None:
    """(start, stop) of the largest submodule call holding node `index` that, with every
    smaller one holding it, makes the same calls in the model's forward (not in `differing`),
    or does from the node `starts` gives it, at or before `index`, to its end (`matched_from`)."""
    span = None
    for call in sorted((call for call in calls if index in call.nodes), key=lambda call: len(call.nodes)):
        if call.nodes in differing and index < starts.get(call.nodes, call.nodes.stop):
            break
        span = (call.nodes.start, call.nodes.stop)
    return span


@dataclass(frozen=True)
class NodeCalls:
    """The ATen calls one node made in the graph run, in order: their names, the positions of
    those that allocated a storage, whether any wrote in place or drew random numbers, and
    whether the model's own forward makes its `KEEPABLE_OPS` calls at the same occurrences in
    every region that holds it (`found`).

    Example:
        >>> NodeCalls(("aten.t.default", "aten.addmm.default"), allocating=(1,)).keepable
        True
    """

    names: tuple[str, ...]
    allocating: tuple[int, ...] = ()
    writes: bool = False
    random: bool = False
    found: bool = True
    # (start, stop) nodes of the largest submodule call holding it whose calls, and those of
    # every smaller one holding it, are all the same, in order, in the model's forward: in
    # those, any of its calls (not just `KEEPABLE_OPS` ones) is found at its occurrence
    span: tuple[int, int] | None = None
    # the same, where a call holding it also counts whose calls match from a submodule call at
    # or before it to its end (`matched_from`): where a run may hold it (a run counts calls from
    # its window's first hook)
    run_span: tuple[int, int] | None = None

    @property
    def keepable(self) -> bool:
        """Whether a region may keep its output: it makes a storage, its storage-making calls
        are found in the model's forward (a policy could not find them otherwise: all its calls
        where they are not all `KEEPABLE_OPS` ones), it writes nothing in place, and it draws no
        random numbers (a cached call is skipped when recomputing, which would shift the
        generator for later draws). Caching its storage-making calls keeps its outputs and
        saved tensors."""
        if not self.allocating or self.writes or self.random:
            return False
        return self.found if self.heavy else self.span is not None

    @property
    def heavy(self) -> bool:
        """Whether every storage it makes comes from a `KEEPABLE_OPS` call (a matmul, a
        convolution, attention)."""
        return all(self.names[i] in KEEPABLE_OPS for i in self.allocating)

    @property
    def keep_span(self) -> tuple[int, int] | None:
        """The nodes within which a region may keep it (`NodeCost.keep_span`): its `span`,
        unless it is `heavy` (then any region: those calls are matched in every one)."""
        return None if self.heavy else self.span


class _CallLog(LiveBytesTracker):
    """The tensor tracker, also noting every ATen call's name, each new storage in order
    (allocation indices) with the call that made it, for each freed one how many calls had
    been made by then, and which calls wrote in place or drew random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.writing_calls: set[int] = set()
        self.random_calls: set[int] = set()
        self.allocated: list[int] = []  # storage id per allocation, in order
        self.allocation_call: list[int] = []  # per allocation, the index of the call that made it
        self.freed: dict[int, int] = {}  # allocation index -> calls made before it was freed
        self._index: dict[int, int] = {}  # storage id of a live allocation -> its index

    def allocation_of(self, tensor: torch.Tensor) -> int | None:
        """The allocation index of a live tensor's storage (None: made before the log)."""
        storage = tensor.untyped_storage()
        ref = self._refs.get(id(storage))
        return self._index.get(id(storage)) if ref is not None and ref() is storage else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "prim":  # a metadata query (fake tensors answer `.device` through it), no work
            return func(*args, **(kwargs or {}))
        if written_arguments(func, args, kwargs or {}):
            self.writing_calls.add(len(self.calls))
        if draws_random_numbers(func, args, kwargs or {}):
            self.random_calls.add(len(self.calls))
        self.calls.append(str(func))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        ref = self._refs.get(id(storage))
        super()._track(storage, inputs)
        if self._refs.get(id(storage)) is not ref:  # a new allocation
            self._index[id(storage)] = len(self.allocated)
            self.allocated.append(id(storage))
            self.allocation_call.append(len(self.calls) - 1)

    def _free(self, key: int, nbytes: int, serial: int) -> None:
        super()._free(key, nbytes, serial)
        self.freed[self._index.pop(key)] = len(self.calls)


class _GraphRun(fx.Interpreter):
    """Runs the graph (values freed after their last use) noting which node makes each call
    and which allocations are each node's outputs. (Its own frees do not matter: it keeps the
    results of in-place calls that nothing reads, which fx's generated code would not.)"""

    def __init__(self, gm: fx.GraphModule, log: _CallLog,
                 constant: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__(gm)
        self.log = log
        self.constant = constant  # makes a graph constant (not a parameter or buffer) fake, the same each time
        self.node_of_call: list[str] = []
        self.output_of: dict[int, str] = {}  # allocation index -> node whose output it is
        self.calls_of: dict[str, NodeCalls] = {}

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if self.constant is not None and isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            return self.constant(value)
        return value

    def make_constants(self) -> None:
        """Make the graph's constants fake before the run is logged: that is no call of the graph's."""
        if self.constant is not None:
            for node in self.graph.nodes:
                if node.op == "get_attr":
                    self.fetch_attr(str(node.target))

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in COMPUTE_OPS:
            return super().run_node(n)
        first_call, first_allocation = len(self.log.calls), len(self.log.allocated)
        result = super().run_node(n)
        stop_call = len(self.log.calls)
        self.node_of_call += [n.name] * (stop_call - first_call)
        own = range(first_call, stop_call)
        self.calls_of[n.name] = NodeCalls(
            names=tuple(self.log.calls[first_call:stop_call]),
            allocating=tuple(sorted({call - first_call for call in self.log.allocation_call[first_allocation:]})),
            writes=any(call in self.log.writing_calls for call in own),
            random=any(call in self.log.random_calls for call in own),
        )
        made = {key: first_allocation + i for i, key in enumerate(self.log.allocated[first_allocation:])}
        for tensor in tensors_in(result):
            index = made.get(id(tensor.untyped_storage()))
            if index is not None:
                self.output_of[index] = n.name
        return result


class _ModuleSpans:
    """The submodule calls of the model's forward, noted by global module hooks: per call, the
    module and the range of the log's calls it made, and the modules called from outside any
    other (the model, and whatever else `run_model` calls), one of which names the rest."""

    def __init__(self, log: _CallLog):
        self.log = log
        self.outermost: list[torch.nn.Module] = []
        self.spans: list[tuple[torch.nn.Module, range]] = []
        self.broken = False  # a hook pair did not nest (a forward that raised midway, another hook's trick)
        self._open: list[tuple[torch.nn.Module, int]] = []

    def enter(self, module: torch.nn.Module) -> None:
        if not self._open and all(module is not seen for seen in self.outermost):
            self.outermost.append(module)
        self._open.append((module, len(self.log.calls)))

    def leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._open or self._open[-1][0] is not module:
            self.broken = True
            return
        _, start = self._open.pop()
        self.spans.append((module, range(start, len(self.log.calls))))

    def by_path(self, paths: Collection[str]) -> dict[str, list[range]]:
        """Qualified submodule name -> the call ranges of each of its calls (a module registered
        under several names counts under each), named in the outermost module that names the
        most of `paths` (the graph's submodule paths): the model."""
        if not self.outermost or self.broken:
            return {}
        named = [self._names(root) for root in self.outermost]
        names = max(named, key=lambda found: sum(path in found for path in paths))
        by_module: dict[int, list[str]] = {}
        for name, module in names.items():
            by_module.setdefault(id(module), []).append(name)
        found: dict[str, list[range]] = {}
        for module, span in self.spans:
            for name in by_module.get(id(module), ()):
                found.setdefault(name, []).append(span)
        return found

    @staticmethod
    def _names(root: torch.nn.Module) -> dict[str, torch.nn.Module]:
        return dict(root.named_modules(remove_duplicate=False))  # "": the model itself


@dataclass
class EagerLifetimes:
    """`holds`: node name -> the last node during whose forward the model's code still held
    its output (where that is later than the graph's last reader). `arguments`: the first node
    of a submodule call -> the nodes whose outputs some call starting there was passed.
    `calls`: node name -> its ATen calls in the graph run, `found` where a policy finds its
    keepable calls in the model's own forward."""

    holds: dict[str, str] = field(default_factory=dict)
    arguments: dict[str, set[str]] = field(default_factory=dict)
    calls: dict[str, NodeCalls] = field(default_factory=dict)
    # per `scaled_dot_product_attention` call of the model's own forward, in order, the bytes of
    # the storages it made and saved for backward (its output aside), as the plan's device runs
    # it (`AttentionSaves`; filled by `fake_eager_holds` only)
    attention_saved: list[int] = field(default_factory=list)


class AttentionSaves(TorchFunctionMode):
    """Notes, per `scaled_dot_product_attention` call, the bytes of the storages the call made and
    saved for backward, its output aside; with `attention`, runs each call as that function does
    (the kernel a CUDA target picks, `planner.measure.targets.target_attention`). The model's own
    call may differ from the traced graph's (a grouped-query model passes its few key/value heads
    with `enable_gqa=True`, which a CUDA GPU runs on the math path, saving the attention matrix;
    the exported graph repeats them and passes a mask)."""

    def __init__(self, attention: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.attention = attention
        self.saved: list[int] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in ATTENTION_TARGETS and func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        before = {id(t.untyped_storage()) for t in tensors_in((args, kwargs))}
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> None:
            if tensor.layout == torch.strided:
                saved[id(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda nothing: nothing):
            result = (self.attention or func)(*args, **kwargs)
        made = {id(t.untyped_storage()) for t in tensors_in(result)}
        self.saved.append(sum(size for key, size in saved.items() if key not in before and key not in made))
        return result


class OwnCheckpoints(ValueError):
    """The model's forward calls `torch.utils.checkpoint` itself: the plan is to choose what to
    recompute in place of those calls, and the traced graph runs through them."""


@contextmanager
def noting_checkpoints(calls: list[str]) -> Iterator[None]:
    """Note in `calls` each `torch.utils.checkpoint` call made inside, reentrant or not (a model
    that checkpoints its own blocks, as users did by hand before a planner).

    Example:
        >>> calls = []
        >>> with noting_checkpoints(calls):
        ...     model(x)
        >>> calls
        ['non-reentrant', 'non-reentrant']
    """
    module = torch.utils.checkpoint
    generator, function = module._checkpoint_without_reentrant_generator, module.CheckpointFunction

    def noted_generator(*args: Any, **kwargs: Any) -> Any:
        calls.append("non-reentrant")
        return generator(*args, **kwargs)

    class NotedFunction:  # (checkpoint() calls only its `apply`)
        @staticmethod
        def apply(*args: Any) -> Any:
            calls.append("reentrant")
            return function.apply(*args)

    module._checkpoint_without_reentrant_generator = noted_generator
    module.CheckpointFunction = NotedFunction  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        module._checkpoint_without_reentrant_generator = generator
        module.CheckpointFunction = function  # type: ignore[misc]


def eager_holds(gm: fx.GraphModule, inputs: list[Any], run_model: Callable[[], Any],
                constant: Callable[[torch.Tensor], torch.Tensor] | None = None) -> EagerLifetimes:
    """The lifetimes of the model's own forward (`run_model()`, on the same inputs as
    `inputs`, the graph's) that the graph does not show, and each node's calls (see
    `EagerLifetimes`). Lifetimes need the two runs' ATen calls to match one to one: where they
    differ, `holds` and `arguments` are empty and it logs why. The caller restores what a
    forward changes (BatchNorm statistics, RNG). `constant` makes the graph's constants fake
    where it runs on fake tensors (`fake_eager_holds`).

    Example:
        >>> eager_holds(gm, [x], lambda: model(x)).holds
        {'add': 'fc2'}
    """
    discard = torch.autograd.graph.saved_tensors_hooks(lambda tensor: None, lambda nothing: nothing)
    with torch.enable_grad(), discard:
        graph_log = _CallLog()
        runner = _GraphRun(gm, graph_log, constant)
        runner.make_constants()
        cold_autocast_cache()  # (each forward as a training step's finds autocast's cache)
        with graph_log:
            output = runner.run(*inputs)
        del output
        eager_log = _CallLog()
        spans = _ModuleSpans(eager_log)
        passed: list[tuple[int, list[int]]] = []  # per module call: calls before it, its arguments
        entered: list[tuple[torch.nn.Module, int]] = []  # calls not yet left: module, index in `passed`

        def allocations_in(arguments: Any) -> list[int]:
            found = [eager_log.allocation_of(t) for t in tensors_in(arguments)]
            return [index for index in found if index is not None]

        def enter(module: torch.nn.Module, args: Any) -> None:
            spans.enter(module)
            entered.append((module, len(passed)))
            passed.append((len(eager_log.calls), allocations_in(args)))

        def leave(module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            # A global pre-hook is not given the keyword arguments (an HF decoder layer's position
            # ids); a checkpoint of the call holds them all the same. They are still alive here.
            if entered and entered[-1][0] is module:
                _, call = entered.pop()
                if passed[call][0] == len(eager_log.calls):  # no ATen call (a dropout of p=0): no region
                    passed[call][1].clear()
                else:
                    passed[call][1].extend(allocations_in(kwargs))

        hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
                 torch.nn.modules.module.register_module_forward_hook(spans.leave, always_call=True),
                 torch.nn.modules.module.register_module_forward_hook(leave, with_kwargs=True, always_call=True)]
        own_checkpoints: list[str] = []
        try:
            cold_autocast_cache()
            with eager_log, noting_checkpoints(own_checkpoints):
                output = run_model()
            del output
        finally:
            for hook in hooks:
                hook.remove()
            # Removing a global keyword hook leaves its flag behind (torch 2.13), which would send
            # every later module call of the user's process down the hooked path.
            getattr(torch.nn.modules.module, "_global_forward_hooks_with_kwargs", {}).pop(hooks[-1].id, None)
    if own_checkpoints:
        count = len(own_checkpoints)
        made = f"{count} call{'s' * (count > 1)}"
        raise OwnCheckpoints(f"the model's forward calls torch.utils.checkpoint itself ({made}): the plan"
                             " chooses what to recompute in place of such calls, and the traced graph runs "
                             "through them; remove them (or turn off the option that makes them) and plan again")
    compute = compute_nodes(gm)
    order = {node.name: i for i, node in enumerate(compute)}
    unmatched, differing, starts = unmatched_regions(
        gm, {name: calls.names for name, calls in runner.calls_of.items()}, eager_log.calls, spans.by_path, spans.broken)
    regions = module_calls(gm)
    calls = {name: replace(record, found=not any(order[name] in region for region in unmatched),
                           span=matched_span(order[name], regions, differing, {}),
                           run_span=matched_span(order[name], regions, differing, starts))
             for name, record in runner.calls_of.items()}
    aligned = CallAlignment.of(eager_log, graph_log)
    if aligned is None:
        logger.info("eager lifetimes not measured: the model's ATen calls differ from the graph's (%s); the graph's "
                    "lifetimes are used", first_difference("call", eager_log.calls, graph_log.calls))
        return EagerLifetimes(calls=calls)
    # The graph's own lifetime of an output: up to its last reader (as the simulator has it).
    last_read = {node.name: max([order[node.name], *(order[u.name] for u in node.users if u.name in order)])
                 for node in compute}
    last_call = len(eager_log.calls)
    holds: dict[str, str] = {}
    for index, name in runner.output_of.items():
        eager_index = aligned.eager_allocation.get(index)
        if eager_index is None:
            continue
        eager_freed = eager_log.freed.get(eager_index, last_call)
        if eager_freed == 0:
            continue
        holder = runner.node_of_call[-1 if eager_freed == last_call else aligned.graph_call_at(eager_freed - 1)]
        if order[holder] > last_read[name]:
            holds[name] = holder
    graph_allocation = {eager: graph for graph, eager in aligned.eager_allocation.items()}
    arguments: dict[str, set[str]] = {}
    for position, indices in passed:
        at = aligned.graph_call_from(position)
        if at is not None and at < len(runner.node_of_call):
            first = runner.node_of_call[at]
            before = {runner.output_of[graph_allocation[i]] for i in indices
                      if graph_allocation.get(i) in runner.output_of}
            before = {name for name in before if order[name] < order[first]}
            if before:
                arguments.setdefault(first, set()).update(before)
    return EagerLifetimes(holds, arguments, calls)


# A constant made in the model's code (`torch.tensor(...)`) is `lift_fresh` there and `lift_fresh_copy`
# in an exported graph: the same call for the alignment. torch.export adds metadata checks that do no work.
_SAME_CALL = {"aten.lift_fresh_copy.default": "aten.lift_fresh.default"}
_TRACE_ADDED = frozenset({"aten._assert_tensor_metadata.default"})


@dataclass(frozen=True)
class CallAlignment:
    """The graph run's ATen calls matched to the model's own forward's, and their allocations.
    The two make the same calls in order where the model was traced faithfully; an exported
    graph may add calls that do no work (`_assert_tensor_metadata`) and leave out the model's
    checks on a tensor's values (`any` then `_local_scalar_dense`), which the alignment skips.
    `graph_call`: per model call, the graph call it is (None: the model's own); `eager_allocation`:
    graph allocation index -> the model's, for allocations of matched calls.

    Example:
        >>> aligned = CallAlignment.of(eager_log, graph_log)
        >>> aligned.graph_call_at(12), aligned.eager_allocation[3]
        (13, 3)
    """

    graph_call: tuple[int | None, ...]
    eager_allocation: dict[int, int]

    @staticmethod
    def of(eager: _CallLog, graph: _CallLog) -> CallAlignment | None:
        """The alignment of the two logs, or None where the graph makes calls the model does not
        (beyond the checks a trace adds: another computation, whose lifetimes cannot be compared)."""
        model_calls = [_SAME_CALL.get(call, call) for call in eager.calls]
        graph_calls = [_SAME_CALL.get(call, call) for call in graph.calls]
        graph_call = _matched_calls(model_calls, graph_calls)
        if graph_call is None:
            return None
        made_by_eager = _allocations_by_call(eager)
        made_by_graph = _allocations_by_call(graph)
        eager_allocation: dict[int, int] = {}
        for eager_index, graph_index in enumerate(graph_call):
            if graph_index is None:
                continue
            made_in_model, made_in_graph = made_by_eager.get(eager_index, []), made_by_graph.get(graph_index, [])
            if len(made_in_model) == len(made_in_graph):
                eager_allocation.update(zip(made_in_graph, made_in_model))
        return CallAlignment(tuple(graph_call), eager_allocation)

    def graph_call_at(self, eager_index: int) -> int:
        """The graph call matched to the model's call `eager_index`, or to the last matched one
        before it (0 where none is)."""
        return next((self.graph_call[i] for i in range(eager_index, -1, -1) if self.graph_call[i] is not None), 0)

    def graph_call_from(self, eager_index: int) -> int | None:
        """The graph call matched to the model's call `eager_index` or to the first matched one after it."""
        return next((self.graph_call[i] for i in range(eager_index, len(self.graph_call))
                     if self.graph_call[i] is not None), None)


# After calls of the model's own, the two are matched again where the next this many calls agree:
# a check of the model's whose first call happens to be the graph's next one is not taken for it.
_AGREEING_CALLS = 4


def _matched_calls(model: list[str], graph: list[str]) -> list[int | None] | None:
    """Per model call, the graph call it is (None: the model's own), in one pass: a check the
    trace added (`_TRACE_ADDED`) that the model does not make next is skipped;
    where the model's next call is not the graph's, the model's calls up to where the next
    ones agree again are its own (a call of its own that is the graph's next one is taken for
    it). None where a graph call that does work is left unmatched."""
    matched: list[int | None] = [None] * len(model)
    at = 0
    for position, call in enumerate(graph):
        if call in _TRACE_ADDED and (at >= len(model) or model[at] != call):
            continue
        if at < len(model) and model[at] != call:
            while at < len(model) and not _agree(model, at, graph, position):
                at += 1
        if at == len(model):
            return None
        matched[at] = position
        at += 1
    return matched


def _agree(model: list[str], at: int, graph: list[str], position: int) -> bool:
    """Whether the model's calls from `at` are the graph's from `position` (the checks the trace
    added aside), for `_AGREEING_CALLS` calls or to the end."""
    compared = 0
    while compared < _AGREEING_CALLS and position < len(graph):
        if at < len(model) and model[at] == graph[position]:
            at, compared = at + 1, compared + 1
        elif graph[position] in _TRACE_ADDED:
            pass
        else:
            return False
        position += 1
    return compared > 0


def _allocations_by_call(log: _CallLog) -> dict[int, list[int]]:
    """Call index -> the indices of the allocations it made, in order."""
    made: dict[int, list[int]] = {}
    for index, call in enumerate(log.allocation_call):
        made.setdefault(call, []).append(index)
    return made


def fake_eager_holds(gm: fx.GraphModule, inputs: list[torch.Tensor], model: torch.nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any], device: torch.device,
                     attention: Callable[..., Any] | None = None) -> EagerLifetimes:
    """`eager_holds` on fake copies of the model's state and of the inputs on `device`: what the
    model's code holds, what each submodule call is passed and each node's ATen calls, with no
    memory and nothing run (a model on `meta` too); and what each attention call of its forward
    saves (`EagerLifetimes.attention_saved`), run as `attention` runs it where given (a CUDA
    target's kernel). `args`, `kwargs` are the model's call (`inputs` the graph's tensors of it).
    The model is left as it was.

    Example:
        >>> fake_eager_holds(gm, [x], model, (x,), {}, torch.device("cpu")).holds
        {'add': 'fc2'}
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            made[id(tensor)] = fake_like(tensor, mode, device)
        return made[id(tensor)]

    fake_inputs = [fake(t) for t in inputs]
    fake_args, fake_kwargs = tree_map_only(torch.Tensor, fake, (args, kwargs))
    # (the graph's parameters are the model's, reparametrised twice: an fx graph holds some through modules
    # of its own)
    attention_saves = AttentionSaves(attention)
    # (the masks real tensors would give, as the graph was traced: fake ones cannot be read)
    masks = eager_attention_masks(bind_arguments(inspect.signature(model.forward), args, kwargs), check_packing=True)

    def run_model() -> Any:
        with attention_saves, masks:
            return model(*fake_args, **fake_kwargs)

    with fake_model_state(gm, mode, device), fake_model_state(model, mode, device), mode:
        lifetimes = eager_holds(gm, fake_inputs, run_model, fake)
    lifetimes.attention_saved = attention_saves.saved
    return lifetimes


__all__ = ["AttentionSaves", "CallAlignment", "EagerLifetimes", "KEEPABLE_OPS", "NodeCalls", "OwnCheckpoints",
           "checked_calls", "eager_holds", "fake_eager_holds", "first_difference", "keepable_calls", "matched_from",
           "matched_span", "noting_checkpoints", "unmatched_regions"]
