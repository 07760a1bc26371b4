"""The `none` pooling: the set itself, for similarities that score sets (late interaction, e.g. CHAN).

`pool(features[B, N, D], lengths[B]) -> [B, N, D]` with the padded rows set to zero: a zero row is how a set
embedding marks its padding, so sets of different widths concatenate by padding them with zero rows.
"""

from __future__ import annotations

import torch
from torch import nn

from vsekit.pooling.basic import length_mask


class KeepSet(nn.Module):
    """No pooling: the set, padded rows zeroed (module docstring)."""

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = length_mask(lengths.to(features.device, non_blocking=True), features.shape[1])
        return features.masked_fill(~mask.unsqueeze(-1), 0.0)
