"""How to measure a traced model for its plan: the measure stage's facade (`measure_model`).

Two paths (docs/design.md, docs/planning-without-running.md):

* "run": the whole training step on real tensors, every value kept for the analysis
  (`planner.measure.profile.profile`), and the model's own forward beside the graph
  (`planner.measure.holds.eager_holds`): exact, but it needs more memory than the unplanned step;
* "no-run": sizes on fake tensors (`planner.measure.sizes`), the model's own forward followed
  on fake tensors (`planner.measure.holds.fake_eager_holds`), then each distinct node alone on
  real tensors made for it (`planner.measure.nodes`), or, for a target GPU that is not this
  machine's device, roofline estimates of its times (`planner.measure.targets`).

"auto" always takes the sizes on fake tensors first (no memory), and measures the whole step
wherever this device can hold what that needs (`planner.measure.device.measurable_bytes`). The
budget plays no part in that choice: it describes the run the plan is for.

Example:
    >>> where = plan_device(sample, target="h100")
    >>> summary = measure_model(traced.gm, inputs, where, "auto")
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx

from planner.core import GraphProfile, training_loss
from planner.measure.device import PlanDevice, can_run, check_measure, measurable_bytes
from planner.measure.holds import EagerLifetimes, OwnCheckpoints, eager_holds, fake_eager_holds
from planner.measure.nodes import estimate_nodes, measure_nodes
from planner.measure.profile import META_KEY, graph_profile, profile
from planner.measure.sizes import profile_sizes
from planner.measure.targets import ATTENTION_TARGETS, target_attention
from solvers.solution import format_bytes

logger = logging.getLogger(__name__)


def measure_model(
    gm: fx.GraphModule,
    inputs: list[torch.Tensor],
    where: PlanDevice,
    mode: str = "auto",
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
    model_call: tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]] | None = None,
    node_times: Callable[[fx.GraphModule], str] | None = None,
) -> GraphProfile:
    """Annotate `gm`'s compute nodes with their measurements for a plan on `where` and return
    the whole-graph figures. `mode`: "run", "no-run" or "auto" (see the module docstring).
    `node_times`, with "no-run", sets every node's forward time itself (times read elsewhere:
    another batch's, scaled) in place of timing each node, and returns how they were read.
    `model_call` is (model, args, kwargs), the model's own call on the inputs: the outputs its
    code holds longer than the graph, and each node's ATen calls, are noted (`planner.measure.holds`),
    on real tensors where the whole step is measured, else on fake ones.
    The caller restores what measuring changes on a real model (BatchNorm statistics, RNG):
    see `planner.measure.memory.preserved_state`.

    Example:
        >>> summary = measure_model(traced.gm, inputs, plan_device(inputs, None), "no-run")
        >>> summary.measurement
        'node by node'
    """
    check_measure(mode)
    say = progress or (lambda message: logger.info(message))
    tensors = [*gm.parameters(), *gm.buffers(), *inputs]
    runnable = can_run(tensors, where)
    if mode == "run" and not runnable:
        here = "meta tensors" if any(t.device.type == "meta" for t in tensors) else "tensors on another device"
        raise ValueError(f"measure='run' runs the whole step on the plan's device ({where.name}), but the model "
                         f"or sample holds {here}{'' if where.local else ', and that device is not this machine'}; "
                         "use measure='no-run' (or 'auto')")
    if mode != "run":
        say("measuring sizes on fake tensors")
        fake = profile_sizes(gm, inputs, where.profile_device, cuda=where.device.type == "cuda", loss=loss)
        room = measurable_bytes(where.device) if runnable else 0
        if mode == "auto" and runnable and fake.needed_bytes <= room:
            logger.info("measuring the whole step: it holds about %s, and %s has room for %s",
                        format_bytes(fake.needed_bytes), where.name, format_bytes(room))
        else:
            if not where.local:
                say(f"estimating times on {where.name} (roofline): it is not this machine's device")
            elif mode == "auto":
                why = ("the model or sample is on the meta device" if not runnable else
                       f"measuring the whole step at once would hold about {format_bytes(fake.needed_bytes)}, "
                       f"more than {where.name} has free ({format_bytes(room)} with a margin)")
                say(f"measuring node by node: {why}")
            if model_call is not None:
                say("following the model's own forward on fake tensors: what its code holds, its ATen calls")
                cuda_attention = target_attention if where.device.type == "cuda" else None
                try:
                    lifetimes = fake_eager_holds(gm, inputs, *model_call, where.profile_device, cuda_attention)
                except OwnCheckpoints:
                    raise
                except Exception as error:  # (a forward fake tensors cannot follow: data-dependent code)
                    _warn_unfollowed(error)
                else:
                    note_holds(gm, lifetimes)
                    keep_attention_saves(gm, lifetimes.attention_saved)
            else:
                logger.info(_NOTHING_KEPT, "the model's own forward was not run")
            if node_times is not None:
                return graph_profile(gm, inputs, where.device, node_times(gm), measurement="sizes on fake tensors",
                                     times_estimated=True, scratch_measured=False, loss_bytes=fake.loss_bytes)
            return _no_run(gm, inputs, fake, where, repeats, say, loss)
    say("measuring the whole step")
    summary = profile(gm, inputs, repeats=repeats, progress=say, loss=loss)
    if model_call is not None:
        say("measuring how long the model's own code holds each output")
        model, args, kwargs = model_call
        note_holds(gm, eager_holds(gm, inputs, lambda: model(*args, **kwargs)))
    else:
        logger.info(_NOTHING_KEPT, "the model's own forward was not run")
    return summary


# Keeping a node's output inside a region (a selective-checkpoint policy) needs its ATen calls
# as the model's own forward makes them (`planner.measure.holds`), recorded only where the step runs.
_NOTHING_KEPT = "no region may keep a node's output (selective checkpointing): %s, so its ATen calls are not known"


def keep_attention_saves(gm: fx.GraphModule, model_saved: list[int]) -> None:
    """Where the model's own attention calls (`model_saved`, in order, from `fake_eager_holds`)
    save more than the graph's attention nodes, add the difference to those nodes' saved bytes
    and warn naming them: the plan runs the model's code, and the prediction errs high, not low.
    Where the two make different numbers of attention calls, nothing is compared (logged).

    Example:
        >>> keep_attention_saves(traced.gm, [4 << 20, 4 << 20])  # two layers' attention
    """
    nodes = [node for node in gm.graph.nodes if node.op == "call_function" and node.target in ATTENTION_TARGETS]
    if len(nodes) != len(model_saved):
        if model_saved or nodes:
            logger.info("attention calls not compared: the model's forward makes %d, the graph %d",
                        len(model_saved), len(nodes))
        return
    raised = []
    for node, saved in zip(nodes, model_saved):
        record = node.meta[META_KEY]
        if saved > record.saved_bytes:
            raised.append(f"{node.name} (+{format_bytes(saved - record.saved_bytes)})")
            record.saved_bytes = saved
    if raised:
        warnings.warn("the model's own attention calls save more than the traced graph's (on fake tensors its code "
                      "cannot read the tokens' values and may build a mask that real batches skip, or it picks "
                      "another kernel: a grouped-query call on the math path); the plan counts the model's at "
                      + ", ".join(raised[:4]) + (" ..." if len(raised) > 4 else ""), stacklevel=4)


def _warn_unfollowed(error: Exception) -> None:
    """Say what the no-run path cannot know where the model's forward does not run on fake tensors."""
    why = f"the model's forward does not run on fake tensors ({type(error).__name__}: {error})"
    logger.info(_NOTHING_KEPT, why)
    warnings.warn(f"{why}: the outputs its code holds longer than the traced graph are not known, so the "
                  "predicted peak may be low; plan where the model runs (measure='auto') to measure them",
                  stacklevel=4)


def note_holds(gm: fx.GraphModule, lifetimes: EagerLifetimes) -> None:
    """Write `planner.measure.holds.eager_holds`'s answer into the nodes' profiles: what the model's
    code holds, what each submodule call is passed, and each node's ATen calls with, where a
    region may keep its output, the ones a selective policy caches (`NodeProfile.keep_calls`)."""
    by_holder: dict[str, list[str]] = {}
    for name, holder in lifetimes.holds.items():
        by_holder.setdefault(holder, []).append(name)
    for node in gm.graph.nodes:
        if node.name in by_holder:
            node.meta[META_KEY].holds = tuple(sorted(by_holder[node.name]))
        if node.name in lifetimes.arguments:
            node.meta[META_KEY].arguments = tuple(sorted(lifetimes.arguments[node.name]))
        calls = lifetimes.calls.get(node.name)
        if calls is not None:
            node.meta[META_KEY].aten_calls = calls.names
            node.meta[META_KEY].keep_calls = calls.allocating if calls.keepable else ()
            node.meta[META_KEY].keep_span = calls.keep_span if calls.keepable else None
            node.meta[META_KEY].call_span = calls.run_span


def _no_run(gm: fx.GraphModule, inputs: list[torch.Tensor], fake: Any, where: PlanDevice, repeats: int,
            say: Callable[[str], None], loss: Callable[[Any], torch.Tensor] | None) -> GraphProfile:
    if where.local:
        count = measure_nodes(gm, fake, where.device, repeats=repeats, progress=say, loss=loss or training_loss)
        say(f"ran {count} distinct nodes one at a time")
        timing = "CUDA events" if where.device.type == "cuda" else "time.perf_counter"
        return graph_profile(gm, inputs, where.device, f"{timing}, node by node", measurement="node by node",
                             loss_bytes=fake.loss_bytes, loss_scratch_bytes=fake.loss_scratch_bytes)
    assert where.target is not None
    estimate_nodes(gm, where.target)
    return graph_profile(gm, inputs, where.device, f"estimated: roofline on {where.target.title}",
                         measurement="sizes on fake tensors; times not measured", times_estimated=True, scratch_measured=False,
                         loss_bytes=fake.loss_bytes)


__all__ = ["keep_attention_saves", "measure_model", "note_holds"]
