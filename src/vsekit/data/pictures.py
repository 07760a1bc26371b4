"""Pictures from disk as the models see them: decoding bounded against decompression bombs (refused like an
unreadable picture, naming the file), and the evaluation transform of a pixel run (alpha on white, then the
backbone's resize and mean/std). Shared by `vsekit.load(run).preprocess`, search and the CLIP_benchmark
adapter."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import torch
from PIL import Image

from vsekit.data.precomp import DataFormatError

MAX_IMAGE_PIXELS = 64_000_000  # refuse decompression bombs before decoding

_OPEN_LOCK = threading.Lock()  # warnings.catch_warnings swaps process-wide state: one opener at a time


def open_bounded(fp) -> Image.Image:
    """`Image.open` (the header only: cheap) with PIL's DecompressionBombWarning — a picture larger than PIL's
    own limit (about 89M pixels), which PIL would print to stderr and then decode — raised as
    `Image.DecompressionBombError` instead, so callers refuse it like any picture over MAX_IMAGE_PIXELS."""
    with _OPEN_LOCK, warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            return Image.open(fp)
        except Image.DecompressionBombWarning as e:
            raise Image.DecompressionBombError(str(e)) from None


def open_image(path: str | Path) -> Image.Image:
    """Decode a picture fully (so errors surface here, naming the file), refusing absurd sizes (more than
    MAX_IMAGE_PIXELS: a DataFormatError, so the picture is skipped and reported like an unreadable one)."""
    path = Path(path)
    if path.is_dir():
        raise DataFormatError(f"{path}: is a folder, expected a picture file")
    return decode_bounded(path, str(path))


def decode_bounded(fp, name: str) -> Image.Image:
    """`open_image` for a path or a binary file object (e.g. a tar member's bytes); errors name `name`."""
    try:
        with open_bounded(fp) as im:
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise DataFormatError(f"{name}: {im.width}x{im.height} pixels is larger than the {MAX_IMAGE_PIXELS} limit")
            im.load()
            return im.copy()
    except DataFormatError:
        raise
    except Image.DecompressionBombError as e:
        raise DataFormatError(f"{name}: larger than the {MAX_IMAGE_PIXELS} pixel limit ({e})") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise DataFormatError(f"{name}: cannot read image ({e})") from e


def backbone_pixels(img: Image.Image, size: int, transform=None) -> torch.Tensor:
    """Same transform as `vsekit.data.raw_images.load_pixels` at evaluation: alpha on white, then the
    backbone's `PixelTransform` (resize filter, mean/std; ImageNet's with bilinear resizing when None)."""
    from vsekit.data.raw_images import to_pixels
    from vsekit.features.backbones import IMAGENET_TRANSFORM

    if img.mode in ("RGBA", "LA", "P"):
        img = img.convert("RGBA")
        bg = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(bg, img)
    return to_pixels(img.convert("RGB"), size, transform or IMAGENET_TRANSFORM)
