"""Peak-memory readings: max allocated on GPU, peak resident set size (RSS) on CPU."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_bytes() -> int:
    """Peak memory of this process so far: `torch.cuda.max_memory_allocated` on CUDA,
    else the peak RSS (ru_maxrss; KiB on Linux, bytes on macOS)."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
