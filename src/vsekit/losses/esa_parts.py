"""ESA's SEL loss as a loss a recipe names (`loss.name: sel`): the triplet loss's keys (margin, hardest negative
after the warm-up, same-image masking) over groups of views. Torch-free (the builder imports its module)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vsekit.config import ConfigError
from vsekit.losses.parts import TripletSettings
from vsekit.registry import has_fact, register


@dataclass
class SELSettings(TripletSettings):
    def check(self, where: str, recipe: Any) -> None:
        m = recipe.model
        if not all(has_fact("pooling", side.pooling.name, "makes_views") for side in (m.image, m.text)):
            raise ConfigError(
                f"{where}.name=sel scores groups of views: it needs encoders that make them "
                "(model.image.pooling.name=esa and model.text.pooling.name=esa, recipe esa)"
            )


def _sel(cfg: Any) -> Any:
    from vsekit.losses.esa import SELLoss

    return SELLoss(cfg.margin, cfg.max_violation, cfg.mask_same_image)


register(
    "loss",
    "sel",
    SELSettings,
    build=_sel,
    help="ESA's SEL loss: hinge over groups of views, the hardest positive of each group against the hardest "
    "negative",
    facts={"scores_views": True},
)
