"""Fuzz the planner with random models (tests/fuzz_models.py), one seed after another, with the
call users make: `plan(model, sample, budget_gb=X)`, every other argument at its default.

Each seed: a random model, blocked (in-place writes on tensors earlier ops consumed, `h += old`,
dropout, BatchNorm in training mode, skips, products and `torch.cat` across blocks, blocks
taking and returning several tensors) or, every third seed, flat (every op in the model's own
forward: linears, LayerNorm, BatchNorm, GELU, dropout, skips, `h * 1.0; h += old`, in-place
ReLU on consumed values, `cat` into a linear, `h * sigmoid(old)`) or, one seed in twelve, an
`nn.Sequential` of single layers (`benchmarks.fuzz_models.model_kind`), planned at a random budget
of 30-100% of its measured unplanned peak. A plan must stay within the budget and within 3% of
its prediction, have run its own step in planning, and train like the unplanned model (in
place, and on half the batch); a budget refused must name a minimum at which a plan fits. The
same budget planned node by node (`measure="no-run"`) and for the model on `meta` (saved,
loaded, applied to the real one) may exceed it by 1% at most. Prints one line per seed and a
summary, writes the records to benchmarks/results/ (a no-run or meta plan that peaked above its
prediction or failed with its saved plan: `benchmarks.fuzz_models.replay_plan` measures it
again) and, with --results, the
summary to RESULTS.md; exits 1 on any failure.

    .venv/bin/python -m benchmarks.fuzz --seeds 400 [--start 0] [--replan] [--results] [--verbose]

`--replan` takes the faster route instead: `plan(..., budget_gb=80)`, then `replan(budget_gb=X)`.
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks.fuzz_models import KINDS, OVER_TOLERANCE, PEAK_TOLERANCE, check_seed, model_kind
from benchmarks.results import set_section, write_run

CHECKS = {
    "ran": "planned, verified and trained without raising",
    "grads_ok": "gradients equal to the unplanned model's (plan applied in place)",
    "buffers_ok": "BatchNorm running_mean/var/num_batches_tracked equal",
    "half_batch_ok": "a second step on half the batch: outputs, gradients and buffers equal",
    "within_budget": "measured peak within the budget",
    "error_ok": f"|peak error| <= {100 * PEAK_TOLERANCE:.0f}%",
    "verified": "its own step ran in planning, within the budget",
    "no_run_ok": f"measure=\"no-run\": measured peak at most {100 * OVER_TOLERANCE:.0f}% over the budget",
    "meta_ok": f"on meta, saved, loaded and applied: at most {100 * OVER_TOLERANCE:.0f}% over the budget",
}


def _within(found: dict) -> bool:
    return bool(found.get("infeasible")) or (found.get("over", 1.0) <= OVER_TOLERANCE and found.get("grads_ok", False))


def line(record: dict) -> str:
    seed, kind = record["seed"], record["kind"][:5]
    if "measured" not in record:
        return f"seed {seed:4d} {kind} FAIL  {record['failure']}"
    status = "ok  " if record["ok"] else "FAIL"
    refused = f" (asked {record['asked'] / 2**20:.3f}: infeasible)" if record.get("infeasible") else ""
    extra = "  ".join(f"{name} {100 * record[name]['over']:+.2f}%" if "over" in record.get(name, {})
                      else f"{name} infeasible" for name in ("no_run", "meta") if name in record)
    text = (f"seed {seed:4d} {kind} {status}  nodes {record['nodes']:3d}  regions {record['regions']:2d}  "
            f"kept {record.get('kept', 0):2d}  budget {record['budget'] / 2**20:7.3f} MiB{refused}  "
            f"predicted {record['predicted'] / 2**20:7.3f}  measured {record['measured'] / 2**20:7.3f}  "
            f"error {100 * record['error']:+6.2f}%  {extra}  ({record['seconds']:.1f} s)")
    if record["failure"]:
        text += f"\n      {record['failure']}"
    return text


def summary(records: list[dict], elapsed: float) -> tuple[list[str], dict[str, int]]:
    n = len(records)
    counts = {"ran": sum("measured" in r and "grads_ok" in r for r in records)}
    for key in ("grads_ok", "buffers_ok", "half_batch_ok", "within_budget", "error_ok", "verified"):
        counts[key] = sum(bool(r.get(key)) for r in records)
    counts["no_run_ok"] = sum(_within(r.get("no_run", {})) for r in records)
    counts["meta_ok"] = sum(_within(r.get("meta", {})) for r in records)
    measured = [r for r in records if "error" in r]
    worst = max(measured, key=lambda r: abs(r["error"]), default=None)
    overs = {name: max((r[name]["over"] for r in records if "over" in r.get(name, {})), default=None)
             for name in ("no_run", "meta")}
    refused = sum(bool(r.get("infeasible")) for r in records)
    kinds = ", ".join(f"{sum(r['kind'] == kind for r in records)} {kind}" for kind in KINDS)
    keeping = sum(bool(r.get("kept")) or bool(r.get("keep", {}).get("kept")) for r in records)
    lines = ["| check | seeds passing |", "|---|---|"]
    lines += [f"| {text} | {counts[key]}/{n} |" for key, text in CHECKS.items()]
    lines.append(f"| every check | {sum(r['ok'] for r in records)}/{n} |")
    lines += ["", f"{n} seeds ({kinds} models) in {elapsed:.0f} s; {refused} budgets refused as "
              f"infeasible and planned at the minimum named; {keeping} plans keep nodes inside regions. Worst peak "
              f"error: " + (f"{100 * worst['error']:+.2f}% (seed {worst['seed']})" if worst else "-") + "; largest "
              "excess over the budget node by node: " + (f"{100 * overs['no_run']:+.2f}%" if overs["no_run"] is not None
                                                          else "-")
              + ", on meta: " + (f"{100 * overs['meta']:+.2f}%" if overs["meta"] is not None else "-") + "."]
    failed = [r for r in records if not r["ok"]]
    if failed:
        lines += ["", "Failures:", *(f"- seed {r['seed']}: {r['failure']}" for r in failed)]
    return lines, counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=400, help="how many seeds (default 400)")
    parser.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--replan", action="store_true", help="plan at 80 GB, then replan (the faster route)")
    parser.add_argument("--results", action="store_true", help="write the summary to benchmarks/RESULTS.md")
    parser.add_argument("--verbose", action="store_true", help="print each failing model and traceback")
    args = parser.parse_args()

    records = []
    started = time.perf_counter()
    for seed in range(args.start, args.start + args.seeds):
        began = time.perf_counter()
        record = check_seed(seed, model_kind(seed), replan=args.replan)
        record["seconds"] = time.perf_counter() - began
        records.append(record)
        print(line(record), flush=True)
        if not record["ok"] and args.verbose:
            print(record.get("model", ""))
            print(record.get("traceback", ""), flush=True)
    elapsed = time.perf_counter() - started
    lines, _ = summary(records, elapsed)
    print("\n" + "\n".join(lines))
    command = (f"python -m benchmarks.fuzz --seeds {args.seeds}" + (f" --start {args.start}" if args.start else "")
               + (" --replan" if args.replan else ""))
    path = write_run("fuzz" + ("_replan" if args.replan else ""), {"command": command, "records": records})
    print(f"records: {path}")
    if args.results:
        title = f"Fuzz: {len(records)} random models at random budgets" + (" (replan route)" if args.replan else "")
        set_section("fuzz" + ("_replan" if args.replan else ""), title, command, "\n".join(lines))
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
