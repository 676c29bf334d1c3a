"""The records a profile writes: one `NodeProfile` per compute node (in
`node.meta["planner.profile"]`, see `planner.profile`) and one `GraphProfile` for the whole
graph. `planner.graph.build_problem` turns them into the solvers' `NodeCost`s.

Example:
    >>> record = gm.graph.find_nodes(op="call_module", target="fc1")[0].meta["planner.profile"]
    >>> record.saved_bytes, record.transient_bytes
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class NodeProfile:
    """What one fx node costs. Node references are fx node names of the owning nodes."""

    forward_ms: float = 0.0
    output_bytes: int = 0
    grad_bytes: int = 0
    saved_bytes: int = 0
    transient_bytes: int = 0
    param_grad_bytes: int = 0
    parameters: tuple[str, ...] = ()  # trainable parameters it reads (first qualified name of each)
    uses: tuple[str, ...] = ()
    saves: tuple[str, ...] = ()
    mutates: tuple[str, ...] = ()
    grad_aliases: tuple[str, ...] = ()  # owners whose gradient its backward hands on uncopied
    mutated_buffers: tuple[str, ...] = ()  # qualified names of buffers written (BatchNorm statistics)
    backward_transient_bytes: int = 0  # temporaries of this node's backward (freed when it ends)
    holds: tuple[str, ...] = ()  # outputs the model's own code still references while it runs (planner.holds)
    arguments: tuple[str, ...] = ()  # outputs passed to a submodule call starting here (planner.holds)
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
    # a region must not recompute from an input written in place (planner.graph.build_problem)
    input_reads: tuple[str, ...] = ()
    input_writes: tuple[str, ...] = ()
    # its ATen calls in the model's own forward, in order (planner.holds; empty where the whole
    # step was not run, or the model's calls differ from the graph's)
    aten_calls: tuple[str, ...] = ()
    # where a region may keep its output (planner.holds.NodeCalls.keepable), the positions in
    # `aten_calls` of the calls that make its storages: what a selective policy caches
    keep_calls: tuple[int, ...] = ()
    # (start, stop) compute-node indices: kept only by regions within them (NodeCost.keep_span)
    keep_span: tuple[int, int] | None = None
    # (start, stop) compute-node indices of the largest submodule call holding it whose ATen
    # calls the model's forward makes exactly as the graph does, from a submodule call at or
    # before it on (planner.holds.NodeCalls.run_span): a run of nodes inside it may be
    # recomputed alone (planner.run_checkpoint)
    call_span: tuple[int, int] | None = None
    # tensors autograd saved for its backward, counted as packed (parameters included): in a
    # region, checkpoint's hooks pack and unpack each one
    saved_tensors: int = 0


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
    # Gradients in flight, measured: (node whose backward made the storage, node whose backward
    # freed it, bytes), where the whole step ran (None: derived from the graph by the solvers)
    gradients: tuple[tuple[str, str, int], ...] | None = None
