"""A saved plan applied before FSDP2 (`fully_shard` per block, then the root) or DDP trains
exactly like the unplanned model: 2 CPU ranks over gloo, each on its own half of the batch,
dropout on (the same seed before each forward in both runs), two steps with an SGD step between.

The parent plans once (measured, small models) and saves the plan; each rank builds two models
from the same seed, applies the saved plan to one (`load_plan(path).apply(model)`), wraps both
the same way and trains them side by side. The ranks send back losses, full gradients and which
submodules ran in backward (recomputation); the parent compares planned against unplanned."""
from __future__ import annotations

import socket
import time
import traceback
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
from planner.api import GIB
from planner.apply import CheckpointedForward
from planner.verify import training_loss

pytestmark = pytest.mark.slow

WORLD = 2
TIMEOUT_S = 90.0  # per test, for all ranks together (each takes a few seconds)
STEPS = 2
LR = 0.1
MODELS = ("gpt", "gpt2")


# -- models and data (the same in the parent and in every rank) ---------------------------------

def _build(name: str) -> tuple[nn.Module, Any]:
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


def _built(name: str, run: str, plan_path: str, result: dict[str, Any]) -> Any:
    """The model for one run; the saved plan applied to it in the planned run."""
    model, _ = _build(name)
    if run == "planned":
        saved = planner.load_plan(plan_path)
        assert saved.solution.regions and saved.wrapped, "the saved plan has no regions"
        assert saved.apply(model) is model
        result["planned_modules"] = [spec.module for spec in saved.wrapped]
    return model


def _fsdp2(name: str, rank: int, plan_path: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    result: dict[str, Any] = {}
    for run in ("planned", "reference"):
        model = _built(name, run, plan_path, result)
        blocks = {"gpt": lambda: model.blocks, "cnn": lambda: model.stages}.get(name, lambda: model.transformer.h)()
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
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


JOBS = {"fsdp2": _fsdp2, "ddp": _ddp}


def _rank_main(rank: int, port: int, job: str, name: str, plan_path: str, out_dir: str) -> None:
    """Entry point of a spawned rank: its result, or its traceback, goes to a file in out_dir."""
    out = Path(out_dir)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
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

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(job: str, name: str, plan_path: Path, out_dir: Path) -> list[dict[str, Any]]:
    """Run `job` on WORLD spawned ranks; fail (after killing the others) as soon as one fails,
    or when all have not finished within TIMEOUT_S. Returns each rank's result."""
    out_dir.mkdir()
    context = mp.get_context("spawn")
    port = _free_port()
    processes = [context.Process(target=_rank_main, args=(rank, port, job, name, str(plan_path), str(out_dir)),
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


@pytest.fixture(scope="module", params=MODELS)
def saved_plan(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Plan the model once under a tight budget (measured here) and save the plan."""
    name = request.param
    model, sample = _build(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs; put back for the tests that follow
    try:
        p = planner.plan(model, sample, budget_gb=80, repeats=1)
    finally:
        torch.set_num_threads(threads)
    static = p.problem.static_bytes
    p = p.replan(budget_gb=(static + 0.6 * (p.baseline_peak_bytes - static)) / GIB)
    assert p.checkpoints
    assert p.module_checkpoints  # raises RuntimeError where a region is not a submodule call
    path = p.save(tmp_path_factory.mktemp(f"plan_{name}") / "plan.json")
    return name, Path(path)


def _under(path: str, modules: list[str]) -> bool:
    return any(path.startswith(module + ".") for module in modules)


def _check(results: list[dict[str, Any]]) -> None:
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


def test_fsdp2_planned_matches_unplanned(saved_plan, tmp_path):
    name, path = saved_plan
    results = _spawn("fsdp2", name, path, tmp_path / "ranks")
    _check(results)
    assert any(cls.startswith("FSDP") for cls in results[0]["planned_class"])  # fully_shard swapped the class


def test_ddp_planned_matches_unplanned(saved_plan, tmp_path):
    name, path = saved_plan
    _check(_spawn("ddp", name, path, tmp_path / "ranks"))


@pytest.fixture(scope="module")
def saved_keep_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every block of the small GPT checkpointed, keeping every node its recomputation reaches
    but the block's layer norms and activation (a selective policy: its linears, attention,
    residual adds), as a hand-written plan; saved, so each rank applies the saved calls to keep."""
    model, sample = _build("gpt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = planner.plan(model, sample, budget_gb=80, repeats=1)
    finally:
        torch.set_num_threads(threads)
    blocks = [f"blocks.{i}" for i in range(len(model.blocks))]
    plain = p.with_submodules(blocks)
    recomputed = ("norm", "act", "gelu")
    kept = [p.problem.nodes[i].name for region in plain.solution.regions for i in p.problem.keepable_in(region)
            if not any(part in p.problem.nodes[i].name for part in recomputed)]
    keeping = p.with_submodules(blocks, kept=kept)
    per_block = len(kept) // len(blocks)
    assert len(keeping.solution.kept) == len(kept) == per_block * len(blocks) and per_block > 4
    # (one call per kept node or more: attention's written-out softmax makes several)
    assert all(len(spec.saved_calls) >= per_block for spec in keeping.module_checkpoints), [
        (len(spec.saved_calls), per_block) for spec in keeping.module_checkpoints]
    return Path(keeping.save(tmp_path_factory.mktemp("keep_plan") / "plan.json"))


def _fsdp2_warned(name: str, rank: int, plan_path: str) -> dict[str, Any]:
    """`_fsdp2`, noting every warning (a planned submodule whose ATen calls under fully_shard
    differ from the planned ones keeps, or recomputes, less than its plan says)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _fsdp2(name, rank, plan_path)
    result["warnings"] = [str(w.message) for w in caught]
    return result


JOBS["fsdp2_warned"] = _fsdp2_warned


def _warned(results: list[dict[str, Any]], phrase: str) -> list[list[str]]:
    return [[message for message in result["warnings"] if phrase in message] for result in results]


def test_fsdp2_keep_plan_matches_unplanned(saved_keep_plan, tmp_path):
    assert all(len(spec.saved_calls) > 4 for spec in planner.load_plan(saved_keep_plan).wrapped)
    results = _spawn("fsdp2_warned", "gpt", saved_keep_plan, tmp_path / "ranks")
    _check(results)
    assert _warned(results, "keeps less than planned") == [[]] * WORLD


@pytest.fixture(scope="module")
def saved_run_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """In every block of the small GPT, the second norm and the MLP's first linear and
    activation recomputed alone (runs inside the block, `planner.run_checkpoint`); saved."""
    model, sample = _build("gpt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = planner.plan(model, sample, budget_gb=80, repeats=1, measure="run")
    finally:
        torch.set_num_threads(threads)
    runs = p.with_regions([(f"blocks_{i}_norm2", f"blocks_{i}_mlp_1") for i in range(len(model.blocks))])
    assert all(len(spec.runs) == 1 for spec in runs.module_checkpoints)
    return Path(runs.save(tmp_path_factory.mktemp("run_plan") / "plan.json"))


def test_fsdp2_plan_with_runs_inside_blocks_matches_unplanned(saved_run_plan, tmp_path):
    results = _spawn("fsdp2_warned", "gpt", saved_run_plan, tmp_path / "ranks")
    assert _warned(results, "other ATen calls") == [[]] * WORLD
    for rank, result in enumerate(results):
        assert result["planned_checkpointed"] == result["planned_modules"]
        planned, reference = result["planned"], result["reference"]
        for step in range(STEPS):
            # (the runs replay ATen calls, not submodules: nothing runs again in backward)
            assert planned["backward_calls"][step] == reference["backward_calls"][step] == {}
            torch.testing.assert_close(planned["loss"][step], reference["loss"][step])
            for key, grad in reference["grads"][step].items():
                torch.testing.assert_close(planned["grads"][step][key], grad, msg=f"rank {rank} step {step} {key}")
        assert all(count > 0 for count in result["dropped"].values()), result["dropped"]


@pytest.fixture(scope="module")
def saved_cross_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """In the CNN, runs from each stage's last BatchNorm through the model's residual add and
    ReLU to the next stage's first convolution: runs in the model's own forward, across the
    stages that FSDP2 shards (its all-gather and reshard hooks run inside the recording)."""
    model, sample = _build("cnn")
    p = planner.plan(model, sample, budget_gb=80, repeats=1)
    runs = p.with_regions([("stages_0_4", "stages_1_0"), ("stages_1_4", "stages_2_0")])
    assert [(spec.module, len(spec.runs)) for spec in runs.module_checkpoints] == [("", 2)]
    return Path(runs.save(tmp_path_factory.mktemp("cross_plan") / "plan.json"))


def test_fsdp2_plan_with_runs_across_sharded_stages_matches_unplanned(saved_cross_plan, tmp_path):
    results = _spawn("fsdp2_warned", "cnn", saved_cross_plan, tmp_path / "ranks")
    assert _warned(results, "other ATen calls") == [[]] * WORLD
    for rank, result in enumerate(results):
        assert result["planned_checkpointed"] == list(dict.fromkeys(result["planned_modules"])) == [""]
        planned, reference = result["planned"], result["reference"]
        for step in range(STEPS):
            torch.testing.assert_close(planned["loss"][step], reference["loss"][step])
            for key, grad in reference["grads"][step].items():
                torch.testing.assert_close(planned["grads"][step][key], grad, msg=f"rank {rank} step {step} {key}")
        assert result["dropped"][""] > 0, result["dropped"]


@pytest.fixture(scope="module")
def saved_slice_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """In the CNN, each stage's children from its first BatchNorm through its second
    convolution under one checkpoint call in the stage's loop (`planner.segments`), in the
    stages that FSDP2 shards."""
    model, sample = _build("cnn")
    p = planner.plan(model, sample, budget_gb=80, repeats=1)
    sliced = p.with_regions([(f"stages_{i}_1", f"stages_{i}_3") for i in range(len(model.stages))])
    assert all(spec.segments == ((1, 4, False),) for spec in sliced.module_checkpoints)
    return Path(sliced.save(tmp_path_factory.mktemp("slice_plan") / "plan.json"))


def test_fsdp2_plan_with_slices_of_sharded_stages_matches_unplanned(saved_slice_plan, tmp_path):
    results = _spawn("fsdp2_warned", "cnn", saved_slice_plan, tmp_path / "ranks")
    stages = [f"stages.{i}" for i in range(3)]  # (_build's CNN)
    for rank, result in enumerate(results):
        assert result["planned_checkpointed"] == stages
        planned, reference = result["planned"], result["reference"]
        for step in range(STEPS):
            # the slices' children run again in backward up to the last that saves (the ReLU: the
            # convolution after it saves its input, made by the ReLU), nothing else does
            assert planned["backward_calls"][step] == {f"{stage}.{child}": 1 for stage in stages for child in (1, 2)}
            assert reference["backward_calls"][step] == {}
            torch.testing.assert_close(planned["loss"][step], reference["loss"][step])
            for key, grad in reference["grads"][step].items():
                torch.testing.assert_close(planned["grads"][step][key], grad, msg=f"rank {rank} step {step} {key}")
