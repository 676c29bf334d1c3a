import copy
import os
from typing import Any, Callable, Iterator

import pytest
import torch
from torch import nn

from planner import plan
from planner.costs import block as block_costs
from planner.costs import block_price
from planner.costs import calls as call_costs
from planner.costs import step as step_costs
from planner.examples import SmallCNN, TinyGPT, cnn, mlp
from solvers import NodeCost, Problem

# Under pytest-xdist (`.ci/run`: one worker per core) each worker keeps to one core, so two
# workers do not both spread their kernels over both.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


# Timing rounds in a test's planning: checkpoint's costs read off 3 paired rounds of the model's
# step (and of a block's), not the 9 and 15 a user's planning times. Those rounds were a third
# of the suite's time. Tests of memory, gradients and plans do not depend on the figures'
# precision (3 rounds give no interval, so each reading is taken as its median: noisier costs,
# the same code paths). Tests of the readings themselves are marked `full_timing_rounds`.
# (Session-wide, so that module-scoped plans get it too; subprocesses plan with the full counts.)
TEST_TIMING_ROUNDS = 3
PLANNING_ROUNDS = {step_costs: ("STEP_ROUNDS", step_costs.STEP_ROUNDS),
                   block_costs: ("FINE_ROUNDS", block_costs.FINE_ROUNDS),
                   call_costs: ("CALL_ROUNDS", call_costs.CALL_ROUNDS),
                   block_price: ("BLOCK_PRICE_ROUNDS", block_price.BLOCK_PRICE_ROUNDS)}


# torch.compile's graph as inductor takes it (its decompositions, and the min-cut partitioner
# that decides what a compiled step recomputes), run without generating kernels: in a fresh
# checkout inductor compiled every C++ kernel again (one test: 84 s, against 24 s here). The
# selective plan's test (test_keep) compiles with the default backend, end to end.
COMPILE_BACKEND = "aot_eager_decomp_partition"


@pytest.fixture(scope="session", autouse=True)
def few_timing_rounds() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for module, (name, _) in PLANNING_ROUNDS.items():
            patch.setattr(module, name, TEST_TIMING_ROUNDS)
        yield


@pytest.fixture(autouse=True)
def full_timing_rounds_where_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("full_timing_rounds") is not None:
        for module, (name, rounds) in PLANNING_ROUNDS.items():
            monkeypatch.setattr(module, name, rounds)


def small_gpt() -> tuple[nn.Module, torch.Tensor]:
    """The built-in transformer (8 blocks, dropout, layer norm) at a test-sized input."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, width=32, heads=4, blocks=8, context=32, dropout=0.1)
    return model, torch.randint(0, 128, (4, 32))


def small_mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return mlp(width=64, depth=12, batch=256)


def small_cnn() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return cnn(batch=8, size=16)


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "mlp": small_mlp,
    "cnn": small_cnn,
    "gpt": small_gpt,
}


def train_step(module: nn.Module, sample: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward+backward with a fixed RNG seed; returns the output and parameter gradients."""
    for parameter in module.parameters():
        parameter.grad = None
    torch.manual_seed(seed)
    output = module(sample)
    output.float().pow(2).mean().backward()
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters()}
    for parameter in module.parameters():
        parameter.grad = None
    return output.detach(), grads


def norms_and_blocks() -> tuple[Problem, list[range], list[range]]:
    """Two blocks of four nodes (5 ms, 3 tensors saved each), each with a norm (1 ms, 1 tensor) in front."""
    nodes = []
    for _ in range(2):
        nodes.append(NodeCost("norm", 1.0, output_bytes=8, saved_bytes=8, saved_tensors=1))
        nodes.extend(NodeCost("op", 5.0, output_bytes=8, saved_bytes=8, saved_tensors=3) for _ in range(4))
    return Problem(tuple(nodes), region_overhead_ms=0.3, saved_tensor_ms=0.05), [range(0, 1), range(5, 6)], \
        [range(1, 5), range(6, 10)]


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.fixture(params=sorted(MODELS))
def example(request: pytest.FixtureRequest) -> tuple[str, nn.Module, torch.Tensor]:
    model, sample = MODELS[request.param]()
    return request.param, model, sample


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def cnn_step(model: nn.Module, images: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    for parameter in model.parameters():
        parameter.grad = None
    model(images).pow(2).sum().backward()
    return [p.grad for p in model.parameters()], [b.clone() for b in model.buffers()]


def small_cnn_plan() -> tuple[nn.Module, torch.Tensor, Any]:
    torch.manual_seed(0)
    model = SmallCNN(channels=8, stages=3).train()
    images = torch.randn(4, 3, 16, 16)
    return model, images, plan(model, images, budget_gb=80, repeats=1)


def assert_trains_like(planned: nn.Module, model: nn.Module, images: torch.Tensor) -> None:
    """Two steps of `planned` give `model`'s gradients and BatchNorm statistics, bit for bit."""
    reference = copy.deepcopy(model)
    for _ in range(2):
        grads, buffers = cnn_step(reference, images)
        planned_grads, planned_buffers = cnn_step(planned, images)
        assert all(torch.equal(a, b) for a, b in zip(planned_grads, grads))
        assert all(torch.equal(a, b) for a, b in zip(planned_buffers, buffers))
