"""Peak memory, measured one way everywhere: the trainer's epoch record and the benchmarks.

On CUDA, `torch.cuda.max_memory_allocated` (tensors the caching allocator handed out; it does not read the
device, so no synchronisation); elsewhere the process's peak resident set size (`ru_maxrss`, the kernel's
high-water mark, which sees torch's CPU allocations), 0 where the `resource` module is missing (Windows)."""

from __future__ import annotations

import os
import sys

import torch

CUDA_PEAK = "CUDA max allocated"
RSS_PEAK = "process peak RSS"


def rss_now_bytes() -> int:
    """Resident set size of this process now (bytes), from /proc/self/statm (0 where there is none)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def rss_peak_bytes() -> int:
    """Peak resident set size of this process so far (bytes)."""
    try:
        import resource
    except ImportError:
        return 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024)  # macOS reports bytes, Linux KiB


def peak_memory_bytes(device: torch.device | str) -> tuple[int, str]:
    """(bytes, what was measured): the peak on `device` so far (CUDA), else this process's peak RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), CUDA_PEAK
    peak = rss_peak_bytes()
    return peak, RSS_PEAK if peak else "unavailable"
