"""Values in a saved plan's JSON: the fixed forward arguments (tagged so that tuples, dtypes,
devices and non-finite floats come back as they were), fx node targets as stable strings, and
the document's layout (one line per node, region and state-dict entry).

Example:
    >>> decode_value(json.loads(json.dumps(encode_value((1, torch.float16)))))
    (1, torch.float16)
"""
from __future__ import annotations

import json
from typing import Any

import torch


def target_name(target: Any) -> str:
    """A stable string for an fx node's target: module paths and method names as they are,
    functions by qualified name (`torch.narrow`, `_operator.add`).

    Example:
        >>> target_name(torch.narrow)
        'torch.narrow'
    """
    if isinstance(target, str):
        return target
    try:
        from torch.fx.node import _get_qualified_name

        return _get_qualified_name(target)
    except Exception:  # objects fx cannot name: fall back to what Python says
        module = getattr(target, "__module__", None)
        name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
        return f"{module}.{name}" if module and name else repr(target)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as saved: `dtype_name(torch.bfloat16) == "bfloat16"`."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype a saved name stands for: `dtype_from_name("bfloat16") is torch.bfloat16`."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the saved plan")
    return value


def encode_value(value: Any) -> Any:
    """A fixed forward argument as JSON. Lists, numbers, strings, booleans and None are kept;
    tuples, str-keyed dicts, dtypes, devices and non-finite floats are tagged so they come back
    as they were; anything else is stored as {"unsupported": repr} and cannot be rebuilt.

    Example:
        >>> encode_value((1, None, torch.float16))
        {'tuple': [1, None, {'dtype': 'float16'}]}
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else {"float": repr(value)}
    if isinstance(value, tuple):
        return {"tuple": [encode_value(item) for item in value]}
    if isinstance(value, list):
        return [encode_value(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {"dict": {key: encode_value(item) for key, item in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    return {"unsupported": repr(value), "type": f"{type(value).__module__}.{type(value).__qualname__}"}


class UnsupportedValue(ValueError):
    """A fixed argument that was saved only as its repr and cannot be rebuilt."""


def decode_value(data: Any) -> Any:
    """The inverse of `encode_value`; raises UnsupportedValue for values saved as a repr.

    Example:
        >>> decode_value({"tuple": [1, {"dtype": "float16"}]})
        (1, torch.float16)
    """
    if isinstance(data, list):
        return [decode_value(item) for item in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, payload), = data.items()
        if tag == "tuple":
            return tuple(decode_value(item) for item in payload)
        if tag == "dict":
            return {key: decode_value(item) for key, item in payload.items()}
        if tag == "dtype":
            return dtype_from_name(payload)
        if tag == "device":
            return torch.device(payload)
        if tag == "float":
            return float(payload)
    if "unsupported" in data:
        raise UnsupportedValue(f"{data['unsupported']} (a {data.get('type', 'value')} that JSON cannot hold)")
    raise ValueError(f"cannot read value {data!r} in the saved plan")


def json_text(document: dict[str, Any]) -> str:
    """JSON with one line per top-level field and per item of its lists and mappings (one line
    per node, region and state-dict entry): compact, and readable in a diff."""
    def line(value: Any) -> str:
        return json.dumps(value, separators=(", ", ": "))

    fields = []
    for key, value in document.items():
        if isinstance(value, list) and value:
            body = ",\n".join(f"  {line(item)}" for item in value)
            fields.append(f" {line(key)}: [\n{body}\n ]")
        elif isinstance(value, dict) and value and key != "sample":
            body = ",\n".join(f"  {line(name)}: {line(item)}" for name, item in value.items())
            fields.append(f" {line(key)}: {{\n{body}\n }}")
        else:
            fields.append(f" {line(key)}: {line(value)}")
    return "{\n" + ",\n".join(fields) + "\n}\n"
