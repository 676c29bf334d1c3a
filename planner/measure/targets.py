"""The GPUs a plan can be made for, and how long a node would take on one (a roofline estimate).

A plan made on one machine (a laptop, a login node) for another (a node of H100s) cannot time
its nodes where they will run. For a target that is not the local device each node's forward
time is estimated from the ATen calls it makes (seen on fake tensors, `KernelCounter`): per
call, FLOPs over the target's peak dense throughput for the call's dtype, or bytes moved over
its memory bandwidth, whichever is larger (the roofline). Matrix products and attention run on
tensor cores where the dtype allows (bf16/fp16, tf32 only where PyTorch enables it); other
FLOPs on the vector units. Views and metadata calls cost nothing. These are estimates, and
every report, saved plan and CLI output made from them says so.

Attention sizes follow the kernel the target runs, not the one this machine's build picks:
`target_attention` calls the flash kernel for fp16/bf16 without a mask (head dim a multiple of
8, at most 256), else the memory-efficient kernel (both save the output and a log-sum-exp, not
the attention matrix the CPU's math path keeps), except for grouped-query attention, which the
memory-efficient kernel does not take: PyTorch falls back to the math path, matrix and all.

Example:
    >>> from planner import targets
    >>> [t.name for t in targets()][:2]
    ['a100-40gb', 'a100-80gb']
    >>> target("h100").memory_bytes
    80000000000
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

TERA = 1e12
GIGA = 1e9

MATRIX_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "cudnn_convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
})
# Calls that read only the rows they return, not all of their table.
GATHER_OPS = frozenset({"embedding", "index", "index_select", "gather", "take_along_dim"})
NO_KERNEL_OPS = frozenset({"_assert_tensor_metadata", "detach", "alias", "lift_fresh", "sym_size", "sym_stride",
                           "sym_numel", "sym_storage_offset", "_local_scalar_dense", "empty", "empty_strided",
                           "empty_like", "_fused_sdp_choice"})


@dataclass(frozen=True)
class Target:
    """One GPU: peak dense throughput per dtype (TFLOP/s, without sparsity), memory bandwidth
    (GB/s) and memory (GB, 10**9 bytes, as sold: a little below what the device reports, which
    leaves room for the CUDA context).

    Example:
        >>> target("h100").tflops["bfloat16"]
        989.4
    """

    name: str
    title: str
    memory_gb: float
    bandwidth_gb_s: float
    tflops: dict[str, float] = field(hash=False)  # tensor cores: float32 (no TF32), tf32, bfloat16, float16, fp8
    vector_tflops: float = 0.0  # float32 on the CUDA cores: elementwise work and float32 matmuls
    aliases: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GIGA)

    def matrix_tflops(self, dtype: torch.dtype) -> float:
        """Peak for a matrix product in `dtype`: float32 products use TF32 tensor cores only
        where PyTorch allows it (`torch.backends.cuda.matmul.allow_tf32`, off by default)."""
        if dtype in (torch.bfloat16, torch.float16):
            return self.tflops[str(dtype).removeprefix("torch.")]
        if dtype.itemsize == 1 and dtype.is_floating_point:
            return self.tflops.get("fp8", self.tflops["bfloat16"])
        if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
            return self.tflops["tf32"]
        return self.vector_tflops

    def kernel_ms(self, kernel: "KernelCost") -> float:
        """The roofline time of one ATen call on this GPU, in ms."""
        peak = self.matrix_tflops(kernel.dtype) if kernel.matrix else self.vector_tflops
        compute_s = kernel.flops / (peak * TERA) if kernel.flops else 0.0
        memory_s = kernel.bytes_moved / (self.bandwidth_gb_s * GIGA)
        return 1000 * max(compute_s, memory_s)

    def estimate_ms(self, kernels: tuple["KernelCost", ...]) -> float:
        """The roofline forward time of a node's ATen calls, in ms."""
        return sum(self.kernel_ms(kernel) for kernel in kernels)

    def describe(self) -> str:
        return (f"{self.title}: {self.memory_gb:g} GB, {self.bandwidth_gb_s:g} GB/s, "
                f"bf16 {self.tflops['bfloat16']:g} / tf32 {self.tflops['tf32']:g} / fp32 {self.vector_tflops:g} TFLOP/s")


def _gpu(name: str, title: str, memory_gb: float, bandwidth: float, fp32: float, tf32: float, bf16: float,
         fp8: float | None = None, aliases: tuple[str, ...] = ()) -> Target:
    tflops = {"tf32": tf32, "bfloat16": bf16, "float16": bf16, **({"fp8": fp8} if fp8 else {})}
    return Target(name, title, memory_gb, bandwidth, tflops, vector_tflops=fp32, aliases=aliases)


# Vendor datasheets, dense (no structured sparsity) figures.
TARGETS: tuple[Target, ...] = (
    _gpu("a100-40gb", "NVIDIA A100 SXM 40GB", 40, 1555, 19.5, 156, 312, aliases=("a100-40",)),
    _gpu("a100-80gb", "NVIDIA A100 SXM 80GB", 80, 2039, 19.5, 156, 312, aliases=("a100", "a100-80")),
    _gpu("h100-sxm", "NVIDIA H100 SXM 80GB", 80, 3350, 67, 494.7, 989.4, 1978.9, aliases=("h100",)),
    _gpu("h100-pcie", "NVIDIA H100 PCIe 80GB", 80, 2000, 51, 378, 756, 1513),
    _gpu("h200", "NVIDIA H200 SXM 141GB", 141, 4800, 67, 494.7, 989.4, 1978.9),
    _gpu("l4", "NVIDIA L4 24GB", 24, 300, 30.3, 60, 121, 242.5),
    _gpu("rtx-4090", "NVIDIA GeForce RTX 4090 24GB", 24, 1008, 82.6, 82.6, 165.2, 330.3, aliases=("4090",)),
)


def targets() -> tuple[Target, ...]:
    """The built-in GPUs a plan can be made for (`plan(..., target=name)`).

    Example:
        >>> for t in targets(): print(t.name, t.describe())
    """
    return TARGETS


def target(name: str) -> Target:
    """The built-in GPU called `name` (or one of its aliases); ValueError lists the names.

    Example:
        >>> target("h100").title
        'NVIDIA H100 SXM 80GB'
    """
    if isinstance(name, Target):
        return name
    wanted = str(name).lower().replace("_", "-").replace(" ", "-")
    for gpu in TARGETS:
        if wanted == gpu.name or wanted in gpu.aliases:
            return gpu
    names = ", ".join(f"{gpu.name}" + (f" ({', '.join(gpu.aliases)})" if gpu.aliases else "") for gpu in TARGETS)
    raise ValueError(f"target must be one of {names}; not {name!r}")


def local_target() -> Target | None:
    """The built-in entry of this machine's CUDA device, if it has one that the table knows.

    Example:
        >>> local_target()  # on a CPU-only machine
    """
    if not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    device_name = properties.name.lower().replace(" ", "").replace("-", "")
    for gpu in TARGETS:
        model = gpu.title.lower().removeprefix("nvidia").replace("geforce", "").split()
        if model and model[0].replace("-", "") in device_name:
            size_ok = abs(properties.total_memory / GIGA - gpu.memory_gb) < 0.15 * gpu.memory_gb
            form_ok = ("pcie" in device_name) == ("pcie" in gpu.name)
            if size_ok and form_ok:
                return gpu
    return None


@dataclass(frozen=True)
class KernelCost:
    """One ATen call: FLOPs (from `torch.utils.flop_counter`'s formulas), bytes read and
    written, the dtype of its result and whether it is a matrix product (tensor cores)."""

    flops: int
    bytes_moved: int
    dtype: torch.dtype
    matrix: bool


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


class KernelCounter(TorchDispatchMode):
    """Notes a `KernelCost` for every ATen call made while active (on fake tensors too).

    Example:
        >>> with KernelCounter() as counter:
        ...     y = torch.randn(64, 64) @ torch.randn(64, 64)
        >>> counter.kernels[-1].flops
        524288
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[KernelCost] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if func.is_view or name in NO_KERNEL_OPS:
            return out
        packet = func._overloadpacket
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        written = _tensor_bytes(out)
        read = written + _tensor_bytes(args[1:]) if name in GATHER_OPS else _tensor_bytes((args, kwargs))
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        dtype = outputs[0].dtype if outputs else torch.float32
        self.kernels.append(KernelCost(int(flops), read + written, dtype, name in MATRIX_OPS))
        return out


ATTENTION_TARGETS = (torch.ops.aten.scaled_dot_product_attention.default, torch._C._nn.scaled_dot_product_attention)


def target_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    """`scaled_dot_product_attention` as a CUDA GPU runs it in training: the flash kernel for
    fp16/bf16 without a mask (head dim a multiple of 8, at most 256), else the memory-efficient
    kernel, or the math path where key and value have fewer heads than the query (grouped-query
    attention, which the memory-efficient kernel does not take). Called on fake tensors of any
    device: only the sizes of what it returns and saves matter.

    Example:
        >>> out = target_attention(q, k, v, is_causal=True)  # inside FakeTensorMode
    """
    head_dim = query.size(-1)
    flash = (query.dtype in (torch.float16, torch.bfloat16) and attn_mask is None
             and head_dim % 8 == 0 and head_dim <= 256)
    if flash:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if key.size(-3) != query.size(-3):
        # The memory-efficient kernel takes no grouped-query attention: PyTorch runs the math
        # path, which saves the attention probabilities.
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=True)[0]
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)  # additive form
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]


__all__ = ["ATTENTION_TARGETS", "GATHER_OPS", "GIGA", "KernelCost", "KernelCounter", "MATRIX_OPS", "NO_KERNEL_OPS",
           "TARGETS", "TERA", "Target", "local_target", "target", "target_attention", "targets"]
