"""Where a plan is for, and what measuring may use there.

`PlanDevice` is the device a plan is for (the model's, or a named `target` GPU) and whether this
machine can run on it; `measurable_bytes` is how much memory measuring may allocate there: the
device's free memory (host memory for the CPU, `torch.cuda.mem_get_info` for a GPU) less
`MEASURE_MARGIN`. `check_measure` validates `plan(measure=...)`. `release_freed_host_memory`
hands what the C heap holds free back to the OS before a step is measured.

Example:
    >>> plan_device([torch.zeros(1)], None)
    PlanDevice(device=device(type='cpu'), target=None, local=True)
    >>> measurable_bytes(torch.device("cpu")) > 0
    True
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from planner.core import check_choice
from planner.measure.targets import Target, local_target
from planner.measure.targets import target as find_target

MEASURE_MODES = ("auto", "run", "no-run")


# Measuring leaves this share of the device's free memory unused: what else the process and the
# allocator hold meanwhile (caches, fragmentation), which the estimate of what it needs omits.
MEASURE_MARGIN = 0.2


def host_available_bytes() -> int:
    """Host memory available to this process without swapping: Linux's MemAvailable, else the
    free pages the OS reports.

    Example:
        >>> host_available_bytes() > 0
        True
    """
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def measurable_bytes(device: torch.device) -> int:
    """What measuring may allocate on `device`: its free memory (host memory for the CPU,
    `torch.cuda.mem_get_info` for a GPU) less `MEASURE_MARGIN` of it.

    Example:
        >>> measurable_bytes(torch.device("cpu")) > 0
        True
    """
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host_available_bytes()
    return int(free * (1 - MEASURE_MARGIN))


def release_freed_host_memory() -> None:
    """Hand the pages the C heap holds free back to the OS (glibc's `malloc_trim`; elsewhere
    nothing), so that a step run next adds its own resident memory, not memory on top of what
    earlier work freed but the heap kept: on a CPU, tensors below glibc's mmap threshold are
    heap allocations, and the heap keeps what a step frees.

    Example:
        >>> release_freed_host_memory()
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    # (the process's own symbols: glibc's where it is the C library; musl has no malloc_trim)
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


@dataclass(frozen=True)
class PlanDevice:
    """The device a plan is for: `device` (its type decides attention kernels and RNG state
    memory), the named GPU if one was given, and whether this machine can time nodes there."""

    device: torch.device
    target: Target | None
    local: bool

    @property
    def profile_device(self) -> torch.device:
        """The device of the fake tensors sizes are measured on: the plan's, except for a
        CUDA target on a build without CUDA, where fake CUDA tensors abort in autograd: then
        the CPU, with attention swapped for the CUDA kernel (`planner.measure.targets.target_attention`)."""
        if self.local or torch.cuda.is_available():
            return self.device
        return torch.device("cpu")

    @property
    def name(self) -> str:
        return self.target.title if self.target else str(self.device)


def plan_device(tensors: list[torch.Tensor], target: str | Target | None) -> PlanDevice:
    """The device of a plan for `target` (a name from `planner.measure.targets()`, or None: the
    device of the model's tensors; for a model on `meta`, this machine's CUDA device if it has
    one, else its CPU). A named GPU is local only if it is this machine's current CUDA device.

    Example:
        >>> plan_device([torch.zeros(1)], None)
        PlanDevice(device=device(type='cpu'), target=None, local=True)
    """
    if target is not None:
        gpu = find_target(target)
        local = local_target() == gpu
        return PlanDevice(torch.device("cuda", torch.cuda.current_device()) if local else torch.device("cuda"),
                          gpu, local)
    devices = {t.device for t in tensors if t.device.type != "meta"}
    if len(devices) > 1:
        raise ValueError(f"the model and sample are on several devices ({', '.join(map(str, sorted(devices, key=str)))}): "
                         "move them to the device you train on first")
    if devices:
        return PlanDevice(devices.pop(), None, True)
    return PlanDevice(torch.device("cuda" if torch.cuda.is_available() else "cpu"), None, True)


def can_run(tensors: list[torch.Tensor], where: PlanDevice) -> bool:
    return where.local and all(t.device == where.device for t in tensors)


def check_measure(mode: Any) -> str:
    """Validate `measure=`: "auto", "run" or "no-run".

    Example:
        >>> check_measure("no-run")
        'no-run'
    """
    return check_choice("measure", mode, MEASURE_MODES)
