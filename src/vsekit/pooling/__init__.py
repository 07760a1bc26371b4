"""Pooling operators with one signature: `pool(features[B,N,D], lengths[B]) -> [B,D]`.

    from vsekit.pooling import GPO
    pooled = GPO()(features, lengths)
"""

from __future__ import annotations

from torch import nn

from vsekit.config import PoolingConfig
from vsekit.pooling.basic import AvgPool, ClsPool, KMaxPool, MaxPool, length_mask, sort_desc_per_dim
from vsekit.pooling.gpo import GPO, positional_encoding_1d

__all__ = [
    "GPO",
    "AvgPool",
    "ClsPool",
    "KMaxPool",
    "MaxPool",
    "create_pooling",
    "length_mask",
    "positional_encoding_1d",
    "sort_desc_per_dim",
]


def create_pooling(cfg: PoolingConfig, dim: int) -> nn.Module:
    """Build a pooling module by name from its config; `dim` is the feature size it will see."""
    if cfg.name == "avg":
        return AvgPool()
    if cfg.name == "max":
        return MaxPool()
    if cfg.name == "kmax":
        return KMaxPool(cfg.k)
    if cfg.name == "cls":
        return ClsPool()
    if cfg.name == "gpo":
        return GPO(cfg.d_pe, cfg.d_hidden, cfg.temperature)
    if cfg.name == "adpool":
        from vsekit.pooling.adpool import ADPool

        return ADPool(dim, token_level=cfg.token_level, embedding_level=cfg.embedding_level, variant=cfg.adpool_variant,
                      mask_padding=cfg.adpool_mask_padding)
    raise ValueError(f"unknown pooling {cfg.name!r}")
