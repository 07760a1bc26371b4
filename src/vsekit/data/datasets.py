"""Torch datasets over a split: (image, caption) pairs for training, images or captions alone for encoding.

All randomness (size augmentation) comes from a generator seeded by (seed, epoch, index), so a batch is
the same whichever worker loads it and a resumed run sees exactly the data of an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from vsekit.utils.runtime import derived_seed


class TextEncoderInput(Protocol):
    def encode(self, caption: str, rng: np.random.Generator | None = None, augment_prob: float = 0.0) -> list[int]: ...


class ImageSource(Protocol):
    """Where images come from: precomputed features or pixels."""

    kind: str  # "features" | "pixels"
    n_images: int

    def load(self, index: int, rng: np.random.Generator | None) -> torch.Tensor: ...


@dataclass
class AugmentConfig:
    enabled: bool = True
    feature_type: str = "region"  # region: keep each with p; grid: per-image drop rate U(0, max)
    region_keep_prob: float = 0.8
    grid_drop_max: float = 0.2
    text_prob: float = 0.2


def augment_set(feats: np.ndarray, rng: np.random.Generator, aug: AugmentConfig) -> np.ndarray:
    """VSE∞ size augmentation on one image's set of vectors (at least one is always kept)."""
    n = feats.shape[0]
    if aug.feature_type == "region":
        keep = rng.random(n) < aug.region_keep_prob
    else:
        r = rng.random()
        if r <= 0.2:  # 20% of images keep every cell (VSE∞ `EncoderImageFull`)
            return feats
        keep = rng.random(n) >= aug.grid_drop_max * r
    if not keep.any():
        keep[rng.integers(n)] = True
    return feats[keep]


class FeatureSource:
    """Precomputed region/grid features from a PrecompSplit (memory-mapped)."""

    kind = "features"

    def __init__(self, split, aug: AugmentConfig | None = None) -> None:
        if hasattr(split, "require_features"):
            split.require_features()
        self.split = split
        self.aug = aug
        self.n_images = split.n_images

    def load(self, index: int, rng: np.random.Generator | None) -> torch.Tensor:
        feats = self.split.image_features(index)
        if rng is not None and self.aug is not None and self.aug.enabled:
            feats = augment_set(feats, rng, self.aug)
        return torch.from_numpy(np.array(feats, dtype=np.float32, copy=True))


class PairDataset(Dataset):
    """One item per caption: (image, caption tokens, image index, caption index) — the VSE∞ sampling."""

    def __init__(self, images: ImageSource, captions: list[str], cap2img: np.ndarray, text: TextEncoderInput,
                 train: bool, seed: int = 0, text_augment_prob: float = 0.2) -> None:  # fmt: skip
        self.images = images
        self.captions = captions
        self.cap2img = cap2img
        self.text = text
        self.train = train
        self.seed = seed
        self.text_augment_prob = text_augment_prob
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, index: int):
        rng = np.random.default_rng(derived_seed(self.seed, self.epoch, index)) if self.train else None
        img = int(self.cap2img[index])
        image = self.images.load(img, rng)
        tokens = self.text.encode(self.captions[index], rng, self.text_augment_prob if self.train else 0.0)
        return image, torch.tensor(tokens, dtype=torch.long), img, index


class ImageDataset(Dataset):
    def __init__(self, images: ImageSource) -> None:
        self.images = images

    def __len__(self) -> int:
        return self.images.n_images

    def __getitem__(self, index: int):
        return self.images.load(index, None), index


class CaptionDataset(Dataset):
    def __init__(self, captions: list[str], text: TextEncoderInput) -> None:
        self.captions = captions
        self.text = text

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, index: int):
        return torch.tensor(self.text.encode(self.captions[index]), dtype=torch.long), index


def pad_sets(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack variable-length sets [n_i, D] into [B, max n, D] with zero padding, plus lengths."""
    lengths = torch.tensor([t.shape[0] for t in items], dtype=torch.long)
    out = items[0].new_zeros((len(items), int(lengths.max()), *items[0].shape[1:]))
    for i, t in enumerate(items):
        out[i, : t.shape[0]] = t
    return out, lengths


def pad_tokens(items: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(t) for t in items], dtype=torch.long)
    out = torch.full((len(items), int(lengths.max())), pad_id, dtype=torch.long)
    for i, t in enumerate(items):
        out[i, : len(t)] = t
    return out, lengths


def stack_images(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixels stack directly; feature sets are padded."""
    if items[0].ndim == 3 and items[0].shape[0] == 3 and all(t.shape == items[0].shape for t in items):
        return torch.stack(items), torch.full((len(items),), -1, dtype=torch.long)
    return pad_sets(items)


class Collate:
    def __init__(self, pad_id: int = 0) -> None:
        self.pad_id = pad_id

    def pairs(self, batch):
        images, tokens, img_idx, cap_idx = zip(*batch)
        image_t, image_len = stack_images(list(images))
        tok_t, tok_len = pad_tokens(list(tokens), self.pad_id)
        return {
            "images": image_t, "image_lengths": image_len, "tokens": tok_t, "token_lengths": tok_len,
            "image_index": torch.tensor(img_idx), "caption_index": torch.tensor(cap_idx),
        }  # fmt: skip

    def images(self, batch):
        images, idx = zip(*batch)
        image_t, image_len = stack_images(list(images))
        return {"images": image_t, "image_lengths": image_len, "image_index": torch.tensor(idx)}

    def captions(self, batch):
        tokens, idx = zip(*batch)
        tok_t, tok_len = pad_tokens(list(tokens), self.pad_id)
        return {"tokens": tok_t, "token_lengths": tok_len, "caption_index": torch.tensor(idx)}
