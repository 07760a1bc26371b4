"""The cosine similarity: the inner product of (already L2-normalised) embeddings."""

from __future__ import annotations

import torch
from torch import nn


class CosineSimilarity(nn.Module):
    """Inner product of (already L2-normalised) embeddings."""

    def forward(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        return image_emb @ text_emb.t()
