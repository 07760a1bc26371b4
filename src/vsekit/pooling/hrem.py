"""HREM's aggregation (Fu et al., CVPR 2023, released code `EncoderImageAggr` / `EncoderText_BERT`).

The same on both sides, after the encoder's local features: a blend of (a) the per-dimension mean of the k
largest values (`KMaxPool`, k = 2 in the release) and (b) one transformer layer over the set (padded
positions masked as keys), averaged over the valid positions: `w (a) + (1 - w) (b)`, w = `residual_weight`
(0.8). The encoder L2-normalises the result. Its state-dict keys are the release's `aggr.layers.0.*`.
"""

from __future__ import annotations

import torch
from torch import nn

from vsekit.pooling.basic import KMaxPool, length_mask


class HREMPool(nn.Module):
    """`pool(features [B, N, D], lengths [B]) -> [B, D]`: HREM's max-k + transformer blend (module docstring)."""

    def __init__(
        self, dim: int, heads: int, residual_weight: float, k: int = 2, dropout: float = 0.1
    ) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"HREM pooling: width {dim} is not divisible by {heads} attention heads")
        layer = nn.TransformerEncoderLayer(d_model=dim, nhead=heads, dim_feedforward=dim, dropout=dropout)
        # sequence-first, as the release builds it (and its keys: aggr.layers.0.*)
        self.aggr = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.kmax = KMaxPool(k)
        self.residual_weight = residual_weight

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        lengths = lengths.to(features.device, non_blocking=True)
        valid = length_mask(lengths, features.shape[1])
        out = self.aggr(features.transpose(0, 1), src_key_padding_mask=~valid).transpose(0, 1)
        weights = valid.unsqueeze(-1).to(out.dtype)
        mean = (out * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        w = self.residual_weight
        return w * self.kmax(features, lengths) + (1.0 - w) * mean
