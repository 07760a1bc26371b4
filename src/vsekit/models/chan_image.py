"""CHAN's region encoder (Pan et al., CVPR 2023, ppanzx/CHAN `precomp_enc_type=selfattention`).

Precomputed region features -> linear -> one pre-LayerNorm multi-head self-attention block with a residual
(`h + MHA(LN(h))`) -> the recipe's pooling (then the model's L2 normalisation). With the `none` pooling the image stays a set
of region vectors (padded rows zero), which CHAN's late-interaction similarity scores.

The released encoder never hands the region lengths to its attention: padded rows (the linear layer's bias)
attend and are attended, so an embedding depends on how far its batch is padded. `selfattn_mask_padding:
false` reproduces that (the default, for imported runs and the release's numbers); `true` masks the padded
keys, so each image's embedding is its own whatever the batch.
"""

from __future__ import annotations

import torch
from torch import nn

from vsekit.config import ImageEncoderConfig
from vsekit.models.image import xavier_linear
from vsekit.pooling import create_pooling, length_mask


class PreNormSelfAttention(nn.Module):
    """`x + MHA(LN(x))` over the set (LayerNorm eps 1e-5, no dropout); `key_padding_mask` True = ignored key."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        q = self.ln(x)
        out, _ = self.attn(q, q, q, key_padding_mask=key_padding_mask, need_weights=False)
        return x + out


class SelfAttentionImageEncoder(nn.Module):
    """Region features [B, R, D] (+ lengths) -> pooled embeddings; with the `none` pooling the set [B, R, E]."""

    def __init__(
        self,
        img_dim: int,
        embed_dim: int,
        cfg: ImageEncoderConfig,
    ) -> None:
        super().__init__()
        if embed_dim % cfg.selfattn_heads:
            raise ValueError(
                f"model.embed_dim={embed_dim} is not a multiple of selfattn_heads={cfg.selfattn_heads}"
            )
        self.fc = xavier_linear(img_dim, embed_dim)
        self.attend = PreNormSelfAttention(embed_dim, cfg.selfattn_heads)
        self.mask_padding = bool(cfg.selfattn_mask_padding)
        self.pool = create_pooling(cfg.pooling, embed_dim)

    def embed_set(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, R, E] region vectors before pooling, padded rows zero."""
        mask = length_mask(lengths.to(feats.device, non_blocking=True), feats.shape[1])
        h = self.attend(self.fc(feats), key_padding_mask=~mask if self.mask_padding else None)
        return h.masked_fill(~mask.unsqueeze(-1), 0.0)

    def forward(
        self, feats: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        lengths = lengths.to(feats.device, non_blocking=True)
        return self.pool(self.embed_set(feats, lengths), lengths)
