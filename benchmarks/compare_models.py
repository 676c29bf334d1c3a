"""The models of `benchmarks/compare.py` and today's ways to checkpoint them by hand: every
block, and sqrt(N) segments (what `checkpoint_sequential` does)."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

# --------------------------------------------------------------------------------------------
# Models


@dataclass
class Spec:
    """A benchmark model: how to build it, where its blocks are, how to checkpoint them."""

    key: str
    title: str
    build: Callable[[bool], tuple[Any, Any, str]]  # quick -> (model, sample, size description)
    blocks: Callable[[Any], Any]  # model -> ModuleList of blocks
    hugging_face: bool = False


def build_gpt(quick: bool):
    import torch

    from planner.examples import TinyGPT

    if quick:
        width, blocks, length, batch = 64, 4, 64, 2
    else:
        width, blocks, length, batch = 128, 8, 256, 6
    model = TinyGPT(width=width, heads=4, blocks=blocks, context=length)
    sample = torch.randint(0, 512, (batch, length))
    return model, sample, (f"TinyGPT: {blocks} blocks, width {width}, 4 heads, vocab 512, dropout 0.1; "
                           f"batch {batch} x {length} tokens")


def _text_sizes(quick: bool) -> tuple[int, int, int, int, int, int]:
    """(layers, hidden, heads, vocab, length, batch) of the Hugging Face text models."""
    return (2, 64, 4, 512, 64, 2) if quick else (6, 256, 4, 8192, 512, 1)


def _text_model(model_class: Any, config: Any, quick: bool, causal: bool, detail: str):
    """The model, a sample with labels (the model computes its loss) and a description."""
    import torch

    layers, hidden, heads, vocab, length, batch = _text_sizes(quick)
    ids = torch.randint(0, vocab, (batch, length))
    sample = {"input_ids": ids, "labels": ids, **({"use_cache": False} if causal else {})}
    return model_class(config), sample, (
        f"{model_class.__name__}: {layers} layers, hidden {hidden}, {heads} heads, vocab {vocab}, {detail}; "
        f"batch {batch} x {length} tokens; loss computed by the model (labels)")


def build_gpt2(quick: bool):
    import transformers

    layers, hidden, heads, vocab, length, _ = _text_sizes(quick)
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                                     n_positions=length, bos_token_id=0, eos_token_id=0)
    return _text_model(transformers.GPT2LMHeadModel, config, quick, True, "dropout 0.1")


def build_llama(quick: bool):
    import transformers

    layers, hidden, heads, vocab, length, _ = _text_sizes(quick)
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=int(2.75 * hidden),
                                      num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                                      max_position_embeddings=length, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return _text_model(transformers.LlamaForCausalLM, config, quick, True, f"SiLU MLP {int(2.75 * hidden)}")


def build_bert(quick: bool):
    import transformers

    layers, hidden, heads, vocab, length, _ = _text_sizes(quick)
    config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden,
                                     num_attention_heads=heads, vocab_size=vocab, max_position_embeddings=length)
    return _text_model(transformers.BertForMaskedLM, config, quick, False, "dropout 0.1")


def build_cnn(quick: bool):
    import torch

    from planner.examples import SmallCNN

    if quick:
        channels, stages, size, batch = 8, 4, 16, 2
    else:
        channels, stages, size, batch = 32, 8, 64, 16
    model = SmallCNN(channels=channels, stages=stages)
    sample = torch.randn(batch, 3, size, size)
    return model, sample, (f"SmallCNN: {stages} residual stages of conv-BN-ReLU-conv-BN, {channels} channels; "
                           f"batch {batch} x 3 x {size} x {size}")


def build_vit(quick: bool):
    import torch
    import transformers

    if quick:
        layers, hidden, heads, image, patch, batch = 2, 64, 4, 32, 8, 2
    else:
        layers, hidden, heads, image, patch, batch = 6, 384, 6, 224, 16, 4
    config = transformers.ViTConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden,
                                    num_attention_heads=heads, image_size=image, patch_size=patch, num_labels=10)
    model = transformers.ViTForImageClassification(config)
    sample = {"pixel_values": torch.randn(batch, 3, image, image), "labels": torch.randint(0, 10, (batch,))}
    return model, sample, (f"ViTForImageClassification: {layers} layers, hidden {hidden}, {heads} heads, "
                           f"patch {patch}; batch {batch} x 3 x {image} x {image}; loss computed by the model (labels)")


def vit_layers(model):
    encoder = model.vit
    return encoder.layers if hasattr(encoder, "layers") else encoder.encoder.layer


SPECS = {
    "gpt": Spec("gpt", "Built-in transformer (TinyGPT)", build_gpt, lambda m: m.blocks),
    "gpt2": Spec("gpt2", "Hugging Face GPT-2 (small config)", build_gpt2, lambda m: m.transformer.h, True),
    "llama": Spec("llama", "Hugging Face Llama (small config)", build_llama, lambda m: m.model.layers, True),
    "bert": Spec("bert", "Hugging Face BERT (small config)", build_bert, lambda m: m.bert.encoder.layer, True),
    "cnn": Spec("cnn", "CNN with BatchNorm (SmallCNN)", build_cnn, lambda m: m.stages),
    "vit": Spec("vit", "Hugging Face ViT (small config)", build_vit, vit_layers, True),
}


def on_device(model, sample, device: str, batch_scale: int):
    """The model and sample on `device`, the sample's batch (dimension 0) repeated `batch_scale`
    times: the CPU sizes make launch-bound steps on a GPU."""
    import torch
    from torch.utils._pytree import tree_map_only

    from planner.cli.models import to_device

    if batch_scale > 1:
        sample = tree_map_only(torch.Tensor, lambda t: t.repeat(batch_scale, *[1] * (t.dim() - 1)) if t.dim() else t,
                               sample)
    return to_device(model, sample, device)


# --------------------------------------------------------------------------------------------
# Baselines: every block, sqrt(N) segments


def segments(count: int) -> list[list[int]]:
    """Consecutive segments of about sqrt(count) blocks (the last may be shorter)."""
    size = max(1, round(math.sqrt(count)))
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def _checkpointed(function):
    from torch.utils.checkpoint import checkpoint

    def run(*args, **kwargs):
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    return run


def every_block(spec: Spec, model):
    """A deep copy with each block checkpointed."""
    copied = copy.deepcopy(model)
    if spec.hugging_face:
        # transformers 5.x renamed it (the old name warns that it goes in v6); older ones lack it.
        if hasattr(copied, "activation_checkpointing_enable"):
            copied.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            how = "`activation_checkpointing_enable(use_reentrant=False)` on a deep copy"
        else:
            copied.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            how = "`gradient_checkpointing_enable(use_reentrant=False)` on a deep copy"
    else:
        blocks = spec.blocks(copied)
        for block in blocks:
            block.forward = _checkpointed(block.forward)
        how = f"each of the {len(blocks)} blocks' `forward` wrapped in `checkpoint(use_reentrant=False)` on a deep copy"
    copied.train()
    return copied, how


def every_nth_block(spec: Spec, model, n: int):
    """A deep copy with every n-th block checkpointed (blocks 0, n, 2n, ...), as Hugging Face's
    `every_n_layers` and torchtune's activation-checkpointing stride do."""
    copied = copy.deepcopy(model)
    blocks = spec.blocks(copied)
    for index, block in enumerate(blocks):
        if index % n == 0:
            block.forward = _checkpointed(block.forward)
    copied.train()
    return copied, f"blocks 0, {n}, {2 * n}, ... of {len(blocks)} under `checkpoint(use_reentrant=False)`"


def _identity(hidden, *args, **kwargs):
    return hidden


def sqrt_segments(spec: Spec, model):
    """A deep copy whose blocks run in segments of about sqrt(N), all but the last under one
    checkpoint call each (what `checkpoint_sequential` does)."""
    copied = copy.deepcopy(model)
    blocks = spec.blocks(copied)
    parts = segments(len(blocks))
    sizes = "+".join(str(len(part)) for part in parts)
    if spec.key == "cnn":
        # The residual add and ReLU live in SmallCNN.forward, between stages: a segment must
        # include them, so the copy gets a forward that runs its stages segment by segment.
        def run_stages(indices):
            def run(x):
                for index in indices:
                    x = copied.relu(blocks[index](x) + x)
                return x
            return run

        runs = [_checkpointed(run_stages(part)) for part in parts[:-1]] + [run_stages(parts[-1])]

        def forward(images):
            x = copied.stem(images)
            for run in runs:
                x = run(x)
            return copied.head(x.mean(dim=(2, 3)))

        copied.forward = forward
        how = (f"a forward on a deep copy running stages (with their residual add and ReLU) in segments "
               f"{sizes}, all but the last under one checkpoint call")
    else:
        # Blocks map (hidden, *same arguments for every block) -> hidden: the first block of a
        # segment runs the whole segment under one checkpoint call, the others pass through.
        for part in parts[:-1]:
            forwards = [blocks[index].forward for index in part]

            def run(hidden, *args, _forwards=forwards, **kwargs):
                for forward in _forwards:
                    hidden = forward(hidden, *args, **kwargs)
                return hidden

            blocks[part[0]].forward = _checkpointed(run)
            for index in part[1:]:
                blocks[index].forward = _identity
        how = (f"blocks' `forward` patched on a deep copy: segments {sizes}, "
               f"all but the last under one checkpoint call")
    copied.train()
    return copied, how


def block_names(spec: Spec, model) -> list[str]:
    """The qualified names of the model's blocks."""
    blocks = set(map(id, spec.blocks(model)))
    return [name for name, module in model.named_modules() if id(module) in blocks]


def every_block_plan(spec: Spec, model, base):
    """The planner's plan checkpointing every block (its `recompute_ms`: the predicted
    overhead), or None where a block is not a submodule call it can checkpoint."""
    try:
        return base.with_submodules(block_names(spec, model))
    except ValueError:
        return None
