"""CHAN's parts (Pan et al., CVPR 2023): the self-attention region encoder (`model.image.kind: selfattention`),
the `none` pooling that keeps a set a set, and the late-interaction similarity (`model.similarity.name: chan`),
each with its settings and builder, registered in `vsekit.registry`. Torch-free (the builders import their
module when called). The caption side is the `bigru` text encoder with the `none` pooling; the loss is the
`triplet` hinge. docs/chan.md says what the release computes and which switches reproduce it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import vsekit.models.image_parts  # noqa: F401  (the built-in parts register first: listings keep them first)
import vsekit.pooling.parts  # noqa: F401
from vsekit.config import ConfigError
from vsekit.registry import MAX_COUNT, Settings, has_fact, register, setting
from vsekit.similarity.parts import scores_sets


@dataclass
class SelfAttentionSettings(Settings):
    selfattn_heads: int = setting(
        8, "selfattention: attention heads (the release hard-codes 8)", rule=">= 1", max=MAX_COUNT
    )
    selfattn_mask_padding: bool = setting(
        False,
        "selfattention: mask the padded regions as attention keys; false = the released CHAN "
        "encoder, which never passes the lengths on, so padded rows attend and are attended and an "
        "embedding depends on its batch's padding width (docs/chan.md)",
    )

    def check(self, where: str, recipe: Any) -> None:
        if recipe.model.embed_dim % self.selfattn_heads:
            raise ConfigError(
                f"model.embed_dim={recipe.model.embed_dim} must be a multiple of "
                f"{where}.selfattn_heads={self.selfattn_heads}"
            )
        if recipe.model.image.views != 1:
            raise ConfigError(f"{where}: the selfattention encoder gives one embedding per image (views: 1)")


@dataclass
class KeepSetSettings(Settings):
    def check(self, where: str, recipe: Any) -> None:
        name = recipe.model.similarity.name
        if not scores_sets(name):
            raise ConfigError(
                f"{where}.name=none keeps sets of vectors, which model.similarity.name={name} "
                "cannot score: name a similarity of sets (chan)"
            )


@dataclass
class ChanSettings(Settings):
    word_pooling: str = setting(
        "lse",
        "chan: how the per-word best-region cosines (VHA coding) become a score: lse (the BiGRU "
        "configurations) | max | mean (the BERT configurations) | sum",
        choices=("lse", "max", "mean", "sum"),
    )
    lse_temperature: float = setting(
        0.1,
        "chan: the LSE pooling's temperature (the release's belta); scores are not multiplied back, "
        "so they are on a ~1/temperature scale",
        rule="a positive finite number",
    )

    def check(self, where: str, recipe: Any) -> None:
        for side in ("image", "text"):
            pooling = getattr(recipe.model, side).pooling.name
            if not has_fact("pooling", pooling, "keeps_sets"):
                raise ConfigError(
                    f"{where}.name=chan scores sets: model.{side}.pooling.name must be none, got {pooling}"
                )


def _selfattention(recipe: Any, spec: Any) -> Any:
    from vsekit.models.chan_image import SelfAttentionImageEncoder

    m = recipe.model
    if spec.img_dim <= 0:
        raise ValueError("a selfattention image encoder needs the feature size (DataSpec.img_dim)")
    return SelfAttentionImageEncoder(spec.img_dim, m.embed_dim, m.image)


def _keep_set(cfg: Any, dim: int) -> Any:
    from vsekit.pooling.keep import KeepSet

    return KeepSet()


def _chan(cfg: Any, embed_dim: int, views: int) -> Any:
    from vsekit.similarity.chan import ChanSimilarity

    return ChanSimilarity(cfg.word_pooling, cfg.lse_temperature)


register(
    "image_encoder",
    "selfattention",
    SelfAttentionSettings,
    build=_selfattention,
    help="precomputed region features -> linear -> a pre-LayerNorm self-attention block with a residual (CHAN)",
)
register(
    "pooling",
    "none",
    KeepSetSettings,
    build=_keep_set,
    help="no pooling: the set itself (padded rows zero), for a similarity of sets (chan)",
    facts={"keeps_sets": True},
)
register(
    "similarity",
    "chan",
    ChanSettings,
    build=_chan,
    help="CHAN's late interaction: per caption word its best region (VHA coding), pooled over the words (LSE)",
    facts={"takes_sets": True},  # scores sets of vectors: both encoders' poolings must be `none`
)
