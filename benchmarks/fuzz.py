"""Fuzz the planner with random models (tests/fuzz_models.py), one seed after another.

Each seed: a random model (in-place writes on tensors earlier ops consumed, `h += old`,
dropout, BatchNorm in training mode, skips, products and `torch.cat` across blocks, blocks
taking and returning several tensors), planned at a random budget between the smallest
feasible one and the unplanned peak; the plan applied in place must give the unplanned
model's gradients and BatchNorm statistics, and `Plan.verify` must find the measured peak
within the budget and within 3% of the predicted one. Prints one line per seed and a summary;
exits 1 on any failure.

    .venv/bin/python benchmarks/fuzz.py --seeds 200 [--start 0] [--results] [--verbose]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fuzz_models import PEAK_TOLERANCE, check_seed  # noqa: E402

from benchmarks.results import append_results  # noqa: E402

CHECKS = {
    "ran": "planned, verified and trained without raising",
    "grads_ok": "gradients equal to the unplanned model's (plan applied in place)",
    "buffers_ok": "BatchNorm running_mean/var/num_batches_tracked equal",
    "outputs_ok": "outputs equal",
    "half_batch_ok": "a second step on half the batch: outputs, gradients and buffers equal",
    "verify_grads_ok": "Plan.verify: gradients match",
    "within_budget": "measured peak within the budget",
    "error_ok": f"|peak error| <= {100 * PEAK_TOLERANCE:.0f}%",
}


def line(record: dict) -> str:
    seed = record["seed"]
    if "measured" not in record:
        return f"seed {seed:4d}  FAIL  {record['failure']}"
    status = "ok  " if record["ok"] else "FAIL"
    text = (f"seed {seed:4d}  {status}  nodes {record['nodes']:3d}  regions {record['regions']:2d}  "
            f"kept {record.get('kept', 0):2d}  "
            f"budget {record['budget'] / 2**20:7.2f} MiB  predicted {record['predicted'] / 2**20:7.2f}  "
            f"measured {record['measured'] / 2**20:7.2f}  error {100 * record['error']:+6.2f}%  "
            f"({record['seconds']:.1f} s)")
    if record["failure"]:
        text += f"\n      {record['failure']}"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=200, help="how many seeds (default 200)")
    parser.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--results", action="store_true", help="append a section to benchmarks/RESULTS.md")
    parser.add_argument("--verbose", action="store_true", help="print each failing model and traceback")
    args = parser.parse_args()

    records = []
    started = time.perf_counter()
    for seed in range(args.start, args.start + args.seeds):
        began = time.perf_counter()
        record = check_seed(seed)
        record["seconds"] = time.perf_counter() - began
        records.append(record)
        print(line(record), flush=True)
        if not record["ok"] and args.verbose:
            print(record.get("model", ""))
            print(record.get("traceback", ""), flush=True)
    elapsed = time.perf_counter() - started

    n = len(records)
    counts = {"ran": sum("measured" in r and "grads_ok" in r for r in records)}
    for key in list(CHECKS)[1:]:
        counts[key] = sum(bool(r.get(key)) for r in records)
    passed = sum(r["ok"] for r in records)
    measured = [r for r in records if "error" in r]
    worst = max(measured, key=lambda r: abs(r["error"]), default=None)
    worst_text = f"{100 * worst['error']:+.2f}% (seed {worst['seed']})" if worst else "-"
    regions = sum(r.get("regions", 0) for r in records)
    kept = sum(r.get("kept", 0) for r in records)
    keeping = sum(bool(r.get("kept")) for r in records)
    hazards = {}
    for record in records:
        for key, value in record.get("features", {}).items():
            hazards[key] = hazards.get(key, 0) + value
    failed = [r for r in records if not r["ok"]]
    depths: dict[int, int] = {}
    for record in records:
        for module in record.get("modules", []):
            depths[module.count(".") + 1] = depths.get(module.count(".") + 1, 0) + 1
    depth_text = ", ".join(f"depth {d}: {depths[d]}" for d in sorted(depths))
    solvers: dict[str, int] = {}
    for record in records:
        if "solver" in record:
            key = f"{record['solver']} {record['status']}"
            solvers[key] = solvers.get(key, 0) + 1
    baseline_worst = max((r for r in records if "baseline_error" in r), key=lambda r: abs(r["baseline_error"]),
                         default=None)
    baseline_text = (f"{100 * baseline_worst['baseline_error']:+.2f}% (seed {baseline_worst['seed']})"
                     if baseline_worst else "-")
    baseline_off = sum(abs(r["baseline_error"]) > PEAK_TOLERANCE for r in records if "baseline_error" in r)

    print(f"\n{passed}/{n} seeds passed every check in {elapsed:.0f} s ({regions} regions in all; "
          f"{keeping} plans keep {kept} nodes inside their regions)")
    for key, text in CHECKS.items():
        print(f"  {counts[key]:4d}/{n}  {text}")
    print(f"  worst peak error: {worst_text}")
    print(f"  unplanned prediction (for reference): {baseline_off} seeds off by more than "
          f"{100 * PEAK_TOLERANCE:.0f}%, worst {baseline_text}")
    print(f"  regions by module depth: {depth_text or '-'}; solvers: "
          + ", ".join(f"{key} {value}" for key, value in sorted(solvers.items())))
    print("  hazards in the models: " + ", ".join(f"{key} {value}" for key, value in hazards.items()))
    for record in failed:
        print(f"  FAILED seed {record['seed']}: {record['failure']}")

    if args.results:
        rows = ["| check | seeds passing |", "|---|---|"]
        rows += [f"| {text} | {counts[key]}/{n} |" for key, text in CHECKS.items()]
        rows.append(f"| every check | {passed}/{n} |")
        body = "\n".join(rows) + (
            f"\n\nSeeds {args.start}..{args.start + n - 1}, {regions} checkpointed regions in all "
            f"({keeping} plans keep {kept} nodes inside their regions), "
            f"{elapsed:.0f} s. Worst peak error (predicted vs measured): {worst_text}; the unplanned "
            f"prediction was off by more than {100 * PEAK_TOLERANCE:.0f}% on {baseline_off} seeds (worst "
            f"{baseline_text}). Regions by module depth: {depth_text or '-'}. "
            "Hazards across the models: " + ", ".join(f"{key} {value}" for key, value in hazards.items()) + "."
        )
        if failed:
            body += "\n\nFailures:\n" + "\n".join(f"- seed {r['seed']}: {r['failure']}" for r in failed)
        append_results(f"Fuzz: {n} random models at random budgets", f"python benchmarks/fuzz.py --seeds {n}"
                       + (f" --start {args.start}" if args.start else "") + " --results", body)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
