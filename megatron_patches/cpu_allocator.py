"""Keep freed tensor memory in the process on CPU, as CUDA's caching allocator does on GPU.

On CPU every tensor is a glibc `malloc`. glibc serves large blocks with `mmap` and, for
blocks from its heap, hands free space at the top back to the kernel (`trim`); the next
allocation of that size then page-faults every page again and the kernel zeroes it. A
training step allocates and frees the same activation sizes over and over, so whether a
step pays that depends on the order in which tensors happen to be freed: measured on the
benchmark's model (TP=1, one process), Megatron's schedule took 0-5,000 minor page faults
per step and dhelix's operator programs 50,000-107,000, 12-14% of the step. With glibc
keeping what it got (`keep_freed_memory`) both took under 5,000 and the gap fell to 7-12%.

The setting is process-wide and applies to every schedule alike (the benchmark builds
Megatron and every dhelix system in one process). Blocks above 32 MiB (glibc's largest
mmap threshold) are still mapped and unmapped per allocation.

A process started with glibc's thresholds set in its environment (`MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TRIM_THRESHOLD_`) keeps them: the GPU emulation's benchmark sets a 1 MiB mmap
threshold so that never-written kernel outputs are fresh, untouched pages; serving them
from a heap that keeps every page once written made 4 ranks of 2 Llama-8B layers each grow
past 5 GB resident within minutes (the heap's resident part grew every step).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20   # glibc's maximum (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
TRIM_THRESHOLD_BYTES = 2**31 - 1    # give heap memory back only past 2 GiB free at its top


ENVIRONMENT_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Tell glibc to serve allocations up to 32 MiB from its heap and trim it only past 2 GiB free.
    Returns True when applied; False where the C library has no `mallopt` (not glibc) or
    the process's environment sets glibc's thresholds itself (`ENVIRONMENT_SETTINGS`:
    those are kept)."""
    if any(name in os.environ for name in ENVIRONMENT_SETTINGS):
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return ok
