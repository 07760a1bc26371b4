"""Every image against every caption under a similarity, in shards, so memory stays bounded.

A shard of vectors costs its [images x captions] scores; a shard of sets (late interaction, e.g. CHAN: [n, set
size, D] per side) costs [images x captions x regions x words] values, so the shards shrink until that product
stays under `max_values`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


@torch.no_grad()
def all_pairs(
    sim: nn.Module,
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    device: torch.device | str = "cpu",
    image_shard: int = 1000,
    text_shard: int = 5000,
    max_values: int = 2**25,
) -> np.ndarray:
    """Full [Ni, Nt] float32 similarity matrix computed shard by shard on `device` (module docstring)."""
    ni, nt = image_emb.shape[0], text_emb.shape[0]
    image_shard, text_shard = shard_sizes(image_emb, text_emb, image_shard, text_shard, max_values)
    out = np.empty((ni, nt), dtype=np.float32)
    for i in range(0, ni, image_shard):
        im = image_emb[i : i + image_shard].to(device)
        for j in range(0, nt, text_shard):
            tx = text_emb[j : j + text_shard].to(device)
            out[i : i + image_shard, j : j + text_shard] = sim(im, tx).float().cpu().numpy()
    return out


def pair_cost(image_emb: torch.Tensor, text_emb: torch.Tensor) -> int:
    """Values one (image, caption) pair makes: 1 for vectors, set size x set size for sets [n, S, D]."""
    per_image = image_emb[0].numel() // image_emb.shape[-1] if image_emb.ndim > 2 and len(image_emb) else 1
    per_text = text_emb[0].numel() // text_emb.shape[-1] if text_emb.ndim > 2 and len(text_emb) else 1
    return max(1, per_image * per_text)


def shard_sizes(
    image_emb: torch.Tensor, text_emb: torch.Tensor, image_shard: int, text_shard: int, max_values: int
) -> tuple[int, int]:
    """(image shard, caption shard) at most the given ones, halved (captions first) until a shard's
    [images x captions x pair_cost] values fit in `max_values` (at least one pair per shard)."""
    cost = pair_cost(image_emb, text_emb)
    while image_shard * text_shard * cost > max_values and (image_shard > 1 or text_shard > 1):
        if text_shard >= image_shard:
            text_shard = max(1, text_shard // 2)
        else:
            image_shard = max(1, image_shard // 2)
    return image_shard, text_shard
