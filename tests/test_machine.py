"""The machine facts a run records: the CPU's name read from /proc/cpuinfo's format, bounded, with fallbacks."""

from __future__ import annotations

import platform

from vsekit.utils.machine import CPUINFO_MAX_BYTES, cpu_model

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu avx2 avx512f

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8488C
"""


def test_cpu_model_reads_the_first_model_name(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(CPUINFO)
    assert cpu_model(f) == "Intel(R) Xeon(R) Platinum 8488C"


def test_cpu_model_without_cpuinfo_falls_back_to_platform(tmp_path):
    expected = platform.processor() or platform.machine() or "unknown"
    assert cpu_model(tmp_path / "missing") == expected
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nfeatures\t: fp asimd\n")  # aarch64 kernels print no model name
    assert cpu_model(f) == expected


def test_cpu_model_reads_a_bounded_prefix(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_bytes(b"x" * CPUINFO_MAX_BYTES + b"\nmodel name\t: past the bound\n")
    assert cpu_model(f) != "past the bound"
