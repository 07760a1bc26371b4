"""Losses on an in-batch similarity matrix: each returns (scalar, diagnostics dict).

The names below are imported when first used, so `vsekit.losses.parts` (the losses a recipe may name, their
settings) loads without torch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vsekit import registry
from vsekit.config import ModelConfig

if TYPE_CHECKING:
    from torch import nn

    from vsekit.config import LossConfig
    from vsekit.losses.base import InBatchLoss
    from vsekit.losses.triplet import TripletLoss, positive_mask, triplet_loss

__all__ = ["InBatchLoss", "TripletLoss", "create_loss", "positive_mask", "triplet_loss"]


def create_loss(cfg: LossConfig, image_views: int = 1, embed_dim: int | None = None) -> nn.Module:
    """The loss `cfg` names (a registered one), on an in-batch similarity matrix. `image_views` (the recipe's
    model.image.views) is what AVSE's view regulariser needs to split the image embedding; `embed_dim` (the
    recipe's model.embed_dim) fills the loss's width settings left null (its fact `model_width_keys`: HREM's
    graph layer); no loss ever sees the model."""
    unset = [k for k in registry.fact("loss", cfg.name, "model_width_keys", ()) if getattr(cfg, k) is None]
    if unset:
        cfg = dataclasses.replace(cfg)
        for k in unset:  # without a recipe's width: the one a recipe without model.embed_dim has
            setattr(cfg, k, ModelConfig().embed_dim if embed_dim is None else embed_dim)
    if cfg.view_reg_weight > 0:  # AVSE: the named loss + the dimension-wise view regulariser
        from vsekit.losses.view_reg import ViewRegularisedLoss

        base = create_loss(dataclasses.replace(cfg, view_reg_weight=0.0))
        return ViewRegularisedLoss(
            base, cfg.view_reg_weight, cfg.view_reg_offdiag, cfg.view_reg_variant, image_views
        )
    return registry.get("loss", cfg.name).build(cfg)


def __getattr__(name: str) -> Any:
    if name in ("TripletLoss", "positive_mask", "triplet_loss"):
        from vsekit.losses import triplet as module
    elif name == "InBatchLoss":
        from vsekit.losses import base as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)
