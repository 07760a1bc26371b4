"""Losses on an in-batch similarity matrix: each returns (scalar, diagnostics dict).

The names below are imported when first used, so `vsekit.losses.parts` (the losses a recipe may name, their
settings) loads without torch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vsekit import registry

if TYPE_CHECKING:
    from torch import nn

    from vsekit.config import LossConfig
    from vsekit.losses.base import InBatchLoss
    from vsekit.losses.triplet import TripletLoss, positive_mask, triplet_loss

__all__ = ["InBatchLoss", "TripletLoss", "create_loss", "positive_mask", "triplet_loss"]


def create_loss(cfg: LossConfig, image_views: int = 1) -> nn.Module:
    """The loss `cfg` names (a registered one), on an in-batch similarity matrix. `image_views` (the recipe's
    model.image.views) is what AVSE's view regulariser needs to split the image embedding; no loss ever sees the
    model."""
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
