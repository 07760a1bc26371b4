"""Parameter-free poolings. Every pooling shares one signature: `pool(features[B,N,D], lengths[B]) -> [B,D]`.

Rows at positions >= length are padding and never influence the result.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def length_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_len] bool, True where a position holds a real element."""
    positions = torch.arange(max_len, device=lengths.device)
    return positions.unsqueeze(0) < lengths.unsqueeze(1)


def sort_values_desc(values: torch.Tensor) -> torch.Tensor:
    """`values` [B, N, D] sorted along N, largest first, differentiable (like `sort(dim=1).values`).

    On CPU, torch.sort over a short middle dimension is slow (a [128, 49, 512] batch: ~220 ms forward and
    backward, most of a GPO training step on 2 cores). numpy's argsort over the transposed, contiguous copy
    finds the same order (up to ties, which hold equal values, so the values are identical) and a gather
    along the last dimension carries the gradient: about 2x faster. Other devices and dtypes, and code being
    compiled (numpy is outside the graph), use torch.sort.
    """
    if (
        values.device.type != "cpu"
        or values.dtype not in (torch.float32, torch.float64)
        or values.numel() == 0
        or torch.compiler.is_compiling()
    ):
        return values.sort(dim=1, descending=True).values
    by_dim = values.transpose(1, 2).contiguous()  # [B, D, N]
    keys = np.negative(by_dim.detach().numpy())
    order = torch.from_numpy(np.argsort(keys, axis=-1))
    return by_dim.gather(2, order).transpose(1, 2)


def sort_desc_per_dim(features: torch.Tensor, lengths: torch.Tensor, fill: float = -1e4) -> torch.Tensor:
    """Sort each dimension independently, largest first; padded rows come out as zeros at the end."""
    mask = length_mask(lengths, features.shape[1]).unsqueeze(-1)
    ordered = sort_values_desc(features.masked_fill(~mask, fill))
    return ordered.masked_fill(~mask, 0.0)


class AvgPool(nn.Module):
    """Mean over the valid elements (VSE++'s pooling in the VSE∞ comparison)."""

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = length_mask(lengths, features.shape[1]).unsqueeze(-1).to(features.dtype)
        return (features * mask).sum(1) / mask.sum(1).clamp_min(1.0)


class MaxPool(nn.Module):
    """Per-dimension maximum over the valid elements."""

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = length_mask(lengths, features.shape[1]).unsqueeze(-1)
        return features.masked_fill(~mask, float("-inf")).amax(1)


class KMaxPool(nn.Module):
    """Per-dimension mean of the k largest values (k clipped to each set's size)."""

    def __init__(self, k: int = 1) -> None:
        super().__init__()
        if k < 1:
            raise ValueError("k must be >= 1")
        self.k = k

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        ordered = sort_desc_per_dim(features, lengths)
        k_eff = lengths.to(features.device, non_blocking=True).clamp(max=self.k, min=1)
        take = length_mask(k_eff, ordered.shape[1]).unsqueeze(-1).to(features.dtype)
        return (ordered * take).sum(1) / k_eff.unsqueeze(-1).to(features.dtype)


class ClsPool(nn.Module):
    """The first element ([CLS] for transformers)."""

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return features[:, 0]
