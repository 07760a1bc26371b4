"""Losses on an in-batch similarity matrix: each returns (scalar, diagnostics dict)."""

from __future__ import annotations

from torch import nn

from vsekit.config import LossConfig
from vsekit.losses.triplet import TripletLoss, positive_mask, triplet_loss

__all__ = ["TripletLoss", "create_loss", "positive_mask", "triplet_loss"]


def create_loss(cfg: LossConfig) -> nn.Module:
    if cfg.view_reg_weight > 0:  # AVSE: the named loss + the dimension-wise view regulariser
        from vsekit.losses.view_reg import create_view_reg_loss

        return create_view_reg_loss(cfg)
    if cfg.name == "triplet":
        return TripletLoss(cfg.margin, cfg.max_violation, cfg.mask_same_image)
    if cfg.name in ("adopt", "infonce"):
        from vsekit.losses.adopt import create_adopt_loss

        return create_adopt_loss(cfg)
    if cfg.name in ("ladder", "ladder_auto"):
        from vsekit.losses.ladder import create_ladder_loss

        return create_ladder_loss(cfg)
    raise ValueError(f"unknown loss {cfg.name!r}")
