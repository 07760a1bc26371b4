"""Pooling operators with one signature: `pool(features[B,N,D], lengths[B]) -> [B,D]`.

    from vsekit.pooling import GPO
    pooled = GPO()(features, lengths)

The names below are imported when first used, so `vsekit.pooling.parts` (the poolings a recipe may name, their
settings) loads without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vsekit import registry

if TYPE_CHECKING:
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
    """The pooling `cfg.name` names (a registered one), built from its settings; `dim` is the feature size it sees."""
    return registry.get("pooling", cfg.name).build(cfg, dim)


def __getattr__(name: str) -> Any:
    if name in ("AvgPool", "ClsPool", "KMaxPool", "MaxPool", "length_mask", "sort_desc_per_dim"):
        from vsekit.pooling import basic as module
    elif name in ("GPO", "positional_encoding_1d"):
        from vsekit.pooling import gpo as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)
