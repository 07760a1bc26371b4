"""ESA's aggregator as a pooling a recipe names (`model.image.pooling.name: esa`, `model.text.pooling.name: esa`),
with its settings; on precomputed region features and on BiGRU captions it brings ESA's own encoders, which make
two views of each item in training (`vsekit.models.esa`), registered as the pooling's `encoders`. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import vsekit.pooling.parts  # noqa: F401  (the built-in poolings register first: listings keep their order)
from vsekit import registry
from vsekit.config import ConfigError
from vsekit.registry import Settings, has_fact, register, setting


@dataclass
class ESAPoolSettings(Settings):
    esa_mask_padding: bool = setting(
        True,
        "esa: the per-channel softmax runs over each set's own vectors; false = the released image "
        "encoder, whose softmax (and BatchNorm) also take the batch's zero padding, so an image's embedding "
        "depends on how far its batch is padded (imported ESA runs set it on the image side; BUTD's 36 "
        "regions are never padded, where both agree)",
    )
    esa_region_drop: float = setting(
        0.2,
        "esa, image side, training: each of an image's two views leaves out each region with this "
        "probability (the release: kept when U >= 0.2)",
        rule="in [0, 1]",
    )
    esa_word_dropout: float = setting(
        0.1,
        "esa, caption side, training: dropout on the word embeddings (the release's 0.1)",
        rule="in [0, 1]",
    )
    esa_caption_augment: float = setting(
        0.2,
        "esa, caption side, training: each of a caption's two copies masks, replaces or deletes each "
        "token with this probability (the data path's rule; data.text_augment_prob must be 0)",
        rule="in [0, 1]",
    )

    def check(self, where: str, recipe: Any) -> None:
        for key in ("esa_region_drop", "esa_word_dropout"):
            if getattr(self, key) >= 1:
                raise ConfigError(f"{where}.{key} must be below 1 (it is a probability of leaving out)")
        scores_views = has_fact("loss", recipe.loss.name, "scores_views")
        if makes_views(where, recipe) and not scores_views:
            raise ConfigError(
                f"{where}.name=esa makes two views of each item in training, which only loss.name=sel scores "
                "(recipe esa)"
            )
        if makes_views(where, recipe) and scores_views:
            image_side = where.startswith("model.image")
            other = "model.text.pooling" if image_side else "model.image.pooling"
            if not makes_views(other, recipe):
                raise ConfigError(
                    f"{where}.name=esa makes two views of each item in training but {other} makes one: the SEL "
                    "loss needs two on both sides (esa pooling on region features, model.image.kind=precomp "
                    "with model.image.feature_type=region, and on a BiGRU caption encoder)"
                )
        if makes_views(where, recipe) and recipe.train.grad_cache_chunk > 0:
            raise ConfigError(
                f"{where}.name=esa trains on two views per item; gradient caching (train.grad_cache_chunk) "
                "splits the batch by items: set train.grad_cache_chunk=0"
            )
        if where.startswith("model.text") and recipe.data.text_augment_prob > 0:
            raise ConfigError(
                f"{where}.name=esa draws two augmented copies of each caption itself "
                f"({where}.esa_caption_augment); set data.text_augment_prob=0"
            )


def makes_views(where: str, recipe: Any) -> bool:
    """Whether the encoder of section `where` trains on two views: its pooling declares `makes_views` and
    brings its own encoder for the section's encoder kind (ESA's: region features, one view at test time, on
    the image side; the BiGRU on the caption side)."""
    m = recipe.model
    side = m.image if where.startswith("model.image") else m.text
    name = "image" if side is m.image else "text"
    own = registry.get("pooling", side.pooling.name).encoders
    if not has_fact("pooling", side.pooling.name, "makes_views") or f"{name}:{side.kind}" not in own:
        return False
    return side is m.text or (m.image.feature_type == "region" and m.image.views == 1)


def _esa_pool(cfg: Any, dim: int) -> Any:
    from vsekit.models.esa import ESAPool

    return ESAPool(dim, cfg.esa_mask_padding)


def _esa_image_encoder(recipe: Any, spec: Any) -> Any:
    """ESA's region encoder (two views in training) where it applies, else None (the plain precomp one)."""
    if not makes_views("model.image", recipe):
        return None
    from vsekit.models.esa import ESAImageEncoder

    m = recipe.model
    return ESAImageEncoder(spec.img_dim, m.embed_dim, m.image)


def _esa_text_encoder(recipe: Any, spec: Any) -> Any:
    """ESA's BiGRU caption encoder (two augmented copies of each caption in training)."""
    from vsekit.models.esa import ESATextEncoder

    m = recipe.model
    return ESATextEncoder(spec.vocab_words, m.embed_dim, m.text)


register(
    "pooling",
    "esa",
    ESAPoolSettings,
    build=_esa_pool,
    encoders={"image:precomp": _esa_image_encoder, "text:bigru": _esa_text_encoder},
    facts={"makes_views": True},
    help="ESA's aggregator: a per-channel softmax of linear scores over the set (two views in training "
    "on region features and BiGRU captions: loss sel)",
)
