"""Hugging Face architectures built from a config on the `meta` device: plan a 70B model on a
laptop without downloading or allocating anything.

    ckpt-plan plan hf:llama --config hidden_size=4096,num_hidden_layers=32 --seq 4096 --target h100

`hf:<model_type>` names any architecture `transformers.AutoConfig.for_model` knows (llama,
gpt2, bert, mistral, qwen2, vit, ...); `config` overrides the defaults of its config. The model
gets its task head (causal LM, else masked LM, else image classification, else the bare
model), `use_cache=False`, and the dtype given (else the config's, else float32). The sample
is `input_ids` and `labels` of shape (batch, seq), or `pixel_values` and `labels` for vision
models, on `meta` too.

Example:
    >>> model, sample = build("llama", {"num_hidden_layers": 2}, batch=1, seq=128)
    >>> next(model.parameters()).device
    device(type='meta')
"""
from __future__ import annotations

import ast
from typing import Any

import torch
from torch import nn

PREFIX = "hf:"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError("hf: models need transformers: pip install transformers") from error
    return transformers


def parse_config(text: str | None) -> dict[str, Any]:
    """`key=value,key=value` as a dict: numbers, booleans, None and lists as Python reads
    them, anything else as a string.

    Example:
        >>> parse_config("hidden_size=4096,tie_word_embeddings=False,hidden_act=silu")
        {'hidden_size': 4096, 'tie_word_embeddings': False, 'hidden_act': 'silu'}
    """
    values: dict[str, Any] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"config entry {part!r} is not key=value")
        try:
            values[key.strip()] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            values[key.strip()] = raw.strip()
    return values


def _dtype(name: Any) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; e.g. float32, bfloat16, float16")
    return value


def _head(transformers: Any, config: Any) -> Any:
    """The task class for the config: causal LM, masked LM, image classification, bare model."""
    auto = transformers.models.auto.modeling_auto
    for mapping, cls in ((auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, transformers.AutoModelForCausalLM),
                         (auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, transformers.AutoModelForMaskedLM),
                         (auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
                          transformers.AutoModelForImageClassification)):
        if config.model_type in mapping:
            return cls
    return transformers.AutoModel


def build(model_type: str, overrides: dict[str, Any], batch: int = 1, seq: int = 512,
          dtype: str | torch.dtype | None = None) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Hugging Face model of `model_type` from its config with `overrides`, on the meta
    device, and its training sample (see the module docstring).

    Example:
        >>> model, sample = build("gpt2", {"n_layer": 2}, batch=2, seq=64)
        >>> sample["input_ids"].shape
        torch.Size([2, 64])
    """
    transformers = _transformers()
    overrides = dict(overrides)
    chosen = dtype or overrides.pop("torch_dtype", None) or overrides.pop("dtype", None)
    try:
        config = transformers.AutoConfig.for_model(model_type, **overrides)
    except ValueError as error:
        raise ValueError(f"hf:{model_type}: {str(error).splitlines()[0]}") from None
    if hasattr(config, "use_cache"):
        config.use_cache = False
    cls = _head(transformers, config)
    with torch.device("meta"):
        model = cls.from_config(config)
    model = model.to(_dtype(chosen or "float32")).train()
    if "pixel_values" in getattr(model, "main_input_name", "input_ids"):
        size = getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        pixels = torch.empty(batch, channels, size, size, device="meta", dtype=next(model.parameters()).dtype)
        return model, {"pixel_values": pixels, "labels": torch.zeros(batch, dtype=torch.long, device="meta")}
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}
