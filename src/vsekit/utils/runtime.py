"""Device choice and seeding helpers (no global state beyond what torch itself keeps)."""

from __future__ import annotations

import random

import numpy as np
import torch

from vsekit.errors import SetupError, check_device_name


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """auto = cuda when available, else cpu; a name that is no device, or a CUDA device on a machine without
    CUDA, is an input error naming the valid choices (cpu, cuda, cuda:N, mps, auto)."""
    name = check_device_name(str(name))
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SetupError(
            f"device {name!r} requested but CUDA is not available on this machine; use --device cpu"
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SetupError(
            f"device {name!r} requested but this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise SetupError(
            f"device {name!r} requested but MPS is not available on this machine; use --device cpu"
        )
    return device


def seed_everything(seed: int) -> None:
    """Seed the libraries' default generators (module init uses them); data order and augmentation
    use their own generators derived from (seed, epoch, index)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def derived_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (seed, epoch, step...)."""
    h = 1469598103934665603
    for p in parts:
        h ^= int(p) & 0xFFFFFFFFFFFFFFFF
        h = (h * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF
