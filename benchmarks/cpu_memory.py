"""Keep freed memory in the process, as the CUDA caching allocator does, for CPU timings.

By default glibc's malloc serves large blocks with fresh `mmap`s and hands freed memory at the
top of the heap back to the kernel, so every training step page-faults its activations in
again: the cost grows with the step's peak, so the unplanned step pays more of it than a
planned one, and a plan's overhead measures below what its recomputation costs. A GPU keeps
its memory in PyTorch's caching allocator and pays no such toll; timing benchmarks call
`retain_freed_memory()` first so the CPU clock measures the same thing.

Example:
    >>> retain_freed_memory()
    True
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def retain_freed_memory() -> bool:
    """Make glibc keep what it frees (no `mmap`ed blocks, no trimming of the heap). Returns
    False, and logs why, where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError) as error:
        logger.warning("freed memory goes back to the OS here: no glibc mallopt (%s)", error)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # mallopt returns 1 on success; the trim threshold is an int, so take the largest one.
    applied = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not applied:
        logger.warning("glibc refused mallopt: freed memory may still go back to the OS")
    return applied


def memory_kept(retained: bool) -> str:
    """The sentence a benchmark's table note says about freed memory, given what
    `retain_freed_memory()` returned.

    Example:
        >>> memory_kept(False)
        "glibc's malloc as it is (freed memory goes back to the OS)."
    """
    if retained:
        return "Freed memory kept in the process, as CUDA's caching allocator keeps it (`benchmarks/cpu_memory.py`)."
    return "glibc's malloc as it is (freed memory goes back to the OS)."
