"""Losses on an in-batch similarity matrix: each returns (scalar, diagnostics dict)."""

from __future__ import annotations

import dataclasses

from torch import nn

from vsekit.config import LossConfig
from vsekit.losses.triplet import TripletLoss, positive_mask, triplet_loss

__all__ = ["TripletLoss", "create_loss", "positive_mask", "triplet_loss"]


def create_loss(cfg: LossConfig, image_views: int = 1) -> nn.Module:
    """The loss `cfg` names, on an in-batch similarity matrix. `image_views` (the recipe's model.image.views)
    is what AVSE's view regulariser needs to split the image embedding; no loss ever sees the model."""
    if cfg.view_reg_weight > 0:  # AVSE: the named loss + the dimension-wise view regulariser
        from vsekit.losses.view_reg import ViewRegularisedLoss

        base = create_loss(dataclasses.replace(cfg, view_reg_weight=0.0))
        return ViewRegularisedLoss(base, cfg.view_reg_weight, cfg.view_reg_offdiag, cfg.view_reg_variant, image_views)
    if cfg.name == "triplet":
        return TripletLoss(cfg.margin, cfg.max_violation, cfg.mask_same_image)
    if cfg.name in ("adopt", "infonce"):
        from vsekit.losses.adopt import create_adopt_loss

        return create_adopt_loss(cfg)
    if cfg.name in ("ladder", "ladder_auto"):
        from vsekit.losses.ladder import create_ladder_loss

        return create_ladder_loss(cfg)
    raise ValueError(f"unknown loss {cfg.name!r}")
