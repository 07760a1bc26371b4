"""The image encoders a recipe names (`model.image.kind`): each one's settings and builder, registered in
`vsekit.registry`. Torch-free (the builders import their module when called). A builder is given the recipe and
the run's `DataSpec` (feature size, ViT configuration) and returns the encoder: features or pixels -> a set of
vectors -> the recipe's pooling -> one embedding per view."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vsekit.registry import (
    MAX_COUNT,
    MAX_IMAGE_SIDE,
    MAX_WIDTH,
    Settings,
    pooling_encoder,
    register,
    setting,
)


@dataclass
class _Projection(Settings):
    feature_type: str = setting(
        "region",
        "region = linear + 2-layer residual MLP (BUTD regions); grid = one linear layer (VSE∞ supp.)",
        choices=("region", "grid"),
    )
    mlp_hidden: int = setting(
        512, "hidden size of the residual MLP of region features", rule=">= 1", max=MAX_WIDTH
    )
    mlp_on_padding: bool = setting(
        False,
        "regions: padded rows go through the residual MLP too, as the released code computes them (a loss "
        "that reads the padded set, HREM's, sees the release's values); false = padded rows stay fc(0)",
    )


@dataclass
class _Views(Settings):
    views: int = setting(
        1,
        "multi-view (AVSE): number of views of each image; 1 = an ordinary single embedding "
        "(more need model.similarity.name=aeom)",
        rule=">= 1",
        max=MAX_COUNT,
    )
    view_keep_train: float = setting(
        0.75, "multi-view: share of the image's vectors each view keeps in training", rule="in (0, 1]"
    )
    view_keep_test: float = setting(
        0.9, "multi-view: share of the image's vectors each view keeps at test time", rule="in (0, 1]"
    )


@dataclass
class _Pixels(Settings):
    image_size: int = setting(
        224, "pictures are resized to this side (the whole picture, no crop)", rule=">= 1", max=MAX_IMAGE_SIDE
    )


@dataclass
class PrecompSettings(_Views, _Projection):
    input_dropout: float = setting(
        0.0,
        "dropout on the input features in training, from the step's generator (IN2R's encoders: 0.3; two "
        "forward passes of one batch then differ)",
        rule="in [0, 1)",
    )
    view_size_augment: bool = setting(
        False,
        "multi-view precomp: false (paper §4.2) = each view keeps "
        "view_keep_train/_test of the image's full set and data.size_augment "
        "drops nothing of a multi-view image; true = the views are drawn from "
        "the size-augmented set (vsekit's earlier behaviour: ~60 % per view)",
    )


@dataclass
class BackboneSettings(_Pixels, _Projection):
    backbone: str = setting(
        "efficientnet_lite0",
        "the CNN: efficientnet_lite0 (packaged weights), "
        "torchvision:<arch>, timm:<name> or python:<module>:<function> "
        "(vsekit.features.backbones)",
    )
    backbone_weights: str = setting(
        "",
        "local weights file of the CNN (safetensors or a state-dict .pth); empty = "
        "the packaged EfficientNet-Lite0 weights; nothing is downloaded",
    )
    backbone_frozen_epochs: int = setting(
        1,
        "staged unfreezing: the CNN is frozen for this many epochs, then trainable from the top down",
        rule=">= 0",
    )
    backbone_trainable_blocks: int = setting(
        -1,
        "-1 = every stage once unfrozen; N = only the last N stages (head included)",
        rule=">= -1 (-1: every stage)",
        max=MAX_COUNT,
    )
    backbone_lr_mult: float = setting(
        0.1, "learning-rate multiplier of the CNN's parameters", rule=">= 0 and finite"
    )
    backbone_warmup: str = setting(
        "loss",
        "the first unfrozen epoch (after backbone_frozen_epochs > 0) ramps in "
        "linearly over its steps: loss (the released VSE∞ code: loss x step/N) | "
        "lr (the paper's learning-rate warm-up) | none; docs/training.md",
        choices=("loss", "lr", "none"),
    )


@dataclass
class ViTSettings(_Pixels, _Views):
    pass


PixelSettings = _Pixels  # the picture side (`image_size`): a pixel encoder of your own inherits it


def reads_pixels(kind: str) -> bool:
    """Whether the image encoder `kind` takes pictures rather than precomputed features: its registered fact
    `reads_pixels` (`encode_image`, the trainer, `vse eval`, search and CLIP_benchmark ask it)."""
    from vsekit import registry

    return registry.has_fact("image_encoder", kind, "reads_pixels")


def _precomp(recipe: Any, spec: Any) -> Any:
    m = recipe.model
    if spec.img_dim <= 0:
        raise ValueError("a precomp image encoder needs the feature size (DataSpec.img_dim)")
    if m.image.views > 1:
        from vsekit.models.multiview import MultiViewImageEncoder

        return MultiViewImageEncoder(spec.img_dim, m.embed_dim, m.image)
    own = pooling_encoder("image", "precomp", recipe, spec)
    if own is not None:
        return own
    from vsekit.models.image import PrecompImageEncoder

    return PrecompImageEncoder(spec.img_dim, m.embed_dim, m.image)


def _backbone(recipe: Any, spec: Any) -> Any:
    from vsekit.models.image import BackboneImageEncoder

    m = recipe.model
    return BackboneImageEncoder(m.embed_dim, m.image, recipe.data.grid_drop_max, recipe.data.size_augment)


def _vit(recipe: Any, spec: Any) -> Any:
    from vsekit.models.vit_views import ViTMultiViewImageEncoder

    m = recipe.model
    if not spec.vision_config:
        raise ValueError("a vit image encoder needs the ViT configuration (DataSpec.vision_config)")
    return ViTMultiViewImageEncoder(
        spec.vision_config,
        m.embed_dim,
        views=m.image.views,
        keep_train=m.image.view_keep_train,
        keep_test=m.image.view_keep_test,
        pooling=m.image.pooling,
        size_augment=recipe.data.size_augment,
        grid_drop_max=recipe.data.grid_drop_max,
    )


register(
    "image_encoder",
    "precomp",
    PrecompSettings,
    build=_precomp,
    help="precomputed features from {split}_ims.npy (regions, grid cells or video frames)",
    facts={"cuda_graph": True},
)
register(
    "image_encoder",
    "backbone",
    BackboneSettings,
    build=_backbone,
    help="a CNN on raw pixels ({split}_images.txt), trained end to end",
    facts={"reads_pixels": True},
)
register(
    "image_encoder",
    "vit",
    ViTSettings,
    build=_vit,
    help="a ViT patch encoder on raw pixels with AVSE's multi-view token sampling (imported AVSE runs)",
    facts={"reads_pixels": True, "encode_kwargs": ("view_indices",)},
)
