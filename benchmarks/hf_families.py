"""Hugging Face families beyond GPT-2, Llama, BERT, ViT and ResNet, from tiny random configs:
decoder-only, encoder, encoder-decoder, mixture-of-experts, vision, speech and state-space
models (`FAMILIES`: name -> build() -> (model, sample(batch, length))). Used by
tests/test_hf_families.py and `benchmarks.families`.

Example:
    >>> model, make = FAMILIES["mistral"]()
    >>> sample = make(BATCH, LENGTH)
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import transformers
from torch import nn

transformers.logging.set_verbosity_error()

BATCH, LENGTH, VOCAB = 2, 32, 100
HIDDEN, FFN = 32, 64  # (4 heads of 8)


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length))  # (0-2: pad, bos, eos in some configs)


class MissingFamily(LookupError):
    """This transformers has no such model class."""


def _config(name: str, **values: Any) -> Any:
    cls = getattr(transformers, name, None)
    if cls is None:
        raise MissingFamily(f"transformers {transformers.__version__} has no {name}")
    return cls(**values)


def _model(name: str, config: Any) -> nn.Module:
    cls = getattr(transformers, name, None)
    if cls is None:
        raise MissingFamily(f"transformers {transformers.__version__} has no {name}")
    return cls(config)


# Each family builds its model and returns it with a function of (batch, length) that makes
# its sample. Samples carry labels wherever the model computes its loss from them, and configs
# leave `use_cache` at its default, as a user's do (the planner turns the cache off in training).

def _causal(batch: int, length: int) -> dict[str, Any]:
    ids = _ids(batch, length)
    return {"input_ids": ids, "labels": ids}


def _masked(batch: int, length: int) -> dict[str, Any]:
    ids = _ids(batch, length)
    return {"input_ids": ids, "labels": ids}


def _seq2seq(batch: int, length: int) -> dict[str, Any]:
    return {"input_ids": _ids(batch, length), "labels": _ids(batch, length // 2)}


DECODER = dict(num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=4, vocab_size=VOCAB,
               max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def mistral():
    config = _config("MistralConfig", **DECODER, num_key_value_heads=2, attention_dropout=0.0)
    return _model("MistralForCausalLM", config), _causal


def phi():
    config = _config("PhiConfig", **DECODER, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
                     attention_dropout=0.0)
    return _model("PhiForCausalLM", config), _causal


def gpt_neox():
    config = _config("GPTNeoXConfig", **DECODER, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0)
    return _model("GPTNeoXForCausalLM", config), _causal


def opt():
    config = _config("OPTConfig", num_hidden_layers=2, hidden_size=HIDDEN, ffn_dim=FFN, num_attention_heads=4,
                     word_embed_proj_dim=HIDDEN, vocab_size=VOCAB, max_position_embeddings=64, dropout=0.0,
                     attention_dropout=0.0, layerdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    return _model("OPTForCausalLM", config), _causal


def falcon(hidden: int = HIDDEN):
    config = _config("FalconConfig", num_hidden_layers=2, hidden_size=hidden, num_attention_heads=4, vocab_size=VOCAB,
                     hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    return _model("FalconForCausalLM", config), _causal


ENCODER = dict(num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=4, vocab_size=VOCAB,
               max_position_embeddings=66, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def roberta():
    config = _config("RobertaConfig", **ENCODER, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return _model("RobertaForMaskedLM", config), _masked


def distilbert():
    config = _config("DistilBertConfig", n_layers=2, dim=HIDDEN, hidden_dim=FFN, n_heads=4, vocab_size=VOCAB,
                     max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, qa_dropout=0.0,
                     seq_classif_dropout=0.0)
    return _model("DistilBertForMaskedLM", config), _masked


def albert():
    config = _config("AlbertConfig", **ENCODER, embedding_size=32, classifier_dropout_prob=0.0)
    return _model("AlbertForMaskedLM", config), _masked


def deberta_v2():
    config = _config("DebertaV2Config", **ENCODER, relative_attention=True, position_buckets=16,
                     pos_att_type=["p2c", "c2p"], max_relative_positions=-1)
    return _model("DebertaV2ForMaskedLM", config), _masked


def t5():
    config = _config("T5Config", num_layers=2, num_decoder_layers=2, d_model=HIDDEN, d_kv=HIDDEN // 4, d_ff=FFN,
                     num_heads=4, vocab_size=VOCAB, dropout_rate=0.0, relative_attention_num_buckets=8, pad_token_id=0,
                     eos_token_id=1, decoder_start_token_id=0)
    return _model("T5ForConditionalGeneration", config), _seq2seq


def bart():
    config = _config("BartConfig", encoder_layers=2, decoder_layers=2, d_model=HIDDEN, encoder_ffn_dim=FFN,
                     decoder_ffn_dim=FFN, encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=VOCAB,
                     max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                     encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                     decoder_start_token_id=2, forced_eos_token_id=None)
    return _model("BartForConditionalGeneration", config), _seq2seq


def mixtral():
    config = _config("MixtralConfig", **DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     router_jitter_noise=0.0, attention_dropout=0.0)
    return _model("MixtralForCausalLM", config), _causal


def qwen2_moe():
    config = _config("Qwen2MoeConfig", **DECODER, num_key_value_heads=2, moe_intermediate_size=FFN // 4,
                     shared_expert_intermediate_size=FFN, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                     attention_dropout=0.0)
    return _model("Qwen2MoeForCausalLM", config), _causal


def _images(size: int = 32) -> Callable[[int, int], dict[str, Any]]:
    def sample(batch: int, length: int) -> dict[str, Any]:
        return {"pixel_values": torch.randn(batch, 3, size, size), "labels": torch.randint(0, 10, (batch,))}
    return sample


def swin():
    config = _config("SwinConfig", image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                     window_size=4, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     drop_path_rate=0.0)
    return _model("SwinForImageClassification", config), _images()


def convnext():
    config = _config("ConvNextConfig", hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32,
                     num_labels=10, drop_path_rate=0.0)
    return _model("ConvNextForImageClassification", config), _images()


def beit():
    config = _config("BeitConfig", num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=FFN,
                     num_attention_heads=4, image_size=32, patch_size=8, num_labels=10, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, drop_path_rate=0.0, use_relative_position_bias=True)
    return _model("BeitForImageClassification", config), _images()


def whisper():
    # The encoder takes exactly 2 * max_source_positions frames: only the batch can be halved.
    config = _config("WhisperConfig", d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, num_mel_bins=16,
                     max_source_positions=16, max_target_positions=32, vocab_size=VOCAB, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
                     pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=0,
                     begin_suppress_tokens=None, suppress_tokens=None)

    def sample(batch: int, length: int) -> dict[str, Any]:
        return {"input_features": torch.randn(batch, 16, 32), "labels": _ids(batch, length // 2)}
    return _model("WhisperForConditionalGeneration", config), sample


SPEECH = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=FFN, conv_dim=(16, 16),
              conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
              vocab_size=32, hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0,
              feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0,
              pad_token_id=0, ctc_loss_reduction="mean")


def _waveform(batch: int, length: int) -> dict[str, Any]:
    """`length` frames of 10 samples (strides 5 and 2). No CTC labels: with them the model's forward
    cannot be traced (`test_ctc_labels_stop_tracing_and_the_error_names_where`), so the planner
    sums the logits."""
    return {"input_values": torch.randn(batch, 10 * length + 10)}


def wav2vec2():
    return _model("Wav2Vec2ForCTC", _config("Wav2Vec2Config", **SPEECH)), _waveform


def mamba():
    # Without the CUDA kernels: the sequential scan (`slow_forward`), a loop over the tokens.
    config = _config("MambaConfig", hidden_size=HIDDEN, state_size=8, num_hidden_layers=2, vocab_size=VOCAB, expand=2,
                     conv_kernel=4, time_step_rank=4, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return _model("MambaForCausalLM", config), _causal


Family = Callable[[], tuple[nn.Module, Callable[[int, int], dict[str, Any]]]]
FAMILIES: dict[str, Family] = {
    # decoder-only
    "mistral": mistral, "phi": phi, "gpt_neox": gpt_neox, "opt": opt, "falcon": falcon,
    # encoder
    "roberta": roberta, "distilbert": distilbert, "albert": albert, "deberta_v2": deberta_v2,
    # encoder-decoder
    "t5": t5, "bart": bart,
    # mixture of experts
    "mixtral": mixtral, "qwen2_moe": qwen2_moe,
    # vision
    "swin": swin, "convnext": convnext, "beit": beit,
    # speech
    "whisper": whisper, "wav2vec2": wav2vec2,
    # state space
    "mamba": mamba,
}

# Image models, and Whisper (its encoder takes exactly 2 * max_source_positions frames): the
# smaller shape halves the batch. The others halve the sequence.
HALF_BATCH = {"swin", "convnext", "beit", "whisper"}

def half_shape(family: str) -> tuple[int, int]:
    return (BATCH // 2, LENGTH) if family in HALF_BATCH else (BATCH, LENGTH // 2)
