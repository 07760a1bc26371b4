"""Image–text similarity functions: `sim(image_emb[Ni, ...], text_emb[Nt, D]) -> [Ni, Nt]`.

Evaluation and search call them through `all_pairs`, in shards, so memory stays bounded.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vsekit.config import SimilarityConfig


class CosineSimilarity(nn.Module):
    """Inner product of (already L2-normalised) embeddings."""

    def forward(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        return image_emb @ text_emb.t()


def create_similarity(cfg: SimilarityConfig, embed_dim: int, views: int = 1) -> nn.Module:
    if cfg.name == "cosine":
        if views != 1:
            raise ValueError("multi-view image embeddings need model.similarity.name=aeom")
        return CosineSimilarity()
    if cfg.name == "aeom":
        from vsekit.similarity.aeom import AEOMSimilarity

        return AEOMSimilarity(embed_dim, views, cfg)
    raise ValueError(f"unknown similarity {cfg.name!r}")


@torch.no_grad()
def all_pairs(sim: nn.Module, image_emb: torch.Tensor, text_emb: torch.Tensor, device: torch.device | str = "cpu",
              image_shard: int = 1000, text_shard: int = 5000) -> np.ndarray:  # fmt: skip
    """Full [Ni, Nt] float32 similarity matrix computed shard by shard on `device`."""
    ni, nt = image_emb.shape[0], text_emb.shape[0]
    out = np.empty((ni, nt), dtype=np.float32)
    for i in range(0, ni, image_shard):
        im = image_emb[i : i + image_shard].to(device)
        for j in range(0, nt, text_shard):
            tx = text_emb[j : j + text_shard].to(device)
            out[i : i + image_shard, j : j + text_shard] = sim(im, tx).float().cpu().numpy()
    return out
