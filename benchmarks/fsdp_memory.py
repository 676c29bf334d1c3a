"""FSDP2 on 2 CPU ranks (gloo): each rank's measured peak against the plan's prediction.

For each model, plans made for `world_size=2` (node by node, as a laptop plans for a node) at
60% of the way from the static memory to the unplanned peak, with and without FSDP2's mixed
precision (`param_dtype=torch.bfloat16`), are applied to the model, which is then sharded as the
README shows (`fully_shard` per block, then the root; with `MixedPrecisionPolicy(param_dtype=
torch.bfloat16, reduce_dtype=torch.float32)` for the mixed-precision plan) and trained two
steps on each rank. A rank's peak is the storages it holds when the second step starts (its
shards of the parameters and gradients, the sample) plus the highest point of that step's
allocations (`planner.measure.memory.PeakMemory`), as `verify` measures a step. FSDP2's terms in
the prediction are estimates (`planner.measure.static`): this is their check.

    .venv/bin/python -m benchmarks.fsdp_memory [--results]
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.results import set_section, write_run
from planner import load_plan, plan
from planner.api import GIB
from planner.core import training_loss
from planner.measure.memory import PeakMemory, storage_bytes
from solvers.solution import format_bytes

WORLD = 2
SHARE = 0.6  # of the way from the static memory to the unplanned peak: the budget


def _model(name: str) -> tuple[torch.nn.Module, dict, list[torch.nn.Module]]:
    """(model, sample, blocks) from a fixed seed: small Hugging Face configs."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (4, 128))
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=128,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config).train()
        blocks = list(model.transformer.h)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=704,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                          max_position_embeddings=128)
        model = transformers.LlamaForCausalLM(config).train()
        blocks = list(model.model.layers)
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}, blocks


def _rank(rank: int, port: int, name: str, plan_path: str, mixed: bool, out: str) -> None:
    """One rank: the plan applied, FSDP2 as the README shards, two steps; its peak to `out`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        model, sample, blocks = _model(name)
        load_plan(plan_path).apply(model)
        mesh = init_device_mesh("cpu", (WORLD,))
        options = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
            if mixed else {}
        for block in blocks:
            fully_shard(block, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        training_loss(model(**sample)).backward()  # (gradients allocated, as from the second step of training on)
        local = [getattr(t, "_local_tensor", t) for p in model.parameters() for t in (p, p.grad) if t is not None]
        resident = storage_bytes((local, sample))
        with PeakMemory(torch.device("cpu")) as memory:
            training_loss(model(**sample)).backward()
        Path(f"{out}.{rank}").write_text(json.dumps({"resident": resident, "step": memory.peak_bytes}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(name: str, mixed: bool, folder: Path) -> dict:
    model, sample, _ = _model(name)
    dtype = torch.bfloat16 if mixed else None
    whole = plan(model, sample, budget_gb=80, world_size=WORLD, param_dtype=dtype, measure="no-run")
    static = whole.problem.static_bytes
    planned = whole.replan(budget_gb=(static + SHARE * (whole.baseline_peak_bytes - static)) / GIB)
    path = planned.save(folder / f"{name}_{'mixed' if mixed else 'float32'}.json")
    out = str(folder / f"{name}_{mixed}")
    mp.spawn(_rank, args=(_free_port(), name, str(path), mixed, out), nprocs=WORLD)
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(WORLD)]
    measured = max(r["resident"] + r["step"] for r in ranks)
    return {"model": name, "param_dtype": "bfloat16" if mixed else None, "regions": len(planned.checkpoints),
            "budget": planned.budget_bytes, "predicted": planned.predicted_peak_bytes, "measured": measured,
            "unplanned_predicted": whole.baseline_peak_bytes, "ranks": ranks,
            "error": (planned.predicted_peak_bytes - measured) / measured}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", action="store_true", help="write the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in ("gpt2", "llama"):
            for mixed in (False, True):
                rows.append(measure(name, mixed, Path(folder)))
                print(rows[-1], flush=True)
    lines = ["| model | FSDP2 mixed precision | unplanned (predicted) | budget | regions | predicted peak "
             "| measured peak (largest rank) | error | under budget |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['model']} | {'bfloat16 parameters' if row['param_dtype'] else 'none'} "
                     f"| {format_bytes(row['unplanned_predicted'])} | {format_bytes(row['budget'])} | {row['regions']} "
                     f"| {format_bytes(row['predicted'])} | {format_bytes(row['measured'])} "
                     f"| {100 * row['error']:+.1f}% | {'yes' if row['measured'] <= row['budget'] else 'NO'} |")
    over = [row for row in rows if row["measured"] > row["budget"]]
    verdict = ("Every rank under its plan's budget." if not over else
               "Over budget: " + ", ".join(f"{row['model']} ({row['param_dtype'] or 'float32'})" for row in over))
    body = "\n".join(lines) + "\n\n" + verdict
    print(f"\n{body}")
    print(f"records: {write_run('fsdp_memory', {'rows': rows})}")
    if args.results:
        set_section("fsdp_memory", "FSDP2 on 2 CPU ranks: each rank's peak against the plan",
                    "python -m benchmarks.fsdp_memory", body)
    return 0 if not over else 1


if __name__ == "__main__":
    sys.exit(main())
