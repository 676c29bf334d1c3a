"""FSDP2's memory as a plan for `world_size` ranks counts it: static terms per rank
(`planner.measure.static`) and the unsharded gradients and buffers backward holds
(`planner.problem.fsdp`). Each rank's measured peak against the plan: test_distributed.py."""
import torch
from test_precision import _Stack

from planner import load_plan, plan
from planner.examples import TinyGPT
from planner.measure.static import collective_copies, reduce_scatter_bytes, static_breakdown

BLOCK = (16 + 16 + 64 * 16 + 64 + 16 * 64 + 16) * 4  # a block's LayerNorm(16), Linear(16, 64), Linear(64, 16)
ROOT = (32 * 16 + 16 + 16 * 8 + 8) * 4  # the embedding Linear(32, 16) and the head Linear(16, 8)


def test_gradients_are_held_from_their_backward_to_their_units_reduce_scatter(tmp_path):
    torch.manual_seed(0)
    p = plan(_Stack(width=16, depth=2), torch.randn(8, 32), budget_gb=80, world_size=2, measure="no-run")
    names = [node.name for node in p.problem.nodes]
    held = sorted((names[first], names[last], size) for first, last, size in p.problem.held_in_backward)
    copies = 1 + collective_copies(torch.device("cpu"), 2)  # (gloo's copy of each reduce-scatter buffer)
    expected = [
        # the root's gradients, made by the backward of the embedding and the head, until the end
        ("embed", "embed", 32 * 16 * 4), ("embed", "embed", 16 * 4), ("embed", "head", 16 * 8 * 4),
        ("embed", "head", 8 * 4),
        ("embed", "embed", copies * ROOT),  # the root's reduce-scatter buffer, at the end
        ("embed", "blocks_0_0", copies * BLOCK),  # block 0's, until the root reduces
        ("blocks_0_0", "blocks_1_0", copies * BLOCK),  # block 1's, until block 0 reduces
        ("blocks_0_0", "blocks_1_3", BLOCK),  # gloo's work holding one more block's parameters
    ]
    for k in range(2):  # each block's gradients, until its reduce-scatter after its first node's backward
        first = f"blocks_{k}_0"
        expected += [(first, first, 16 * 4), (first, first, 16 * 4), (first, f"blocks_{k}_1", 64 * 16 * 4),
                     (first, f"blocks_{k}_1", 64 * 4), (first, f"blocks_{k}_3", 16 * 64 * 4),
                     (first, f"blocks_{k}_3", 16 * 4)]
    assert held == sorted(expected)
    assert not any(node.param_grad_bytes for node in p.problem.nodes)  # (no longer a backward temporary)
    terms = p.static_breakdown
    assert terms["block parameters in flight (FSDP, 3 blocks)"] == 3 * BLOCK  # (2, and gloo's copy)
    assert terms["root parameters, unsharded (FSDP)"] == ROOT and not any("gradients, unsharded" in t for t in terms)
    loaded = load_plan(p.save(tmp_path / "plan.json"))
    assert loaded.problem.held_in_backward == p.problem.held_in_backward


def test_reduce_scatter_buffers_pad_dim_0_and_gloo_copies_them():
    model = _Stack(width=16, depth=2)
    on_gpus = reduce_scatter_bytes(model, 3, torch.device("cuda"))  # 16 rows padded to 18, 64 to 66, 8 to 9
    block = (18 + 18 + 66 * 16 + 66 + 18 * 64 + 18) * 4
    assert on_gpus == {"": (18 * 32 + 18 + 9 * 16 + 9) * 4, "blocks.0": block, "blocks.1": block}
    assert reduce_scatter_bytes(model, 3, torch.device("cpu")) == {unit: 2 * size for unit, size in on_gpus.items()}
    assert collective_copies(torch.device("cuda"), 8) == 0 and collective_copies(torch.device("cpu"), 1) == 0
    gpus = static_breakdown(model, 0, 0, torch.device("cuda"), None, world_size=3)
    assert gpus["block parameters in flight (FSDP, 2 blocks)"] == 2 * BLOCK


def test_a_float32_buffer_passed_to_every_block_is_counted_once_per_block_in_param_dtype():
    # FSDP2 casts each block's floating inputs to param_dtype: the built-in GPT's float32 causal
    # mask (32 x 32) is copied in bfloat16 for each of its 2 blocks
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, width=16, heads=2, blocks=2, context=32)
    tokens = torch.randint(0, 64, (2, 32))
    mixed = plan(model, tokens, budget_gb=80, measure="no-run", param_dtype=torch.bfloat16).static_breakdown
    assert mixed["block inputs cast to param_dtype (FSDP, estimate)"] == 2 * 32 * 32 * 2
    sharded = plan(model, tokens, budget_gb=80, measure="no-run", world_size=2).static_breakdown
    assert not any("cast" in term for term in sharded)  # (no param_dtype: nothing cast)


def test_a_root_weight_viewed_by_every_block_is_held_from_the_last_blocks_backward():
    # DeBERTa-style relative embeddings (a root parameter): its unsharded gradient from the last
    # layer's backward to the root's reduce-scatter at the end; the first layer's gradient for
    # its view a storage of its own until the view hands it on
    from test_no_run import _RelativeEmbeddings

    torch.manual_seed(0)
    p = plan(_RelativeEmbeddings(width=16, span=32, layers=2), torch.randn(2, 8, 16), budget_gb=80, world_size=2,
             measure="no-run")
    names = [node.name for node in p.problem.nodes]
    held = sorted((names[first], names[last]) for first, last, size in p.problem.held_in_backward
                  if size == 32 * 16 * 4)
    assert held == [(names[0], "layers_1_query"), ("getitem_1", "layers_0_query")]
