"""Turn a profiled fx graph into a torch-free `solvers.Problem` (`build_problem`): each compute
node's `NodeCost`, the allowed regions (submodule calls, `module_checkpoint`; runs inside them,
`run_spans`), what a region keeps and records (`saved_calls`, `run_checkpoints`), and the time
figures on a dyadic grid (`on_time_grid`), so that plans of equal cost tie exactly.

Example:
    >>> problem = build_problem(gm, static_bytes, tuple(wrapped), overhead_ms)
    >>> len(problem) == len(compute_nodes(gm))
    True
"""
from __future__ import annotations

from dataclasses import replace
from typing import Collection, Sequence

import torch.fx as fx

from planner.core import ModuleCheckpoint, counted_call
from planner.measure.allocations import LOSS_BACKWARD
from planner.measure.profile import META_KEY, parameter_readers, passes_on, reaches_backward
from planner.trace.structure import ModuleCall, compute_nodes
from solvers import NodeCost, Problem

# A run holds at most this many nodes: the solvers search every run from every node, and a
# longer one costs about what checkpointing its block does (runs that matter free a norm's or an
# activation's output, or cross a block's end: its residual add and the next block's norm).
MAX_RUN_NODES = 32


def module_checkpoint(gm: fx.GraphModule, call: ModuleCall, model_class: str,
                      uncached: bool) -> ModuleCheckpoint | None:
    """How to checkpoint `call` (random draws, buffers to restore after recomputing), or None
    where it writes a buffer outside its own module, which recomputation could not restore.
    `model_class` names the model's own forward's class (path ""); `uncached` is
    `casts_uncached(gm)`, asked once per graph."""
    nodes = compute_nodes(gm)
    records = [nodes[i].meta[META_KEY] for i in call.nodes if META_KEY in nodes[i].meta]
    prefix = call.path + "." if call.path else ""
    written = sorted({name for record in records for name in record.mutated_buffers})
    if any(not name.startswith(prefix) for name in written):
        return None
    return ModuleCheckpoint(
        module=call.path, module_class=call.module_class or model_class,
        random=any(record.random for record in records) or len(records) < len(call.nodes),
        written_buffers=tuple(name[len(prefix):] for name in written), uncached=uncached,
    )


def casts_uncached(gm: fx.GraphModule) -> bool:
    """Whether the plan's regions run with autocast's cache off (`planner.core.uncached_autocast`):
    where no parameter's autocast copy is used by two nodes (`NodeProfile.cast_parameters`: a
    tied embedding that only the output layer casts qualifies), each region's casts are its own,
    and the problem counts those a node saves as its saved tensors; else (ALBERT's shared layers)
    every region runs cached, as the plan was measured, and a node's casts count as held to its
    backward.

    Example:
        >>> casts_uncached(traced.gm)
        True
    """
    return all(len(users) == 1 for users in parameter_readers(compute_nodes(gm), cast=True).values())


def saved_calls(gm: fx.GraphModule, region: range, kept: Collection[int]) -> tuple[tuple[str, int], ...]:
    """The ATen calls a selective-checkpoint policy caches so that `region` keeps the outputs
    of its nodes in `kept` (node indices): (func name, occurrence of that func counted from the
    first call of the region's first node), as `ModuleCheckpoint.saved_calls` lists them. The
    region is one submodule call, whose forward makes its nodes' calls (`NodeProfile.aten_calls`).

    Example:
        >>> saved_calls(gm, range(10, 24), [12, 20])  # a block's qkv and first MLP linear
        (('aten.addmm.default', 0), ('aten.addmm.default', 2))
    """
    nodes = compute_nodes(gm)
    kept = frozenset(kept)
    seen: dict[str, int] = {}
    found: list[tuple[str, int]] = []
    for i in region:
        record = nodes[i].meta[META_KEY]
        if i in kept and not record.keep_calls:
            raise ValueError(f"node {nodes[i].name!r} cannot be kept: its ATen calls were not recorded, or not all "
                             "the storages it makes come from matrix products, convolutions or attention")
        cached = set(record.keep_calls) if i in kept else set()
        for position, name in enumerate(record.aten_calls):
            if position in cached:
                found.append((name, seen.get(name, 0)))
            seen[name] = seen.get(name, 0) + 1
    return tuple(found)


def run_checkpoints(gm: fx.GraphModule, problem: Problem, regions: Sequence[range],
                    wrapped: dict[range, ModuleCheckpoint], kept: Collection[int] = ()) -> dict[range, ModuleCheckpoint]:
    """For each of `regions` that is a run inside a submodule call (`Problem.run_span_of`),
    how that call's forward is applied: not checkpointed, recomputing the ATen calls of every
    planned run inside it (`ModuleCheckpoint.runs`, indices into its calls as the model's
    forward makes them, `planner.core.counted_call`). `kept`: the plan's kept
    nodes; a run's recording does not start inside a region that keeps some (see below).

    Example:
        >>> run_checkpoints(gm, problem, [range(30, 34)], wrapped)[range(30, 34)].runs
        ((52, 58),)
    """
    nodes = compute_nodes(gm)
    runs: dict[range, list[range]] = {}
    for region in regions:
        span = problem.run_span_of(region)
        if span is not None:
            runs.setdefault(span, []).append(region)
    # A region that keeps nodes runs its forward under its selective policy's dispatch mode,
    # which must nest with the recording's: a recording started at a submodule's hook inside
    # that forward would be popped when the policy's mode exits (fuzz seed 401: the run freed
    # nothing). Such a window starts at the keeping region's own pre-hook instead, and so also
    # sees its forward's calls (at `run_call_ms` each, which the solvers do not price).
    keeping = [region for region in regions if region in wrapped and any(i in region for i in kept)]
    found: dict[range, ModuleCheckpoint] = {}
    for span, inside in runs.items():
        calls: list[str] = []
        first_call: dict[int, int] = {}
        for i in span:
            first_call[i] = len(calls)
            calls += [name for name in nodes[i].meta[META_KEY].aten_calls if counted_call(name)]
        first_call[span.stop] = len(calls)
        prefix = wrapped[span].module + "."
        windows = []
        for region in inside:  # the submodules whose forward hooks start and stop the recording
            entry, leave = problem.run_windows(region)  # type: ignore[misc]
            entry = next((r for r in keeping if r.start <= entry.start and entry.stop <= r.stop), entry)
            windows.append((wrapped[entry].module.removeprefix(prefix) if entry != span else "", first_call[entry.start],
                            wrapped[leave].module.removeprefix(prefix) if leave != span else "",
                            first_call[leave.stop]))
        spec = replace(wrapped[span], runs=tuple((first_call[r.start], first_call[r.stop]) for r in inside),
                       calls=tuple(calls), run_windows=tuple(windows))
        found.update({region: spec for region in inside})
    return found


def kept_indices(problem: Problem, regions: tuple[range, ...], kept: Sequence[str]) -> tuple[int, ...]:
    """The sorted node indices of `kept` (node names), each a node one of `regions` may keep
    (`Problem.keepable_in`); ValueError naming the first that is not, with the nodes the
    regions may keep.

    Example:
        >>> kept_indices(problem, (range(8, 43),), ["blocks_0_mlp_0"])
        (38,)
    """
    if isinstance(kept, str):
        raise TypeError(f"kept takes a list of node names, not the string {kept!r}")
    index = {node.name: i for i, node in enumerate(problem.nodes)}
    candidates = {i for region in regions for i in problem.keepable_in(region)}
    for name in kept:
        if index.get(name) in candidates:
            continue
        if name not in index:
            why = "is not a node of the graph"
        elif not any(index[name] in region for region in regions):
            why = "lies in none of the checkpointed regions"
        else:
            why = ("is not a node its region may keep (one that makes a storage, writes nothing in place, draws "
                   "no random numbers, whose calls were recorded in the model's forward as in the graph, and "
                   "that recomputation reaches)")
        named = ", ".join(problem.nodes[i].name for i in sorted(candidates)[:12]) or (
            "none" if any(node.keepable for node in problem.nodes) else "none (plan with selective=True to keep nodes)")
        more = f" and {len(candidates) - 12} more" if len(candidates) > 12 else ""
        raise ValueError(f"cannot keep {name!r}: it {why}; the regions may keep {named}{more}")
    return tuple(sorted({index[name] for name in kept}))


def build_problem(gm: fx.GraphModule, static_bytes: int, allowed_regions: tuple[range, ...] | None = None,
                  region_overhead_ms: float = 0.0, rng_state_bytes: int = 0,
                  gradients: tuple[tuple[str, str, int], ...] | None = None,
                  saved_tensor_ms: float = 0.0, segments: tuple[range, ...] = (),
                  sequentials: tuple[range, ...] = (), loss_scratch_bytes: int = 0) -> Problem:
    """Collect the per-node profiles of `gm` into a Problem (plain ints and floats), with the
    static memory the plan does not change (see `planner.measure.static`). Regions are limited to the
    node ranges `allowed_regions` (None: any run of nodes), each costs `region_overhead_ms` more,
    and `saved_tensor_ms` per tensor its nodes save, and one that draws random numbers keeps an
    RNG state of `rng_state_bytes`. `segments`, slices of an `nn.Sequential`'s children
    (`planner.problem.segments`), are allowed regions too; no run is recorded inside them nor inside the
    calls in `sequentials`. `gradients`
    (measured gradients in flight, `GraphProfile.gradients`) replace the graph's estimate;
    `loss_scratch_bytes` is the scratch of the loss computed outside the graph
    (`GraphProfile.loss_scratch_bytes`).

    Example:
        >>> problem = build_problem(gm, sum(static_breakdown(...).values()))
        >>> len(problem) == len(compute_nodes(gm))
        True
    """
    nodes = compute_nodes(gm)
    index = {node.name: i for i, node in enumerate(nodes)}
    if segments:
        allowed_regions = tuple(sorted({*(allowed_regions or ()), *segments}, key=lambda r: (r.start, -len(r))))
    output_node = next(node for node in gm.graph.nodes if node.op == "output")
    returned: set[str] = set()
    for node in output_node.all_input_nodes:
        record = node.meta.get(META_KEY)
        if record is not None and record.output_bytes == 0:
            returned.update(record.uses)  # returns views or a record of tensors made earlier
        returned.add(node.name)
    parameter_grads, shared = _parameter_gradients(gm, nodes, index, derived=gradients is None)
    released = _released_with_outputs(nodes, index)
    # A kept output must not be written in place later: the cached copy would be stale.
    written = {index[name] for node in nodes for name in node.meta[META_KEY].mutates}
    fixed = _touching_written_inputs(nodes) | _dead_with_saved(nodes)
    no_runs = {*segments, *sequentials}
    spans = tuple(span for span in run_spans(nodes, allowed_regions) if span not in no_runs)
    buffer_sizes = {name: buffer.numel() * buffer.element_size() for name, buffer in gm.named_buffers()}
    uncached = casts_uncached(gm)  # (how a region's autocast casts live: see casts_uncached)
    costs = []
    for i, node in enumerate(nodes):
        record = node.meta[META_KEY]
        runs = record.backward_runs
        param_grad_bytes = parameter_grads[i]
        costs.append(
            NodeCost(
                name=node.name,
                compute_ms=record.forward_ms,
                output_bytes=record.output_bytes + (0 if runs else record.saved_bytes + record.unhooked_saved_bytes
                                                    + record.cast_bytes - record.cast_saved_bytes),
                grad_bytes=record.grad_bytes,
                backward_runs=runs,
                # (where regions run with autocast's cache off, the casts a node saves are saved tensors)
                saved_bytes=record.saved_bytes - (0 if uncached else record.cast_saved_bytes) if runs else 0,
                transient_bytes=record.transient_bytes,
                param_grad_bytes=param_grad_bytes,
                late_grad_bytes=max(0, min(record.late_grad_bytes, param_grad_bytes)),
                unhooked_saved_bytes=(record.unhooked_saved_bytes + (0 if uncached else record.cast_bytes)
                                      if runs else 0),
                # casts it does not save (a bias): cached to the end of forward (in a region, uncached: less)
                forward_held_bytes=record.cast_bytes - record.cast_saved_bytes if runs and uncached else 0,
                backward_transient_bytes=record.backward_transient_bytes,
                uses=tuple(index[name] for name in record.uses),
                saves=tuple(index[name] for name in record.saves) if runs else (),
                mutates=tuple(index[name] for name in record.mutates),
                grad_aliases=tuple(index[name] for name in record.grad_aliases),
                view_grads=tuple((index[owner], index[view], size) for owner, view, size in record.view_grads),
                holds=tuple(sorted({index[name] for name in record.holds} | released.get(i, set()))),
                arguments=tuple(index[name] for name in record.arguments),
                shared_grads=tuple(shared.get(i, ())),
                is_output=node.name in returned,
                random=record.random,
                buffer_bytes=sum(buffer_sizes[name] for name in record.mutated_buffers),
                stops_before_output=record.stops_before_output,
                stop_ms=record.stop_ms,
                stop_transient_bytes=record.stop_transient_bytes,
                keepable=bool(record.keep_calls) and i not in written,
                keep_span=None if record.keep_span is None else tuple(record.keep_span),
                aten_calls=len(record.aten_calls),
                saved_tensors=record.saved_tensors,
                recomputable=i not in fixed,
                # (a run's replay writes buffers on copies, `planner.apply.runs`)
                replayable=_replayable(record.call_span, i, spans),
            )
        )
    measured = None
    if gradients is not None:
        # A storage lives from the backward that made it (the later node; the loss's: after
        # every node) to the one that freed it.
        position = {**index, LOSS_BACKWARD: len(nodes)}
        measured = tuple(sorted((min(position[made], position[freed]), max(position[made], position[freed]), size)
                                for made, freed, size in gradients))
    return Problem(nodes=tuple(costs), static_bytes=static_bytes, allowed_regions=allowed_regions,
                   region_overhead_ms=region_overhead_ms, rng_state_bytes=rng_state_bytes,
                   measured_gradients=measured, saved_tensor_ms=saved_tensor_ms,
                   run_spans=spans, max_run_nodes=MAX_RUN_NODES, segment_regions=segments,
                   loss_scratch_bytes=loss_scratch_bytes)


# Time figures are put on a dyadic grid (multiples of this many ms, about 15 ns): sums and
# products of them are then exact in floating point, so plans of equal cost (the same regions in
# twin layers) tie exactly, and the solvers break the tie the same way every time.
TIME_QUANTUM_MS = 2.0**-16


def on_time_grid(problem: Problem) -> Problem:
    """`problem` with every time figure (node times and the cost model's) on `TIME_QUANTUM_MS`'s grid.

    Example:
        >>> on_time_grid(problem).nodes[0].compute_ms * 2**16 % 1
        0.0
    """
    def grid(ms: float) -> float:
        return round(ms / TIME_QUANTUM_MS) * TIME_QUANTUM_MS

    nodes = tuple(replace(node, compute_ms=grid(node.compute_ms),
                          stop_ms=None if node.stop_ms is None else grid(node.stop_ms)) for node in problem.nodes)
    return replace(problem, nodes=nodes, region_overhead_ms=grid(problem.region_overhead_ms),
                   saved_tensor_ms=grid(problem.saved_tensor_ms), keep_region_ms=grid(problem.keep_region_ms),
                   keep_call_ms=grid(problem.keep_call_ms), kept_node_ms=grid(problem.kept_node_ms),
                   run_call_ms=grid(problem.run_call_ms), recorded_call_ms=grid(problem.recorded_call_ms),
                   run_region_ms=grid(problem.run_region_ms))


def run_spans(nodes: list[fx.Node], allowed_regions: tuple[range, ...] | None) -> tuple[range, ...]:
    """The allowed regions (submodule calls) inside which any run of nodes may be a region
    (`Problem.run_spans`): those of 2 nodes or more within some node's
    `NodeProfile.call_span` (the largest call holding it whose ATen calls the model's forward
    makes as the graph does; so do the calls inside it)."""
    matched = {range(*span) for node in nodes if (span := node.meta[META_KEY].call_span) is not None}
    return tuple(region for region in allowed_regions or ()
                 if len(region) >= 2
                 and any(span.start <= region.start and region.stop <= span.stop for span in matched))


def _replayable(call_span: tuple[int, int] | None, index: int, spans: tuple[range, ...]) -> bool:
    """Whether a run in any of `spans` may hold node `index`: its calls are the graph's in each
    that holds it (its `NodeProfile.call_span` holds them all; a stack whose forward makes other
    calls before its blocks matches from its first block only)."""
    return all(call_span is not None and call_span[0] <= span.start and span.stop <= call_span[1]
               for span in spans if index in span)


def gradient_maker(reader: fx.Node, index: dict[str, int]) -> int:
    """The node whose backward makes a parameter's gradient for `reader`: the reader, or where
    it only views the parameter (`self.weight.T`) or passes it on (`passes_on`), the last node
    reading down that chain, whose backward runs first.

    Example:
        >>> names[gradient_maker(t_node, index)]  # `self.weight.T` read by a matmul
        'matmul'
    """
    if passes_on(reader.meta[META_KEY]):
        makers = [gradient_maker(user, index) for user in _gradient_readers(reader, index)]
        if makers:
            return max(makers)
    return index[reader.name]


def gradient_entries(reader: fx.Node, index: dict[str, int]) -> list[int]:
    """Where a parameter's gradient for `reader` joins the parameter's own (the sum autograd adds
    to `.grad`): at the reader's backward (a view's hands it on), or, where the reader has no
    backward (it passes the parameter itself on: dropout at p=0), at its readers'.

    Example:
        >>> [names[i] for i in gradient_entries(dropout_node, index)]  # DeBERTa: `dropout(weight)[0:n]`
        ['alias_1']
    """
    if reader.meta[META_KEY].backward_runs:
        return [index[reader.name]]
    return [entry for user in _gradient_readers(reader, index) for entry in gradient_entries(user, index)]


def _gradient_readers(node: fx.Node, index: dict[str, int]) -> list[fx.Node]:
    """The compute nodes reading `node`'s output through which gradients reach it."""
    return [user for user in node.users if user.name in index and reaches_backward(user)]


def parameter_gradient_paths(nodes: list[fx.Node], index: dict[str, int]) -> dict[str, dict[int, int]]:
    """Per trainable parameter read in backward, where each of its gradients joins the
    parameter's (`gradient_entries`) -> the node whose backward makes it (`gradient_maker`).

    Example:
        >>> parameter_gradient_paths(nodes, index)["head.weight"]  # tied to the embedding at node 1
        {1: 1, 40: 40}
    """
    return {name: {entry: gradient_maker(nodes[entry], index)
                   for reader in readers for entry in gradient_entries(reader, index)}
            for name, readers in parameter_readers(nodes, backward=True).items()}


def _parameter_gradients(gm: fx.GraphModule, nodes: list[fx.Node], index: dict[str, int], derived: bool
                         ) -> tuple[list[int], dict[int, list[tuple[int, int]]]]:
    """Each node's parameters' gradient bytes (`NodeCost.param_grad_bytes`: temporaries of its
    backward, as in a step where `.grad` already holds the sum) and the parameter gradients that
    live across nodes' backward (`NodeCost.shared_grads`, by the node whose backward makes one).

    A node that only views a parameter (`self.weight.T`: no storage, no gradient of its own) or
    passes it on reads it, but its gradient is made by the backward of the last node reading down
    the chain (`parameter_gradient_paths`), which runs first, and lives until the view's own
    backward hands it on. Where gradients reach a parameter along several paths (tied weights;
    DeBERTa's relative embeddings, viewed by every layer), autograd sums them in one buffer
    before adding it to `.grad`: the path whose gradient gets there first holds it until the
    last path's has (at the earliest node's backward). A node whose backward never runs and
    that nothing reads (a metadata check on a weight) makes none. Where gradients in flight were
    measured (not `derived`), a view's storage is counted as a temporary of its maker's
    backward, as the measured windows leave it, and only a tied parameter's sum is held."""
    sizes = [0 if passes_on(node.meta[META_KEY]) else node.meta[META_KEY].param_grad_bytes for node in nodes]
    parameter_bytes = {name: p.numel() * p.element_size() for name, p in gm.named_parameters()}
    held: dict[int, list[tuple[int, int]]] = {}
    readers = parameter_readers(nodes, backward=True)
    for name, paths in parameter_gradient_paths(nodes, index).items():
        size = parameter_bytes[name]
        for reader in readers[name]:
            if passes_on(reader.meta[META_KEY]):  # made down its chains
                for entry in gradient_entries(reader, index):
                    sizes[paths[entry]] += size
        first, last = min(paths), max(paths)
        for entry, maker in paths.items():
            until = first if entry == last else entry
            if until < maker and (derived or entry == maker):  # held from the backward that makes it
                held.setdefault(maker, []).append((until, size))
                sizes[maker] = max(0, sizes[maker] - size)
    return sizes, held


def _touching_written_inputs(nodes: list[fx.Node]) -> set[int]:
    """Nodes no region may hold: those that write a graph input in place, and those that read
    one written in place at or after them (see `NodeCost.recomputable`)."""
    last_write: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for name in node.meta[META_KEY].input_writes:
            last_write[name] = i
    return {i for i, node in enumerate(nodes)
            if node.meta[META_KEY].input_writes
            or any(last_write.get(name, -1) >= i for name in node.meta[META_KEY].input_reads)}


def _dead_with_saved(nodes: list[fx.Node]) -> set[int]:
    """Nodes no region may hold because their backward never runs (`NodeProfile.backward_runs`:
    a dead branch, whose output no loss reads) and they save storages of their own for it.
    Outside a region those live as long as the node's output, which the problem counts; inside
    one, checkpoint would drop them at once, which the memory model does not count: the
    prediction would err high (a dropout's mask on a dead branch). Recomputing such a node buys
    no gradient. (What it saves of its inputs is held as `_released_with_outputs` says, in a
    region or not.)"""
    return {i for i, node in enumerate(nodes)
            if not (record := node.meta[META_KEY]).backward_runs and record.saved_bytes}


def _released_with_outputs(nodes: list[fx.Node], index: dict[str, int]) -> dict[int, set[int]]:
    """For nodes whose backward never runs (`NodeProfile.backward_runs`), what they saved is
    freed with their output (the autograd node that holds it dies with it), not by backward:
    by node index, the saved owners that node's reading or holding of such an output keeps
    alive (a dead branch: `gelu(x)` that nothing returned depends on keeps `x` while the
    model's code holds the result)."""
    records = [node.meta[META_KEY] for node in nodes]
    kept: dict[int, set[int]] = {}
    for k, record in enumerate(records):
        if record.backward_runs or not record.saves:
            continue
        saved = {index[name] for name in record.saves}
        # Its output: its own storage, or the one it writes in place or views.
        outputs = {nodes[k].name} if record.output_bytes else set(record.mutates or record.uses)
        kept.setdefault(k, set()).update(saved)
        for m in range(k + 1, len(records)):
            if outputs & {*records[m].uses, *records[m].holds}:
                kept.setdefault(m, set()).update(saved)
    return kept
