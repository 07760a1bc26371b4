"""Image feature extractors (pretrained CNN grids) shared by dataset builders, models and the search index."""

from vsekit.features.efficientnet import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    GridFeatureExtractor,
    load_efficientnet_lite0,
    preprocess_image,
)

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "GridFeatureExtractor",
    "load_efficientnet_lite0",
    "preprocess_image",
]
