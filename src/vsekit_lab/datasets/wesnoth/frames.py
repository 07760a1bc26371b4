"""Frames: each sprite centred on a fixed grey canvas, upscaled for the CNN, and turned into one feature row."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image

from vsekit.data.pictures import open_image
from vsekit.errors import VseInputError

BACKGROUND = (128, 128, 128)  # neutral grey behind the transparent sprites
CANVAS = 112  # native sprite pixels around the hex centre: a 72 px unit keeps its size relative to a dragon
IMAGE_SIZE = 224  # the canvas upscaled x2 (nearest: pixel art stays sharp) for the CNN


def render_frame(
    path: Path, background: tuple[int, int, int] = BACKGROUND, canvas: int = CANVAS, size: int = IMAGE_SIZE
) -> Image.Image:
    """The sprite centred on a `canvas`-pixel grey square (shrunk only if larger), then upscaled to `size`.
    A sprite of a game's data folder is input from elsewhere: read and decoded by the one bounded reader
    (`vsekit.data.pictures.open_image`: a regular file, bytes and pixels capped; a refusal names the file)."""
    with open_image(path) as im:
        sprite = im.convert("RGBA")
    if max(sprite.size) > canvas:
        scale = canvas / max(sprite.size)
        sprite = sprite.resize(
            (max(1, round(sprite.width * scale)), max(1, round(sprite.height * scale))),
            Image.Resampling.LANCZOS,
        )
    bg = Image.new("RGBA", (canvas, canvas), (*background, 255))
    bg.alpha_composite(sprite, ((canvas - sprite.width) // 2, (canvas - sprite.height) // 2))
    return bg.convert("RGB").resize((size, size), Image.Resampling.NEAREST)


class FrameExtractor(Protocol):
    def __call__(self, frames: list[Image.Image]) -> np.ndarray: ...  # (n, D) float

    def describe(self) -> dict: ...


class EfficientNetFrameMean:
    """EfficientNet-Lite0 grid at 224 px (7x7 x 1280), averaged over the grid: one 1280-d vector a frame."""

    def __init__(self, batch_size: int = 16) -> None:
        from vsekit.features.extractor import LiteGridExtractor

        self.extractor = LiteGridExtractor(image_size=IMAGE_SIZE, pooling="mean")
        self.batch_size = batch_size

    def __call__(self, frames: list[Image.Image]) -> np.ndarray:
        import torch

        return self.extractor.run(torch.stack([self.extractor.prepare(f) for f in frames]))[:, 0]  # (n, 1280)

    def describe(self) -> dict:
        spec = self.extractor.describe()
        spec.update(
            grid_pooling="mean over the 7x7 grid cells",
            preprocess="the rendered 224 px RGB frame (frame_render), ImageNet mean/std",
            dtype="float16",
            frame_render=f"RGBA sprite centred on a {CANVAS} px RGB{BACKGROUND} square "
            f"(shrunk to fit if larger), nearest-neighbour upscaled to {IMAGE_SIZE} px",
        )
        return spec


def extract_frames(
    paths: list[Path], extract: FrameExtractor, batch_size: int = 16, progress: bool = True
) -> np.ndarray:
    """One feature row per sprite path, in order (rendered and extracted in batches)."""
    from vsekit.utils.progress import progress_bar

    rows: list[np.ndarray] = []
    bar = progress_bar(total=len(paths), desc="wesnoth frames", unit="frame", enabled=progress)
    for start in range(0, len(paths), batch_size):
        chunk = paths[start : start + batch_size]
        feats = np.asarray(extract([render_frame(p) for p in chunk]), dtype=np.float32)
        if feats.ndim != 2 or feats.shape[0] != len(chunk):
            raise VseInputError(f"the frame extractor returned shape {feats.shape} for {len(chunk)} frames")
        rows.append(feats)
        bar.update(len(chunk))
    bar.close()
    return np.concatenate(rows)
