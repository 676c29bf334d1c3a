"""The command line's models and samples: `MODEL` (a built-in example or
`package.module:factory`, `load_model`; `hf:TYPE`, `load_hf_model`), `--sample` resizing
(`parse_shapes`, `resize_sample`) and `--device` (`to_device`), with one-line errors
(`UsageError`, `FactoryError`).

Hugging Face architectures are built from a config on the `meta` device (`build`): plan a 70B
model on a laptop without downloading or allocating anything. Where the command runs steps
(`--verify`, `throughput`) or names `--device`, they are built there with random weights.

    ckpt-plan plan hf:llama --config hidden_size=4096,num_hidden_layers=32 --seq 4096 --target h100

`hf:<model_type>` names any architecture `transformers.AutoConfig.for_model` knows (llama,
gpt2, bert, mistral, qwen2, vit, ...); `config` overrides the defaults of its config
(`parse_config`). The model gets its task head (causal LM, else masked LM, else image
classification, else the bare model), `use_cache=False`, and the dtype given (else the
config's, else float32). The sample is `input_ids` and `labels` of shape (batch, seq), or
`pixel_values` and `labels` for vision models, on `meta` too.

Example:
    >>> model, sample = load_model("mlp")
    >>> resize_sample(sample, parse_shapes("8x256")).shape
    torch.Size([8, 256])
    >>> model, sample = build("llama", {"num_hidden_layers": 2}, batch=1, seq=128)
    >>> next(model.parameters()).device
    device(type='meta')
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from planner.core import split_sample
from planner.examples import EXAMPLES

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
          dtype: str | torch.dtype | None = None, device: str | torch.device = "meta"
          ) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Hugging Face model of `model_type` from its config with `overrides`, on `device`
    (`meta`: nothing allocated; elsewhere random weights), and its training sample (see the
    module docstring).

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
    with torch.device(device):
        model = cls.from_config(config)
    model = model.to(_dtype(chosen or "float32")).train()
    if "pixel_values" in getattr(model, "main_input_name", "input_ids"):
        size = getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        pixels = torch.randn(batch, channels, size, size, device=device, dtype=next(model.parameters()).dtype)
        return model, {"pixel_values": pixels, "labels": torch.zeros(batch, dtype=torch.long, device=device)}
    ids = torch.randint(0, getattr(config, "vocab_size", 2), (batch, seq), device=device)
    return model, {"input_ids": ids, "labels": ids}


class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit status 2."""


class FactoryError(Exception):
    """The MODEL factory itself raised: reported in one line, exit status 1."""


def _import_module(module_name: str, spec: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise UsageError(f"MODEL {spec!r}: no file {module_name!r}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise UsageError(f"MODEL {spec!r}: cannot import {module_name!r} as a Python file")
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as error:
            raise UsageError(f"MODEL {spec!r}: running {module_name!r} failed: {type(error).__name__}: {error}") from error
        return module
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:  # console scripts do not put the current directory on the path; python -m does
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise UsageError(f"MODEL {spec!r}: cannot import module {module_name!r} ({error})") from error
        raise UsageError(f"MODEL {spec!r}: importing module {module_name!r} failed: {error}") from error
    except Exception as error:
        raise UsageError(
            f"MODEL {spec!r}: importing module {module_name!r} failed: {type(error).__name__}: {error}"
        ) from error
    finally:
        if added:
            sys.path.remove(cwd)


def load_hf_model(spec: str, args: argparse.Namespace, device: str = "meta") -> tuple[nn.Module, Any]:
    """Build `hf:TYPE` from `--config`, `--batch`, `--seq` and `--dtype` (see `build`) on
    `device`.

    Example:
        >>> load_hf_model("hf:gpt2", build_parser().parse_args(["plan", "hf:gpt2", "--target", "h100"]))
    """
    try:
        overrides = parse_config(args.config)
        return build(spec.removeprefix(PREFIX), overrides, batch=args.batch, seq=args.seq or 512, dtype=args.dtype,
                     device=device)
    except ImportError as error:
        raise UsageError(f"MODEL {spec!r}: {error}") from None
    except (ValueError, TypeError) as error:
        raise UsageError(f"MODEL {spec!r}: {first_line(error)}") from None


def load_model(spec: str) -> tuple[nn.Module, Any]:
    """Build `(model, sample)` from a MODEL argument: a built-in example name or
    `package.module:factory` (dotted attributes allowed after the colon).

    Raises UsageError with a one-line message naming what is wrong: the module cannot be
    imported, the attribute is missing, not callable or needs arguments, or the factory does
    not return `(model, sample)`. FactoryError wraps an error raised inside the factory.

    Example:
        >>> model, sample = load_model("mlp")
        >>> model, sample = load_model("mypackage.models:tiny_gpt")
    """
    if spec in EXAMPLES:
        return EXAMPLES[spec]()
    if ":" not in spec:
        raise UsageError(
            f"MODEL {spec!r} is neither a built-in example ({', '.join(sorted(EXAMPLES))}) "
            "nor package.module:factory"
        )
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise UsageError(f"MODEL {spec!r}: give it as package.module:factory")
    factory: Any = _import_module(module_name, spec)
    walked = module_name
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise UsageError(f"MODEL {spec!r}: {walked!r} has no attribute {part!r}")
        factory = getattr(factory, part)
        walked = f"{walked}:{part}" if walked == module_name else f"{walked}.{part}"
    if not callable(factory):
        raise UsageError(f"MODEL {spec!r} is a {type(factory).__name__}, not a callable that returns (model, sample)")
    try:
        inspect.signature(factory).bind()
    except TypeError:
        parameters = inspect.signature(factory).replace(return_annotation=inspect.Signature.empty)
        raise UsageError(f"MODEL {spec!r}: {attribute}{parameters} needs arguments; "
                         "name a factory that takes none") from None
    except ValueError:  # no signature to inspect (some builtins): just call it
        pass
    try:
        result = factory()
    except Exception as error:
        raise FactoryError(f"MODEL {spec!r}: {attribute}() failed: {type(error).__name__}: {first_line(error)}") from error
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        got = (f"a tuple of {len(result)}" if isinstance(result, tuple) and len(result) != 2
               else f"({type(result[0]).__name__}, ...)" if isinstance(result, tuple) else f"a {type(result).__name__}")
        raise UsageError(f"MODEL {spec!r}: {attribute}() must return (model, sample) with an nn.Module model, "
                         f"not {got}")
    try:
        split_sample(result[1])
    except TypeError as error:
        raise UsageError(f"MODEL {spec!r}: {attribute}() returned a sample that cannot be used: {error}") from None
    return result


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """Shapes from `--sample`: dims joined by `x`, shapes by commas.

    Example:
        >>> parse_shapes("8x128,8x128")
        [(8, 128), (8, 128)]
    """
    shapes = []
    for part in text.split(","):
        try:
            shape = tuple(int(dim) for dim in part.strip().lower().split("x"))
        except ValueError:
            shape = ()
        if not shape or any(dim <= 0 for dim in shape):
            raise UsageError(f"--sample {text!r}: {part!r} is not a shape like 8x128 (positive dims joined by x)")
        shapes.append(shape)
    return shapes


def _like(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor of `shape` with `tensor`'s dtype, device and kind of values."""
    options = {"dtype": tensor.dtype, "device": tensor.device}
    if tensor.is_floating_point() or tensor.is_complex():
        return torch.randn(shape, **options)
    if tensor.dtype == torch.bool:
        return torch.randint(0, 2, shape, device=tensor.device).bool()
    if tensor.numel() == 0:
        return torch.zeros(shape, **options)
    return torch.randint(int(tensor.min()), int(tensor.max()) + 1, shape, **options)


def resize_sample(sample: Any, shapes: list[tuple[int, ...]]) -> Any:
    """Replace the sample's tensors (top level, in order) by new ones of the given shapes.

    Example:
        >>> resize_sample(torch.randint(0, 512, (8, 128)), [(2, 64)]).shape
        torch.Size([2, 64])
    """
    args, kwargs = split_sample(sample)
    slots = [("arg", i) for i, v in enumerate(args) if isinstance(v, torch.Tensor)]
    slots += [("kwarg", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    if len(shapes) != len(slots):
        raise UsageError(f"--sample gives {len(shapes)} shape(s) but the model's sample has {len(slots)} tensor(s)")
    new_args, new_kwargs = list(args), dict(kwargs)
    for (kind, key), shape in zip(slots, shapes):
        old = args[key] if kind == "arg" else kwargs[key]
        if len(shape) != old.dim():
            raise UsageError(
                f"--sample {'x'.join(map(str, shape))}: the sample's tensor is "
                f"{'x'.join(map(str, old.shape))} ({old.dim()} dims); give {old.dim()} dims"
            )
        if kind == "arg":
            new_args[key] = _like(old, shape)
        else:
            new_kwargs[key] = _like(old, shape)
    if isinstance(sample, torch.Tensor):
        return new_args[0]
    if isinstance(sample, dict):
        return new_kwargs
    return type(sample)(new_args) if isinstance(sample, list) else tuple(new_args)


def to_device(model: nn.Module, sample: Any, name: str) -> tuple[nn.Module, Any]:
    try:
        device = torch.device(name)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:
        raise UsageError(f"--device {name!r} cannot be used here: {first_line(error)}") from None
    args, kwargs = split_sample(sample)
    move = lambda value: value.to(device) if isinstance(value, torch.Tensor) else value  # noqa: E731
    if isinstance(sample, torch.Tensor):
        moved: Any = move(sample)
    elif isinstance(sample, dict):
        moved = {key: move(value) for key, value in kwargs.items()}
    else:
        moved = tuple(move(value) for value in args)
    return model.to(device), moved


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


__all__ = ["FactoryError", "PREFIX", "UsageError", "build", "first_line", "load_hf_model", "load_model", "parse_config",
           "parse_shapes", "resize_sample", "to_device"]
