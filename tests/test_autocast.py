"""Plans for a step under autocast: `plan(..., autocast=dtype)`, and CUDA autocast's casts on a CPU."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from conftest import small_gpt
from torch.utils._python_dispatch import TorchDispatchMode

from planner import InfeasibleBudget, load_plan, plan
from planner.api import GIB
from planner.core import after_autocast, training_loss
from planner.measure.autocast import CUDA_POLICY, cuda_autocast_on_cpu, cuda_ops
from planner.measure.memory import PeakMemory
from planner.measure.steps import static_bytes, steady_peak


def test_the_cuda_policy_names_every_op_cuda_autocast_casts_in_this_pytorch():
    assert "linear" in cuda_ops() and "layer_norm" in cuda_ops()
    assert cuda_ops() <= CUDA_POLICY.keys(), sorted(cuda_ops() - CUDA_POLICY.keys())


def test_cuda_autocast_on_cpu_casts_as_cuda_does_and_leaves_cpu_autocast_as_it_was():
    x = torch.randn(4, 8, requires_grad=True)
    linear = torch.nn.Linear(8, 8)
    clear = torch.clear_autocast_cache
    with cuda_autocast_on_cpu(torch.bfloat16):
        h = linear(x)
        assert h.dtype == torch.bfloat16  # matrix products in the low precision
        assert F.layer_norm(h, (8,)).dtype == torch.float32  # norms, softmaxes, sums, exp in float32
        assert torch.softmax(h, -1).dtype == F.log_softmax(h, -1).dtype == torch.float32
        assert h.sum().dtype == h.sum(0).dtype == h.cumsum(0).dtype == h.norm().dtype == torch.float32
        assert h.exp().dtype == torch.float32
        assert torch.addcmul(h, x, h).dtype == torch.float32  # widest of the arguments
        assert torch.cat([h, h]).dtype == torch.bfloat16  # CPU's own list promotes cat; CUDA's does not
        assert torch.einsum("ij,jk->ik", x, linear.weight).dtype == torch.bfloat16
        assert torch.softmax(h, -1, dtype=torch.float64).dtype == torch.float64  # an explicit dtype stays
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.sigmoid(h.float()), torch.rand(4, 8))
    assert torch.clear_autocast_cache is clear
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = linear(x)
        assert F.layer_norm(h, (8,)).dtype == torch.softmax(h, -1).dtype == torch.bfloat16  # CPU's policy again


class _Casts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


def test_parameters_cast_by_the_added_kernels_are_cached_until_autocast_clears_its_cache():
    x, weight = torch.randn(4, 8), torch.nn.Parameter(torch.randn(8, 8))
    with cuda_autocast_on_cpu(torch.bfloat16), _Casts() as casts:
        torch.einsum("ij,jk->ik", x, weight)  # x and the weight
        torch.einsum("ij,jk->ik", x, weight)  # x only: the weight's copy is cached
        assert casts.count == 3
        torch.clear_autocast_cache()
        torch.einsum("ij,jk->ik", x, weight)
        assert casts.count == 5


def _loop_peak(planned, tokens) -> int:
    def step() -> None:  # forward under autocast, backward after it, as on a GPU
        with cuda_autocast_on_cpu(torch.bfloat16):
            loss = training_loss(planned(tokens))
            with after_autocast():
                loss.backward()

    step()  # (gradients allocated, as in training)
    with PeakMemory(torch.device("cpu")) as memory:
        step()
    return static_bytes(planned, tokens) + memory.peak_bytes


@pytest.mark.parametrize("measure", ["auto", "no-run"])
def test_plans_under_cuda_autocasts_casts_fit_that_step_as_predicted(measure):
    # CUDA's policy holds float32 norm and softmax inputs and outputs where CPU's holds bfloat16:
    # the planner's figures follow whichever casts the step makes.
    model, tokens = small_gpt()
    with cuda_autocast_on_cpu(torch.bfloat16):
        unplanned = steady_peak(model, tokens, torch.device("cpu"))
        p = plan(model, tokens, budget_gb=0.6 * unplanned / GIB, measure=measure)
    measured = _loop_peak(p.module(), tokens)
    assert p.checkpoints and measured <= p.budget_bytes
    error = p.predicted_peak_bytes - measured
    assert -0.0001 * measured <= error <= 0.005 * measured, (p.predicted_peak_bytes, measured)


def test_a_plan_for_a_gpu_under_autocast_is_made_with_cudas_casts_and_says_so(tmp_path):
    model, tokens = small_gpt()
    meta = model.to("meta")
    as_float32 = plan(meta, tokens.to("meta"), budget_gb=1.0, target="h100")
    p = plan(meta, tokens.to("meta"), budget_gb=1.0, target="h100", autocast=torch.bfloat16)
    assert p.record.planned_for["autocast"] == "bfloat16" and p.record.planned_for["autocast_emulated"]
    assert "CUDA autocast's casts" in p.report()
    assert p.baseline_peak_bytes < 0.8 * as_float32.baseline_peak_bytes  # (bfloat16 activations)
    loaded = load_plan(p.save(tmp_path / "plan.json"))
    assert loaded.record.planned_for["autocast"] == "bfloat16"
    with pytest.raises(ValueError, match="autocast="):
        plan(meta, tokens.to("meta"), budget_gb=1.0, target="h100", autocast=torch.int8)


def test_the_autocast_argument_plans_and_verifies_as_planning_inside_torch_autocast():
    model, tokens = small_gpt()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unplanned = steady_peak(model, tokens, torch.device("cpu"))
        inside = plan(model, tokens, budget_gb=0.6 * unplanned / GIB, measure="no-run")
    p = plan(model, tokens, budget_gb=0.6 * unplanned / GIB, measure="no-run", autocast="bfloat16")
    assert p.baseline_peak_bytes == inside.baseline_peak_bytes  # (the plans may differ: node times)
    assert not torch.is_autocast_enabled("cpu")
    record = p.verify(steps=1)  # under the plan's autocast
    assert record.gradients_match and record.planned_peak_bytes <= p.budget_bytes
    measured = record.planned_peak_bytes
    assert -0.0001 * measured <= p.predicted_peak_bytes - measured <= 0.005 * measured


class _Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1000))

    def forward(self, x, labels):
        return F.cross_entropy(self.body(x), labels)  # (autocast runs it in float32: a copy of the logits)


def test_autocasts_float32_copies_count_once_as_the_tensors_they_are():
    # The profiler puts the copy inside the loss's operator, which frees it on return, so it also
    # looked like that operator's kernel scratch: the prediction was one copy of the logits high.
    from planner.measure.allocations import forward_scratch, memory_profile

    logits, labels = torch.randn(512, 1000).bfloat16(), torch.randint(0, 1000, (512,))
    with torch.autocast("cpu", dtype=torch.bfloat16), memory_profile() as profile:
        with torch.profiler.record_function("node:loss"):
            F.cross_entropy(logits, labels)
    assert forward_scratch(profile, "cpu", "node:")["loss"] == 0
    torch.manual_seed(0)
    model, sample = _Classifier(), (torch.randn(512, 64), torch.randint(0, 1000, (512,)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = steady_peak(model, sample, torch.device("cpu"))
        for measure in ("auto", "no-run"):
            p = plan(model, sample, budget_gb=1.0, measure=measure)
            assert abs(p.baseline_peak_bytes - measured) <= 0.01 * measured, (measure, p.baseline_peak_bytes, measured)


@pytest.mark.parametrize("measure", ["auto", "no-run"])
def test_regions_run_with_autocasts_cache_off_so_their_casts_are_freed_as_planned(measure):
    # Parameters weigh much in this step. Cached to the end of forward, the casts of recomputed
    # blocks' weights would hold memory no region frees; regions run uncached, and the plan is
    # predicted to the byte where the step ran (a weight's float32 gradient is made by its cast's
    # backward, after the linear's has freed what it saved: the room measured below what it keeps),
    # within 1% node by node (high by that room: fake tensors show no kernel scratch to set it from).
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                                      torch.nn.Linear(1024, 256)) for _ in range(6)])
    x = torch.randn(384, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unplanned = steady_peak(model, x, torch.device("cpu"))
        p = plan(model, x, budget_gb=0.8 * unplanned / GIB, measure=measure)
        measured = steady_peak(p.module(), x, torch.device("cpu"), model)
        assert torch.is_autocast_cache_enabled()  # (left as it was)
    assert p.checkpoints and measured <= p.budget_bytes
    error = p.predicted_peak_bytes - measured
    assert -0.0001 * measured <= error <= (0.0001 if measure == "auto" else 0.01) * measured, (p.predicted_peak_bytes,
                                                                                              measured)


class _SharedLayer(torch.nn.Module):
    """One layer applied three times, as ALBERT shares its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(64, 256)
        self.layer = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
        self.head = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))

    def forward(self, x):
        h = self.embed(x)
        for _ in range(3):
            h = h + self.layer(h)
        return self.head(h)


def test_a_model_that_shares_parameters_keeps_autocasts_cache_in_its_regions():
    # Uncached, each use of a shared layer would cast its weights again: other ATen calls than
    # planned, copies the plan did not count, and gradients summed in float32 where the original
    # sums them in bfloat16 (ALBERT under CPU autocast: 19.5% over budget, gradients unlike).
    torch.manual_seed(0)
    model, x = _SharedLayer(), torch.randn(512, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unplanned = steady_peak(model, x, torch.device("cpu"))
    for measure in ("auto", "no-run"):
        p = plan(model, x, budget_gb=0.8 * unplanned / GIB, measure=measure, autocast=torch.bfloat16)
        assert p.checkpoints and not any(c.wrapped.uncached for c in p.checkpoints)
        record = p.verify(steps=1)
        assert record.gradients_match and record.within_budget
        # (high: cached, a region's casts count as held to their node's backward)
        assert -0.0001 <= record.peak_error <= 0.1, (measure, record.peak_error)


class _TiedEmbeddings(torch.nn.Module):
    """A language model whose output layer is its token embedding (GPT-2, BERT)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, 128)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(),
                                                              torch.nn.Linear(512, 128)) for _ in range(4))
        self.head = torch.nn.Linear(128, 512, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_tied_embeddings_run_uncached_since_only_the_output_layer_casts_them():
    # The embedding reads its weight in float32; only the output layer uses its autocast copy,
    # so each cast is made once whether cached or not, and the regions run uncached (exact).
    torch.manual_seed(0)
    model, tokens = _TiedEmbeddings(), torch.randint(0, 512, (4, 256))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unplanned = steady_peak(model, tokens, torch.device("cpu"))
    for measure in ("auto", "no-run"):
        p = plan(model, tokens, budget_gb=0.7 * unplanned / GIB, measure=measure, autocast=torch.bfloat16)
        # (measured, the output layer's weight gradient is the buffer the embedding's is summed into
        # in place: in flight from the output layer's backward, as the graph says)
        assert abs(p.baseline_peak_bytes - unplanned) <= 0.0001 * unplanned, (measure, p.baseline_peak_bytes)
        assert p.checkpoints and all(c.wrapped.uncached for c in p.checkpoints)
        record = p.verify(steps=1)
        assert record.gradients_match and record.within_budget
        assert -0.0001 <= record.peak_error <= 0.01, (measure, record.peak_error)


@pytest.mark.parametrize("measure", ["auto", "no-run"])
def test_the_losss_kernel_scratch_is_counted_where_forward_ends(measure):
    # Under CUDA's casts a sum of bfloat16 logits runs in float32, and the CPU kernel copies
    # them to float32 first (4 MiB here, twice the logits): the loss the planner computes outside
    # the graph has that scratch, which the unplanned step's peak reaches when forward is done,
    # autocast's cached casts still alive (without it, the measured path predicted 4.79 MB for a
    # 7.71 MB step; counted at the first backward step instead, 9 KiB low: the casts are gone).
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 512)), torch.randn(2048, 64)
    with cuda_autocast_on_cpu(torch.bfloat16):
        p = plan(model, x, budget_gb=80, measure=measure)
        measured = steady_peak(model, x, torch.device("cpu"))
    assert 0 <= p.baseline_peak_bytes - measured <= 0.001 * measured, (p.baseline_peak_bytes, measured)


@pytest.mark.parametrize("measure", ["auto", "no-run"])
def test_a_plan_at_the_minimum_fits_where_the_loss_peaks(measure):
    # Every plan peaks at the loss here: the smallest budget named must hold its scratch beside
    # all that is alive when forward ends (counted at the first backward step, it was named
    # 1 KiB too small).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 512))
    x = torch.randn(2048, 64)
    with cuda_autocast_on_cpu(torch.bfloat16):
        with pytest.raises(InfeasibleBudget) as refused:
            plan(copy.deepcopy(model), x, budget_gb=1e6 / GIB, measure=measure)
        planned = copy.deepcopy(model)
        p = plan(planned, x, budget_gb=refused.value.minimum_bytes / GIB, measure=measure)
        p.apply(planned)
        measured = steady_peak(planned, x, torch.device("cpu"))
    assert p.checkpoints and measured <= p.budget_bytes, (measured, p.budget_bytes)


class _NormAfterActivation(torch.nn.Module):
    """A LayerNorm on a GELU of a linear (RoBERTa's output head): under CPU autocast its input is
    bfloat16 and its weights float32, and the CPU kernel saves float32 statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(F.gelu(self.fc(x))))


def test_a_norms_statistics_on_fake_tensors_have_the_dtype_its_kernel_gives_them():
    from torch._subclasses import FakeTensorMode

    from planner.measure.sizes import NormStatistics

    torch.manual_seed(0)
    model, x = _NormAfterActivation(), torch.randn(256, 64)
    saved = {}
    for measure in ("run", "no-run"):  # (PyTorch's fake CPU kernel gives them the input's dtype)
        p = plan(model, x, budget_gb=80, measure=measure, autocast=torch.bfloat16, repeats=1)
        saved[measure] = next(node.saved_bytes for node in p.problem.nodes if "norm" in node.name)
    assert saved["no-run"] == saved["run"] == 2 * 256 * 4  # mean and inverse deviation, float32
    with FakeTensorMode():  # a CUDA GPU keeps float32 statistics for any 16-bit input
        half = torch.empty(8, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
        with NormStatistics(cuda=True):
            _, mean, rstd = torch.ops.aten.native_layer_norm(half[0], [64], half[1], None, 1e-5)
        with NormStatistics(cuda=False):
            _, cpu_mean, _ = torch.ops.aten.native_layer_norm(half[0], [64], half[1], None, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float32 and cpu_mean.dtype == torch.bfloat16
