"""The command line: `ckpt-plan plan/show/demo`, run in-process through main() and once as the
installed console script."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import small_mlp
from torch import nn

from planner import InfeasibleBudget, load_plan, plan
from planner.api import GIB
from planner.cli import main as cli
from planner.cli.main import main
from planner.cli.models import load_model, parse_shapes, resize_sample

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FAST = ["--repeats", "1"]


# Factories for MODEL specs (this module imports as `test_cli`).
def model_only() -> nn.Module:
    return nn.Linear(2, 2)


def three_things() -> tuple:
    return nn.Linear(2, 2), torch.ones(1, 2), None


def sample_is_not_usable() -> tuple:
    return nn.Linear(2, 2), "text"


def broken() -> tuple:
    raise RuntimeError("weights file missing")


def needs_width(width: int) -> tuple:
    return nn.Linear(width, width), torch.ones(1, width)


def pair_of_inputs() -> tuple:
    class Add(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x, y):
            return torch.tanh(x * self.scale) + y
    return Add(), {"x": torch.randn(4, 8), "y": torch.randint(0, 5, (4, 8))}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def tight_budget_gb() -> str:
    """A budget under small_mlp's unplanned peak that the sqrt solver can meet."""
    model, x = small_mlp()
    p = plan(model, x, budget_gb=80.0, solver="sqrt", repeats=1)
    return f"{0.75 * p.baseline_peak_bytes / GIB:.6f}"


def test_plan_prints_the_report_and_progress(capsys):
    code, out, err = run(capsys, "plan", "mlp", "--budget-gb", "1", "--sample", "32x256", *FAST)
    assert code == 0
    assert out.startswith("Checkpoint plan for Sequential: 0 regions, predicted peak ")
    assert "for a budget of 1.00 GiB" in out and "regions           0" in out
    assert "solver" not in out  # the cost model's internals: --verbose
    for step in ("model mlp: Sequential", "sample 32x256 float32", "tracing", "timing forward pass 1/2", "solving"):
        assert step in err


def test_verbose_adds_the_solver_and_the_cost_model(capsys):
    code, out, _ = run(capsys, "plan", "mlp", "--budget-gb", "1", "--sample", "32x256", "--quiet", "--verbose", *FAST)
    assert code == 0 and "  solver            " in out and "  cost model        " in out and "per checkpoint call" in out


def test_autocast_plans_the_mixed_precision_step(capsys):
    code, out, _ = run(capsys, "plan", "mlp", "--budget-gb", "1", "--sample", "32x256", "--quiet",
                       "--autocast", "bfloat16", *FAST)
    assert code == 0 and "the step under autocast to bfloat16" in out


def test_param_dtype_plans_fsdp2s_mixed_precision_step(capsys):
    code, out, _ = run(capsys, "plan", "mlp", "--budget-gb", "1", "--sample", "32x256", "--quiet",
                       "--param-dtype", "bfloat16", *FAST)
    assert code == 0 and "parameters and inputs in bfloat16, as FSDP2's MixedPrecisionPolicy runs them" in out
    assert "root parameters, unsharded (FSDP)" in out and "(per rank, FSDP2 over 1 rank)" in out


def test_quiet_prints_only_the_report(capsys):
    code, out, err = run(capsys, "plan", "mlp", "--budget-gb", "1", "--sample", "32x256", "--quiet", *FAST)
    assert code == 0 and out.startswith("Checkpoint plan") and err == ""


def test_a_factory_spec_with_json_plot_and_verify(capsys, tmp_path, tight_budget_gb):
    plan_path, plot_path = tmp_path / "plan.json", tmp_path / "memory.png"
    code, out, err = run(capsys, "plan", "conftest:small_mlp", "--budget-gb", tight_budget_gb, "--solver", "sqrt",
                         "--json", str(plan_path), "--plot", str(plot_path), "--verify", "--verify-steps", "1", *FAST)
    assert code == 0, err
    saved = load_plan(plan_path)
    assert saved.solution.regions, "a budget under the unplanned peak must recompute something"
    assert f"regions           {len(saved.solution.regions)}" in out
    assert "Verification over 1 measured steps" in out
    assert [line.split() for line in out.splitlines() if "gradients match" in line] == [["gradients", "match", "yes"]]
    assert saved.verification is not None and saved.verification.gradients_match
    assert plot_path.read_bytes().startswith(PNG_SIGNATURE)
    assert f"saved the plan to {plan_path}" in err and f"wrote the memory plot to {plot_path}" in err

    code, shown, _ = run(capsys, "show", str(plan_path), "--quiet")
    assert code == 0
    assert shown.splitlines()[1:] == out.splitlines()[1:]  # same report, read back from JSON


def test_sample_resizes_the_factorys_tensors(capsys, tmp_path):
    code, _, err = run(capsys, "plan", "test_cli:pair_of_inputs", "--budget-gb", "1", "--sample", "2x3,2x3",
                       "--json", str(tmp_path / "plan.json"), *FAST)
    assert code == 0, err
    arguments = load_plan(tmp_path / "plan.json").record.sample["arguments"]
    assert [(a["name"], a["tensor"]["shape"], a["tensor"]["dtype"]) for a in arguments] == [
        ("x", [2, 3], "float32"), ("y", [2, 3], "int64"),
    ]


def test_the_hint_says_whose_smallest_budget_it_is(capsys):
    cli._infeasible(InfeasibleBudget(1 << 20, 3 << 30, 1 << 30, "sqrt", proven=False))
    assert "hint: the smallest budget sqrt fits is about --budget-gb 3" in capsys.readouterr().err
    cli._infeasible(InfeasibleBudget(1 << 20, 3 << 30, 1 << 30, "dp"))
    assert "hint: the smallest budget that fits is about --budget-gb 3" in capsys.readouterr().err


def test_resize_sample_keeps_dtype_device_and_value_range():
    tokens = torch.randint(3, 7, (8, 128))
    resized = resize_sample(tokens, [(2, 64)])
    assert resized.shape == (2, 64) and resized.dtype == torch.int64
    assert 3 <= int(resized.min()) and int(resized.max()) <= 6
    args = resize_sample((torch.randn(4, 4, dtype=torch.float64), 7), [(2, 2)])
    assert args[0].shape == (2, 2) and args[0].dtype == torch.float64 and args[1] == 7
    assert parse_shapes("8x128, 4X3x2") == [(8, 128), (4, 3, 2)]


def test_unmeetable_budget_exits_3_with_the_minimum(capsys):
    code, out, err = run(capsys, "plan", "mlp", "--budget-gb", "0.000001", "--sample", "32x256", "--quiet", *FAST)
    assert code == 3 and out == ""
    first, hint = err.strip().splitlines()
    assert first.startswith("ckpt-plan: error: budget") and "is below the minimum" in first
    suggested = float(hint.rsplit(" ", 1)[1])
    code, out, _ = run(capsys, "plan", "mlp", "--budget-gb", str(suggested), "--sample", "32x256", "--quiet", *FAST)
    assert code == 0 and out.startswith("Checkpoint plan"), "the hinted budget must fit"


@pytest.mark.parametrize("spec, message", [
    ("gpt2", "MODEL 'gpt2' is neither a built-in example (cnn, gpt, mlp, unet) nor package.module:factory"),
    ("no_such_package.models:build", "cannot import module 'no_such_package.models'"),
    ("conftest:no_such_factory", "'conftest' has no attribute 'no_such_factory'"),
    ("conftest:MODELS", "MODEL 'conftest:MODELS' is a dict, not a callable"),
    ("test_cli:needs_width", "needs_width(width: int) needs arguments; name a factory that takes none"),
    ("test_cli:model_only", "model_only() must return (model, sample) with an nn.Module model, not a Linear"),
    ("test_cli:three_things", "must return (model, sample) with an nn.Module model, not a tuple of 3"),
    ("test_cli:sample_is_not_usable", "returned a sample that cannot be used: sample must be a Tensor"),
    ("missing_file.py:build", "no file 'missing_file.py'"),
])
def test_bad_model_spec_is_a_one_line_usage_error(capsys, spec, message):
    code, out, err = run(capsys, "plan", spec, "--budget-gb", "1")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("ckpt-plan: error: ")
    assert message in err


def test_a_failing_factory_exits_1_naming_it(capsys):
    code, _, err = run(capsys, "plan", "test_cli:broken", "--budget-gb", "1")
    assert code == 1
    assert err == "ckpt-plan: error: MODEL 'test_cli:broken': broken() failed: RuntimeError: weights file missing\n"


def test_a_model_file_path_works(capsys):
    examples = Path(__file__).parent.parent / "planner" / "examples.py"
    model, sample = load_model(f"{examples}:mlp")
    assert isinstance(model, nn.Sequential) and sample.shape == (64, 256)


@pytest.mark.parametrize("argv, message", [
    (["plan", "mlp"], "give --budget-gb, or --target"),
    (["plan", "mlp", "--budget-gb", "-1"], "'-1' must be more than zero"),
    (["plan", "mlp", "--budget-gb", "lots"], "'lots' is not a number of GiB"),
    (["plan", "mlp", "--budget-gb", "1", "--solver", "magic"], "invalid choice: 'magic'"),
    (["plan", "mlp", "--budget-gb", "1", "--sample", "8xbig"], "'8xbig' is not a shape like 8x128"),
    (["plan", "mlp", "--budget-gb", "1", "--sample", "8x4x2"], "the sample's tensor is 64x256 (2 dims); give 2 dims"),
    (["plan", "mlp", "--budget-gb", "1", "--sample", "8x4,8x4"], "--sample gives 2 shape(s) but the model's sample"),
    (["show", "no-such-plan.json"], "cannot read plan 'no-such-plan.json'"),
])
def test_usage_errors_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err


def test_planning_failure_exits_1(capsys):
    # The example GPT's context is 128 tokens: a longer sample cannot be profiled.
    code, out, err = run(capsys, "plan", "gpt", "--budget-gb", "1", "--sample", "1x200", "--quiet", *FAST)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "planning gpt failed (its sample was resized by --sample" in err


def test_demo_still_runs(capsys):
    code, out, err = run(capsys, "demo", "--model", "mlp", "--budget-gb", "0.019", "--quiet")
    assert code == 0, err
    assert out.startswith("Checkpoint plan for Sequential")
    assert "One training step of the planned module ran" in out


def test_help_exits_0(capsys):
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0
    assert "--sample SHAPE[,SHAPE...]" in out and "Exit status: 0 done" in " ".join(out.split())


def test_console_script(tmp_path):
    script = Path(sys.executable).parent / "ckpt-plan"
    if not script.exists():
        script = shutil.which("ckpt-plan")
    if script is None:
        pytest.skip("the ckpt-plan console script is not installed (pip install -e .)")
    plan_path = tmp_path / "plan.json"
    done = subprocess.run(
        # (node by node: a whole step would time checkpoint's costs in full rounds, which the
        # in-process tests shorten and this process cannot)
        [str(script), "plan", "mlp", "--budget-gb", "1", "--sample", "16x256", "--repeats", "1",
         "--measure", "no-run", "--json", str(plan_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Checkpoint plan for Sequential")
    assert "... tracing" in done.stderr
    assert json.loads(plan_path.read_text())["sample"]["arguments"][0]["tensor"]["shape"] == [16, 256]


def test_throughput_prints_the_table_and_saves_the_chosen_plan(capsys, tmp_path):
    plan_path = tmp_path / "plan.json"
    code, out, err = run(capsys, "throughput", "mlp", "--budget-gb", "0.04", "--sample", "32x256",
                         "--batches", "8,16,32", "--json", str(plan_path), "--quiet")
    assert code == 0, err
    assert out.startswith("Throughput plan: batch ") and "<- chosen" in out and "every block" in out
    assert load_plan(plan_path).record.sample["arguments"][0]["tensor"]["shape"][0] in (8, 16, 32)


def test_throughput_refuses_bad_batches(capsys):
    code, _, err = run(capsys, "throughput", "mlp", "--budget-gb", "1", "--batches", "0,4")
    assert code == 2 and "--batches" in err
