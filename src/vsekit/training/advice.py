"""Advice for a recipe that meets data it was not built for (a one-line hint, never a refusal)."""

from __future__ import annotations

from vsekit.config import Recipe

# Recipes whose settings (1024-d, hardest-negative triplet, from-scratch BiGRU, 25-epoch schedule) were chosen
# for Flickr30K / MS-COCO (29k-113k images) say so (the recipe field `coco_scale`: vse_infty and the recipes
# based on it that keep it, vsepp, vse_2ad, cvsepp, cvsepp_auto, avse); below SMALL_DATA_IMAGES they do not
# beat the bag-of-words floor on the data measured (openclipart, 2,506 images: docs/floor.md), and nothing
# measured there beat the floor
SMALL_DATA_IMAGES = 10_000
SMALL_DATA_RECIPE = "bow"
# the preset: SMALL_DATA_RECIPE and this one trained apart, evaluated as an ensemble (docs/floor.md)
SMALL_DATA_PARTNER = "small_data"


def small_data_advice(recipe: Recipe, train_images: int) -> str | None:
    """A one-line hint when a COCO-scale recipe meets a small training split (None otherwise)."""
    if not recipe.coco_scale or train_images >= SMALL_DATA_IMAGES:
        return None
    return (
        f"recipe {recipe.name!r} was built for 29k-113k training images and this split has {train_images:,}; "
        f"on small data it scored below the bag-of-words floor (docs/floor.md). Best measured there: train "
        f"`--recipe {SMALL_DATA_RECIPE}` and `--recipe {SMALL_DATA_PARTNER}` and score them together with "
        f"`vse eval RUN_{SMALL_DATA_RECIPE.upper()} RUN_{SMALL_DATA_PARTNER.upper()}` (+28 rsum over the floor); "
        f"the best single model was `--recipe {SMALL_DATA_RECIPE}`"
    )
