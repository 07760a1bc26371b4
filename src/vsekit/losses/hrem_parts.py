"""HREM's loss as a loss a recipe names (`loss.name: hrem`): the triplet margin plus the settings of its
training-only instance graph (`vsekit.losses.hrem`). Torch-free (the builder imports its module)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vsekit.config import ConfigError
from vsekit.losses.parts import MarginSettings
from vsekit.registry import MAX_COUNT, MAX_WIDTH, register, setting


@dataclass
class HREMSettings(MarginSettings):
    hrem_embed_dim: int | None = setting(
        None,
        "hrem: width of the graph layer, the joint space's; null (the default): model.embed_dim, which a "
        "value given here must equal",
        rule=">= 1",
        max=MAX_WIDTH,
    )
    hrem_heads: int = setting(
        16, "hrem: attention heads of the instance graph layer", rule=">= 1", max=MAX_COUNT
    )
    hrem_cutoff: float = setting(
        1.7,
        "hrem: negatives farther than this distance are never drawn (the release: 1.7 for f30k, 1.9 for coco)",
        rule="a positive finite number",
    )
    hrem_threshold: float = setting(
        0.5, "hrem: share of each row's strongest entries connected in the graph", rule="in (0, 1]"
    )
    hrem_topk: int = setting(
        10, "hrem: K, the region-word maxima the relation MLPs read", rule=">= 1", max=MAX_WIDTH
    )
    hrem_mask_weight: float = setting(
        1.0, "hrem: weight of the relevance bias in the graph's attention", rule=">= 0 and finite"
    )
    hrem_reg_weight: float = setting(
        10.0, "hrem: weight of the KL relation regulariser", rule=">= 0 and finite"
    )
    hrem_warmup_iters: int = setting(
        8000, "hrem: training steps with the base triplet term only, before the graph joins", rule=">= 0"
    )
    hrem_cross_terms: bool = setting(
        True, "hrem: also the (img, cap_gnn) and (img_gnn, cap) triplet terms (the release's cross_loss)"
    )
    hrem_dropout: float = setting(0.1, "hrem: dropout of the graph layer in training", rule="in [0, 1]")

    def check(self, where: str, recipe: Any) -> None:
        width = recipe.model.embed_dim if self.hrem_embed_dim is None else self.hrem_embed_dim
        if width != recipe.model.embed_dim:
            raise ConfigError(
                f"{where}.hrem_embed_dim={self.hrem_embed_dim} must equal model.embed_dim={recipe.model.embed_dim} "
                "(or be left out: null takes model.embed_dim)"
            )
        if width % self.hrem_heads:
            raise ConfigError(f"{where}.hrem_heads={self.hrem_heads} does not divide {where}.hrem_embed_dim")
        t = recipe.train
        refused = [
            k
            for k, on in (
                ("train.grad_cache_chunk", t.grad_cache_chunk > 0),
                ("train.cuda_graph", t.cuda_graph),
                ("train.compile", t.compile),
            )
            if on
        ]
        if refused:
            raise ConfigError(
                f"{where}.name=hrem reads the encoders' local sets in the step: it runs eager only; "
                f"unset {', '.join(refused)}"
            )


def _hrem(cfg: Any) -> Any:
    from vsekit.losses.hrem import HREMLoss

    return HREMLoss(
        cfg.hrem_embed_dim,
        cfg.hrem_heads,
        cfg.margin,
        cfg.hrem_cutoff,
        cfg.hrem_threshold,
        cfg.hrem_topk,
        cfg.hrem_mask_weight,
        cfg.hrem_reg_weight,
        cfg.hrem_warmup_iters,
        cfg.hrem_cross_terms,
        cfg.hrem_dropout,
    )


register(
    "loss",
    "hrem",
    HREMSettings,
    build=_hrem,
    help="HREM's loss: distance-weighted triplets on the embeddings and on their instance-graph versions",
    facts={"model_width_keys": ("hrem_embed_dim",)},
)
