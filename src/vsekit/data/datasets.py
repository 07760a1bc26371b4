"""Torch datasets over a split: (image, caption) pairs for training, images or captions alone for encoding.

All randomness (size augmentation) comes from a generator seeded by (seed, epoch, index), so a batch is
the same whichever worker loads it and a resumed run sees exactly the data of an uninterrupted one.

`set_keep_mask`, `pack_order` and `augment_token_batch` are the same augmentation rules as `augment_set` and
`Vocabulary.encode`, batched as tensor ops (any device, one generator per batch): the training data path that
keeps the set on the device (`vsekit.training.data_path`) uses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from vsekit.data.batch import Batch, CaptionBatch, ImageBatch
from vsekit.data.text import MASKED_BELOW, RANDOM_BELOW
from vsekit.utils.runtime import derived_seed


class TextEncoderInput(Protocol):
    def encode(
        self, caption: str, rng: np.random.Generator | None = None, augment_prob: float = 0.0
    ) -> list[int]: ...


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


def set_keep_mask(
    lengths: torch.Tensor, width: int, generator: torch.Generator | None, aug: AugmentConfig
) -> torch.Tensor:
    """`augment_set` for a batch: which of each set's first `lengths[b]` vectors are kept, [B, width] bool.

    Regions: each kept with `aug.region_keep_prob`; grid: per image r ~ U(0, 1), every cell kept when
    r <= 0.2, else each cell kept when its draw is >= grid_drop_max * r. A set that lost every vector keeps
    one, drawn uniformly among its own. The draws (always the same number, on the lengths' device) come from
    `generator`, so a batch's mask is a function of the generator's seed."""
    dev, b = lengths.device, lengths.shape[0]
    slots = torch.arange(width, device=dev)
    if aug.feature_type == "region":
        keep = torch.rand(b, width, generator=generator, device=dev) < aug.region_keep_prob
    else:
        r = torch.rand(b, 1, generator=generator, device=dev)
        cell = torch.rand(b, width, generator=generator, device=dev)
        keep = (r <= 0.2) | (cell >= aug.grid_drop_max * r)
    keep &= slots < lengths[:, None]
    pick = torch.minimum((torch.rand(b, generator=generator, device=dev) * lengths).long(), lengths - 1)
    return keep | (~keep.any(1, keepdim=True) & (slots == pick[:, None]))


def pack_order(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [B, W], counts [B]): gathering row b of a [B, W, ...] tensor by `order[b]` puts its kept slots first,
    in their original order (a stable sort on the keep flag), the others after them."""
    return torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices, keep.sum(1)


def augment_token_batch(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    generator: torch.Generator | None,
    prob: float,
    mask_id: int,
    random_range: tuple[int, int],
    start_id: int,
    end_id: int,
    pad_id: int = 0,
    keep_ends: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Vocabulary.encode`'s augmentation for a batch of token rows [B, L] (each `<start> words <end>`, padded).

    Every token of a caption, `<start>` and `<end>` included as in the released VSE∞ code and in
    `Vocabulary.encode` (`keep_ends=True`: only the words between them), is picked with probability `prob`;
    a picked token is masked (u/prob < 0.5), replaced by a random word id from `random_range` (< 0.6) or
    deleted. The kept tokens move to the front in order (stable sort), the width stays L and the rest is
    `pad_id`; a caption that lost every token becomes `<start> <end>`. Returns the new (tokens, lengths)."""
    b, width = tokens.shape
    dev = tokens.device
    slots = torch.arange(width, device=dev)
    valid = slots < lengths[:, None]
    u = torch.rand(b, width, generator=generator, device=dev)
    other = torch.randint(random_range[0], random_range[1], (b, width), generator=generator, device=dev)
    picked = valid & (u < prob)
    if keep_ends:
        picked &= (slots > 0) & (slots < lengths[:, None] - 1)
    v = u / prob
    out = torch.where(picked & (v < MASKED_BELOW), mask_id, tokens)
    out = torch.where(picked & (v >= MASKED_BELOW) & (v < RANDOM_BELOW), other, out)
    order, n = pack_order(valid & ~(picked & (v >= RANDOM_BELOW)))
    out = torch.gather(out, 1, order)
    out = torch.where(slots < n[:, None], out, pad_id)
    empty = n == 0
    ends = torch.where(slots == 0, start_id, end_id)
    out = torch.where(empty[:, None] & (slots < 2), ends, out)
    return out, torch.where(empty, 2, n)


class FeatureSource:
    """Precomputed region/grid features from a PrecompSplit (memory-mapped).

    `keep_dtype`: sets come as stored (float16 features stay float16, half the bytes through the training
    DataLoader and its host-to-device copy; converted to float32 on the device); default float32."""

    kind = "features"

    def __init__(self, split, aug: AugmentConfig | None = None, keep_dtype: bool = False) -> None:
        if hasattr(split, "require_features"):
            split.require_features()
        self.split = split
        self.aug = aug
        self.keep_dtype = keep_dtype
        self.n_images = split.n_images

    def _stored(self, index: int) -> np.ndarray:
        split = self.split
        row = split.image_rows[index]
        feats = split.features[row]
        return feats if split.set_sizes is None else feats[: int(split.set_sizes[row])]

    def load(self, index: int, rng: np.random.Generator | None) -> torch.Tensor:
        augment = rng is not None and self.aug is not None and self.aug.enabled
        if not self.keep_dtype:
            feats = self.split.image_features(index)
            if augment:
                feats = augment_set(feats, rng, self.aug)
            return torch.from_numpy(np.array(feats, dtype=np.float32, copy=True))
        stored = self._stored(index)
        feats = augment_set(stored, rng, self.aug) if augment else stored
        # a boolean selection is already a fresh array; the stored rows themselves are copied (memory-mapped)
        return torch.from_numpy(np.array(feats, copy=True) if feats is stored else feats)


class PairDataset(Dataset):
    """One item per caption: (image, caption tokens, image index, caption index) — the VSE∞ sampling."""

    def __init__(
        self,
        images: ImageSource,
        captions: list[str],
        cap2img: np.ndarray,
        text: TextEncoderInput,
        train: bool,
        seed: int = 0,
        text_augment_prob: float = 0.2,
    ) -> None:
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

    def __getitem__(self, index: int | tuple[int, int]):
        """`index`, or `(epoch, index)`: the epoch travels with the index, so persistent DataLoader workers
        (which keep the copy of the dataset they started with) draw epoch e's augmentation."""
        epoch = self.epoch
        if isinstance(index, tuple):
            epoch, index = index
        rng = np.random.default_rng(derived_seed(self.seed, epoch, index)) if self.train else None
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
    """Stack variable-length sets [n_i, D] into [B, max n, D] with zero padding, plus lengths (one C++ copy
    loop: `pad_sequence`; the dtype is kept)."""
    lengths = torch.tensor([t.shape[0] for t in items], dtype=torch.long)
    return torch.nn.utils.rnn.pad_sequence(items, batch_first=True), lengths


def pad_tokens(items: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(t) for t in items], dtype=torch.long)
    return torch.nn.utils.rnn.pad_sequence(items, batch_first=True, padding_value=pad_id).long(), lengths


def stack_images(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixels stack directly; feature sets are padded."""
    if items[0].ndim == 3 and items[0].shape[0] == 3 and all(t.shape == items[0].shape for t in items):
        return torch.stack(items), torch.full((len(items),), -1, dtype=torch.long)
    return pad_sets(items)


class Collate:
    """`float32`: feature sets leave the collate function as float32 (training on the CPU: the conversion then
    runs in the DataLoader's workers); otherwise as stored (float16 stays float16 until it is on the device)."""

    def __init__(self, pad_id: int = 0, float32: bool = False) -> None:
        self.pad_id = pad_id
        self.float32 = float32

    def pairs(self, batch) -> Batch:
        images, tokens, img_idx, cap_idx = zip(*batch)
        image_t, image_len = stack_images(list(images))
        if self.float32 and image_t.is_floating_point():
            image_t = image_t.float()
        tok_t, tok_len = pad_tokens(list(tokens), self.pad_id)
        return Batch(
            images=image_t,
            image_lengths=image_len,
            tokens=tok_t,
            token_lengths=tok_len,
            image_index=torch.tensor(img_idx),
            caption_index=torch.tensor(cap_idx),
        )

    def images(self, batch) -> ImageBatch:
        images, idx = zip(*batch)
        image_t, image_len = stack_images(list(images))
        return ImageBatch(images=image_t, image_lengths=image_len, image_index=torch.tensor(idx))

    def captions(self, batch) -> CaptionBatch:
        tokens, idx = zip(*batch)
        tok_t, tok_len = pad_tokens(list(tokens), self.pad_id)
        return CaptionBatch(tokens=tok_t, token_lengths=tok_len, caption_index=torch.tensor(idx))
