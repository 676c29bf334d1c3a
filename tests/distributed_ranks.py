"""The harness of the distributed tests (tests/test_distributed.py, test_distributed_runs.py):
the models and their data, one rank's training of a planned and an unplanned copy under FSDP2
or DDP, spawning 2 CPU ranks over gloo on 127.0.0.1 within a time limit, and the checks of what
they send back. Spawned ranks import this module, not the tests."""
from __future__ import annotations

import dataclasses
import json
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import planner
from planner.apply.checkpoints import CheckpointedForward
from planner.core import split_sample, training_loss
from planner.measure.memory import PeakMemory, storage_bytes

WORLD = 2
TIMEOUT_S = 90.0  # per test, for all ranks together (each takes a few seconds)
STEPS = 2
LR = 0.1


# -- models and data (the same in the parent and in every rank) ---------------------------------

def build(name: str) -> tuple[nn.Module, Any]:
    """The model, built from a fixed seed, in training mode with dropout on, and its planning sample."""
    if name == "gpt":
        from conftest import small_gpt

        model, sample = small_gpt()  # seeds itself
    elif name == "cnn":
        from planner.examples import SmallCNN

        torch.manual_seed(0)
        model, sample = SmallCNN(channels=8, stages=3), torch.randn(2, 3, 16, 16)
    else:
        from models_hf import gpt2

        torch.manual_seed(0)
        model, sample = gpt2()
    model.train()
    return model, sample


def _batch(name: str, step: int, rank: int) -> Any:
    """This rank's half of the global batch of `step`: different data on every rank and step."""
    generator = torch.Generator().manual_seed(1000 + step)
    if name == "cnn":
        return torch.randn(2 * WORLD, 3, 16, 16, generator=generator).chunk(WORLD)[rank]
    if name == "gpt":
        tokens = torch.randint(0, 128, (2 * WORLD, 32), generator=generator)
    else:
        tokens = torch.randint(0, 100, (2 * WORLD, 32), generator=generator)
    ids = tokens.chunk(WORLD)[rank]
    if name == "gpt":
        return ids
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def _loss(name: str, model: nn.Module, batch: Any) -> torch.Tensor:
    if name == "cnn":
        return model(batch).pow(2).mean()
    if name == "gpt":
        logits = model(batch)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
    return training_loss(model(**batch))


def _checkpointed(model: nn.Module) -> list[str]:
    return [path for path, module in model.named_modules()
            if isinstance(module.__dict__.get("forward"), CheckpointedForward)]


# -- one rank ------------------------------------------------------------------------------------

class _CallCounter:
    """Counts calls of every submodule (forward hooks): those that run during backward are
    recomputed ones (a checkpointed module's own hooks run once, its children's run again)."""

    def __init__(self, model: nn.Module):
        self.counts: dict[str, int] = {}
        self.handles = [module.register_forward_hook(self._hook(path)) for path, module in model.named_modules()
                        if path]

    def _hook(self, path: str):
        def hook(module, args, output):
            self.counts[path] = self.counts.get(path, 0) + 1
        return hook

    def take(self) -> dict[str, int]:
        counts, self.counts = self.counts, {}
        return counts


def _train(name: str, wrapped: nn.Module, inner: nn.Module, rank: int, full_grad) -> dict[str, Any]:
    """STEPS forward+backward passes with an SGD step between; the loss, the full gradients and
    the submodules called in forward and in backward, per step."""
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    counter = _CallCounter(inner)
    record: dict[str, Any] = {"loss": [], "grads": [], "forward_calls": [], "backward_calls": [],
                              "checkpoint_calls": []}
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(100 * step + rank)  # dropout differs by rank and step, not between runs
        loss = _loss(name, wrapped, _batch(name, step, rank))
        record["forward_calls"].append(counter.take())
        record["checkpoint_calls"].append(
            {path: module.__dict__["forward"].calls for path, module in inner.named_modules()
             if isinstance(module.__dict__.get("forward"), CheckpointedForward)})
        loss.backward()
        record["backward_calls"].append(counter.take())
        record["loss"].append(loss.detach().clone())
        record["grads"].append({path: full_grad(parameter.grad).detach().clone()
                                for path, parameter in inner.named_parameters()})
        optimizer.step()
    return record


def _built(name: str, run: str, plan_path: str | planner.Plan, result: dict[str, Any]) -> Any:
    """The model for one run; the plan (a saved one's path, or a Plan) applied to it in the planned run."""
    model, _ = build(name)
    if run == "planned":
        saved = planner.load_plan(plan_path) if isinstance(plan_path, str) else plan_path
        assert saved.solution.regions and saved.module_checkpoints, "the saved plan has no regions"
        assert saved.apply(model) is model
        result["planned_modules"] = [spec.module for spec in saved.module_checkpoints]
    return model


def _fsdp2_planning(name: str, rank: int, budget_path: str) -> dict[str, Any]:
    """Every rank calls `planner.plan()` in the process group (the default call, at the budget in
    `budget_path`): rank 0 plans, the others get its plan; then `_fsdp2` trains with it."""
    model, sample = build(name)
    budget_gb = json.loads(Path(budget_path).read_text())["budget_gb"]
    started = time.perf_counter()
    p = planner.plan(model, sample, budget_gb=budget_gb)
    result = _fsdp2(name, rank, p)
    result.update(plan=[dataclasses.asdict(spec) for spec in p.module_checkpoints], measured_here=p.model is model
                  and p._measurements is not None, planning_s=time.perf_counter() - started)
    return result


def _fsdp2(name: str, rank: int, plan_path: str | planner.Plan, **shard_options: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    result: dict[str, Any] = {}
    for run in ("planned", "reference"):
        model = _built(name, run, plan_path, result)
        blocks = {"gpt": lambda: model.blocks, "cnn": lambda: model.stages}.get(name, lambda: model.transformer.h)()
        for block in blocks:
            fully_shard(block, mesh=mesh, **shard_options)
        fully_shard(model, mesh=mesh, **shard_options)
        result[f"{run}_checkpointed"] = _checkpointed(model)  # still there after fully_shard
        result[f"{run}_class"] = [cls.__name__ for cls in type(model).__mro__]
        result[run] = _train(name, model, model, rank, lambda grad: grad.full_tensor())
        if run == "planned":  # saved tensors each planned submodule's runs dropped in the last step
            result["dropped"] = {path: module.__dict__["forward"].recording.dropped
                                 for path, module in model.named_modules()
                                 if isinstance(module.__dict__.get("forward"), CheckpointedForward)
                                 and module.__dict__["forward"].recording is not None}
    return result


def _ddp(name: str, rank: int, plan_path: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    result: dict[str, Any] = {}
    for run in ("planned", "reference"):
        model = _built(name, run, plan_path, result)
        wrapped = DistributedDataParallel(model)
        result[f"{run}_checkpointed"] = _checkpointed(wrapped.module)
        result[f"{run}_class"] = [cls.__name__ for cls in type(model).__mro__]
        result[run] = _train(name, wrapped, wrapped.module, rank, lambda grad: grad)
    return result


def _fsdp2_warned(name: str, rank: int, plan_path: str) -> dict[str, Any]:
    """`_fsdp2`, noting every warning (a planned submodule whose ATen calls under fully_shard
    differ from the planned ones keeps, or recomputes, less than its plan says)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _fsdp2(name, rank, plan_path)
    result["warnings"] = [str(w.message) for w in caught]
    return result


def _fsdp2_mixed(name: str, rank: int, plan_path: str) -> dict[str, Any]:
    """`_fsdp2` under FSDP2's mixed precision, as torchtitan sets it: bfloat16 parameters,
    gradients reduced in float32 (the plan made with `param_dtype=torch.bfloat16`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return _fsdp2(name, rank, plan_path,
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


def _fsdp2_memory(name: str, rank: int, plan_path: str) -> dict[str, Any]:
    """One rank's peak with the plan applied under FSDP2 (its mixed precision where the plan is
    for it), on the plan's sample: the storages the rank holds when
    the second step starts (its shards of the parameters and gradients, the sample) plus that
    step's allocator peak."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    saved = planner.load_plan(plan_path)
    model, sample = build(name)
    saved.apply(model)
    mixed = saved.record.planned_for.get("param_dtype") is not None
    options = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
        if mixed else {}
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks if name == "gpt" else model.transformer.h:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    args, kwargs = split_sample(sample)
    training_loss(model(*args, **kwargs)).backward()  # (the gradients' shards exist from the second step on)
    shards = [getattr(t, "_local_tensor", t) for p in model.parameters() for t in (p, p.grad) if t is not None]
    with PeakMemory(torch.device("cpu")) as memory:
        training_loss(model(*args, **kwargs)).backward()
    return {"peak": storage_bytes((shards, sample)) + memory.peak_bytes}


JOBS = {"fsdp2": _fsdp2, "ddp": _ddp, "fsdp2_warned": _fsdp2_warned, "fsdp2_planning": _fsdp2_planning,
        "fsdp2_mixed": _fsdp2_mixed, "fsdp2_memory": _fsdp2_memory}


def _rank_main(rank: int, job: str, name: str, plan_path: str, out_dir: str) -> None:
    """Entry point of a spawned rank: its result, or its traceback, goes to a file in out_dir."""
    out = Path(out_dir)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=TIMEOUT_S))
        try:
            result = JOBS[job](name, rank, plan_path)
        finally:
            dist.destroy_process_group()
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)


# -- the parent ----------------------------------------------------------------------------------

def spawn(job: str, name: str, plan_path: Path, out_dir: Path) -> list[dict[str, Any]]:
    """Run `job` on WORLD spawned ranks; fail (after killing the others) as soon as one fails,
    or when all have not finished within TIMEOUT_S. Returns each rank's result."""
    out_dir.mkdir()
    context = mp.get_context("spawn")
    # (ranks meet through a file in out_dir, not a port: a port found free may be taken, by another
    # test's ranks, before rank 0 listens on it)
    processes = [context.Process(target=_rank_main, args=(rank, job, name, str(plan_path), str(out_dir)),
                                 daemon=True)
                 for rank in range(WORLD)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + TIMEOUT_S
    failed = False
    while time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in processes):
            failed = True
            break
        if all(p.exitcode is not None for p in processes):
            break
        time.sleep(0.1)
    timed_out = not failed and any(p.exitcode is None for p in processes)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(10)
    errors = "\n".join(f"rank {rank}:\n{(out_dir / f'rank{rank}.err').read_text()}"
                       for rank in range(WORLD) if (out_dir / f"rank{rank}.err").exists())
    if timed_out:
        pytest.fail(f"{job} on {WORLD} ranks did not finish within {TIMEOUT_S:.0f} s\n{errors}")
    if failed or any(p.exitcode != 0 for p in processes):
        pytest.fail(f"{job} failed (exit codes {[p.exitcode for p in processes]})\n{errors}")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


def _under(path: str, modules: list[str]) -> bool:
    return any(path.startswith(module + ".") for module in modules)


def check(results: list[dict[str, Any]]) -> None:
    """Planned and unplanned runs agree on every rank; the plan really ran under checkpoint."""
    for rank, result in enumerate(results):
        planned, reference = result["planned"], result["reference"]
        modules = result["planned_modules"]
        assert modules, "the saved plan has no regions"
        assert result["planned_checkpointed"] == modules, (rank, result["planned_checkpointed"], modules)
        assert result["reference_checkpointed"] == []
        assert result["planned_class"] == result["reference_class"]
        for step in range(STEPS):
            # each planned submodule ran once, under checkpoint, in forward
            assert planned["checkpoint_calls"][step] == dict.fromkeys(modules, 1), planned["checkpoint_calls"][step]
            assert planned["forward_calls"][step] == reference["forward_calls"][step]
            # backward recomputed inside the planned submodules only, and did recompute
            recomputed = planned["backward_calls"][step]
            assert reference["backward_calls"][step] == {}
            if any(_under(path, modules) for path in planned["forward_calls"][step]):
                assert recomputed, f"rank {rank} step {step}: no submodule ran again in backward"
            assert all(_under(path, modules) for path in recomputed), (sorted(recomputed), modules)
            torch.testing.assert_close(planned["loss"][step], reference["loss"][step],
                                       msg=f"rank {rank} step {step}: loss")
            assert planned["grads"][step].keys() == reference["grads"][step].keys()
            for key, grad in reference["grads"][step].items():
                torch.testing.assert_close(planned["grads"][step][key], grad,
                                           msg=lambda m, key=key: f"rank {rank} step {step} grad {key}: {m}")
    # every rank trained on its own data, and gradients were synchronised across ranks
    first, second = results[0]["planned"], results[1]["planned"]
    for step in range(STEPS):
        assert not torch.equal(first["loss"][step], second["loss"][step])
        for key, grad in first["grads"][step].items():
            torch.testing.assert_close(second["grads"][step][key], grad,
                                       msg=lambda m, key=key: f"step {step} grad {key} differs between ranks: {m}")
    # the SGD step changed the model: the second step's gradients are not the first's
    assert any(not torch.equal(first["grads"][0][key], first["grads"][1][key]) for key in first["grads"][0])


def warned(results: list[dict[str, Any]], phrase: str) -> list[list[str]]:
    return [[message for message in result["warnings"] if phrase in message] for result in results]


def plan_on_one_thread(model: nn.Module, sample: Any, budget_gb: float = 80, **options: Any) -> planner.Plan:
    """`planner.plan(model, sample, budget_gb=budget_gb, repeats=1, **options)` measured on one thread,
    as each rank runs; the thread count is put back for the tests that follow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return planner.plan(model, sample, budget_gb=budget_gb, repeats=1, **options)
    finally:
        torch.set_num_threads(threads)
