"""The mixed precision a plan's step runs under: `plan(..., autocast=torch.bfloat16)`.

A training step under `torch.autocast` (the Trainer's `bf16=True`) holds other tensors than the
float32 step: matrix products save bfloat16 inputs, norms and softmaxes float32 ones, and the
cache holds a low-precision copy of each parameter it casts to the end of forward.
`step_autocast` is the context every step of planning runs in for the plan's device: there,
`torch.autocast(device, dtype)`. A plan for a CUDA GPU made on a machine without CUDA measures
its sizes on CPU fake tensors, where `torch.autocast("cuda")` is off and CPU autocast casts
other ops than CUDA's (it keeps norms and softmaxes in bfloat16): `cuda_autocast_on_cpu` runs
CPU autocast with CUDA's op lists instead, so the sizes are the GPU step's.

How: each ATen op CUDA autocast handles (`CUDA_POLICY`, its lists in PyTorch's
`aten/src/ATen/autocast_mode.h`) gets a kernel at the `AutocastCPU` dispatch key that casts as
CUDA's does; ops that CPU autocast handles and CUDA's does not fall through to the op; matrix
products that both cast to the low precision keep CPU's kernel (and its cache). Registered on
entry, removed on exit. Casts of parameters by the kernels added here are cached as CUDA's are,
until autocast's cache is cleared.

Example:
    >>> with cuda_autocast_on_cpu(torch.bfloat16):
    ...     torch.nn.functional.layer_norm(x.bfloat16(), (8,)).dtype  # float32, as on a GPU
    torch.float32
"""
from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet

from planner.measure.device import PlanDevice

AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

# CUDA autocast's op lists (PyTorch's aten/src/ATen/autocast_mode.h): op name or "name.overload".
LOWER_PRECISION = (
    "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "cudnn_convolution",
    "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
# Float32 output, inputs as they are: the op's `dtype` argument set where the caller left it out.
FLOAT32_OUTPUT = (
    "prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname", "log_softmax.int",
    "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum", "cumsum.dimname", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList", "sum.dim_DimnameList",
)
# norm without a dtype: called as its overload that takes one, with float32.
FLOAT32_APPENDED = {"norm.Scalar": "ScalarOpt_dtype", "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype",
                    "norm.names_ScalarOpt_dim": "names_ScalarOpt_dim_dtype"}
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")
BANNED = ("binary_cross_entropy",)

CUDA_POLICY: dict[str, str] = {
    **dict.fromkeys(LOWER_PRECISION, "lower_precision"), **dict.fromkeys(FLOAT32, "float32"),
    **dict.fromkeys(FLOAT32_OUTPUT, "float32_output"), **dict.fromkeys(FLOAT32_APPENDED, "float32_appended"),
    **dict.fromkeys(PROMOTE, "promote"), **dict.fromkeys(BANNED, "banned"),
}

_AUTOCAST_CPU = DispatchKeySet(DispatchKey.AutocastCPU)


def step_autocast(where: PlanDevice, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """The autocast a step planned for `where` runs under: none without `dtype`, else
    `torch.autocast` for the plan's device, or, for a CUDA plan measured on CPU fake tensors
    (no CUDA here), `cuda_autocast_on_cpu`.

    Example:
        >>> with step_autocast(plan_device([x], None), torch.bfloat16):
        ...     loss = model(x).sum()
    """
    if dtype is None:
        return contextlib.nullcontext()
    if emulates_cuda(where):
        return cuda_autocast_on_cpu(dtype)
    return torch.autocast(where.profile_device.type, dtype=dtype)


def emulates_cuda(where: PlanDevice) -> bool:
    """Whether a step planned for `where` is measured on the CPU for a CUDA device (no CUDA here).

    Example:
        >>> emulates_cuda(plan_device([x], "h100"))  # on a machine without CUDA
        True
    """
    return where.device.type == "cuda" and where.profile_device.type == "cpu"


def autocast_name(dtype: torch.dtype | None) -> str | None:
    """How a plan's record names a dtype: autocast's, FSDP2's `param_dtype` (`check_autocast`,
    `planner.measure.precision.check_param_dtype` read it back).

    Example:
        >>> autocast_name(torch.bfloat16)
        'bfloat16'
    """
    return None if dtype is None else str(dtype).removeprefix("torch.")


def check_autocast(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`plan(autocast=...)`: None, torch.bfloat16 or torch.float16 (or their names).

    Example:
        >>> check_autocast("bfloat16")
        torch.bfloat16
    """
    return low_precision_dtype(dtype, "autocast", "the dtype the step runs matrix products in under torch.autocast",
                               "a float32 step")


def low_precision_dtype(dtype: torch.dtype | str | None, argument: str, meaning: str,
                        none_means: str) -> torch.dtype | None:
    """`dtype` as `plan(<argument>=...)` takes it: None, torch.bfloat16 or torch.float16 (or their
    names); else a ValueError asking for `meaning`.

    Example:
        >>> low_precision_dtype("float16", "param_dtype", "FSDP2's param_dtype", "no cast")
        torch.float16
    """
    if dtype is None or dtype in AUTOCAST_DTYPES.values():
        return dtype  # type: ignore[return-value]
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in AUTOCAST_DTYPES:
        return AUTOCAST_DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"{argument}={dtype!r}: give {meaning}, torch.bfloat16 or torch.float16 (or None for "
                     f"{none_means})")


@contextlib.contextmanager
def cuda_autocast_on_cpu(dtype: torch.dtype) -> Iterator[None]:
    """CPU autocast to `dtype` that casts as CUDA autocast does (see the module docstring).

    Example:
        >>> with cuda_autocast_on_cpu(torch.bfloat16):
        ...     torch.softmax(x.bfloat16(), -1).dtype
        torch.float32
    """
    cache = _CastCache()
    library = torch.library.Library("aten", "IMPL")
    clear = torch.clear_autocast_cache
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            _register(library, dtype, cache)

        def clear_both() -> None:  # (what torch.autocast's exit calls, as the planner's steps do)
            cache.clear()
            clear()

        torch.clear_autocast_cache = clear_both
        with torch.autocast("cpu", dtype=dtype):
            yield
    finally:
        torch.clear_autocast_cache = clear
        library._destroy()
        cache.clear()


def cuda_ops() -> frozenset[str]:
    """The ops CUDA autocast handles in this PyTorch ("name" or "name.overload").

    Example:
        >>> "linear" in cuda_ops()
        True
    """
    return _autocast_ops("AutocastCUDA")


@functools.cache
def _autocast_ops(key: str) -> frozenset[str]:
    return frozenset(name.removeprefix("aten::") for name in torch._C._dispatch_get_all_op_names()
                     if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key))


def _register(library: torch.library.Library, dtype: torch.dtype, cache: _CastCache) -> None:
    cpu, cuda = _autocast_ops("AutocastCPU"), cuda_ops()
    for name in cpu - cuda:
        library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
    for name in cuda:
        policy = CUDA_POLICY.get(name)
        if policy is None:
            raise RuntimeError(f"CUDA autocast handles aten::{name} in this PyTorch, which the planner does not know: "
                               "plan without autocast=, or with a PyTorch it knows (see pyproject.toml)")
        if name in cpu and policy == "lower_precision":
            continue  # (CPU's kernel casts the same way, with autocast's own cache)
        op_name, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, op_name), overload or "default")
        library.impl(name, _kernel(op, name, policy, dtype, cache), "AutocastCPU")


class _CastCache:
    """CUDA autocast's cache of low-precision copies of float32 leaf parameters, for the ops
    whose kernel is added here."""

    def __init__(self) -> None:
        self._casts: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        cacheable = (tensor.dtype == torch.float32 and tensor.requires_grad and tensor.is_leaf
                     and not tensor._is_view() and torch.is_autocast_cache_enabled())
        if not cacheable:
            return tensor.to(dtype)
        held = self._casts.get(id(tensor))
        if held is not None and held[0]() is tensor:
            return held[1]
        cast = tensor.to(dtype)
        self._casts[id(tensor)] = (weakref.ref(tensor), cast)
        return cast

    def clear(self) -> None:
        self._casts.clear()


def _eligible(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64
            and value.device.type == "cpu")


def _cast_all(value: Any, to: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if _eligible(value):
        return to(value)
    if isinstance(value, (list, tuple)) and any(_eligible(item) for item in value):
        return type(value)(to(item) if _eligible(item) else item for item in value)
    return value


def _first_tensor(args: tuple[Any, ...]) -> Any:
    return next((arg for arg in args if isinstance(arg, torch.Tensor)), None)


def _kernel(op: Any, name: str, policy: str, dtype: torch.dtype, cache: _CastCache) -> Callable[..., Any]:
    if policy == "banned":
        def banned(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"aten::{name} is unsafe to autocast on CUDA (PyTorch refuses it there): use "
                               "binary_cross_entropy_with_logits (nn.BCEWithLogitsLoss)")
        return banned
    schema = op._schema.arguments

    def every_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        # (defaults filled in, by position or keyword as the schema takes them: the dtype overload needs them all)
        positional, keywords = list(args), {}
        for argument in schema[len(args):]:
            value = kwargs.get(argument.name, argument.default_value)
            if argument.kwarg_only:
                keywords[argument.name] = value
            else:
                positional.append(value)
        return positional, keywords

    def cast_to(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
        if policy == "lower_precision":
            return lambda t: t if t.dtype == dtype else cache.cast(t, dtype)
        target = torch.float32
        if policy == "promote":  # (the widest floating type among the arguments)
            found = [t.dtype for v in (*args, *kwargs.values())
                     for t in (v if isinstance(v, (list, tuple)) else (v,)) if _eligible(t)]
            target = functools.reduce(torch.promote_types, found[1:], found[0]) if found else target
        return lambda t: t if t.dtype == target else t.to(target)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if policy in ("float32_output", "float32_appended"):
                if not _eligible(_first_tensor(args)):
                    return op(*args, **kwargs)
                positional, keywords = every_argument(args, kwargs)
                if policy == "float32_appended":
                    return getattr(torch.ops.aten.norm, FLOAT32_APPENDED[name])(*positional, dtype=torch.float32)
                if "dtype" in keywords:
                    keywords["dtype"] = torch.float32 if keywords["dtype"] is None else keywords["dtype"]
                else:
                    position = [a.name for a in schema].index("dtype")
                    positional[position] = torch.float32 if positional[position] is None else positional[position]
                return op(*positional, **keywords)
            to = cast_to(args, kwargs)
            return op(*(_cast_all(arg, to) for arg in args), **{k: _cast_all(v, to) for k, v in kwargs.items()})
    return kernel


__all__ = ["AUTOCAST_DTYPES", "CUDA_POLICY", "autocast_name", "check_autocast", "cuda_autocast_on_cpu", "cuda_ops",
           "emulates_cuda", "low_precision_dtype", "step_autocast"]
