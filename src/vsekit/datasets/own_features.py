"""Grid features of users' own pictures, cached by picture content so that a long build resumes.

Used by `vsekit.datasets.own_pairs` (`vse data folder | table | webdataset`). Two extractors:
- `efficientnet_lite0` (default): `vsekit.features.extractor.LiteGridExtractor`, the openclipart
  extractor (49 x 1280 at 224 px, alpha on white, bicubic, ImageNet mean/std). Its spec is what `vse index`
  needs to embed raw pictures for a model trained on these features.
- any other `vsekit.features.backbones.build_backbone` name (`torchvision:<arch>`, `timm:<name>`,
  `python:<module>:<function>`, with a local weights file): the backbone's last feature map, flattened to
  h*w region tokens, its own pixel transform. Such features train; raw-picture search supports Lite0 only.

The cache (`OUT/.cache/features/<spec key>/part-NNNNNN.npy` + `.keys`) holds float16 rows keyed by the
sha256 of the picture bytes: the same picture under another name, or in another input (a folder, a table,
a tar), is never computed twice. Missing pictures are computed in sha256 order, in parts of whole batches,
each part written atomically (array first, then its key list: a part without keys is redone). A build that
stops keeps every finished part, and the rerun computes the rest in exactly the batches an uninterrupted
build would have used, so its features are bit-equal to it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from PIL import Image

from vsekit.data.pictures import decode_bounded
from vsekit.data.precomp import DataFormatError
from vsekit.features.extractor import LiteGridExtractor, PictureExtractor
from vsekit.utils.io import atomic_save_npy, atomic_write_text, sha256_file
from vsekit.utils.progress import progress_bar

log = logging.getLogger(__name__)

DEFAULT_BACKBONE = "efficientnet_lite0"
PART_PICTURES = 512  # pictures per cache part (rounded up to whole batches): the work a Ctrl-C can lose


class HasBytes(Protocol):
    def read(self) -> bytes: ...


@dataclass(frozen=True)
class FeatureOptions:
    """How features are made: the backbone (and its local weights), device, input size and batch size."""

    backbone: str = DEFAULT_BACKBONE
    weights: str | None = None
    device: str = "cpu"
    image_size: int = 224
    batch_size: int = 8


def decode_picture(data: bytes, name: str) -> Image.Image:
    """Fully decoded picture (errors surface here, naming `name`); more than MAX_IMAGE_PIXELS is refused."""
    return decode_bounded(io.BytesIO(data), name)


class BackboneGrid(PictureExtractor):
    """The last feature map of a `build_backbone` CNN, flattened to h*w region tokens (the picture -> features
    contract of `vsekit.features.extractor`)."""

    def __init__(self, name: str, weights: str | None, device: torch.device, image_size: int) -> None:
        from vsekit.features.backbones import build_backbone

        self.backbone = build_backbone(name, weights).to(device).eval()
        self.device = device
        self.image_size = image_size
        self.transform = self.backbone.pixel_transform
        with torch.inference_mode():
            probe = self._grid(torch.zeros(1, 3, image_size, image_size, device=device))
        regions, dim = int(probe.shape[1]), int(probe.shape[2])
        side = int(math.isqrt(regions))
        self.spec = {
            "name": f"grid:{name}",
            "architecture": name,
            "weights": Path(weights).name if weights else None,
            "weights_sha256": sha256_file(weights)[:16] if weights else None,
            "image_size": image_size,
            "grid": [side, side] if side * side == regions else [regions],
            "regions": regions,
            "dim": dim,
            **self.transform.describe(),
            "preprocess": "RGB, alpha composited on white, resize to image_size x image_size with the backbone's "
            "filter, its mean/std",
            "layer": "last feature map before pooling",
            "dtype": "float16",
        }

    def _grid(self, x: torch.Tensor) -> torch.Tensor:
        grid = self.backbone(x)
        return grid.flatten(2).transpose(1, 2) if grid.dim() == 4 else grid

    def prepare(self, img: Image.Image) -> torch.Tensor:
        from vsekit.data.pictures import backbone_pixels

        return backbone_pixels(img, self.image_size, self.transform)

    def run(self, batch: torch.Tensor) -> np.ndarray:
        with torch.inference_mode():
            return self._grid(batch.to(self.device)).float().cpu().numpy().astype(np.float16)

    def describe(self) -> dict:
        return self.spec


def make_extractor(opts: FeatureOptions) -> PictureExtractor:
    """The extractor of `opts` on its device (`auto`: CUDA when present)."""
    from vsekit.utils.runtime import resolve_device

    device = resolve_device(opts.device)
    if opts.backbone == DEFAULT_BACKBONE:
        return LiteGridExtractor(opts.weights, device, opts.image_size)
    return BackboneGrid(opts.backbone, opts.weights, device, opts.image_size)


def spec_key(spec: dict, batch_size: int) -> str:
    """Cache folder name: the extractor spec and the batch size (batching can change the last bits)."""
    return hashlib.sha1((json.dumps(spec, sort_keys=True) + f"|batch={batch_size}").encode()).hexdigest()[:16]


def extract_part(
    extractor: PictureExtractor,
    pictures: Sequence[tuple[HasBytes, str]],
    batch_size: int,
    workers: int = 1,
    on_batch: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Features of `pictures` ((bytes source, name) pairs) in batches of `batch_size`, decoded by `workers`
    threads; float16 [N, R, D]."""

    def load(pair: tuple[HasBytes, str]) -> torch.Tensor:
        ref, name = pair
        return extractor.prepare(decode_picture(ref.read(), name))

    out = np.zeros((len(pictures), *extractor.shape), np.float16)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for start in range(0, len(pictures), batch_size):
            chunk = pictures[start : start + batch_size]
            feats = extractor.run(torch.stack(list(pool.map(load, chunk))))
            if not np.isfinite(feats).all():
                raise DataFormatError(f"non-finite features for one of {', '.join(n for _, n in chunk)}")
            out[start : start + len(chunk)] = feats
            if on_batch is not None:
                on_batch(len(chunk))
    return out


def _load_parts(folder: Path, shape: tuple[int, int]) -> tuple[dict[str, tuple[np.ndarray, int]], int]:
    """(sha256 -> (part array, row), next part number); a broken or unfinished part is removed."""
    where: dict[str, tuple[np.ndarray, int]] = {}
    last = -1
    for npy in sorted(folder.glob("part-*.npy")):
        keys_file = npy.with_suffix(".keys")
        try:
            number = int(npy.stem.split("-", 1)[1])
        except ValueError:
            continue
        last = max(last, number)
        try:
            keys = keys_file.read_text(encoding="ascii").split() if keys_file.is_file() else None
            arr = np.load(npy, mmap_mode="r", allow_pickle=False) if keys is not None else None
        except (OSError, ValueError, UnicodeDecodeError):
            keys, arr = None, None
        if arr is None or arr.dtype != np.float16 or arr.shape[1:] != shape or arr.shape[0] != len(keys):
            log.info("feature cache: %s is unfinished or broken; it is computed again", npy.name)
            npy.unlink(missing_ok=True)
            keys_file.unlink(missing_ok=True)
            continue
        for row, key in enumerate(keys):
            where.setdefault(key, (arr, row))
    return where, last + 1


def finished_parts(cache_dir: Path) -> int:
    """Feature parts a build finished under `cache_dir` (`OUT/.cache/features`): the work a rerun resumes from."""
    return sum(1 for _ in cache_dir.glob("*/part-*.keys")) if cache_dir.is_dir() else 0


def compute_features(
    pictures: dict[str, tuple[HasBytes, str]],
    cache_dir: Path,
    extractor: PictureExtractor,
    batch_size: int,
    workers: int = 1,
    progress: bool = True,
) -> tuple[dict[str, tuple[np.ndarray, int]], dict[str, int]]:
    """Features of every picture (sha256 -> (bytes source, name)), from the cache or computed and cached.

    Returns (sha256 -> (array, row), {"computed": n, "reused": n}). Caches of other extractors or batch sizes
    in `cache_dir` are removed (a build keeps one).
    """
    key = spec_key(extractor.spec, batch_size)
    folder = cache_dir / key
    folder.mkdir(parents=True, exist_ok=True)
    for stale in cache_dir.iterdir():
        if stale.name != key:
            log.info("feature cache: removing %s (another extractor or batch size)", stale)
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    where, number = _load_parts(folder, extractor.shape)
    missing = sorted(sha for sha in pictures if sha not in where)
    reused = len(pictures) - len(missing)
    part = batch_size * max(1, math.ceil(PART_PICTURES / batch_size))  # whole batches: a resume batches alike
    bar = progress_bar(total=len(pictures), initial=reused, desc="features", unit="img", enabled=progress)
    try:
        for start in range(0, len(missing), part):
            keys = missing[start : start + part]
            feats = extract_part(extractor, [pictures[k] for k in keys], batch_size, workers, bar.update)
            npy, keys_file = folder / f"part-{number:06d}.npy", folder / f"part-{number:06d}.keys"
            atomic_save_npy(npy, feats)
            atomic_write_text(
                keys_file, "".join(f"{k}\n" for k in keys)
            )  # after the array: it marks the part done
            arr = np.load(npy, mmap_mode="r", allow_pickle=False)
            for row, k in enumerate(keys):
                where[k] = (arr, row)
            number += 1
    finally:
        bar.close()
    return {sha: where[sha] for sha in pictures}, {"computed": len(missing), "reused": reused}


__all__ = [
    "FeatureOptions",
    "PictureExtractor",
    "compute_features",
    "decode_picture",
    "extract_part",
    "finished_parts",
    "make_extractor",
    "spec_key",
    "DEFAULT_BACKBONE",
    "PART_PICTURES",
]
