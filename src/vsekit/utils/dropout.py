"""Dropout that draws from a given generator, so a training step's masks follow from (seed, epoch, step) and a
resumed run draws the same ones (torch's `nn.Dropout` draws from the global generator)."""

from __future__ import annotations

import torch
from torch import nn


def seeded_dropout(
    x: torch.Tensor, p: float, training: bool, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Inverted dropout of rate `p` (kept values scaled by 1 / (1 - p)) when `training`, else `x` unchanged.
    Without a generator (a direct call outside the training step) torch's global generator draws."""
    if not training or p <= 0:
        return x
    if generator is None:
        return nn.functional.dropout(x, p, training=True)
    keep = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32) >= p
    return x * keep.to(x.dtype) / (1.0 - p)
