"""Picture -> features: the one contract that every set builder and `vse index` use, and the one wrapper of the
EfficientNet-Lite0 grid extractor.

A model trained on precomputed features never saw pixels, so search must make a raw picture's features exactly as
the set's builder made them, bit for bit. That is why the three steps live here once:

- `prepare(picture)`: a PIL picture -> the net's input [3, S, S] (for Lite0: alpha on white, bicubic resize,
  ImageNet mean/std: `vsekit.features.efficientnet.preprocess_image`);
- `run(batch)`: [B, 3, S, S] -> the features as a set stores them, float16 [B, R, D] (R regions of D numbers;
  the grid mean gives R = 1);
- `describe()`: the spec a builder records in its manifest (`features` / `extractor`) and a run copies into its
  config.json; `extractor_from_spec(spec)` makes the extractor that spec names again, or refuses in one line.

Users' own-data builds with another CNN backbone implement the same contract (`vsekit.datasets.own_features`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vsekit.errors import VseInputError
from vsekit.features.efficientnet import IMAGE_SIZE, GridFeatureExtractor, preprocess_image
from vsekit.utils.progress import progress_bar

GRID = "efficientnet_lite0_grid"  # 49 x 1280 region tokens at 224 px (the openclipart and own-data sets)
GRID_MEAN = "efficientnet_lite0_grid_mean"  # the grid averaged: one 1280-d vector a picture (video frames)
POOLINGS = {GRID: "grid", GRID_MEAN: "mean"}
STORED_DTYPE = np.float16  # what every set stores and what `run` returns (half the bytes of float32)


class PictureExtractor(ABC):
    """Pictures -> stored features: `prepare` one picture, `run` a batch, `describe` the spec."""

    device: torch.device

    @abstractmethod
    def prepare(self, picture: Image.Image) -> torch.Tensor:
        """The net's input for one picture, float32 [3, S, S] on the CPU."""

    @abstractmethod
    def run(self, batch: torch.Tensor) -> np.ndarray:
        """[B, 3, S, S] prepared pictures -> float16 [B, R, D] features on the CPU, as a set stores them."""

    @abstractmethod
    def describe(self) -> dict:
        """The spec recorded next to the features (name, weights, input size, layer, regions, dim, dtype)."""

    @cached_property
    def spec(self) -> dict:
        """`describe()`, computed once (the Lite0 spec hashes the weights file)."""
        return self.describe()

    @property
    def shape(self) -> tuple[int, int]:
        """(regions, dim) of one picture's features."""
        return int(self.spec["regions"]), int(self.spec["dim"])

    def extract_paths(
        self,
        paths: Sequence[str | Path],
        batch_size: int = 8,
        progress: bool = True,
        *,
        open_picture: Callable[[Path], Image.Image],
    ) -> np.ndarray:
        """Features of picture files, float16 [N, R, D], in batches. Each file is read and decoded by
        `open_picture`: pass `vsekit.data.pictures.open_image`, the one bounded reader (a regular file, bytes
        and pixels capped before decoding), which this layer, below the formats, cannot import itself."""
        out = np.zeros((len(paths), *self.shape), dtype=STORED_DTYPE)
        bar = progress_bar(total=len(paths), desc="features", unit="img", enabled=progress)
        for start in range(0, len(paths), batch_size):
            chunk = paths[start : start + batch_size]
            tensors = []
            for p in chunk:
                with open_picture(Path(p)) as im:
                    tensors.append(self.prepare(im))
            out[start : start + len(chunk)] = self.run(torch.stack(tensors))
            bar.update(len(chunk))
        bar.close()
        return out


class LiteGridExtractor(PictureExtractor):
    """EfficientNet-Lite0 (ImageNet) grid features at `image_size` px: the grid's (image_size/32)^2 region tokens
    (`pooling="grid"`), or their mean, one vector a picture (`pooling="mean"`). The only module that runs
    `GridFeatureExtractor`."""

    def __init__(
        self,
        weights_path: str | None = None,
        device: str | torch.device = "cpu",
        image_size: int = IMAGE_SIZE,
        pooling: str = "grid",
    ) -> None:
        if pooling not in ("grid", "mean"):
            raise VseInputError(f"unknown grid pooling {pooling!r}; choose grid or mean")
        self.net = GridFeatureExtractor(weights_path=weights_path, device=device, image_size=image_size)
        self.device = self.net.device
        self.image_size = image_size
        self.pooling = pooling

    def prepare(self, picture: Image.Image) -> torch.Tensor:
        return preprocess_image(picture, self.image_size)

    def run(self, batch: torch.Tensor) -> np.ndarray:
        feats = self.net(batch)  # float32 [B, R, 1280] on the device
        if self.pooling == "mean":
            feats = feats.mean(dim=1, keepdim=True)  # averaged in float32, rounded once below
        return feats.float().cpu().numpy().astype(STORED_DTYPE)

    def describe(self) -> dict:
        spec = self.net.describe()
        if self.pooling == "mean":
            spec.update(name=GRID_MEAN, regions=1, grid_pooling="mean over the grid cells")
        return spec


def extractor_from_spec(
    spec: dict, device: str | torch.device = "cpu", weights_path: str | None = None
) -> PictureExtractor:
    """The extractor that makes the features `spec` describes (a set's manifest, a run's config.json), here and
    now; a `VseInputError` when this machine cannot make them: another extractor, or other weights than the
    installed EfficientNet-Lite0 file (the features would not match the training ones)."""
    name = spec.get("name")
    if name not in POOLINGS:
        raise VseInputError(
            f"feature extractor {name!r} cannot be run on raw pictures here (known: {', '.join(POOLINGS)})"
        )
    extractor = LiteGridExtractor(
        weights_path, device, int(spec.get("image_size", IMAGE_SIZE)), POOLINGS[name]
    )
    local = extractor.spec
    if spec.get("weights_sha256") and spec["weights_sha256"] != local["weights_sha256"]:
        raise VseInputError(
            f"the run's features came from extractor weights {spec['weights_sha256']}, but the installed "
            f"EfficientNet-Lite0 weights are {local['weights_sha256']}; features would not match training"
        )
    return extractor
