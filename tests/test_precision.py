"""`plan(param_dtype=...)`: the step FSDP2 runs under `MixedPrecisionPolicy(param_dtype=...)`,
activations in that dtype, shards and optimizer state in the parameters' own (the 2-rank
training check is in test_distributed.py)."""
import copy

import pytest
import torch
from torch import nn

from planner import plan
from planner.measure.precision import check_param_dtype, inputs_in, parameters_in
from planner.measure.static import IN_FLIGHT_BLOCKS, static_breakdown


class _Stack(nn.Module):
    """An embedding and a head around a ModuleList of blocks (what FSDP2 shards one by one)."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(32, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_check_param_dtype_takes_low_precision_dtypes_and_their_names():
    assert check_param_dtype("bfloat16") is torch.bfloat16
    assert check_param_dtype(torch.float16) is torch.float16
    assert check_param_dtype(None) is None
    for wrong in (torch.float32, "int8", 2):
        with pytest.raises(ValueError, match="param_dtype"):
            check_param_dtype(wrong)


def test_parameters_in_swaps_the_parameters_and_gives_the_models_own_back():
    model = _Stack()
    model(torch.randn(4, 32)).sum().backward()
    before = [(p, p.data_ptr(), p.grad) for p in model.parameters()]
    with parameters_in(model, torch.bfloat16):
        assert all(p.dtype == torch.bfloat16 and p.grad is None for p in model.parameters())
        assert model(inputs_in(torch.randn(4, 32), torch.bfloat16)).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 and p.data_ptr() == ptr and p.grad is grad for p, ptr, grad in before)
    assert inputs_in({"x": torch.ones(2), "ids": torch.ones(2, dtype=torch.long)}, torch.bfloat16)["ids"].dtype \
        == torch.long


def test_static_terms_of_fsdp2_mixed_precision_count_unsharded_copies_in_param_dtype():
    model = _Stack(width=64, depth=4)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("blocks."))
    mixed = static_breakdown(model, 0, 0, torch.device("cuda"), "adamw", world_size=2, param_dtype=torch.bfloat16)
    plain = static_breakdown(model, 0, 0, torch.device("cuda"), "adamw", world_size=2)
    # shards, their gradients and the optimizer's state: the parameters' own (float32) either way
    for term in ("parameters", "gradients", "optimizer state"):
        assert mixed[term] == plain[term]
    assert mixed[f"block parameters in flight (FSDP, {IN_FLIGHT_BLOCKS} blocks)"] == IN_FLIGHT_BLOCKS * 2 * block
    assert mixed["root parameters, unsharded (FSDP)"] == 2 * root
    # (the unsharded gradients, in param_dtype, and the float32 reduce-scatter buffers are placed in
    # backward: tests/test_fsdp_terms.py)
    # one rank under FSDP2's mixed precision has the unsharded copies too
    single = static_breakdown(model, 0, 0, torch.device("cpu"), None, world_size=1, param_dtype=torch.bfloat16)
    assert single["root parameters, unsharded (FSDP)"] == 2 * root


@pytest.mark.parametrize("measure", ["auto", "no-run"])
def test_activations_are_planned_as_the_step_in_param_dtype_and_the_model_is_left_as_it_was(measure):
    torch.manual_seed(0)
    model, x = _Stack(width=128), torch.randn(256, 32)
    pointers = [p.data_ptr() for p in model.parameters()]
    p = plan(model, x, budget_gb=1, measure=measure, param_dtype=torch.bfloat16)
    assert [q.data_ptr() for q in model.parameters()] == pointers
    assert all(q.dtype == torch.float32 and q.grad is None for q in model.parameters())
    # the same activations as a bfloat16 copy of the model planned on bfloat16 inputs (the unsharded
    # gradients are FSDP2's, held in backward: tests/test_fsdp_terms.py)
    reference = plan(copy.deepcopy(model).to(torch.bfloat16), x.to(torch.bfloat16), budget_gb=1, measure=measure)

    def activations(q):
        return [(node.output_bytes, node.saved_bytes, node.grad_bytes) for node in q.problem.nodes]

    assert activations(p) == activations(reference)
    float32 = plan(model, x, budget_gb=1, measure=measure)
    assert sum(map(sum, activations(p))) < 0.6 * sum(map(sum, activations(float32)))
    assert not p.verified  # (one process holds no shards: its own step is not the one planned)
    assert p.record.planned_for["param_dtype"] == "bfloat16"
    assert "in bfloat16, as FSDP2's MixedPrecisionPolicy runs them" in p.report()
