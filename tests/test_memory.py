"""vsekit.utils.memory against the kernel's own accounting in /proc/self/status (Linux)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from vsekit.utils.memory import RSS_PEAK, peak_memory_bytes, rss_now_bytes, rss_peak_bytes

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status", encoding="ascii"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


@linux
def test_peak_rss_is_the_kernels_high_water_mark():
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB touched: the high-water mark is at least this far up
    before = _status_kib("VmHWM") * 1024
    peak = rss_peak_bytes()
    after = _status_kib("VmHWM") * 1024
    # getrusage's maximum is updated lazily (at page-table teardown and fault points), VmHWM also takes the
    # current RSS: equal but for the growth since the last update (a few hundred KiB here), never above it
    assert 0.99 * before <= peak <= after and peak >= block.nbytes
    again, measured = peak_memory_bytes("cpu")
    assert measured == RSS_PEAK and again >= peak  # a high-water mark does not go down


@linux
def test_rss_now_is_the_kernels_resident_size():
    before = _status_kib("VmRSS") * 1024
    now = rss_now_bytes()
    after = _status_kib("VmRSS") * 1024
    page = 4096 * 64  # the two files are read at different instants: allow a few pages of drift
    assert min(before, after) - page <= now <= max(before, after) + page
