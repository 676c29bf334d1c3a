"""A saved plan's JSON document: the plain records it is made of (`planner.plans.record`
assembles them) and the values inside them, to and from JSON-ready values.

- values: the fixed forward arguments (`encode_value`, `decode_value`: tagged so that tuples,
  dtypes, devices and non-finite floats come back as they were), fx node targets as stable
  strings (`target_name`), and the document's layout (`json_text`: one line per node, region
  and state-dict entry);
- records: what a model looks like (its graph, leaves and sample: `graph_nodes`,
  `whole_modules`, `sample_structure`), each node's cost and profile (`cost_record`,
  `profile_delta`), each region (`region_record`), the problem's own fields (`problem_record`)
  and the measured figures, and the way back from each (`cost_from_record`, `profile_full`,
  `regions_from_records`, `problem_from_record`, `verification_from_record`).

Example:
    >>> decode_value(json.loads(json.dumps(encode_value((1, torch.float16)))))
    (1, torch.float16)
    >>> record = cost_record(problem.nodes[3], [node.name for node in problem.nodes])
    >>> cost_from_record("linear", record, index) == problem.nodes[3]
    True
"""
from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any, Collection

import torch
import torch.fx as fx
from torch import nn

from planner.core import ModuleCheckpoint, NodeProfile, split_sample
from planner.measure.allocations import LOSS_BACKWARD
from planner.measure.steps import Verification
from planner.trace.structure import compute_nodes, module_path
from planner.trace.tracing import bind_arguments
from solvers import NodeCost, Problem


def target_name(target: Any) -> str:
    """A stable string for an fx node's target: module paths and method names as they are,
    functions by qualified name (`torch.narrow`, `_operator.add`).

    Example:
        >>> target_name(torch.narrow)
        'torch.narrow'
    """
    if isinstance(target, str):
        return target
    try:
        from torch.fx.node import _get_qualified_name

        return _get_qualified_name(target)
    except Exception:  # objects fx cannot name: fall back to what Python says
        module = getattr(target, "__module__", None)
        name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
        return f"{module}.{name}" if module and name else repr(target)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as saved: `dtype_name(torch.bfloat16) == "bfloat16"`."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype a saved name stands for: `dtype_from_name("bfloat16") is torch.bfloat16`."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the saved plan")
    return value


def encode_value(value: Any) -> Any:
    """A fixed forward argument as JSON. Lists, numbers, strings, booleans and None are kept;
    tuples, str-keyed dicts, dtypes, devices and non-finite floats are tagged so they come back
    as they were; anything else is stored as {"unsupported": repr} and cannot be rebuilt.

    Example:
        >>> encode_value((1, None, torch.float16))
        {'tuple': [1, None, {'dtype': 'float16'}]}
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else {"float": repr(value)}
    if isinstance(value, tuple):
        return {"tuple": [encode_value(item) for item in value]}
    if isinstance(value, list):
        return [encode_value(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {"dict": {key: encode_value(item) for key, item in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    return {"unsupported": repr(value), "type": f"{type(value).__module__}.{type(value).__qualname__}"}


class UnsupportedValue(ValueError):
    """A fixed argument that was saved only as its repr and cannot be rebuilt."""


def decode_value(data: Any) -> Any:
    """The inverse of `encode_value`; raises UnsupportedValue for values saved as a repr.

    Example:
        >>> decode_value({"tuple": [1, {"dtype": "float16"}]})
        (1, torch.float16)
    """
    if isinstance(data, list):
        return [decode_value(item) for item in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, payload), = data.items()
        if tag == "tuple":
            return tuple(decode_value(item) for item in payload)
        if tag == "dict":
            return {key: decode_value(item) for key, item in payload.items()}
        if tag == "dtype":
            return dtype_from_name(payload)
        if tag == "device":
            return torch.device(payload)
        if tag == "float":
            return float(payload)
    if "unsupported" in data:
        raise UnsupportedValue(f"{data['unsupported']} (a {data.get('type', 'value')} that JSON cannot hold)")
    raise ValueError(f"cannot read value {data!r} in the saved plan")


def json_text(document: dict[str, Any]) -> str:
    """JSON with one line per top-level field and per item of its lists and mappings (one line
    per node, region and state-dict entry): compact, and readable in a diff."""
    def line(value: Any) -> str:
        return json.dumps(value, separators=(", ", ": "))

    fields = []
    for key, value in document.items():
        if isinstance(value, list) and value:
            body = ",\n".join(f"  {line(item)}" for item in value)
            fields.append(f" {line(key)}: [\n{body}\n ]")
        elif isinstance(value, dict) and value and key != "sample":
            body = ",\n".join(f"  {line(name)}: {line(item)}" for name, item in value.items())
            fields.append(f" {line(key)}: {{\n{body}\n }}")
        else:
            fields.append(f" {line(key)}: {line(value)}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


# NodeCost fields that hold node indices
_NODE_REFERENCES = ("uses", "saves", "mutates", "grad_aliases", "holds", "arguments")


def model_device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def whole_modules(gm: fx.GraphModule) -> list[str]:
    """call_module targets that fx would have traced into: the leaves the plan was traced with
    (given by the user or found automatically). Re-tracing needs all of them."""
    default = fx.Tracer()
    whole = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target not in whole:
            if not default.is_leaf_module(gm.get_submodule(node.target), node.target):
                whole.append(node.target)
    return whole


def graph_nodes(gm: fx.GraphModule) -> list[dict[str, str]]:
    return [
        {"name": node.name, "op": node.op, "target": target_name(node.target), "module": module_path(node)}
        for node in compute_nodes(gm)
    ]


def node_identity(node: dict[str, str]) -> tuple[str, str, str]:
    """What must match between a saved graph and a model's: name, op and target."""
    return node["name"], node["op"], node["target"]


def sample_structure(model: nn.Module, sample: Any, tensor_names: tuple[str, ...],
                      fixed_args: dict[str, Any]) -> dict[str, Any]:
    args, kwargs = split_sample(sample)
    bound = bind_arguments(inspect.signature(model.forward), args, kwargs)
    arguments: list[dict[str, Any]] = []
    for name, value in bound.items():
        if name in tensor_names:
            arguments.append({"name": name, "tensor": {
                "shape": list(value.shape), "dtype": dtype_name(value.dtype), "requires_grad": value.requires_grad,
            }})
        else:
            arguments.append({"name": name, "value": encode_value(fixed_args.get(name, value))})
    device = next(value.device for value in bound.values() if isinstance(value, torch.Tensor))
    return {"device": str(device), "arguments": arguments}


def cost_record(cost: NodeCost, names: list[str]) -> dict[str, Any]:
    record = dataclasses.asdict(cost)
    for key in _NODE_REFERENCES:
        record[key] = [names[index] for index in record[key]]
    record["shared_grads"] = [[names[user], size] for user, size in cost.shared_grads]
    record["view_grads"] = [[names[owner], names[view], size] for owner, view, size in cost.view_grads]
    del record["name"]
    return record


def cost_from_record(name: str, record: dict[str, Any], index: dict[str, int]) -> NodeCost:
    known = {field.name for field in dataclasses.fields(NodeCost)}
    values = {key: value for key, value in record.items() if key in known}
    for key in _NODE_REFERENCES:
        values[key] = tuple(index[owner] for owner in values.get(key, ()))
    values["shared_grads"] = tuple((index[user], size) for user, size in values.get("shared_grads", ()))
    values["view_grads"] = tuple((index[owner], index[view], size) for owner, view, size in values.get("view_grads", ()))
    if values.get("keep_span") is not None:
        values["keep_span"] = tuple(values["keep_span"])
    return NodeCost(name=name, **values)


def _profile_defaults() -> dict[str, Any]:
    return dataclasses.asdict(NodeProfile())


def profile_delta(profile: dict[str, Any], cost: dict[str, Any]) -> dict[str, Any]:
    """The profiler's record less what the cost record already says (same field, same value)
    and less defaults: usually the forward time and the buffers the node writes."""
    def plain(value: Any) -> Any:
        return [plain(item) for item in value] if isinstance(value, (tuple, list)) else value

    defaults = _profile_defaults()
    return {
        key: value for key, value in profile.items()
        if not (plain(cost[key]) == plain(value) if key in cost else plain(value) == plain(defaults.get(key)))
    }


def profile_full(delta: dict[str, Any], cost: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `profile_delta`."""
    defaults = _profile_defaults()
    return {**defaults, **{key: cost[key] for key in defaults if key in cost}, **delta}


def region_record(names: list[str], spec: ModuleCheckpoint | None, kept: Collection[str] = ()) -> dict[str, Any]:
    """One saved region: its nodes, the submodule it checkpoints, and where it keeps outputs,
    the nodes it keeps and the ATen calls its policy caches (`ModuleCheckpoint.saved_calls`).

    Example:
        >>> region_record(["fc1", "relu"], ModuleCheckpoint("block", "Block"), kept={"fc1"})["kept"]
        ['fc1']
    """
    record: dict[str, Any] = {"nodes": names}
    if spec is not None:
        record = {"module": spec.module, "class": spec.module_class, "random": spec.random,
                  "written_buffers": list(spec.written_buffers), **record}
    keeps = [name for name in names if name in kept]
    if keeps:
        record["kept"] = keeps
    if spec is not None and spec.saved_calls:
        record["saved_calls"] = [[name, occurrence] for name, occurrence in spec.saved_calls]
    if spec is not None and spec.runs:
        record["runs"] = [list(run) for run in spec.runs]
        record["calls"] = list(spec.calls)
        record["run_windows"] = [list(window) for window in spec.run_windows]
    if spec is not None and spec.segments:
        record["segments"] = [list(segment) for segment in spec.segments]
    if spec is not None and spec.uncached:
        record["uncached"] = True
    return record


def module_checkpoint(record: Any) -> ModuleCheckpoint | None:
    """The submodule a saved region checkpoints (None in versions 1 and 2: node ranges), with
    the calls it keeps (none in plans saved before keeps existed)."""
    if not isinstance(record, dict) or "module" not in record:
        return None
    return ModuleCheckpoint(module=record["module"], module_class=record["class"], random=record["random"],
                            written_buffers=tuple(record["written_buffers"]),
                            saved_calls=tuple((str(name), int(occurrence))
                                              for name, occurrence in record.get("saved_calls", ())),
                            runs=tuple((int(start), int(stop)) for start, stop in record.get("runs", ())),
                            calls=tuple(str(name) for name in record.get("calls", ())),
                            run_windows=tuple((str(a), int(b), str(c), int(d)) for a, b, c, d in record.get("run_windows", ())),
                            segments=tuple((int(start), int(stop), bool(random))
                                           for start, stop, random in record.get("segments", ())),
                            uncached=bool(record.get("uncached", False)))


def kept_nodes(record: Any) -> list[str]:
    """The nodes a saved region keeps (none in plans saved before keeps existed); ValueError
    where one is not a node of the region.

    Example:
        >>> kept_nodes({"nodes": ["fc1", "relu"], "kept": ["fc1"]})
        ['fc1']
    """
    if not isinstance(record, dict):
        return []
    kept = list(record.get("kept", ()))
    outside = [name for name in kept if name not in record["nodes"]]
    if outside:
        raise ValueError(f"region {record['nodes'][0]}..{record['nodes'][-1]} keeps {outside[0]!r}, "
                         "which is not one of its nodes")
    return kept


def verification_from_record(record: dict[str, Any] | None) -> Verification | None:
    """The saved measured figures, or None where they are absent or from another version."""
    if record is None:
        return None
    known = {field.name for field in dataclasses.fields(Verification)}
    try:
        return Verification(**{key: value for key, value in record.items() if key in known})
    except TypeError:
        return None


def report_setup(planned_for: dict[str, Any] | None) -> dict[str, Any]:
    """The report's arguments about what a saved plan was for (none for version 1 plans)."""
    if not planned_for:
        return {}
    return {"device": planned_for.get("device", ""), "world_size": planned_for.get("world_size", 1),
            "measurement": planned_for.get("measurement", "whole step"),
            "times_estimated": planned_for.get("times_estimated", False),
            "scratch_measured": planned_for.get("scratch_measured", True),
            "own_step_peak_bytes": planned_for.get("own_step_peak_bytes")}


def describe_node(node: dict[str, str]) -> str:
    return f"{node['name']!r} ({node['op']} {node['target']})"


def problem_record(problem: Problem, names: list[str]) -> dict[str, Any]:
    """A Problem's own fields (not its nodes), as a saved plan holds them.

    Example:
        >>> problem_record(problem, names)["static_bytes"]
        13946880
    """
    return {
        "static_bytes": problem.static_bytes,
        "region_overhead_ms": problem.region_overhead_ms,
        "saved_tensor_ms": problem.saved_tensor_ms,
        "keep_region_ms": problem.keep_region_ms,
        "keep_call_ms": problem.keep_call_ms,
        "kept_node_ms": problem.kept_node_ms,
        "rng_state_bytes": problem.rng_state_bytes,
        "measured_gradients": (None if problem.measured_gradients is None
                               else [[names[first], names[last] if last < len(names) else LOSS_BACKWARD, size]
                                     for first, last, size in problem.measured_gradients]),
        "held_in_backward": [[names[first], names[last], size] for first, last, size in problem.held_in_backward],
        "loss_scratch_bytes": problem.loss_scratch_bytes,
        "allowed_regions": (None if problem.allowed_regions is None
                            else [[region.start, region.stop] for region in problem.allowed_regions]),
        "run_spans": [[span.start, span.stop] for span in problem.run_spans],
        "run_call_ms": problem.run_call_ms,
        "recorded_call_ms": problem.recorded_call_ms,
        "run_region_ms": problem.run_region_ms,
        "max_run_nodes": problem.max_run_nodes,
        "segment_regions": [[region.start, region.stop] for region in problem.segment_regions],
    }


def problem_from_record(data: dict[str, Any], index: dict[str, int]) -> Problem:
    """The Problem of a saved plan: its nodes' cost records and `problem_record`'s fields
    (older plans lack some: no selective cost, no cost per saved tensor, RNG states counted as
    static).

    Example:
        >>> problem_from_record(json.loads(text), index).static_bytes
        13946880
    """
    position = {**index, LOSS_BACKWARD: len(data["nodes"])}  # (the loss's backward made the output's gradient)
    return Problem(
        nodes=tuple(cost_from_record(node["name"], node["cost"], index) for node in data["nodes"]),
        static_bytes=data["static_bytes"],
        allowed_regions=(None if data.get("allowed_regions") is None
                         else tuple(range(start, stop) for start, stop in data["allowed_regions"])),
        region_overhead_ms=data.get("region_overhead_ms", 0.0),
        saved_tensor_ms=data.get("saved_tensor_ms", 0.0),
        keep_region_ms=data.get("keep_region_ms", 0.0),
        keep_call_ms=data.get("keep_call_ms", 0.0),
        kept_node_ms=data.get("kept_node_ms", 0.0),
        rng_state_bytes=data.get("rng_state_bytes", 0),
        run_spans=tuple(range(start, stop) for start, stop in data.get("run_spans", ())),
        run_call_ms=data.get("run_call_ms", 0.0),
        recorded_call_ms=data.get("recorded_call_ms", 0.0),
        run_region_ms=data.get("run_region_ms", 0.0),
        max_run_nodes=data.get("max_run_nodes"),
        segment_regions=tuple(range(start, stop) for start, stop in data.get("segment_regions", ())),
        measured_gradients=(None if data.get("measured_gradients") is None
                            else tuple((position[first], position[last], size)
                                       for first, last, size in data["measured_gradients"])),
        held_in_backward=tuple((index[first], index[last], size)
                                for first, last, size in data.get("held_in_backward", ())),
        loss_scratch_bytes=data.get("loss_scratch_bytes", 0),
    )


def regions_from_records(records: list[Any], index: dict[str, int]
                         ) -> tuple[tuple[range, ...], tuple[ModuleCheckpoint | None, ...], tuple[int, ...]]:
    """The regions of a saved plan (node ranges), the submodule each checkpoints and the sorted
    nodes they keep (older plans keep nothing); ValueError for a region that is not a run of
    consecutive nodes.

    Example:
        >>> regions, wrapped, kept = regions_from_records(data["regions"], index)
    """
    names_in_order = sorted(index, key=index.__getitem__)
    regions = []
    wrapped = []
    kept: list[int] = []
    for record in records:
        names = record["nodes"] if isinstance(record, dict) else record
        wrapped.append(module_checkpoint(record))
        kept += [index[name] for name in kept_nodes(record)]
        start = index[names[0]]
        region = range(start, start + len(names))
        if names_in_order[region.start:region.stop] != list(names):
            raise ValueError(f"region {names[0]}..{names[-1]} is not a run of consecutive nodes")
        regions.append(region)
    return tuple(regions), tuple(wrapped), tuple(sorted(kept))


__all__ = ["UnsupportedValue", "cost_from_record", "cost_record", "decode_value", "describe_node", "dtype_from_name",
           "dtype_name", "encode_value", "graph_nodes", "json_text", "kept_nodes", "model_device", "module_checkpoint",
           "node_identity", "problem_from_record", "problem_record", "profile_delta", "profile_full", "region_record",
           "regions_from_records", "report_setup", "sample_structure", "target_name", "verification_from_record",
           "whole_modules"]
