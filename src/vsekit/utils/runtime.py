"""Device choice and seeding helpers (no global state beyond what torch itself keeps)."""

from __future__ import annotations

import random

import numpy as np
import torch


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available on this machine")
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
