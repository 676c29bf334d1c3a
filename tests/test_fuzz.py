"""A fast slice of the fuzz run (`benchmarks/fuzz.py --seeds 200` runs the full one): random
models with in-place writes, dropout, BatchNorm, skips, products and concatenations within and
across blocks (tests/fuzz_models.py), planned at a random feasible budget. The plan applied in
place must train exactly like the unplanned model and update BatchNorm statistics once, stay
under the budget, and predict its peak to 3%."""
import functools

import pytest
import torch
import torch.fx

from fuzz_models import PEAK_TOLERANCE, check_seed, random_model, training_step

# 6: a branch nothing returned depends on; 7: saved tensors freed before a gradient sum;
# 52: gradients summed out of place (measured gradients in flight); 59: a region's recomputation
# stops at a dropout before its product runs; 401: a block keeping a linear's output, then a run
# whose recording started inside that block's forward (odd seeds plan with keeping free).
SEEDS = (*range(8), 52, 59, 401)


@functools.lru_cache(maxsize=None)
def checked(seed: int) -> dict:
    return check_seed(seed)


def describe(record: dict) -> str:
    return f"seed {record['seed']}: {record['failure']}\n{record.get('traceback', '')}\n{record.get('model', '')}"


def test_random_models_are_reproducible_traceable_and_train():
    for seed in SEEDS:
        model, sample = random_model(seed)
        again, same = random_model(seed)
        assert torch.equal(sample, same)
        assert str(model) == str(again)
        for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
            assert torch.equal(a, b), name
        torch.fx.symbolic_trace(model)
        output, grads = training_step(model, sample)
        assert torch.isfinite(output).all()
        assert len(grads) == len(list(model.parameters())), "every parameter gets a gradient"


@pytest.mark.parametrize("seed", SEEDS)
def test_plan_applied_in_place_trains_like_the_original(seed):
    record = checked(seed)
    assert "grads_ok" in record, describe(record)  # planned, verified, applied and trained
    assert record["grads_ok"] and record["buffers_ok"] and record["outputs_ok"], describe(record)
    assert record["half_batch_ok"], describe(record)  # another batch size
    assert record["verify_grads_ok"] and record["verify_outputs_ok"], describe(record)
    assert record["within_budget"], describe(record)


@pytest.mark.parametrize("seed", SEEDS)
def test_predicted_peak_within_3_percent_of_measured(seed):
    record = checked(seed)
    assert "error" in record, describe(record)
    assert abs(record["error"]) <= PEAK_TOLERANCE, describe(record)
