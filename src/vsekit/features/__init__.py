"""Image feature extractors (pretrained CNN grids) shared by dataset builders, models and the search index; the
picture -> features contract that builders and search use is `vsekit.features.extractor`."""

from vsekit.features.efficientnet import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    GridFeatureExtractor,
    load_efficientnet_lite0,
    preprocess_image,
)
from vsekit.features.extractor import LiteGridExtractor, PictureExtractor, extractor_from_spec

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "GridFeatureExtractor",
    "LiteGridExtractor",
    "PictureExtractor",
    "extractor_from_spec",
    "load_efficientnet_lite0",
    "preprocess_image",
]
