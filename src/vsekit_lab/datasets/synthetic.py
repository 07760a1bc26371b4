"""A synthetic precomp dataset with real structure, written in the on-disk layout (for tests and demos).

Each image is a combination of attribute words; its regions are noisy mixtures of the attributes'
random feature vectors, and its captions name the attributes in random order among filler words. A model
that learns the mapping retrieves far above chance; one that does not stays at chance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vsekit.data.precomp import IMAGE_SPLIT_FILES, write_precomp_split
from vsekit.errors import VseInputError

ATTRIBUTES = [
    "red",
    "blue",
    "green",
    "yellow",
    "black",
    "white",
    "small",
    "large",
    "old",
    "new",
    "dog",
    "cat",
    "horse",
    "bird",
    "car",
    "boat",
    "tree",
    "house",
    "man",
    "woman",
    "beach",
    "street",
    "field",
    "kitchen",
    "snow",
    "river",
    "table",
    "ball",
    "bike",
    "train",
]
FILLERS = ["a", "the", "with", "on", "near", "and", "in", "of"]
SPLITS = ("train", "dev", "test")
SPLIT_FILES = IMAGE_SPLIT_FILES  # per split, in the precomp layout


def make_synthetic_precomp(
    out_dir: str | Path,
    n_train: int = 400,
    n_dev: int = 100,
    n_test: int = 100,
    regions: int = 12,
    dim: int = 64,
    captions_per_image: int = 5,
    seed: int = 0,
    attrs_per_image: int = 3,
    noise: float = 0.5,
    variable_captions: bool = False,
    ids_per_caption: bool = False,
) -> Path:
    """Write train/dev/test splits; with `variable_captions` each image gets 1..captions_per_image captions
    and a `{split}_cap2img.txt` file."""
    for name, value in (
        ("n_train", n_train),
        ("n_dev", n_dev),
        ("n_test", n_test),
        ("regions", regions),
        ("dim", dim),
        ("captions_per_image", captions_per_image),
    ):
        if value < 1:
            raise VseInputError(f"{name} must be at least 1, got {value}")
    if not 1 <= attrs_per_image <= len(ATTRIBUTES):
        raise VseInputError(f"attrs_per_image must lie in 1..{len(ATTRIBUTES)}, got {attrs_per_image}")
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    protos = rng.normal(size=(len(ATTRIBUTES), dim)).astype(np.float32)
    for split, n in zip(SPLITS, (n_train, n_dev, n_test)):
        attrs = np.stack([rng.choice(len(ATTRIBUTES), attrs_per_image, replace=False) for _ in range(n)])
        feats = np.empty((n, regions, dim), dtype=np.float32)
        for i in range(n):
            mix = rng.dirichlet(np.ones(attrs_per_image), size=regions)  # each region shows a blend
            feats[i] = mix @ protos[attrs[i]] + noise * rng.normal(size=(regions, dim))
        captions, cap2img = [], []
        for i in range(n):
            k = int(rng.integers(1, captions_per_image + 1)) if variable_captions else captions_per_image
            for _ in range(k):
                words = [ATTRIBUTES[a] for a in rng.permutation(attrs[i])]
                words += list(rng.choice(FILLERS, size=int(rng.integers(1, 4))))
                captions.append(" ".join(rng.permutation(words)))
                cap2img.append(i)
        ids = [f"{split}{i:05d}" for i in range(n)]
        write_precomp_split(
            out,
            split,
            feats,
            captions,
            np.asarray(cap2img) if variable_captions else None,
            ids,
            ids_per_caption=ids_per_caption,
        )
    return out
