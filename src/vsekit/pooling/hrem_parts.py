"""HREM's encoder pooling as a pooling a recipe names (`model.image.pooling.name: hrem`, and on the text side):
k-max pooling blended with the mean of one transformer layer over the set (`vsekit.pooling.hrem`). Torch-free
(the builder imports its module)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vsekit.pooling.parts import KMaxSettings
from vsekit.registry import MAX_COUNT, register, setting


@dataclass
class HREMPoolSettings(KMaxSettings):
    hrem_heads: int = setting(
        16, "hrem: attention heads of the aggregating transformer layer", rule=">= 1", max=MAX_COUNT
    )
    hrem_residual_weight: float = setting(
        0.8, "hrem: weight of the k-max pooling; the transformer layer's mean gets the rest", rule="in [0, 1]"
    )
    hrem_dropout: float = setting(0.1, "hrem: dropout of the transformer layer in training", rule="in [0, 1]")


def _hrem(cfg: Any, dim: int) -> Any:
    from vsekit.pooling.hrem import HREMPool

    return HREMPool(dim, cfg.hrem_heads, cfg.hrem_residual_weight, cfg.k, cfg.hrem_dropout)


register(
    "pooling",
    "hrem",
    HREMPoolSettings,
    build=_hrem,
    help="HREM's blend: k-max pooling (k) and the mean of one transformer layer over the set",
)
