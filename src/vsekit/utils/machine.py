"""Where a run ran: the CPU model, the vector kernels torch chose on it, the GPU and the torch build.

Under one seed a run repeats bit for bit on one machine, but a CPU with other vector units (AVX2 against
AVX-512) sums in another order, and over many epochs two such runs drift apart; a run records these facts so
that two results can be told apart by machine."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CPUINFO_MAX_BYTES = 1 << 20  # a few KB a core: room for hundreds of cores


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's marketing name (Linux's /proc/cpuinfo), else what `platform` knows."""
    try:
        with cpuinfo.open("rb") as f:
            text = f.read(CPUINFO_MAX_BYTES).decode("utf-8", "replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("model name") and ":" in line:
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def machine_facts(device: torch.device | str = "cpu") -> dict[str, str | int]:
    """JSON-ready facts of this machine for `device`: what decides whether a seeded run repeats elsewhere."""
    import torch  # here, not at the top: `cpu_model` serves verbs that start without torch

    device = torch.device(device)
    facts: dict[str, str | int] = {
        "cpu": cpu_model(),
        "cpu_kernels": str(torch.backends.cpu.get_cpu_capability()),
        "cores": os.cpu_count() or 0,
        "torch": str(torch.__version__),
        "device": str(device),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(device)
        facts["cuda"] = str(torch.version.cuda)
    return facts
